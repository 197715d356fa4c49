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
from memtree import LimitError, MemtreeError, NonTensor, NonTensorValueError, TensorTree
from memtree.format import schema, values
from memtree.format.values import MAX_JSON_DEPTH, MAX_TUPLE_PATHS, check_json, json_depth, json_problem


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


# -- every limit the reader enforces, the writer enforces first (issue 24 follow-up) -----------


def test_a_value_with_more_tuples_than_a_meta_json_records_is_refused_at_memmap(tmp_path: Path) -> None:
    """Before, ``memmap`` wrote 100,001 tuple paths and ``load_memmap`` refused the tree."""
    tree = TensorTree({"w": torch.ones(2), "cfg": NonTensor([()] * (MAX_TUPLE_PATHS + 1))})
    with pytest.raises(NonTensorValueError, match=rf"'cfg'.*more than {MAX_TUPLE_PATHS:,} tuples"):
        tree.memmap(tmp_path / "t")
    assert not (tmp_path / "t").exists()
    tree.memmap(tmp_path / "p", allow_pickle=True)  # what JSON cannot record is pickled on request
    assert memtree.load_memmap(tmp_path / "p", allow_pickle=True)["cfg"] == [()] * (MAX_TUPLE_PATHS + 1)
    TensorTree({"cfg": NonTensor([()] * MAX_TUPLE_PATHS)}).memmap(tmp_path / "at")
    assert memtree.load_memmap(tmp_path / "at")["cfg"] == [()] * MAX_TUPLE_PATHS


def test_a_level_whose_meta_json_exceeds_the_size_limit_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    """Before, ``memmap`` wrote a 17 MB ``meta.json`` that ``load_memmap`` refused."""
    TensorTree({"w": torch.arange(3)}).memmap(tmp_path / "t")
    big = TensorTree({"w": torch.ones(2), "sub": {"text": "x" * (schema.MAX_META_BYTES + 1)}})
    with pytest.raises(LimitError, match=r"sub/meta.json would take .* readers refuse more than 16,777,216"):
        big.memmap(tmp_path / "t")
    assert memtree.load_memmap(tmp_path / "t", lazy=False)["w"].tolist() == [0, 1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]  # no staging directory left


def _nested_tree(depth: int) -> TensorTree:
    tree = TensorTree({"w": torch.ones(1)})
    for _ in range(depth):
        tree = TensorTree({"s": tree})
    return tree


@pytest.mark.parametrize("what", ["depth", "entries"])
def test_a_level_beyond_the_readers_nesting_or_entry_limit_is_refused_at_memmap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, what: str
) -> None:
    """The limits lowered (the real ones, 256 levels and 1,000,000 entries, take long to reach):
    before, ``memmap`` wrote what ``load_memmap`` then refused with ``LimitError``."""
    monkeypatch.setattr(schema, "MAX_DEPTH", 3)
    monkeypatch.setattr(schema, "MAX_ENTRIES", 4)
    at, beyond = (
        (_nested_tree(3), _nested_tree(4))
        if what == "depth"
        else (TensorTree({str(i): i for i in range(4)}), TensorTree({"s": {str(i): i for i in range(5)}}))
    )
    at.memmap(tmp_path / "at")
    assert memtree.load_memmap(tmp_path / "at", lazy=False).to_dict() == at.to_dict()
    depth, entries = r"nests sub-trees 4 levels deep, readers refuse more than 3", r"level 's'.* 5 entries"
    with pytest.raises(LimitError, match=depth if what == "depth" else entries):
        beyond.memmap(tmp_path / "beyond")
    assert not (tmp_path / "beyond").exists()


_leaf = st.one_of(
    st.integers(-(2**64), 2**65),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(st.characters(codec=None), max_size=40),  # lone surrogates included
    st.none(),
)
_value = st.recursive(
    _leaf,
    lambda inner: st.lists(inner, max_size=4)
    | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=12,
)
_keys = st.text(st.characters(codec=None), min_size=1, max_size=6)
_tree = st.recursive(
    st.dictionaries(_keys, _value.map(NonTensor), max_size=6),
    lambda inner: st.dictionaries(_keys, inner | _value.map(NonTensor), min_size=1, max_size=6),
    max_leaves=10,
)


@settings(max_examples=60, deadline=None)
@given(content=_tree)
def test_what_memmap_accepts_loads_back_exactly_at_and_beyond_every_limit(
    tmp_path_factory: pytest.TempPathFactory, content: dict[str, Any]
) -> None:
    """With every limit of ``format/schema.py`` and ``format/values.py`` lowered to where random
    trees cross them: ``memmap`` either refuses with a memtree error, writing nothing, or writes
    a tree ``load_memmap`` reads back exactly."""
    path = tmp_path_factory.mktemp("limits") / "t"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(schema, "MAX_DEPTH", 2)
        mp.setattr(schema, "MAX_ENTRIES", 4)
        mp.setattr(schema, "MAX_META_BYTES", 700)
        mp.setattr(schema, "MAX_TUPLE_PATHS", 2)
        mp.setattr(values, "MAX_TUPLE_PATHS", 2)
        try:
            tree = TensorTree(content)
        except MemtreeError:
            return  # refused when assigned: nothing to write
        try:
            tree.memmap(path)
        except MemtreeError:
            assert not path.exists()
            return
        loaded = memtree.load_memmap(path, lazy=False)
    assert loaded.to_dict() == tree.to_dict()
    assert [type(x) for x in loaded.values(True, True)] == [type(x) for x in tree.values(True, True)]
