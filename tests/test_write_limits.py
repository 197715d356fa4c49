"""What a tree refuses to hold or write, so that every directory ``memmap`` writes loads back.

One nesting limit for non-tensor values, what orjson can write in a ``meta.json``: a value
nesting lists and dicts more than ``MAX_JSON_DEPTH`` (251) levels deep is refused with a clear
``NonTensorValueError`` when it is assigned to a tree; one that reaches ``memmap`` some other way
is refused there (or pickled, with ``allow_pickle=True``), never with orjson's raw ``TypeError``;
and ``meta.json`` files holding one are refused on load (tests/test_format_parse.py,
tests/test_bad_input.py). Up to the limit, values round-trip exactly.

Zero-element tensors whose other dims are too large for a reader (torch makes some of them, such
as ``[0, 2**63 - 1]``) are refused by ``memmap`` as the loader refuses them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import memtree
from memtree import NonTensor, NonTensorValueError, TensorTree
from memtree.format.values import MAX_JSON_DEPTH, check_json, json_depth, json_problem


def nested(depth: int, inner: Any = 1, kinds: str = "ld") -> Any:
    """``inner`` in ``depth`` levels of lists and one-field dicts (``kinds`` cycled)."""
    for i in range(depth):
        inner = [inner] if kinds[i % len(kinds)] == "l" else {"k": inner}
    return inner


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 255, 1000, 50_000])
@pytest.mark.parametrize("kinds", ["l", "d", "ld"])
def test_assigning_a_value_nested_too_deep_is_refused_naming_the_key(depth: int, kinds: str) -> None:
    """Before, the assignment passed and ``memmap`` failed with orjson's raw TypeError."""
    tree = TensorTree({"w": torch.ones(2)}, batch_size=[2])
    value = nested(depth, kinds=kinds)
    assigns = [
        lambda: tree.__setitem__("cfg", NonTensor(value)),
        lambda: tree.update({"cfg": NonTensor(value)}),
        lambda: tree.__setitem__(("sub", "cfg"), NonTensor(value)),
        lambda: TensorTree({"cfg": NonTensor(value)}),
    ]
    if isinstance(value, list):  # a plain list is a non-tensor leaf too (a dict, a sub-tree)
        assigns.append(lambda: tree.__setitem__("cfg", value))
    for assign in assigns:
        with pytest.raises(NonTensorValueError, match=rf"'cfg'.*more than {MAX_JSON_DEPTH} levels deep"):
            assign()
        assert "cfg" not in tree and ("sub", "cfg") not in tree


@pytest.mark.parametrize("kinds", ["l", "d", "ld"])
@pytest.mark.parametrize("allow_pickle", [False, True])
def test_a_value_at_the_limit_round_trips(tmp_path: Path, kinds: str, allow_pickle: bool) -> None:
    value = nested(MAX_JSON_DEPTH, inner="x", kinds=kinds)
    tree = TensorTree({"w": torch.arange(3), "cfg": NonTensor(value), "deep": nested(MAX_JSON_DEPTH)})
    tree.memmap(tmp_path / "t", allow_pickle=allow_pickle)
    assert not list((tmp_path / "t").glob("*.pickle"))  # JSON, even where pickle is allowed
    loaded = memtree.load_memmap(tmp_path / "t", lazy=False)
    assert loaded["cfg"] == value and loaded["deep"] == nested(MAX_JSON_DEPTH)
    assert memtree.verify_tree(tmp_path / "t").ok


def test_a_deep_value_that_bypassed_assignment_is_refused_at_memmap(tmp_path: Path) -> None:
    """``load_state_dict`` replaces non-tensor leaves in place: the write-time check still holds,
    with memtree's error instead of orjson's raw ``TypeError: Recursion limit reached``."""
    tree = TensorTree({"w": torch.ones(2), "cfg": NonTensor({"lr": 0.1})})
    tree.load_state_dict({"w": torch.zeros(2), "cfg": nested(300)})
    with pytest.raises(NonTensorValueError, match=rf"'cfg'.*more than {MAX_JSON_DEPTH} levels"):
        tree.memmap(tmp_path / "t")
    assert not (tmp_path / "t").exists()
    tree.memmap(tmp_path / "p", allow_pickle=True)  # what JSON cannot hold is pickled on request
    loaded = memtree.load_memmap(tmp_path / "p", allow_pickle=True, lazy=False)
    assert loaded["cfg"] == nested(300)


@settings(max_examples=200, deadline=None)
@given(depth=st.integers(min_value=0, max_value=600), kinds=st.sampled_from(["l", "d", "ld", "lld"]))
def test_json_depth_and_the_checks_agree(depth: int, kinds: str) -> None:
    value = nested(depth, kinds=kinds)
    assert json_depth(value) == min(depth, MAX_JSON_DEPTH + 1)
    assert json_depth(value, limit=depth + 5) == depth
    too_deep = depth > MAX_JSON_DEPTH
    assert (json_problem(value) is not None) == too_deep
    if too_deep:
        with pytest.raises(NonTensorValueError, match="levels deep"):
            check_json(value, "'v'")
    else:
        check_json(value, "'v'")


def test_json_depth_counts_the_deepest_branch_of_wide_values() -> None:
    wide = {"a": [1, 2, {"b": [[3]]}], "c": "x" * 10, "d": [[]] * 1000}
    assert json_depth(wide) == 5 and json_depth([]) == 1 and json_depth(()) == 1  # a tuple is a JSON array (format version 2)


@pytest.mark.parametrize("shape", [(0, 2**63 - 1), (4, 0, 2**61, 2), (0, 2**61, 2)], ids=str)
@pytest.mark.parametrize("like", [False, True])
def test_memmap_refuses_the_empty_shapes_the_loader_refuses(tmp_path: Path, shape: tuple, like: bool) -> None:
    """torch makes these (element strides fit int64) but the format bounds byte extents: before,
    memmap wrote a tree that load_memmap then refused."""
    tree = TensorTree({"w": torch.ones(2), "x": torch.empty(shape, dtype=torch.float32)})
    with pytest.raises(memtree.LimitError, match=r"leaf 'x' has the shape"):
        tree.memmap_like(tmp_path / "t") if like else tree.memmap(tmp_path / "t")
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("shape", [(0, 2**60), (3, 0, 2**58), (0,)], ids=str)
def test_large_empty_shapes_within_the_limit_round_trip(tmp_path: Path, shape: tuple) -> None:
    tree = TensorTree({"x": torch.empty(shape, dtype=torch.float32)})
    tree.memmap(tmp_path / "t")
    assert memtree.load_memmap(tmp_path / "t", lazy=False)["x"].shape == shape
    assert memtree.verify_tree(tmp_path / "t").ok
