"""The package's import graph keeps its layers: no import circle, and no import from a lower layer
to a higher one (``docs/architecture.md``).

Layers, lowest first: ``errors`` < ``format/`` < ``store/`` < ``interop/`` and ``dcp/`` <
``tree/`` < ``nn/`` < ``training/`` < the public top-level modules (``memtree``, ``memtree.remote``,
``memtree.routing`` and its modules) < ``cli/`` < ``integrations/``.
Every ``import`` of a ``memtree`` module counts, at module level or inside a function; only
imports under ``if TYPE_CHECKING:`` (annotations, never run) are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "memtree"

#: rank of each layer; a module may import modules of its own rank or lower ones.
LAYERS = {
    "errors": 0,
    "format": 1,
    "store": 2,
    "interop": 3,
    "dcp": 3,
    "tree": 4,
    "nn": 5,
    "training": 5.5,  # memtree.Checkpointer: above nn/, below the public surface
    "": 6,  # memtree/__init__.py, remote.py, routing/: the public surface
    "cli": 7,
    "integrations": 8,  # Lightning, transformers, torchrl: may import any layer; none imports it
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> str:
    if module == "memtree.__main__":  # ``python -m memtree``: an entry point of the command line
        return "cli"
    parts = module.split(".")
    if len(parts) == 1:
        return ""
    if parts[1] in LAYERS:
        return parts[1]
    return ""  # a top-level module such as memtree.remote


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` blocks."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for child in node.body:
                skip.update(id(n) for n in ast.walk(child))
    return skip


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The memtree modules ``path`` imports (a name imported from a package that is a module
    counts as that module)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "memtree")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "memtree":
                target = node.module
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, modules) for p in paths}


GRAPH = _graph()


def test_the_graph_sees_every_layer() -> None:
    layers = {_layer(m) for m in GRAPH}
    assert layers == set(LAYERS), f"a folder of memtree/ has no rank in LAYERS: {layers - set(LAYERS)}"
    assert "memtree.store.read" in GRAPH["memtree.store.open"]  # the parser sees relative imports
    assert _layer("memtree.routing.save") == "" and "memtree.tree.tensortree" in GRAPH["memtree.routing.save"]


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_import_goes_up_a_layer(module: str) -> None:
    rank = LAYERS[_layer(module)]
    upward = sorted(m for m in GRAPH[module] if LAYERS[_layer(m)] > rank)
    assert not upward, f"{module} (layer {_layer(module) or 'top'!r}) imports higher layers: {upward}"


def test_no_import_circle() -> None:
    """Depth-first search over the whole graph; a back edge is a circle (reported as its path)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(GRAPH[m]):
            if state.get(n) == 1:
                cycle = path[path.index(n):] + [n]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


def test_a_package_init_imported_by_its_children_is_a_circle_too() -> None:
    """The checker itself: a child importing its own package's ``__init__`` that imports the
    child is found (the shape of the old ``tree.py`` <-> ``grow.py`` circle)."""
    global GRAPH
    saved = GRAPH
    GRAPH = {"memtree.x": {"memtree.x.a"}, "memtree.x.a": {"memtree.x"}}
    try:
        with pytest.raises(pytest.fail.Exception, match="import circle"):
            test_no_import_circle()
    finally:
        GRAPH = saved


def test_benchmarks_and_tutorials_import_no_private_name_of_memtree() -> None:
    """Scripts outside the package use memtree's public functions: a private name (``_files``)
    imported by a benchmark breaks silently when the module that owns it changes."""
    private = []
    for folder in ("benchmarks", "tutorials"):
        for path in sorted((PACKAGE.parent / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("memtree"):
                    private += [f"{folder}/{path.name}: {node.module}.{a.name}" for a in node.names
                                if a.name.startswith("_")]
    assert not private, f"give these a public home (or use the public API): {private}"
