"""Bad API inputs get a clear error of the ``MemtreeError`` family, raised before anything changes.

One test per class of input (key types, ``keys=`` selections, option values, shapes that cannot
combine, numpy scalars, partial module bindings), and a static guard: the package never raises a
bare builtin exception at a user-facing boundary (``test_no_bare_builtin_raise``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import memtree
from memtree import (
    InvalidArgumentError,
    InvalidIndexError,
    KeyTypeError,
    MemtreeError,
    MemtreeKeyError,
    NonTensorValueError,
    ShapeMismatchError,
    TensorTree,
)

PACKAGE = Path(memtree.__file__).parent


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    tree = TensorTree({"a": torch.arange(3), "sub": {"x": torch.ones(2)}, "cfg": 3})
    tree.memmap(tmp_path / "t")
    return tmp_path / "t"


# ------------------------------------------------------------------------------- keys= values
@pytest.mark.parametrize("keys", [1, 2.5, [None], [1], [("a", 1)], [b"a"], [["a"]], object()])
def test_keys_of_the_wrong_type_raise_key_type_error(saved: Path, keys: object) -> None:
    with pytest.raises(KeyTypeError, match="keys="):
        memtree.load_memmap(saved, keys=keys)


@pytest.mark.parametrize("keys", [[""], [()], [("sub", "")]])
def test_empty_keys_raise_memtree_key_error(saved: Path, keys: object) -> None:
    with pytest.raises(MemtreeKeyError):
        memtree.load_memmap(saved, keys=keys)


@pytest.mark.parametrize("leaf", ["cfg", "a"])
def test_keys_inside_a_leaf_are_refused(saved: Path, leaf: str) -> None:
    """A JSON leaf ('cfg') or a tensor leaf ('a') has no keys inside: asking for one is an error,
    never a silent selection of the leaf itself."""
    with pytest.raises(MemtreeKeyError, match=f"inside '{leaf}'.*not a sub-tree"):
        memtree.load_memmap(saved, keys=[(leaf, "x")])


# --------------------------------------------------------------------------------- options
@pytest.mark.parametrize("mode", ["w", "rw", "", None, 1])
def test_a_bad_mode_is_an_invalid_argument(saved: Path, mode: object) -> None:
    with pytest.raises(InvalidArgumentError, match="mode must be"):
        memtree.load_memmap(saved, mode=mode)
    with pytest.raises(InvalidArgumentError, match="mode must be"):
        memtree.MemoryMappedTensor.from_filename(saved / "a.memmap", torch.int64, (3,), mode=mode)


@pytest.mark.parametrize("length", [-1, 1.5, "2", None])
def test_resize_to_a_bad_length_changes_nothing(tmp_path: Path, length: object) -> None:
    data = TensorTree({"x": torch.arange(2.0)}, batch_size=[2]).memmap(tmp_path / "d")
    with pytest.raises(InvalidArgumentError, match="resize_ needs an int length"):
        data.resize_(length)  # type: ignore[arg-type]
    assert memtree.load_memmap(tmp_path / "d")["x"].tolist() == [0.0, 1.0]


def test_checksum_options_are_invalid_arguments(tmp_path: Path) -> None:
    tree = TensorTree({"x": torch.zeros(2)})
    with pytest.raises(InvalidArgumentError, match="checksum must be"):
        tree.memmap(tmp_path / "a", checksum="md5")
    assert not (tmp_path / "a").exists()


# ------------------------------------------------------------------------ keys and indices
@pytest.mark.parametrize("key", [b"x", 1.5, {"a": 1}, [0.5], ("a", 0), [b"x"]])
def test_keys_that_are_neither_str_nor_batch_indices_raise_key_type_error(key: object) -> None:
    tree = TensorTree({"x": torch.zeros(4)}, batch_size=[4])
    with pytest.raises(KeyTypeError):
        tree[key] = torch.ones(4)
    with pytest.raises(KeyTypeError):
        tree[key]
    assert tree["x"].tolist() == [0.0] * 4


def test_a_bytes_key_on_an_empty_tree_is_not_a_silent_no_op() -> None:
    tree = TensorTree()
    with pytest.raises(KeyTypeError, match="neither a key"):
        tree[b"x"] = torch.zeros(1)
    assert list(tree.keys()) == []


@pytest.mark.parametrize("index", [0, -1, slice(1, 3), [0, 2], torch.tensor([1, 0]), np.array([0, 1]),
                                   torch.tensor([True, False, True, False]), range(2), (Ellipsis,), None])
def test_every_kind_of_batch_index_still_works(index: object) -> None:
    tree = TensorTree({"x": torch.arange(4)}, batch_size=[4])
    assert torch.equal(tree[index]["x"], torch.arange(4)[index])  # type: ignore[index]


# ---------------------------------------------------------------------------- stack and cat
def test_cat_of_mismatched_leaf_shapes_names_the_leaf() -> None:
    a = TensorTree({"x": torch.zeros(2, 3)}, batch_size=[2])
    b = TensorTree({"x": torch.zeros(2, 4)}, batch_size=[2])
    with pytest.raises(ShapeMismatchError, match=r"leaf \('x',\) has shape \[2, 3\].*\[2, 4\]"):
        memtree.cat([a, b])
    with pytest.raises(ShapeMismatchError, match="leaf"):
        memtree.stack([a, b])
    # along the cat dim, leaves may differ
    c = TensorTree({"x": torch.zeros(5, 3)}, batch_size=[5])
    assert memtree.cat([a, c])["x"].shape == (7, 3)


def test_stack_and_cat_arguments_are_checked() -> None:
    t = TensorTree({"x": torch.zeros(2)}, batch_size=[2])
    with pytest.raises(InvalidArgumentError):
        memtree.stack([])
    with pytest.raises(InvalidArgumentError):
        memtree.cat([])
    with pytest.raises(InvalidIndexError):
        memtree.stack([t], dim=5)
    with pytest.raises(InvalidIndexError):
        memtree.cat([t], dim=3)
    with pytest.raises(InvalidIndexError):
        t.unsqueeze(7)


def test_differing_non_tensor_leaves_cannot_combine() -> None:
    a = TensorTree({"x": torch.zeros(2), "tag": "a"}, batch_size=[2])
    b = TensorTree({"x": torch.zeros(2), "tag": "b"}, batch_size=[2])
    with pytest.raises(ShapeMismatchError, match="non-tensor leaf"):
        memtree.cat([a, b])


# ---------------------------------------------------------------------------- numpy scalars
@pytest.mark.parametrize(
    "value, expected",
    [(np.float64(1.5), 1.5), (np.float32(0.25), 0.25), (np.int64(-3), -3), (np.uint8(7), 7), (np.bool_(True), True)],
)
def test_numpy_scalars_are_the_json_numbers_they_hold(tmp_path: Path, value: object, expected: object) -> None:
    tree = TensorTree()
    tree["v"] = value
    assert tree["v"] == expected and type(tree["v"]) is type(expected)
    tree.memmap(tmp_path / "t")
    loaded = memtree.load_memmap(tmp_path / "t")["v"]
    assert loaded == expected and type(loaded) is type(expected)


@pytest.mark.parametrize("value", [np.complex128(1 + 2j), np.datetime64("2024-01-01"), np.void(b"ab")])
def test_other_numpy_scalars_are_refused_at_assignment(value: object) -> None:
    tree = TensorTree()
    with pytest.raises(NonTensorValueError, match="numpy"):
        tree["v"] = value
    assert "v" not in tree


# -------------------------------------------------------------------------------- modules
def test_load_into_module_refuses_keys_that_match_nothing() -> None:
    src = TensorTree.from_module(nn.Linear(2, 2))
    for strict in (True, False):
        with pytest.raises(MemtreeKeyError, match=r"\['nope'\] name no tensor or sub-module"):
            memtree.load_into_module(nn.Linear(2, 2), src, keys=["nope"], strict=strict)
    # a sub-module without tensors (a ReLU) is a name, not a typo
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert memtree.load_into_module(seq, TensorTree.from_module(seq), keys=["0", "1"]) == memtree.LoadResult([], [])


def test_to_module_with_a_tree_that_lacks_tensors_raises_and_changes_nothing() -> None:
    with memtree.empty_init():
        model = nn.Linear(2, 2)
    before = (model.weight, model.bias)
    partial = TensorTree.from_module(nn.Linear(2, 2)).exclude("bias")
    with pytest.raises(MemtreeKeyError, match="lacks 1 tensors: 'bias'"):
        partial.to_module(model)
    assert (model.weight, model.bias) == before and model.weight.is_meta


def test_repr_of_a_memory_mapped_leaf_names_its_device(saved: Path) -> None:
    assert "  a: int64[3] cpu memmap" in repr(memtree.load_memmap(saved)).splitlines()


# ---------------------------------------------------------------------------- static guard
#: Internal raises that never reach a caller as they are (caught and converted, or asserting a
#: programming error inside the package), as (file relative to memtree/, exception name).
_INTERNAL = {
    ("store/primitives/files.py", "OSError"),  # EIO of short reads/writes: converted by storage_error()
    ("store/primitives/files.py", "ValueError"),  # create_leaf's preconditions
    ("store/primitives/checksums.py", "OSError"),  # file_checksum's EIO of a short file: storage_error() converts it
    ("store/primitives/commit.py", "OSError"),  # renameat2's errno: converted by the callers' storage_error()
    ("store/primitives/commit.py", "ValueError"),  # the journal's size: a programming error
    ("store/writing/cache.py", "FileExistsError"),  # caught two lines below: another download won
    ("store/writing/recovery.py", "FileExistsError"),  # caught by recover(), reported as a problem
    ("store/primitives/faults.py", "ValueError"),  # MEMTREE_FAULT parsing: a test hook
    ("store/open.py", "TypeError"),  # unexpected keyword arguments, as Python reports them
    ("format/record.py", "TypeError"),  # evolve() with a field the record lacks: a programming error (as dataclasses.replace)
    ("store/reading/mapped.py", "IndexError"),  # MemoryMappedTensor indexing mirrors torch.Tensor's
    ("dist/placement.py", "ValueError"),  # check_layout: memtree.dist turns it into PlacementError
}
_BUILTINS = {"ValueError", "TypeError", "RuntimeError", "KeyError", "IndexError", "OSError",
             "FileNotFoundError", "FileExistsError", "Exception", "AttributeError", "LookupError"}


def test_no_bare_builtin_raise() -> None:
    """Every ``raise X(...)`` of a builtin exception in memtree/ is a known internal one."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                name = node.exc.func.id if isinstance(node.exc.func, ast.Name) else None
                if name in _BUILTINS and (rel, name) not in _INTERNAL and name != "AttributeError":
                    found.add(f"{rel}:{node.lineno} raise {name}")
    assert not found, "raise a MemtreeError subclass instead (memtree/errors.py): " + ", ".join(sorted(found))


