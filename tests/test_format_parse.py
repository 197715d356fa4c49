"""The inline parse of common ``meta.json`` entries agrees with the full checks, and the parser's
edges: shapes torch cannot make, JSON nested deeper than memtree writes, repeated object fields
(at any depth, however the bytes are spelled), ints beyond 64 bits.

``format.parse_level`` takes a short path for plain tensor entries and sub-tree entries and
falls back to the full checks (with their precise messages) for anything else. Property: for any
entry, the level parses to the same ``LevelMeta``, or fails with the same error and message,
whether the short path is there or not.
"""

from __future__ import annotations

import sys
import json
from math import prod
from typing import Any

import orjson
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from memtree import LimitError, MemtreeError, MetaFormatError
from memtree.format import schema as fmt
from memtree.format.dtypes import dtype_from_name
from memtree.format.values import MAX_JSON_DEPTH

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

#: Dims at the edges of what torch takes, for shapes with and without a zero dim.
HUGE_DIMS = [0, 0, 1, 2, 4, 2**31, 2**58, 2**60, 2**60 + 1, 2**61, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
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
        st.lists(st.sampled_from(HUGE_DIMS), min_size=1, max_size=4),  # zero dims beside huge ones
    ),
    "value": st.integers(),
    "checksum": st.sampled_from(["crc32:0000abcd", "crc32:XYZ", "sha256:" + "0" * 64, None]),
    "capacity": st.sampled_from([0, 2, 5, -1, None, 2**62, 2**63 - 1, 2**64 - 1]),
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
@example(batch=[], first=_with(TENSOR, shape=[4, 0, 2**63]), second=None)  # no element, huge dims
@example(batch=[], first=_with(TENSOR, shape=[0, 2**64 - 1]), second=None)
@example(batch=[], first=_with(TENSOR, shape=[0, 2**62, 2**62]), second=None)  # strides overflow
@example(batch=[], first=_with(TENSOR, shape=[0, 2**60]), second=None)  # extent exactly MAX_NBYTES
@example(batch=[], first=_with(TENSOR, shape=[0, 2**60 + 1]), second=None)
@example(batch=[0], first=_with(TENSOR, shape=[0, 0], capacity=2**64 - 1), second=None)
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
        fmt.LeafMeta("w", "w.memmap", dtype_from_name("float32"), (2, 3)),
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


def level_doc(entries: list[Any], batch: list[int] | None = None) -> dict[str, Any]:
    return {
        "format": "memtree", "version": fmt.VERSION, "type": "TensorTree", "byteorder": "little",
        "batch_size": [] if batch is None else batch, "entries": entries,
    }


def nested(depth: int, inner: Any = 1, *, kind: str = "list") -> Any:
    """``inner`` inside ``depth`` lists (or one-field objects)."""
    for _ in range(depth):
        inner = [inner] if kind == "list" else {"k": inner}
    return inner


# -- shapes: every dim bounded, zero-element shapes too ----------------------------------------


@pytest.mark.parametrize(
    "shape",
    [[4, 0, 2**63], [0, 2**64 - 1], [0, 2**63 - 1], [0, 2**62, 2**62], [0, 2**61, 4], [2**62, 0, 2],
     [0] + [2**8] * 8],
    ids=str,
)
def test_zero_element_shapes_with_huge_dims_are_refused(shape: list[int]) -> None:
    """torch cannot make these (its strides overflow, or a dim is not an int64): before, the parser
    took them because the tensor holds no byte, and the load failed with a raw TypeError."""
    with pytest.raises(MetaFormatError, match=r"entries\[0\]\.shape"):
        fmt.parse_level(orjson.dumps(level_doc([_with(TENSOR, shape=shape)])), "t/meta.json")


@pytest.mark.parametrize("batch", [[2**63], [0, 2**64 - 1], [2**64 - 1]], ids=str)
def test_batch_dims_beyond_int64_are_refused(batch: list[int]) -> None:
    with pytest.raises(MetaFormatError, match=r"batch_size\[\d\] must be an int in \[0, 2\*\*63\)"):
        fmt.parse_level(orjson.dumps(level_doc([], batch)), "t/meta.json")


