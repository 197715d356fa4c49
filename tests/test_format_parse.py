"""The inline parse of common ``meta.json`` entries agrees with the full checks.

``format.parse_level`` takes a short path for plain tensor entries and sub-tree entries and
falls back to the full checks (with their precise messages) for anything else. Property: for any
entry, the level parses to the same ``LevelMeta``, or fails with the same error and message,
whether the short path is there or not.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from memtree import MemtreeError
from memtree.format import schema as fmt

ODD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=2**64 + 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(
        ["", ".", "..", "a/b", "../x.memmap", ".hidden.memmap", "meta.json", "META.JSON", "x.memmap",
         "X.MEMMAP", "sub", "a\\b", "a\0b", "é.memmap", "x" * 300 + ".memmap", "float32", "bfloat16",
         "complex64", "nodtype", "tensor", "tree", "json", "pickle", "x.pkl"]
    ),
    st.lists(st.integers(min_value=-2, max_value=2**62), max_size=3),
    st.lists(st.integers(min_value=0, max_value=4), min_size=65, max_size=66),
    st.lists(st.sampled_from([1, 2.0, "3", None, True]), max_size=3),
    st.dictionaries(st.sampled_from(["a", "b"]), st.integers(), max_size=2),
)

TENSOR = {"key": "w", "kind": "tensor", "file": "w.memmap", "dtype": "float32", "shape": [2, 3]}
TREE = {"key": "sub", "kind": "tree", "dir": "sub"}
NAMES = st.sampled_from(
    ["", ".", "..", "a/b", "../x.memmap", ".h.memmap", "meta.json", "META.JSON", "x.memmap", "W.MEMMAP",
     "w.memmap", "sub", "SUB", "a\\b", "a\0b", "é.memmap", "x" * 300 + ".memmap", "x.pkl", "w"]
)
#: Per field, values near the edge of what is valid (plus any odd value).
FIELD_VALUES = {
    "key": st.sampled_from(["", "w", "sub", "a.b", "x" * 300, 1, None]),
    "kind": st.sampled_from(["tensor", "tree", "json", "pickle", "other", 1, None]),
    "file": NAMES,
    "dir": NAMES,
    "dtype": st.sampled_from(["float32", "bfloat16", "bool", "complex64", "float64x", "", 4]),
    "shape": st.one_of(
        st.lists(st.integers(min_value=-1, max_value=3), max_size=3),
        st.lists(st.sampled_from([-1, 0, 2, 3, True, 2.0, 2**40, 2**63]), max_size=66),
    ),
    "value": st.integers(),
    "checksum": st.sampled_from(["crc32:0000abcd", "crc32:XYZ", "sha256:" + "0" * 64, None]),
    "capacity": st.sampled_from([0, 2, 5, -1, None, 2**62]),
    "extra": st.just(1),
}


@st.composite
def entries(draw: Any) -> Any:
    """A valid tensor or sub-tree entry with (mostly) one field changed, added or removed."""
    raw = dict(draw(st.sampled_from([TENSOR, TREE])))
    for _ in range(1 if draw(st.integers(0, 3)) else 2):
        own = draw(st.integers(0, 4)) > 0  # mostly a field the entry has: its value changes
        field = draw(st.sampled_from(sorted(raw) if own and raw else sorted(FIELD_VALUES)))
        if field in raw and not own:
            del raw[field]
        elif field in FIELD_VALUES and draw(st.integers(0, 4)):  # mostly a value near the edge
            raw[field] = draw(FIELD_VALUES[field])
        else:
            raw[field] = draw(ODD_VALUES)
    return raw if draw(st.integers(0, 20)) else draw(ODD_VALUES)  # now and then not an object


def _parse(data: bytes) -> Any:
    try:
        return fmt.parse_level(data, "t/meta.json")
    except MemtreeError as err:
        return type(err), str(err)


def _with(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**base, **changes}


@settings(max_examples=600, deadline=None)
@example(batch=[], first=_with(TENSOR, shape=[-1, 3]), second=None)
@example(batch=[], first=_with(TENSOR, shape=[True, 3]), second=None)
@example(batch=[2], first=_with(TENSOR, shape=[3, 3]), second=None)
@example(batch=[], first=_with(TENSOR, shape=[2**40, 2**40]), second=None)
@example(batch=[], first=_with(TENSOR, shape=[1] * 65), second=None)  # more dims than MAX_NDIM
@example(batch=[], first=_with(TENSOR, shape=[0] * 65), second=None)
@example(batch=[], first=_with(TENSOR, shape=[2**61]), second=None)  # float32: bytes over MAX_NBYTES
@example(batch=[], first=_with(TENSOR, shape=[2**60]), second=None)  # exactly MAX_NBYTES
@example(batch=[], first=_with(TENSOR, key=""), second=None)
@example(batch=[], first=_with(TENSOR, file="../w.memmap"), second=None)
@example(batch=[], first=_with(TENSOR, dtype="float64x"), second=None)
@example(batch=[], first=_with(TREE, dir=".."), second=None)
@example(batch=[], first=_with(TREE, key=1), second=None)
@example(batch=[], first=_with(TREE, kind="tensor"), second=None)
@example(batch=[], first=TREE, second=_with(TENSOR, file="SUB"))
@given(
    batch=st.sampled_from([[], [2], [2, 3]]),
    first=entries(),
    second=st.one_of(st.none(), entries()),
)
def test_short_path_agrees_with_the_full_checks(batch: list[int], first: Any, second: Any) -> None:
    doc = {
        "format": "memtree",
        "version": fmt.VERSION,
        "type": "TensorTree",
        "byteorder": "little",
        "batch_size": batch,
        "entries": [first] if second is None else [first, second],
    }
    data = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()  # ints >= 2**64 too
    fast = _parse(data)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(fmt, "_plain_entry", lambda raw, batch_size: None)
        full = _parse(data)
    assert fast == full


def test_short_path_is_taken_for_plain_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    """The common entries never reach the full checks (the point of the short path)."""
    doc = {
        "format": "memtree", "version": fmt.VERSION, "type": "TensorTree", "byteorder": "little",
        "batch_size": [2], "entries": [TENSOR, TREE],
    }

    def refuse(*args: Any) -> Any:
        raise AssertionError("the full checks ran for a plain entry")

    monkeypatch.setattr(fmt, "_parse_entry", refuse)
    level = fmt.parse_level(orjson.dumps(doc), "t/meta.json")
    assert level.entries == (
        fmt.LeafMeta("w", "w.memmap", fmt.dtype_from_name("float32"), (2, 3)),
        fmt.ChildMeta("sub", "sub"),
    )


@pytest.mark.parametrize(
    ("second", "message"),
    [
        (_with(TENSOR, file="v.memmap"), "entries[1].key repeats the key 'w'"),
        (_with(TENSOR, key="v", file="W.memmap"), "entries[1] reuses the file name 'W.memmap' (case-insensitively)"),
        (_with(TREE, key="v", dir="w.memmap"), "entries[1] reuses the file name 'w.memmap' (case-insensitively)"),
    ],
)
def test_repeated_keys_and_file_names_name_the_entry(second: dict[str, Any], message: str) -> None:
    doc = {
        "format": "memtree", "version": fmt.VERSION, "type": "TensorTree", "byteorder": "little",
        "batch_size": [], "entries": [TENSOR, second],
    }
    with pytest.raises(MemtreeError) as err:
        fmt.parse_level(orjson.dumps(doc), "t/meta.json")
    assert message in str(err.value)