def test_every_error_class_is_a_memtree_error() -> None:
    for name in memtree.errors.__all__:
        assert issubclass(getattr(memtree, name), MemtreeError), name


def _state_dict_hook_module(kind: str) -> nn.Module:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 3)

        def get_extra_state(self) -> dict:
            return {"step": 3, "name": "run"}

        def set_extra_state(self, state: dict) -> None:
            self.state = state

    m = Model()
    if kind == "post":  # adds a key, drops one, casts one: the public post-hook
        def post(module, sd, prefix, local_metadata):
            sd[prefix + "extra"] = torch.ones(1)
            sd.pop(prefix + "bias")
            sd[prefix + "weight"] = sd[prefix + "weight"].detach().to(torch.float16)
        m.lin.register_state_dict_post_hook(post)
    elif kind == "replace":  # the older hook that returns a new dict (renames every key)
        m._register_state_dict_hook(lambda module, sd, prefix, meta: {k.replace("lin", "proj"): v for k, v in sd.items()})
    return m


@pytest.mark.parametrize("kind", ["post", "replace", "extra_state"])
def test_from_module_with_use_state_dict_is_what_state_dict_returns(kind: str) -> None:
    m = _state_dict_hook_module(kind)
    expected = m.state_dict()
    tree = TensorTree.from_module(m, use_state_dict=True)
    got = {k if isinstance(k, str) else ".".join(k): v for k, v in tree.items(include_nested=True, leaves_only=True)}
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
        else:
            assert got[name] == value, name


@pytest.mark.parametrize("batch_size", [[2**64 - 1], [2**63], [1] * 65, [3, 2**63]])
def test_batch_size_beyond_what_the_format_holds_is_refused_when_built(batch_size: list[int]) -> None:
    # once accepted, such a tree was written and then refused by its own reader
    with pytest.raises(memtree.BatchSizeError, match="below 2\\*\\*63"):
        TensorTree(batch_size=batch_size)


def test_batch_size_at_the_limits_round_trips(tmp_path: Path) -> None:
    for n, batch_size in enumerate(([2**63 - 1], [1] * 64)):
        tree = TensorTree(batch_size=batch_size).memmap(tmp_path / str(n))
        assert list(memtree.load_memmap(tmp_path / str(n)).batch_size) == batch_size == list(tree.batch_size)