@settings(max_examples=400, deadline=None)
@given(
    shape=st.lists(st.sampled_from(HUGE_DIMS), max_size=5),
    dtype=st.sampled_from(["bool", "float32", "complex128"]),
)
def test_every_shape_the_parser_takes_is_one_torch_makes(shape: list[int], dtype: str) -> None:
    """Accepted exactly when the dims, zeros counted as 1, span at most MAX_NBYTES; and then
    torch makes the tensor, its strides and its byte view (what loading does with it)."""
    doc = level_doc([_with(TENSOR, shape=shape, dtype=dtype)])
    torch_dtype = dtype_from_name(dtype)
    span = prod(d or 1 for d in shape) * torch_dtype.itemsize
    try:
        (leaf,) = fmt.parse_level(orjson.dumps(doc), "t/meta.json").entries
    except MetaFormatError:
        assert span > fmt.MAX_NBYTES
        return
    assert span <= fmt.MAX_NBYTES and fmt.extent_bytes(leaf.shape, leaf.dtype) == span
    t = torch.empty(leaf.shape, dtype=torch_dtype, device="meta")
    assert all(0 <= s <= fmt.MAX_NBYTES for s in t.stride())
    assert t.reshape(-1).view(torch.uint8).numel() == prod(shape) * torch_dtype.itemsize


# -- nesting: one limit, what orjson writes ------------------------------------------------------


def test_orjson_writes_exactly_the_nesting_the_parser_allows() -> None:
    """The parser's fast path trusts bytes orjson wrote to be at most MAX_META_NESTING deep."""
    assert fmt.MAX_META_NESTING == MAX_JSON_DEPTH + 3 == 254
    orjson.dumps(nested(fmt.MAX_META_NESTING))
    with pytest.raises(TypeError):
        orjson.dumps(nested(fmt.MAX_META_NESTING + 1))
    orjson.loads(b"[" * 1024 + b"]" * 1024)  # reads far deeper: the parser must bound it


@pytest.mark.parametrize("kind", ["list", "dict"])
def test_json_value_at_the_nesting_limit_round_trips(kind: str) -> None:
    value = nested(MAX_JSON_DEPTH, kind=kind)
    meta = fmt.LevelMeta((), (fmt.JsonMeta("cfg", value),))
    assert fmt.parse_level(fmt.dump_level(meta), "t/meta.json") == meta


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 254, 255, 600, 1000, 1020])
@pytest.mark.parametrize("kind", ["list", "dict"])
def test_json_value_nested_deeper_is_a_limit_error(depth: int, kind: str) -> None:
    """Before: orjson read it, re-dumping it for the duplicate check raised a raw TypeError."""
    data = orjson.dumps(level_doc([{"key": "cfg", "kind": "json", "value": 0}]))
    deep = b"[" * depth + b"0" + b"]" * depth if kind == "list" else b'{"k":' * depth + b"0" + b"}" * depth
    with pytest.raises(LimitError, match="nested more than 254 levels"):
        fmt.parse_level(data.replace(b'"value":0', b'"value":' + deep), "t/meta.json")


@pytest.mark.parametrize("field", ["batch_size", "save_id", "type", "extra"])
def test_deep_json_in_any_field_is_a_limit_error(field: str) -> None:
    data = orjson.dumps(level_doc([TENSOR])).replace(b'"format"', b'"%s":%s,"format"' % (
        field.encode(), b"[" * 1000 + b"]" * 1000), 1)
    with pytest.raises(LimitError):
        fmt.parse_level(data, "t/meta.json")


@pytest.mark.parametrize("field", ["batch_size", "extra"])
def test_deep_repeated_field_is_a_limit_error_whatever_the_recursion_limit(
    field: str,
) -> None:
    """Before: the depth of a value hidden by a repeated field was found only by json.loads'
    RecursionError, so a test that raised the recursion limit (torch._dynamo, transformers) made
    this a MetaFormatError, and the whole suite failed in one order and passed in another."""
    data = orjson.dumps(level_doc([TENSOR])).replace(b'"format"', b'"%s":%s,"format"' % (
        field.encode(), b"[" * 1000 + b"]" * 1000), 1)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)
    try:
        with pytest.raises(LimitError, match="nested more than"):
            fmt.parse_level(data, "t/meta.json")
    finally:
        sys.setrecursionlimit(limit)


# -- repeated object fields, found however the bytes are spelled ---------------------------------


def test_a_float_that_redumps_longer_cannot_hide_a_repeated_field() -> None:
    """``1e15`` re-dumps as ``1000000000000000.0`` (14 bytes more), exactly what a repeated
    ``,"kind":"json"`` takes away: the old length comparison saw canonical bytes."""
    data = orjson.dumps(level_doc([{"key": "x", "kind": "json", "value": 0}]))
    data = data.replace(b'"kind":"json","value":0', b'"kind":"json","kind":"json","value":1e15')
    assert len(orjson.dumps(orjson.loads(data))) == len(data)
    with pytest.raises(MetaFormatError, match="the entry of key 'x' repeats the field 'kind'"):
        fmt.parse_level(data, "t/meta.json")


