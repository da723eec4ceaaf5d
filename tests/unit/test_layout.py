"""The test tree's layout: shared test code lives in tests/helpers/ (conftest.py holds only fixtures and
hooks, which pytest hands out), so no test module imports another one or conftest: running or changing one
test module never depends on another, and each helper has one import path."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from helpers.workflow import REPO

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
    shared = [
        p
        for p in [*sorted(TESTS.glob("*.py")), *sorted((TESTS / "helpers").glob("*.py"))]
        if p.name != "conftest.py"
    ]
    found = {
        (p.relative_to(REPO).as_posix(), name)
        for p in [*modules, *shared, *sorted((REPO / "bench").rglob("*.py"))]
        for name in imported_modules(p) & test_names
    }
    assert found == set(), "import shared test code from tests/helpers/ instead"


def test_bench_is_a_package_that_edits_no_sys_path() -> None:
    """Each bench runs as `python -m bench.<name>` and imports its siblings as `bench.<name>`: no bench
    puts a folder on sys.path (a script run by path, or a test loading one, would shadow or miss them)."""
    edits = [
        p.relative_to(REPO).as_posix()
        for p in sorted((REPO / "bench").rglob("*.py"))
        if re.search(r"sys\.path\.(insert|append)", p.read_text())
    ]
    assert (
        edits == []
        and (REPO / "bench" / "__init__.py").is_file()
        and (REPO / "bench" / "peer" / "__main__.py").is_file()
    )


def test_every_documented_bench_command_names_a_bench_module() -> None:
    """`python -m bench.<name>` in README.md, docs/, configs/ and scripts/ names a module in bench/, and no
    document still runs a bench by path (`python bench/<name>.py`)."""
    texts = {p: p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
             *sorted((REPO / "configs").glob("*.yaml")), *sorted((REPO / "scripts").glob("*"))] if p.is_file()}  # fmt: skip
    named = {m for text in texts.values() for m in re.findall(r"-m (bench(?:\.\w+)+)", text)}
    missing = {m for m in named if not (REPO / (m.replace(".", "/") + ".py")).is_file()
               and not (REPO / m.replace(".", "/") / "__main__.py").is_file()}  # fmt: skip
    by_path = {p.name for p, text in texts.items() if re.search(r"python3? bench/", text)}
    assert named and missing == set() and by_path == set()


def test_the_unit_tests_mirror_the_sub_packages_of_core() -> None:
    """tests/unit/<sub-package>/ for each of draftsmith/core/'s sub-packages (tests/unit/ also holds
    backends/, bench/ and the tests of the whole tree), and tests/helpers/ split the same way."""
    core = {p.name for p in (REPO / "draftsmith" / "core").iterdir() if (p / "__init__.py").is_file()}
    unit = {p.name for p in (TESTS / "unit").iterdir() if (p / "__init__.py").is_file()}
    helpers = {p.stem for p in (TESTS / "helpers").glob("*.py")} - {"__init__"}
    assert core <= unit and helpers <= core, (core - unit, helpers - core)
