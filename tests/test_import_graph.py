"""No import cycle among torchfeed's modules, counting imports inside functions.

A cycle broken by moving one import into a function still couples the two
modules both ways (issue 15: ``_index_stream`` and ``_state`` did that), so this
reads every ``import`` in the package, at any depth, and looks for cycles.
Function-level imports that remain are for optional libraries, or keep
``bench``/``tune`` off the import path; they make no cycle.  Imports under
``if TYPE_CHECKING:`` never run and are left out: they name types for mypy.
"""
from __future__ import annotations

import ast
import pathlib

import torchfeed

PACKAGE = pathlib.Path(torchfeed.__file__).parent

# Known, with why; fixing one means deleting it here.
KNOWN_CYCLES: set = set()
# Counting imports under ``if TYPE_CHECKING:`` too: a type-only cycle still says
# two modules each need the other (issue 28 broke _receive <-> _restart's).
# None left: the transport's packer and unpacker name the channel by the
# protocols they read (PoolSettings, Arenas), not by importing _shm.
KNOWN_TYPE_CYCLES: set = set()


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    """Dotted module name -> (file, is a package's __init__)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        found[".".join(parts)] = (path, is_package)
    return found


def _targets(module: str, is_package: bool, node, modules) -> list[str]:
    """The torchfeed modules an import statement loads (not counting parent packages)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        # ``from . import _seeding`` loads a submodule; ``from .x import name``, x itself.
        names = [f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules else target
                 for alias in node.names]
    out = []
    for name in names:
        if name.split(".")[0] != "torchfeed":
            continue
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        out.append(name)
    return out


def _imports(tree: ast.AST, type_checking: bool = False):
    """Every import statement in ``tree``, at any depth, except under ``if TYPE_CHECKING:``
    (unless ``type_checking``)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif not type_checking and isinstance(node, ast.If) and ast.unparse(node.test) in (
                "TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for branch in node.orelse:
                yield from _imports(ast.Module(body=[branch], type_ignores=[]))
        else:
            yield from _imports(node, type_checking)


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, is_package) in modules.items():
        for node in _imports(ast.parse(path.read_text(), str(path)), type_checking):
            graph[name].update(_targets(name, is_package, node, modules))
    return graph


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """Strongly connected components of more than one module, and self-imports (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[frozenset[str]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w == v:
                found.add(frozenset({v}))
            elif w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.add(frozenset(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_relative_and_function_level_imports():
    graph = import_graph()
    assert "torchfeed._protocol" in graph["torchfeed._worker"]       # from ._protocol import
    assert "torchfeed._seeding" in graph["torchfeed._worker"]        # from . import _seeding
    assert "torchfeed._transport" in graph["torchfeed._worker"]      # a package
    assert "torchfeed._tuner" in graph["torchfeed"]                  # inside __getattr__
    snippet = ast.parse("if TYPE_CHECKING:\n    import a\nelse:\n    import b\n"
                        "def f():\n    if x:\n        import c\n")
    assert [ast.unparse(node) for node in _imports(snippet)] == ["import b", "import c"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {frozenset("abc")}


def test_no_import_cycle_among_torchfeed_modules():
    assert cycles(import_graph()) == KNOWN_CYCLES


def test_no_import_cycle_counting_type_only_imports():
    assert cycles(import_graph(type_checking=True)) == KNOWN_TYPE_CYCLES
