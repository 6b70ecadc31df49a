"""No import cycles between the project's modules (issue 38, item 7).

A cycle makes the import order matter: whichever module is imported first sees the other
half-initialised, and a harmless-looking new import elsewhere turns into an ImportError or
an AttributeError at start-up. This reads the imports of ``elastic/``, ``agent/`` and
``checkpoints/`` with ``ast`` (no module is imported, so it runs in milliseconds) and fails
naming every cycle it finds.

Every import counts: a deferred one inside a function, or one under ``if TYPE_CHECKING:``,
hides a cycle from the import order, not from the design (two modules that need each other are
one idea split in two, or share a third that belongs apart; a type-only import is still a
dependency a reader and mypy follow). ``from pkg import name`` depends on ``pkg/__init__.py`` unless ``name`` is a submodule;
``import a.b`` depends on ``a.b``.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("elastic", "agent", "checkpoints")

# A cycle that must stay for a while goes here, with its reason, and out again once it is gone
# (test_each_known_cycle_is_still_there says when). Issue 38 left none.
KNOWN_CYCLES: tuple[frozenset[str], ...] = ()


def _allowed(cycle: list[str]) -> bool:
    return any(set(cycle) <= known for known in KNOWN_CYCLES)


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in the module, at any depth."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def dependencies(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    deps: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            deps |= {a.name for a in node.names if a.name in known}
            continue
        base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else [])) \
            if node.level else (node.module or "")
        for alias in node.names:
            if f"{base}.{alias.name}" in known:
                deps.add(f"{base}.{alias.name}")  # a submodule: its package may be half-done, that is fine
            elif base in known:
                deps.add(base)  # a name from the module (or the package's __init__)
    deps.discard(name)
    return deps


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@functools.cache
def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: dependencies(name, path, known) for name, path in known.items()}


def test_no_module_imports_itself_back() -> None:
    found = [c for c in cycles(import_graph()) if not _allowed(c)]
    assert not found, "import cycles (each a set of modules that import one another, directly or around a loop; " \
        "defer one import into the function that needs it, or move what both need into a third module):\n" + \
        "\n".join("  " + " <-> ".join(c) for c in found)


def test_each_known_cycle_is_still_there() -> None:
    """An allowance outlives its cycle only until someone notices: this is the notice."""
    present = cycles(import_graph())
    gone = [sorted(known) for known in KNOWN_CYCLES if not any(set(c) <= known for c in present)]
    assert not gone, f"these cycles are gone: delete them from KNOWN_CYCLES: {gone}"


def test_the_reader_sees_a_cycle_and_every_import() -> None:
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    tree = ast.parse("import os\nif TYPE_CHECKING:\n    import x\ndef f():\n    import y\ntry:\n    import z\n"
                     "except ImportError:\n    import w\n")
    assert sorted(a.name for n in _import_nodes(tree) for a in n.names) == ["os", "w", "x", "y", "z"]
