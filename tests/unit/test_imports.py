"""The package's import graph has no cycles between modules, and import-linter keeps pyproject's contracts
(the layers cli > stages > backends > core, no stage importing another, no cycles between packages).

The module graph is read with `ast` from the source (grimp, which import-linter builds on, is not in the dev
venv). Every import counts: module level, inside functions (deferred imports run too) and under
TYPE_CHECKING (a type-only import still ties the two modules together for a reader and a refactor).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE_ROOT = REPO / "draftsmith"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(tree: ast.Module, importer: str, is_package: bool, known: set[str]) -> set[str]:
    """The package's modules that `importer` imports, grimp's way: `from a import b` names the
    module a.b when that is a module, else a."""
    package = importer if is_package else importer.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in known else base)
    # `import a.b.c` names a.b.c; keep the longest known prefix so an attribute path still resolves.
    resolved = set()
    for name in found:
        parts = name.split(".")
        while parts and ".".join(parts) not in known:
            parts.pop()
        if parts:
            resolved.add(".".join(parts))
    resolved.discard(importer)
    return resolved


def import_graph(root: Path = PACKAGE_ROOT) -> dict[str, set[str]]:
    paths = sorted(root.rglob("*.py"))
    known = {module_name(path, root) for path in paths}
    graph = {}
    for path in paths:
        importer = module_name(path, root)
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[importer] = imported_modules(tree, importer, path.name == "__init__.py", known)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted, largest first."""
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = lowlink[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                visit(successor)
                lowlink[node] = min(lowlink[node], lowlink[successor])
            elif successor in on_stack:
                lowlink[node] = min(lowlink[node], index[successor])
        if lowlink[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components, key=lambda component: (-len(component), component))


def cycle_path(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One closed import path through a component, to name in a failure: a -> b -> ... -> a."""
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for successor in sorted(graph[node] & members):
            if successor == start:
                path = [start]
                while node != start:
                    path.insert(1, node)
                    node = previous[node]
                return path + [start]
            if successor not in previous:
                previous[successor] = node
                frontier.append(successor)
    raise AssertionError(f"no cycle through {start} in {component}")


def test_reader_resolves_relative_and_from_imports_and_finds_a_cycle(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .sub import b\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text("def f():\n    from pkg import c\n")
    (package / "c.py").write_text("import os\nfrom . import a\n")
    (package / "d.py").write_text("from pkg.sub import b\nimport pkg.sub.b.attribute\n")
    graph = import_graph(package)
    assert graph["pkg.a"] == {"pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg.c"}
    assert graph["pkg.d"] == {"pkg.sub.b"}
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    assert cycle_path(graph, ["pkg.a", "pkg.c", "pkg.sub.b"]) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]


def test_package_has_no_import_cycles() -> None:
    graph = import_graph()
    assert "draftsmith.cli" in graph and "draftsmith.backends" in graph
    found = cycles(graph)
    if found:
        named = "\n".join(" -> ".join(cycle_path(graph, component)) for component in found)
        pytest.fail(f"import cycles in draftsmith:\n{named}")


def test_the_import_contracts_of_pyproject_are_kept() -> None:
    """import-linter's run of pyproject's contracts (layers, stages independent, no cycles between a
    package's children), as `make lint` runs it; an ignored import that no longer exists fails too."""
    proc = subprocess.run(
        [Path(sys.executable).with_name("lint-imports")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
