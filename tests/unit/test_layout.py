"""The test tree's layout: shared test code lives in tests/helpers.py (conftest.py holds only fixtures and
hooks, which pytest hands out), so no test module imports another one or conftest: running or changing one
test module never depends on another, and each helper has one import path."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import REPO

TESTS = REPO / "tests"


def imported_modules(path: Path) -> set[str]:
    """The top-level names of every module `path` imports, at module level or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_no_test_module_helper_or_bench_imports_a_test_module_or_conftest() -> None:
    modules = sorted(TESTS.rglob("test_*.py"))
    test_names = {p.stem for p in modules} | {"conftest"}
    shared = [p for p in sorted(TESTS.glob("*.py")) if p.name != "conftest.py"]
    found = {
        (p.relative_to(REPO).as_posix(), name)
        for p in [*modules, *shared, *sorted((REPO / "bench").glob("*.py"))]
        for name in imported_modules(p) & test_names
    }
    assert found == set(), "import shared test code from tests/helpers.py instead"
