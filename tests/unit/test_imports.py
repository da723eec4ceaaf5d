"""The package's import graph has no cycles.

The graph is read with `ast` from the source (grimp, which import-linter builds on, is not in the dev
venv). Every import counts: module level, inside functions (deferred imports run too) and under
TYPE_CHECKING (a type-only import still ties the two modules together for a reader and a refactor).
"""

from __future__ import annotations

import ast
import tomllib
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


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def sibling_graph(graph: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    """Imports between the children of `package`, each child standing for itself and its descendants
    (how import-linter's acyclic_siblings contract sees them)."""
    depth = package.count(".") + 2

    def child(module: str) -> str | None:
        return ".".join(module.split(".")[:depth]) if module.startswith(package + ".") else None

    siblings: dict[str, set[str]] = {}
    for importer, imported in graph.items():
        source = child(importer)
        if source is not None:
            targets = {child(module) for module in imported} - {None, source}
            siblings.setdefault(source, set()).update(targets)  # type: ignore[arg-type]
    return siblings


def forbidden_chain(
    graph: dict[str, set[str]], sources: list[str], forbidden: list[str], ignored: set[tuple[str, str]]
) -> list[str] | None:
    """A chain of imports from a source module to a forbidden one, direct or not, leaving out the
    ignored imports (import-linter's forbidden contract); None when there is none."""
    previous: dict[str, str | None] = {m: None for m in graph if any(within(m, s) for s in sources)}
    frontier = sorted(previous)
    while frontier:
        node = frontier.pop(0)
        if any(within(node, f) for f in forbidden):
            chain = [node]
            while previous[chain[0]] is not None:
                chain.insert(0, previous[chain[0]])  # type: ignore[arg-type]
            return chain
        for successor in sorted(graph[node]):
            if successor not in previous and (node, successor) not in ignored:
                previous[successor] = node
                frontier.append(successor)
    return None


def contracts(kind: str) -> list[dict]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    return [c for c in config["contracts"] if c["type"] == kind]


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


def test_sibling_graph_squashes_subpackages_and_a_forbidden_chain_is_found() -> None:
    graph = {"p.a": {"p.sub.x"}, "p.sub.x": {"p.sub.y"}, "p.sub.y": {"p.a"}, "p.sub": set()}
    assert cycles(sibling_graph(graph, "p")) == [["p.a", "p.sub"]]
    assert cycles(sibling_graph(graph, "p.sub")) == []
    assert forbidden_chain(graph, ["p.a"], ["p.sub.y"], set()) == ["p.a", "p.sub.x", "p.sub.y"]
    assert forbidden_chain(graph, ["p.a"], ["p.sub.y"], {("p.sub.x", "p.sub.y")}) is None


def test_the_packages_children_have_no_import_cycles() -> None:
    """pyproject's acyclic_siblings contracts, for every package under their ancestors."""
    graph = import_graph()
    for contract in contracts("acyclic_siblings"):
        for ancestor in contract["ancestors"]:
            packages = [
                m
                for m in graph
                if within(m, ancestor) and (PACKAGE_ROOT.parent / m.replace(".", "/")).is_dir()
            ]
            for package in packages:
                assert cycles(sibling_graph(graph, package)) == [], f"{contract['name']}: {package}"


def test_the_forbidden_imports_of_pyproject_are_absent() -> None:
    graph = import_graph()
    found = contracts("forbidden")
    assert found, "pyproject.toml has no forbidden contract"
    for contract in found:
        ignored = {tuple(i.replace(" ", "").split("->")) for i in contract.get("ignore_imports", [])}
        for pair in ignored:  # import-linter fails on an ignored import that is gone: so does this
            assert pair[1] in graph[pair[0]], f"{contract['name']}: ignored import {pair} no longer exists"
        chain = forbidden_chain(graph, contract["source_modules"], contract["forbidden_modules"], ignored)
        assert chain is None, f"{contract['name']}: {' -> '.join(chain)}"
