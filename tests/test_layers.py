"""The package's import graph keeps its layers and rooms: no import circle, and no import from a
lower layer or room to a higher one (``docs/architecture.md``).

Layers, lowest first: ``errors`` < ``format/`` < ``store/`` < ``interop/``, ``dcp/`` and ``dist/`` <
``tree/`` < ``nn/`` < ``training/`` < the public top-level modules (``memtree``, ``memtree.remote``,
``routing/``) < ``cli/`` < ``integrations/``. Inside a layer, its rooms (sub-folders) are ordered
the same way: ``store/``: ``primitives/`` < ``reading/`` < ``writing/`` < ``urls/`` and
``foreign/`` < the layer's own modules (``store/open.py``, ``store/verify.py``); ``tree/``:
``parts/`` < its own modules. A module imports from its own room and lower ones only; two rooms of
one rank (``urls/`` and ``foreign/``; ``interop/``, ``dcp/`` and ``dist/``) import neither from the other.

Every ``import`` of a ``memtree`` module counts: at module level, inside a function, and under
``if TYPE_CHECKING:`` (an annotation that names a module is a dependency on it, and a circle of
them is a circle a reader has to hold in their head).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "memtree"

#: rank of each layer (a top-level module or folder of memtree/); a module may import modules of
#: its own layer or of a lower rank.
LAYERS = {
    "errors": 0,
    "format": 1,
    "store": 2,
    "interop": 3,
    "dcp": 3,
    "dist": 3,
    "tree": 4,
    "nn": 5,
    "training": 5.5,  # memtree.Checkpointer: above nn/, below the public surface
    "": 6,  # memtree/__init__.py, remote.py and routing/ (TOP_FOLDERS): the public surface
    "cli": 7,
    "integrations": 8,  # Lightning, transformers, torchrl: may import any layer; none imports it
}

#: folders that belong to the public surface (layer ""): memtree.saving / memtree.loading.
TOP_FOLDERS = {"routing"}

#: rank of each room (sub-folder) of a layer; "" is the layer's own modules, above its rooms.
ROOMS = {
    "store": {"primitives": 0, "reading": 1, "writing": 2, "urls": 3, "foreign": 3, "": 4},
    "tree": {"parts": 0, "": 1},
}

#: most modules (``__init__.py`` aside) one folder of the package may hold.
MOST_MODULES_PER_FOLDER = 12


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


PATHS = sorted(PACKAGE.rglob("*.py"))
MODULES = {_module_name(p) for p in PATHS}
PACKAGES = {_module_name(p) for p in PATHS if p.name == "__init__.py"}


def _layer(module: str) -> str:
    """The layer of ``module``: its top-level folder, or "" for the public surface (``memtree``,
    ``memtree.remote``, :data:`TOP_FOLDERS`); ``memtree.errors`` is a layer of its own. A new
    folder is a layer of its own too, which fails the tests until it is ranked in LAYERS."""
    if module == "memtree.__main__":  # ``python -m memtree``: an entry point of the command line
        return "cli"
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in TOP_FOLDERS or (f"memtree.{parts[1]}" not in PACKAGES and parts[1] != "errors"):
        return ""
    return parts[1]


def _room(module: str) -> tuple[str, str]:
    """(layer, room) of ``module``: the room is its folder inside the layer, "" for the layer's
    own modules (and for a layer without rooms)."""
    layer = _layer(module)
    parts = module.split(".")
    if layer in ROOMS and len(parts) > 2 and ".".join(parts[:3]) in PACKAGES:
        return layer, parts[2]
    return layer, ""


def _rank(module: str) -> tuple[float, float]:
    layer, room = _room(module)
    return LAYERS[layer], ROOMS.get(layer, {"": 0})[room]


def may_import(importer: str, imported: str) -> bool:
    """Whether ``importer`` may import ``imported``: same room, or a strictly lower one."""
    return _room(importer) == _room(imported) or _rank(imported) < _rank(importer)


def named_modules(name: str, is_package: bool, source: str, modules: set[str]) -> set[str]:
    """The memtree modules that the module ``name`` (whose code is ``source``) names in an import,
    wherever the import is (a name imported from a package that is a module counts as that
    module), whether they exist or not."""
    package = name if is_package else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
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
    return found


def imports_of(name: str, is_package: bool, source: str, modules: set[str]) -> set[str]:
    """The memtree modules that the module ``name`` imports (see :func:`named_modules`)."""
    return {m for m in named_modules(name, is_package, source, modules) if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    return {
        _module_name(p): imports_of(_module_name(p), p.name == "__init__.py", p.read_text(), MODULES)
        for p in PATHS
    }


GRAPH = _graph()


def test_the_graph_sees_every_layer_and_room() -> None:
    unranked = {_layer(m) for m in GRAPH} - set(LAYERS)
    assert not unranked, f"a folder of memtree/ has no rank in LAYERS: {unranked}"
    for package in sorted(PACKAGES):
        parts = package.split(".")
        if len(parts) == 3:
            assert parts[2] in ROOMS.get(parts[1], {}), f"the room {package} has no rank in ROOMS[{parts[1]!r}]"
        assert len(parts) <= 3, f"{package}: a room inside a room; rank it, or keep rooms one level deep"
    assert {(layer, room) for layer, rooms in ROOMS.items() for room in rooms} == {
        _room(m) for m in GRAPH if _layer(m) in ROOMS
    }, "a room in ROOMS has no folder"
    open_ = GRAPH["memtree.store.open"]
    assert "memtree.store.reading.read" in open_  # a relative import, two folders apart
    assert "memtree.store.urls.remote" in open_  # an import inside a function
    assert "memtree.training" in GRAPH["memtree"]  # an import under TYPE_CHECKING
    assert _layer("memtree.routing.save") == "" and "memtree.tree.tensortree" in GRAPH["memtree.routing.save"]


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_import_goes_up_a_layer_or_a_room(module: str) -> None:
    upward = sorted(m for m in GRAPH[module] if not may_import(module, m))
    layer, room = _room(module)
    assert not upward, f"{module} (layer {layer or 'top'!r}, room {room or 'own'!r}) imports higher or sibling rooms: {upward}"


def test_the_order_of_the_rooms() -> None:
    """The checker itself, on the rooms of ``store/``."""
    assert may_import("memtree.store.reading.read", "memtree.store.reading.leaf_reader")  # same room
    assert may_import("memtree.store.writing.write", "memtree.store.reading.read")  # lower room
    assert may_import("memtree.store.open", "memtree.store.urls.remote")  # the layer's own modules
    assert may_import("memtree.tree.parts.core", "memtree.store.reading.read")  # a lower layer
    assert not may_import("memtree.store.reading.mapped", "memtree.store.writing.write")  # higher
    assert not may_import("memtree.store.urls.remote", "memtree.store.foreign.tensordict")  # a sibling
    assert not may_import("memtree.store.primitives.files", "memtree.store.open")  # the layer's own
    assert not may_import("memtree.store", "memtree.tree.parts.core")  # a higher layer
    assert not may_import("memtree.dcp.reader", "memtree.interop.checkpoint")  # sibling layers


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


def test_imports_in_functions_and_for_type_checking_count() -> None:
    """The checker itself: the shape of the old ``read.py`` <-> ``leaf_reader.py`` circle, whose
    way back was an import inside a function and one under ``TYPE_CHECKING``."""
    modules = {"memtree.s", "memtree.s.read", "memtree.s.leaf", "memtree.s.fill", "memtree.errors"}
    source = (
        "from typing import TYPE_CHECKING\n"
        "from .. import errors\n"
        "if TYPE_CHECKING:\n    from .read import PendingLevel\n"
        "def flush():\n    from .fill import fill\n"
    )
    assert imports_of("memtree.s.leaf", False, source, modules) == {"memtree.errors", "memtree.s.read", "memtree.s.fill"}


def test_every_import_names_a_module_that_exists() -> None:
    """An import of a memtree module that is not there (a relative import left pointing at a
    module's old place after a move, or a package that was never committed) fails when it runs,
    which for an import inside a function is only on the path that calls it; here it fails at once."""
    missing = {
        f"{_module_name(p)} imports {m}"
        for p in PATHS
        for m in named_modules(_module_name(p), p.name == "__init__.py", p.read_text(), MODULES) - MODULES
    }
    assert not missing, sorted(missing)
    gone = named_modules("memtree.store.writing.staged", False, "def f():\n    from .faults import point\n", MODULES)
    assert gone == {"memtree.store.writing.faults"}  # the checker itself: faults.py is in primitives/


def test_no_folder_holds_more_than_a_dozen_modules() -> None:
    """A folder is read in one sitting: past :data:`MOST_MODULES_PER_FOLDER` modules it gets
    rooms (``docs/architecture.md``)."""
    crowded = {}
    for folder in sorted({p.parent for p in PATHS}):
        count = sum(1 for p in folder.glob("*.py") if p.name != "__init__.py")
        if count > MOST_MODULES_PER_FOLDER:
            crowded[str(folder.relative_to(PACKAGE.parent))] = count
    assert not crowded, f"split these into rooms: {crowded}"


def test_importing_a_room_loads_none_of_its_modules() -> None:
    """``store/__init__.py`` and each room's ``__init__.py`` import nothing: a room is a folder, not
    an API, so importing one module of ``store/`` loads only what that module needs (the fresh
    process's ready path, ``tests/test_import_path.py``)."""
    inits = ["memtree.store"] + [f"memtree.{layer}.{room}" for layer, rooms in ROOMS.items() for room in rooms if room]
    assert {init: GRAPH[init] for init in inits if GRAPH[init]} == {}


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