SPELLINGS = {  # float spellings orjson reads as the same value and writes differently
    "1e15": 1e15, "1E+15": 1e15, "0.5e1": 5.0, "1.50": 1.5, "100e-2": 1.0, "-0.0": -0.0, "2e0": 2.0,
}


@st.composite
def json_values(draw: Any, depth: int = 0) -> Any:
    if depth >= 3 or draw(st.integers(0, 2)) == 0:
        return draw(st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from(list(SPELLINGS)).map(
            lambda s: _Raw(s)), st.text(max_size=4), st.booleans(), st.none()))
    if draw(st.booleans()):
        return draw(st.lists(json_values(depth + 1), max_size=3))
    return draw(st.dictionaries(st.sampled_from(["a", "b", "kind", "key", "value"]), json_values(depth + 1), max_size=3))


class _Raw:
    """A number written with exactly this spelling."""

    def __init__(self, text: str) -> None:
        self.text = text


def spell(v: Any, dup: list[Any] | None = None) -> str:
    """JSON text of ``v``; the object ``dup[0]`` (compared by identity) gets its first field twice."""
    if isinstance(v, _Raw):
        return v.text
    if isinstance(v, list):
        return "[" + ",".join(spell(x, dup) for x in v) + "]"
    if isinstance(v, dict):
        parts = [json.dumps(k) + ":" + spell(x, dup) for k, x in v.items()]
        if dup is not None and dup[0] is v:
            parts.insert(dup[1] % (len(parts) + 1), parts[0])  # first field again, anywhere
        return "{" + ",".join(parts) + "}"
    return json.dumps(v, ensure_ascii=False)


def objects(v: Any) -> list[dict[str, Any]]:
    """Every non-empty object in ``v``, outermost first."""
    out = [v] if isinstance(v, dict) and v else []
    for x in (v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()):
        out += objects(x)
    return out


def plain(v: Any) -> Any:
    if isinstance(v, _Raw):
        return SPELLINGS[v.text]
    if isinstance(v, list):
        return [plain(x) for x in v]
    if isinstance(v, dict):
        return {k: plain(x) for k, x in v.items()}
    return v


@settings(max_examples=400, deadline=None)
@example(values=[{"a": _Raw("1e15")}], which=0, at=1)
@given(
    values=st.lists(json_values(), min_size=1, max_size=3),
    which=st.integers(min_value=0),
    at=st.integers(min_value=0),
)
def test_a_repeated_field_is_refused_at_any_depth(values: list[Any], which: int, at: int) -> None:
    """Any object of the level (the level itself, an entry, an object inside a non-tensor value)
    given one of its fields twice is refused; without it the same spelling parses, to what the
    canonical bytes parse to."""
    doc = level_doc([TENSOR, TREE] + [{"key": f"v{i}", "kind": "json", "value": v} for i, v in enumerate(values)])
    clean = spell(doc).encode()
    expected = fmt.parse_level(orjson.dumps(plain(doc)), "t/meta.json")
    assert fmt.parse_level(clean, "t/meta.json") == expected
    target = objects(doc)[which % len(objects(doc))]
    with pytest.raises(MetaFormatError, match="repeats the field"):
        fmt.parse_level(spell(doc, [target, at]).encode(), "t/meta.json")


@pytest.mark.parametrize("number", [b"-9223372036854775809", b"18446744073709551616", b"1" + b"0" * 30,
                                    b"-1" + b"0" * 5000])
def test_ints_beyond_64_bits_are_refused_not_turned_into_floats(number: bytes) -> None:
    """orjson reads them as floats (or refuses them): a value JSON would change."""
    data = orjson.dumps(level_doc([{"key": "n", "kind": "json", "value": 0}])).replace(b'"value":0', b'"value":' + number)
    with pytest.raises(MetaFormatError):
        fmt.parse_level(data, "t/meta.json")


@pytest.mark.parametrize("number", [-(2**63), 2**64 - 1, 0])
def test_ints_at_the_64_bit_edges_stay_ints(number: int) -> None:
    data = b" " + orjson.dumps(level_doc([{"key": "n", "kind": "json", "value": number}]))  # not canonical
    (entry,) = fmt.parse_level(data, "t/meta.json").entries
    assert type(entry.value) is int and entry.value == number
