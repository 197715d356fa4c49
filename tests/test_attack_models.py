"""An attacker's and a demanding user's review of loading models (issue 17), as a test suite.

Every class of input is a parametrized or hypothesis suite: hostile safetensors headers, shard
indexes that point outside their directory or disagree with their shards, ``torch.save`` files
whose tensors share records or are strided views, casts, ``prefix=`` ambiguities, tied and
storage-sharing targets, mixed meta/live modules, non-persistent buffers, ``assign=``, the
optimizer built before the load, files changed during a load, and unusual dtypes and shapes.
Each case asserts either the exact bits (against ``nn.Module.load_state_dict`` of the same
values) or a :class:`~memtree.MemtreeError` naming the key or path, with the module untouched
where the documentation promises that nothing changes.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

import memtree
import memtree.nn.loading as loading_mod
import memtree.store.primitives.fill as fill_mod
from memtree import (
    CheckpointFormatError,
    MemtreeError,
    MemtreeKeyError,
    ShapeMismatchError,
    SourceError,
    StorageError,
    TensorTree,
    UnsafePathError,
    empty_init,
    load_into_module,
)
from memtree.interop import save_safetensors
from treeutil import random_tensor, raw_bytes

SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


# ------------------------------------------------------------------------------------ helpers
class Pair(nn.Module):
    """Two float32 parameters and a persistent int64 buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(4, 3))
        self.b = nn.Parameter(torch.zeros(5))
        self.register_buffer("n", torch.zeros(2, dtype=torch.int64))


def values(seed: int = 0) -> dict[str, torch.Tensor]:
    return {
        "a": random_tensor((4, 3), torch.float32, seed),
        "b": random_tensor((5,), torch.float32, seed + 1),
        "n": random_tensor((2,), torch.int64, seed + 2),
    }


def _bits(t: torch.Tensor) -> Any:
    return ("meta", tuple(t.shape), t.dtype) if t.device.type == "meta" else raw_bytes(t)


def snapshot(module: nn.Module) -> dict[str, Any]:
    """The bytes of every parameter and buffer (persistent or not), by name (meta: no bytes)."""
    out = {f"p:{k}": _bits(v) for k, v in module.named_parameters(remove_duplicate=False)}
    out.update({f"b:{k}": _bits(v) for k, v in module.named_buffers(remove_duplicate=False)})
    return out


def filled(module: nn.Module, seed: int = 7) -> nn.Module:
    """``module`` with recognisable values in every tensor (so that any write shows)."""
    with torch.no_grad():
        for i, t in enumerate(module.state_dict(keep_vars=True).values()):
            if t.device.type != "meta" and torch._debug_has_internal_overlap(t) != 1:  # not expanded
                t.copy_(random_tensor(tuple(t.shape), t.dtype, seed + i))
    return module


def reference(make: Callable[[], nn.Module], state: dict[str, torch.Tensor], **kw: Any) -> nn.Module:
    """What ``nn.Module.load_state_dict`` makes of ``state`` (the user's expectation)."""
    m = filled(make())
    m.load_state_dict(state, **kw)
    return m


def write_source(state: dict[str, torch.Tensor], kind: str, where: Any) -> Any:
    """``state`` as a source of ``kind``: a state_dict, a memtree directory, a safetensors or
    torch.save file, or a Hugging Face index of two shards of either format."""
    d = str(where)
    os.makedirs(d, exist_ok=True)
    state = {k: v.detach() for k, v in state.items()}
    if kind == "state_dict":
        return state
    if kind == "memtree":  # nested by dotted name, as from_module nests a module
        nested: dict[str, Any] = {}
        for name, t in state.items():
            *parents, leaf = name.split(".")
            level = nested
            for p in parents:
                level = level.setdefault(p, {})
            level[leaf] = t
        TensorTree(nested).memmap(d + "/tree")
        return d + "/tree"
    if kind == "safetensors":
        save_safetensors(state, d + "/m.safetensors")
        return d + "/m.safetensors"
    if kind == "torch":
        torch.save(state, d + "/m.pt")
        return d + "/m.pt"
    keys = list(state)
    parts = [{k: state[k] for k in keys[: (len(keys) + 1) // 2]}, {k: state[k] for k in keys[(len(keys) + 1) // 2 :]}]
    ext = "safetensors" if kind == "st-index" else "bin"
    weight_map = {}
    for i, part in enumerate(p for p in parts if p):
        name = f"model-0000{i + 1}-of-00002.{ext}"
        (save_safetensors if ext == "safetensors" else torch.save)(part, os.path.join(d, name))
        weight_map.update({k: name for k in part})
    index = "model.safetensors.index.json" if ext == "safetensors" else "pytorch_model.bin.index.json"
    with open(os.path.join(d, index), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return os.path.join(d, index)


KINDS = ["state_dict", "memtree", "safetensors", "torch", "st-index", "bin-index"]
FILE_KINDS = ["memtree", "safetensors", "torch", "st-index", "bin-index"]


def safetensors_bytes(entries: dict[str, dict[str, Any]], data: bytes, *, header_len: int | None = None) -> bytes:
    header = json.dumps(entries).encode()
    n = len(header) if header_len is None else header_len
    return struct.pack("<Q", n) + header + data


# ---------------------------------------------------------- 1. safetensors headers that lie
def _good_entries() -> tuple[dict[str, dict[str, Any]], bytes]:
    v = values(1)
    a, b, n = (raw_bytes(v[k]) for k in ("a", "b", "n"))
    entries = {
        "a": {"dtype": "F32", "shape": [4, 3], "data_offsets": [0, 48]},
        "b": {"dtype": "F32", "shape": [5], "data_offsets": [48, 68]},
        "n": {"dtype": "I64", "shape": [2], "data_offsets": [68, 84]},
    }
    return entries, a + b + n


def _lie(case: str) -> bytes:
    entries, data = _good_entries()
    if case == "overlap":
        entries["b"]["data_offsets"] = [40, 60]
        entries["n"]["data_offsets"] = [60, 76]
        data = data[:76]
    elif case == "past-the-end":
        entries["n"]["data_offsets"] = [68, 84 + 8]
        entries["n"]["shape"] = [3]
    elif case == "count-mismatch":
        entries["a"]["shape"] = [4, 4]
    elif case == "dtype-mismatch":
        entries["b"]["dtype"] = "F64"
    elif case == "hole":
        entries["b"]["data_offsets"] = [52, 72]
        entries["n"]["data_offsets"] = [72, 88]
        data = data[:48] + b"\0" * 4 + data[48:]
    elif case == "trailing":
        data += b"\0" * 8
    elif case == "reversed":
        entries["b"]["data_offsets"] = [68, 48]
    elif case == "negative":
        entries["b"]["data_offsets"] = [-20, 0]
    elif case == "huge-shape":
        entries["b"]["shape"] = [2**62, 2**62]
    elif case == "unknown-dtype":
        entries["b"]["dtype"] = "F128"
    elif case == "bool-as-int":
        entries["b"]["data_offsets"] = [True, 68]
    elif case == "float-offsets":
        entries["b"]["data_offsets"] = [48.0, 68.0]
    elif case == "extra-field":
        entries["b"]["offset"] = 0
    elif case == "duplicate":
        header = json.dumps(entries).encode()[:-1] + b', "a": ' + json.dumps(entries["a"]).encode() + b"}"
        return struct.pack("<Q", len(header)) + header + data
    elif case == "header-len-huge":
        return safetensors_bytes(entries, data, header_len=2**63)
    elif case == "header-len-past-file":
        return safetensors_bytes(entries, data, header_len=len(json.dumps(entries)) + 200)
    elif case == "header-len-short":
        return safetensors_bytes(entries, data, header_len=len(json.dumps(entries)) - 3)
    elif case == "offsets-past-2**64":
        entries["n"]["data_offsets"] = [2**64 + 68, 2**64 + 84]
    elif case == "deep-json":
        entries["b"]["shape"] = [[[5]]]
    elif case == "not-an-object":
        header = b"[1, 2, 3]"
        return struct.pack("<Q", len(header)) + header
    return safetensors_bytes(entries, data)


LIES = [
    "overlap", "past-the-end", "count-mismatch", "dtype-mismatch", "hole", "trailing", "reversed",
    "negative", "huge-shape", "unknown-dtype", "bool-as-int", "float-offsets", "extra-field",
    "duplicate", "header-len-huge", "header-len-past-file", "header-len-short", "offsets-past-2**64", "deep-json",
    "not-an-object",
]


def test_the_honest_file_the_lies_are_made_from_loads_bit_exact(tmp_path) -> None:
    path = tmp_path / "m.safetensors"
    path.write_bytes(safetensors_bytes(*_good_entries()))
    m = filled(Pair())
    assert load_into_module(m, path) == ([], [])
    assert snapshot(m) == snapshot(reference(Pair, values(1)))


@pytest.mark.parametrize("meta", [False, True], ids=["live", "meta"])
@pytest.mark.parametrize("case", LIES)
def test_a_lying_safetensors_header_is_refused_naming_the_file_and_nothing_changes(tmp_path, case, meta) -> None:
    path = tmp_path / "m.safetensors"
    path.write_bytes(_lie(case))
    if meta:
        with empty_init():
            m = Pair()
    else:
        m = filled(Pair())
    before = snapshot(m) if not meta else None
    with pytest.raises(MemtreeError) as info:
        load_into_module(m, path)
    assert str(path) in str(info.value)
    if before is not None:
        assert snapshot(m) == before
    else:
        assert all(p.device.type == "meta" for p in m.parameters())


@st.composite
def _layouts(draw: Any) -> tuple[dict[str, list[int]], list[int]]:
    """Offsets of ``a`` (12 float32), ``b`` (5 float32), ``n`` (2 int64) laid out honestly in a
    random order, then perhaps lied about: one offset moved, or one end changed."""
    sizes = {"a": 48, "b": 20, "n": 16}
    order = draw(st.permutations(list(sizes)))
    offsets, at = {}, 0
    for name in order:
        offsets[name] = [at, at + sizes[name]]
        at += sizes[name]
    lie = draw(st.sampled_from(["none", "none", "none", "move", "end", "swap"]))
    if lie == "move":
        name = draw(st.sampled_from(order))
        shift = draw(st.sampled_from([-24, -8, -4, -1, 1, 4, 8, 24]))
        offsets[name] = [max(offsets[name][0] + shift, 0), max(offsets[name][1] + shift, 0)]
    elif lie == "end":
        name = draw(st.sampled_from(order))
        offsets[name][1] = max(offsets[name][1] + draw(st.sampled_from([-8, -4, -1, 1, 4, 8])), 0)
    elif lie == "swap":
        x, y = draw(st.permutations(order))[:2]
        offsets[x], offsets[y] = offsets[y], offsets[x]
    return offsets, [at]


@SETTINGS
@given(
    layout=_layouts(),
    tail=st.sampled_from([0, 0, 0, 0, 0, 8]),
    shape_a=st.sampled_from([[4, 3], [4, 3], [4, 3], [3, 4], [12], [2, 3]]),
)
def test_fuzzed_offsets_either_load_exactly_the_bytes_they_name_or_raise_and_change_nothing(
    tmp_path_factory, layout, tail, shape_a
) -> None:
    offsets, _ = layout
    data = bytes(range(256))[:84] + bytes(tail)
    entries = {
        "a": {"dtype": "F32", "shape": shape_a, "data_offsets": offsets["a"]},
        "b": {"dtype": "F32", "shape": [5], "data_offsets": offsets["b"]},
        "n": {"dtype": "I64", "shape": [2], "data_offsets": offsets["n"]},
    }
    path = tmp_path_factory.mktemp("st") / "m.safetensors"
    path.write_bytes(safetensors_bytes(entries, data))
    m = filled(Pair())
    before = snapshot(m)
    try:
        result = load_into_module(m, path, strict=False)
        event("loaded")
    except MemtreeError as err:
        event("refused")
        assert str(path) in str(err) or "'a'" in str(err)  # the file, or the key of a wrong shape
        assert snapshot(m) == before
        return
    assert result == ([], [])
    for name, t in (("a", m.a), ("b", m.b), ("n", m.n)):
        begin, end = entries[name]["data_offsets"]
        assert raw_bytes(t) == data[begin:end], name


# ------------------------------------------------- 2. shard indexes: paths, links, disagreement
@pytest.mark.parametrize(
    "shard",
    ["../outside.safetensors", "/etc/passwd", "sub/../../outside.safetensors", "./m.safetensors",
     "a\\..\\..\\outside.safetensors", "m.safetensors\0x", "", "sub//m.safetensors",
     "model.safetensors.index.json", "sub", "~/outside.safetensors", "%2e%2e/outside.safetensors"],
)
def test_an_index_naming_a_shard_outside_its_directory_is_refused_before_any_read(tmp_path, shard) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "sub").mkdir()
    save_safetensors(values(), tmp_path / "outside.safetensors")
    save_safetensors(values(), model / "m.safetensors")
    index = model / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": shard, "b": "m.safetensors", "n": "m.safetensors"}}))
    m = filled(Pair())
    before = snapshot(m)
    with pytest.raises((UnsafePathError, CheckpointFormatError, StorageError)) as info:
        load_into_module(m, model)  # "~" and "%2e" are plain names here: missing shards
    assert str(index) in str(info.value) or str(model / shard) in str(info.value)
    assert snapshot(m) == before


@pytest.mark.parametrize("how", ["file-link", "dir-link", "link-chain"])
def test_a_shard_that_links_outside_the_directory_is_refused(tmp_path, how) -> None:
    model, outside = tmp_path / "model", tmp_path / "outside"
    model.mkdir()
    outside.mkdir()
    save_safetensors(values(3), outside / "s.safetensors")
    if how == "file-link":
        os.symlink(outside / "s.safetensors", model / "s.safetensors")
        name = "s.safetensors"
    elif how == "dir-link":
        os.symlink(outside, model / "sub")
        name = "sub/s.safetensors"
    else:  # a link inside pointing at a link that leaves
        os.symlink(outside / "s.safetensors", model / "hop")
        os.symlink("hop", model / "s.safetensors")
        name = "s.safetensors"
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: name for k in "abn"}}))
    m = filled(Pair())
    before = snapshot(m)
    with pytest.raises(UnsafePathError, match="outside"):
        load_into_module(m, model)
    assert snapshot(m) == before


def _two_shards(tmp_path: Any, fmt: str) -> tuple[Any, Callable[[str, dict[str, torch.Tensor]], None]]:
    ext = "safetensors" if fmt == "safetensors" else "bin"

    def write(name: str, part: dict[str, torch.Tensor]) -> None:
        (save_safetensors if fmt == "safetensors" else torch.save)(part, tmp_path / f"{name}.{ext}")

    return ext, write


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_an_index_whose_weight_map_puts_a_tensor_in_the_wrong_shard_is_refused(tmp_path, fmt) -> None:
    v = values(2)
    ext, write = _two_shards(tmp_path, fmt)
    write("s1", {"a": v["a"]})
    write("s2", {"b": v["b"], "n": v["n"]})
    index = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
    (tmp_path / index).write_text(json.dumps({"weight_map": {"a": f"s2.{ext}", "b": f"s2.{ext}", "n": f"s2.{ext}"}}))
    m = filled(Pair())
    before = snapshot(m)
    with pytest.raises(CheckpointFormatError, match="'a'"):
        load_into_module(m, tmp_path)
    assert snapshot(m) == before


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_the_index_decides_which_shard_a_tensor_held_twice_comes_from(tmp_path, fmt) -> None:
    """A stale copy of a tensor in another shard is never read: the index names the source."""
    v, stale = values(2), values(9)
    ext, write = _two_shards(tmp_path, fmt)
    write("s1", {"a": stale["a"], "b": v["b"]})
    write("s2", {"a": v["a"], "n": v["n"]})
    index = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
    (tmp_path / index).write_text(json.dumps({"weight_map": {"a": f"s2.{ext}", "b": f"s1.{ext}", "n": f"s2.{ext}"}}))
    m = filled(Pair())
    assert load_into_module(m, tmp_path) == ([], [])
    assert snapshot(m) == snapshot(reference(Pair, v))


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_an_index_that_lists_a_name_the_module_lacks_reports_it_unexpected(tmp_path, fmt) -> None:
    v = values(2)
    ext, write = _two_shards(tmp_path, fmt)
    write("s1", {**v, "extra": torch.ones(3)})
    index = "model.safetensors.index.json" if fmt == "safetensors" else "pytorch_model.bin.index.json"
    (tmp_path / index).write_text(json.dumps({"weight_map": {k: f"s1.{ext}" for k in [*v, "extra"]}}))
    m = filled(Pair())
    before = snapshot(m)
    with pytest.raises(MemtreeKeyError, match="'extra'"):
        load_into_module(m, tmp_path)
    assert snapshot(m) == before
    assert load_into_module(m, tmp_path, strict=False) == ([], ["extra"])
    assert snapshot(m) == snapshot(reference(Pair, v))


# ------------------------------------------- 3. torch.save: shared records, offsets, strides
class Views(nn.Module):
    """Parameters of the shapes the view cases below produce."""

    def __init__(self) -> None:
        super().__init__()
        self.x = nn.Parameter(torch.zeros(3, 4))
        self.y = nn.Parameter(torch.zeros(3, 4))
        self.z = nn.Parameter(torch.zeros(4, 3))


def _views(base: torch.Tensor, case: str) -> dict[str, torch.Tensor]:
    """Three tensors of shapes (3, 4), (3, 4), (4, 3) that share ``base``'s storage."""
    flat = base.reshape(-1)
    if case == "same-record":  # two names, one tensor (a tied state_dict)
        return {"x": base[:3, :4], "y": base[:3, :4], "z": base[:4, :3]}
    if case == "offsets":
        return {"x": flat[5:17].view(3, 4), "y": flat[17:29].view(3, 4), "z": flat[1:13].view(4, 3)}
    if case == "overlapping":
        return {"x": flat[0:12].view(3, 4), "y": flat[6:18].view(3, 4), "z": flat[3:15].view(4, 3)}
    if case == "transposed":
        return {"x": base[:4, :3].t(), "y": base[2:6, 1:4].t(), "z": base[:3, :4].t()}
    if case == "strided":
        return {"x": base[::2, ::2][:3, :4], "y": base[1::2, 1::2][:3, :4], "z": base[::2, 1::2][:4, :3]}
    if case == "broadcast":  # stride 0
        return {"x": flat[:4].expand(3, 4), "y": flat[4:5].expand(3, 4), "z": flat[:3].expand(4, 3)}
    if case == "negative-offset-into-a-big-storage":
        return {"x": flat[-12:].view(3, 4), "y": flat[-24:-12].view(3, 4), "z": flat[40:52].view(4, 3)}
    raise AssertionError(case)


VIEW_CASES = ["same-record", "offsets", "overlapping", "transposed", "strided", "broadcast",
              "negative-offset-into-a-big-storage"]


@pytest.mark.parametrize("target", ["live", "meta", "assign"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16-cast"])
@pytest.mark.parametrize("case", VIEW_CASES)
def test_torch_save_views_of_shared_storage_load_as_torch_load_reads_them(tmp_path, case, dtype, target) -> None:
    base = random_tensor((8, 8), dtype, seed=11)
    state = _views(base, case)
    torch.save(state, tmp_path / "m.pt")
    expected = {k: v.to(torch.float32) for k, v in torch.load(tmp_path / "m.pt", weights_only=True).items()}
    if target == "meta":
        with empty_init():
            m = Views()
    else:
        m = filled(Views())
    params = list(m.parameters())
    cast = torch.float32 if dtype != torch.float32 else None
    assert load_into_module(m, tmp_path / "m.pt", dtype=cast, assign=target == "assign") == ([], [])
    for name in "xyz":
        got = getattr(m, name)
        assert got.dtype == torch.float32 and got.device.type == "cpu", name
        assert raw_bytes(got) == raw_bytes(expected[name]), name
    if target == "live":
        assert list(m.parameters()) == params  # the same objects, filled


@pytest.mark.parametrize(
    "layout, error, match",
    [
        ("OVERLAP", SourceError, r"to_module\(inplace=True\): .*'q', 'k'.*share memory.*inplace=True"),
        ([(0, (4, 1)), (12, (0, 1)), (24, (3, 1))], memtree.InvalidArgumentError, r"to_module\(inplace=True\): .*'k'.*share memory"),
    ],
)
def test_to_module_inplace_refuses_shared_memory_as_load_into_module_does(layout, error, match) -> None:
    """Before, ``to_module(inplace=True)`` skipped the check: overlapping views got
    last-write-wins, an expanded view torch's raw RuntimeError."""
    state = {"q": random_tensor((3, 4), torch.float32, 1), "k": random_tensor((3, 4), torch.float32, 2),
             "v": random_tensor((2, 3), torch.float32, 3)}
    m = filled(SharedStorage(getattr(SharedStorage, layout) if isinstance(layout, str) else layout))
    before = snapshot(m)
    with pytest.raises(error, match=match):
        TensorTree(state).to_module(m, inplace=True)
    assert snapshot(m) == before
    TensorTree(state).to_module(m)  # binding: each its own tensor
    assert all(raw_bytes(getattr(m, k)) == raw_bytes(v) for k, v in state.items())


def test_to_module_inplace_fills_overlapping_tensors_given_agreeing_bytes() -> None:
    base = random_tensor((64,), torch.float32, 5)
    state = {"q": base[0:12].view(3, 4).clone(), "k": base[8:20].view(3, 4).clone(), "v": base[24:30].view(2, 3).clone()}
    m = filled(SharedStorage(SharedStorage.OVERLAP))
    TensorTree(state).to_module(m, inplace=True)
    assert snapshot(m) == snapshot(reference(lambda: SharedStorage(SharedStorage.OVERLAP), state))


@SETTINGS
@given(
    layout=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 5), st.integers(0, 5)), min_size=3, max_size=3),
    target=st.sampled_from(["live", "meta"]),
    cast=st.booleans(),
)
def test_fuzzed_strided_views_of_one_storage_load_as_torch_load_reads_them(tmp_path_factory, layout, target, cast) -> None:
    """Any offsets and strides (0 included: broadcasts; overlapping views), one shared record."""
    base = random_tensor((128,), torch.bfloat16 if cast else torch.float32, seed=sum(map(sum, layout)))
    shapes = {"x": (3, 4), "y": (3, 4), "z": (4, 3)}
    state = {k: base.as_strided(shapes[k], (s0, s1), off) for k, (off, s0, s1) in zip("xyz", layout)}
    path = tmp_path_factory.mktemp("views") / "m.pt"
    torch.save(state, path)
    expected = torch.load(path, weights_only=True)
    if target == "meta":
        with empty_init():
            m = Views()
    else:
        m = filled(Views())
    assert load_into_module(m, path, dtype=torch.float32 if cast else None) == ([], [])
    for name in "xyz":
        assert raw_bytes(getattr(m, name)) == raw_bytes(expected[name].float()), name


# ------------------------------------------------------ 4. dtypes, casts, odd shapes, all kinds
ODD = {  # name: (shape, dtype) of a tensor the module below holds
    "w": ((3, 2), torch.float32),
    "flag": ((4,), torch.bool),
    "phase": ((2, 2), torch.complex64),
    "f8": ((3,), torch.float8_e4m3fn),
    "f8b": ((2, 1), torch.float8_e5m2),
    "empty": ((0, 5), torch.float32),
    "none": ((3, 0, 2), torch.int32),
    "step": ((), torch.int64),
    "scale": ((), torch.float64),
    "h": ((7,), torch.float16),
    "u": ((2,), torch.uint8),
}


class Odd(nn.Module):
    def __init__(self, dtypes: dict[str, torch.dtype] | None = None) -> None:
        super().__init__()
        for name, (shape, dtype) in ODD.items():
            dtype = (dtypes or {}).get(name, dtype)
            if name == "w":
                self.w = nn.Parameter(torch.zeros(shape, dtype=dtype))
            else:
                self.register_buffer(name, torch.zeros(shape, dtype=dtype))


def odd_values(seed: int, dtypes: dict[str, torch.dtype] | None = None) -> dict[str, torch.Tensor]:
    return {
        n: random_tensor(shape, (dtypes or {}).get(n, dt), seed + i) for i, (n, (shape, dt)) in enumerate(ODD.items())
    }


@pytest.mark.parametrize("target", ["live", "meta", "assign"])
@pytest.mark.parametrize("kind", KINDS)
def test_bool_complex_float8_empty_and_0_dim_tensors_load_bit_exact_from_every_kind(tmp_path, kind, target) -> None:
    state = odd_values(5)
    source = write_source(state, kind, tmp_path)
    if target == "meta":
        with empty_init():
            m = Odd()
    else:
        m = filled(Odd())
    assert load_into_module(m, source, assign=target == "assign") == ([], [])
    for name, t in state.items():
        got = getattr(m, name)
        assert (got.dtype, got.shape, raw_bytes(got)) == (t.dtype, t.shape, raw_bytes(t)), name


CASTS = [  # (stored dtype of the floating tensors, module dtype)
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.float8_e4m3fn, torch.float32),
    (torch.float64, torch.bfloat16),
]


@pytest.mark.parametrize("target", ["live", "meta"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stored, wanted", CASTS, ids=lambda d: str(d).replace("torch.", ""))
def test_dtype_casts_floating_tensors_exactly_as_tensor_to_and_keeps_the_others(tmp_path, stored, wanted, kind, target) -> None:
    floats = ["w", "f8", "f8b", "empty", "scale", "h"]
    state = odd_values(3, {n: stored for n in floats})
    source = write_source(state, kind, tmp_path)
    module_dtypes = {n: wanted for n in floats}
    if target == "meta":
        with empty_init():
            m = Odd(module_dtypes)
    else:
        m = filled(Odd(module_dtypes))
    assert load_into_module(m, source, dtype=wanted) == ([], [])
    for name, t in state.items():
        want = t.to(wanted) if t.is_floating_point() else t
        got = getattr(m, name)
        assert (got.dtype, got.shape, raw_bytes(got)) == (want.dtype, want.shape, raw_bytes(want)), name


@pytest.mark.parametrize("target", ["live", "meta"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "stored, module_dtype, cast",
    [
        (torch.bfloat16, torch.float32, None),         # no dtype=: a dtype difference is an error
        (torch.float32, torch.float64, None),
        (torch.int32, torch.float32, torch.float32),   # integers are never cast
        (torch.bool, torch.float32, torch.float32),
        (torch.complex64, torch.float32, torch.float32),  # complex is not floating point
        (torch.float32, torch.float16, torch.bfloat16),  # the cast dtype is not the module's
    ],
    ids=lambda d: str(d).replace("torch.", ""),
)
def test_a_dtype_difference_that_dtype_does_not_cover_is_refused_before_any_change(
    tmp_path, kind, target, stored, module_dtype, cast
) -> None:
    state = odd_values(4)
    state["w"] = random_tensor((3, 2), stored, 4)
    source = write_source(state, kind, tmp_path)
    if target == "meta":
        with empty_init():
            m = Odd({"w": module_dtype})
    else:
        m = filled(Odd({"w": module_dtype}))
    before = snapshot(m) if target == "live" else None
    with pytest.raises(ShapeMismatchError, match=r"'w'.*(bfloat16|float|int32|bool|complex64).*module"):
        load_into_module(m, source, dtype=cast, strict=False)
    if before is not None:
        assert snapshot(m) == before
    else:
        assert all(t.device.type == "meta" for t in m.state_dict().values())


@pytest.mark.parametrize("bad", [torch.int64, torch.bool, torch.complex64, "float32", torch.float32.__class__])
def test_a_cast_to_a_non_floating_dtype_is_refused(bad) -> None:
    m = filled(Pair())
    before = snapshot(m)
    with pytest.raises(memtree.InvalidArgumentError, match="dtype="):
        load_into_module(m, values(), dtype=bad)
    assert snapshot(m) == before


# ------------------------------------------------------------- 5. prefix= and ignore_mismatched
class Wrapped(nn.Module):
    """``Pair`` under ``model.``: the names a training checkpoint of a wrapper has."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Pair()


@pytest.mark.parametrize("kind", KINDS)
def test_a_source_with_a_name_both_with_and_without_the_prefix_is_refused_not_guessed(tmp_path, kind) -> None:
    """``model.a`` and ``a`` in one source: stripping ``model.`` would make two sources of ``a``."""
    state = {**{f"model.{k}": v for k, v in values(1).items()}, "a": values(2)["a"]}
    source = write_source(state, kind, tmp_path)
    m = filled(Pair())
    before = snapshot(m)
    with pytest.raises(SourceError, match=r"'model\.a' and 'a'|'a' and 'model\.a'"):
        load_into_module(m, source, prefix="model.")
    assert snapshot(m) == before


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("direction", ["strip", "add"])
def test_prefix_maps_whole_components_only(tmp_path, kind, direction) -> None:
    """``prefix='model'`` never strips ``models.``/``modela``: those names stay as they are."""
    v = values(3)
    if direction == "strip":
        state = {**{f"model.{k}": t for k, t in v.items()}, "modelb": torch.ones(5)}
        m = filled(Pair())
        expected_unexpected = ["modelb"]
    else:
        state = dict(v)
        m = filled(Wrapped())
        expected_unexpected = []
    source = write_source(state, kind, tmp_path)
    result = load_into_module(m, source, prefix="model", strict=False)
    assert (result.missing, sorted(result.unexpected)) == ([], expected_unexpected)
    inner = m if direction == "strip" else m.model
    assert snapshot(inner) == snapshot(reference(Pair, v))


@pytest.mark.parametrize("kind", KINDS)
def test_ignore_mismatched_with_strict_still_fails_on_unexpected_and_missing_names(tmp_path, kind) -> None:
    v = values(4)
    state = {"a": random_tensor((3, 4), torch.float32, 1), "b": v["b"], "extra": torch.ones(2)}
    source = write_source(state, kind, tmp_path)
    m = filled(Pair())
    before = snapshot(m)
    with pytest.raises(MemtreeKeyError) as info:
        load_into_module(m, source, ignore_mismatched=True)
    message = str(info.value)
    assert "'n'" in message and "'extra'" in message and "'a'" not in message.split("Nothing")[0]
    assert snapshot(m) == before
    result = load_into_module(m, source, ignore_mismatched=True, strict=False)
    assert (result.missing, result.unexpected, result.mismatched) == (["n"], ["extra"], ["a"])
    assert raw_bytes(m.b) == raw_bytes(v["b"])
    assert {k: x for k, x in snapshot(m).items() if k != "p:b"} == {k: x for k, x in before.items() if k != "p:b"}


@pytest.mark.parametrize("kind", KINDS)
def test_ignore_mismatched_never_hides_a_dtype_difference_of_the_same_shape(tmp_path, kind) -> None:
    state = {**values(4), "b": random_tensor((5,), torch.float64, 1), "a": random_tensor((2, 2), torch.float32, 2)}
    source = write_source(state, kind, tmp_path)
    m = filled(Pair())
    before = snapshot(m)
    with pytest.raises(ShapeMismatchError, match="'b'"):
        load_into_module(m, source, ignore_mismatched=True, strict=False)
    assert snapshot(m) == before


# ---------------------------------------------- 6. non-persistent buffers, mixed meta and live
class WithTables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.bn = nn.BatchNorm1d(2)
        self.register_buffer("rotary", torch.arange(6.0), persistent=False)


@pytest.mark.parametrize("kind", KINDS)
def test_a_non_persistent_buffer_is_never_loaded_and_its_name_is_unexpected_as_in_torch(tmp_path, kind) -> None:
    donor = filled(WithTables(), seed=21)
    state = {**donor.state_dict(), "rotary": torch.full((6,), 9.0)}
    source = write_source(state, kind, tmp_path)
    m = filled(WithTables())
    rotary = m.rotary.clone()
    expected = reference(WithTables, state, strict=False)
    with pytest.raises(MemtreeKeyError, match="'rotary'"):
        load_into_module(m, source)
    result = load_into_module(m, source, strict=False)
    assert (result.missing, result.unexpected) == ([], ["rotary"])
    assert list(expected.load_state_dict(state, strict=False)) == [[], ["rotary"]]  # torch agrees
    assert torch.equal(m.rotary, rotary)
    assert snapshot(m) == {**snapshot(expected), "b:rotary": raw_bytes(rotary)}


@pytest.mark.parametrize("kind", KINDS)
def test_meta_parameters_are_bound_and_live_buffers_filled_in_one_load(tmp_path, kind) -> None:
    donor = filled(WithTables(), seed=22)
    source = write_source(donor.state_dict(), kind, tmp_path)
    with empty_init():
        m = WithTables()
    with torch.no_grad():  # the buffers made live (a module half materialised)
        m.bn.running_mean = torch.zeros(2)
        m.bn.running_var = torch.zeros(2)
    live = [m.bn.running_mean, m.bn.running_var]
    assert load_into_module(m, source) == ([], [])
    assert m.bn.running_mean is live[0] and m.bn.running_var is live[1]  # filled in place
    assert all(p.device.type == "cpu" for p in m.state_dict().values())
    assert snapshot(m) == snapshot(donor)


# --------------------------------------------------------------- 7. tied and storage-sharing targets
class Tied(nn.Module):
    """An embedding and an output projection tied by the constructor (as in GPT-2)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.emb.weight


@pytest.mark.parametrize("target", ["live", "meta", "assign"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_source_giving_tied_names_different_values_is_refused_not_resolved_silently(tmp_path, kind, target) -> None:
    """``load_state_dict`` keeps whichever name it copies last, Hugging Face re-ties to the input
    embedding: either is a silent choice. memtree refuses, naming both names, before any change."""
    state = {"emb.weight": random_tensor((6, 4), torch.float32, 1), "head.weight": random_tensor((6, 4), torch.float32, 2)}
    source = write_source(state, kind, tmp_path)
    if target == "meta":
        with empty_init():
            m = Tied()
    else:
        m = filled(Tied())
    before = snapshot(m)
    with pytest.raises(MemtreeError, match=r"'emb\.weight'.*'head\.weight'|'head\.weight'.*'emb\.weight'") as info:
        load_into_module(m, source, assign=target == "assign")
    assert "tied" in str(info.value)
    assert snapshot(m) == before
    assert m.head.weight is m.emb.weight


@pytest.mark.parametrize("layout", ["one-tensor", "copies", "strided-copies"])
@pytest.mark.parametrize("target", ["live", "meta", "assign"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_source_giving_tied_names_equal_values_loads_and_stays_tied(tmp_path, kind, target, layout) -> None:
    """A ``torch.save(model.state_dict())`` of a tied model has both names (one storage, or two
    copies of equal bits, NaN payloads included): that loads."""
    w = random_tensor((6, 4), torch.float32, 3)
    if layout == "one-tensor" and kind != "safetensors":  # safetensors cannot share
        state = {"emb.weight": w, "head.weight": w}
    elif layout == "strided-copies":
        state = {"emb.weight": torch.stack([w, torch.zeros_like(w)], 2)[:, :, 0], "head.weight": w.t().contiguous().t()}
        assert not any(t.is_contiguous() for t in state.values())
    else:
        state = {"emb.weight": w, "head.weight": w.clone()}
    source = write_source(state, kind, tmp_path)
    if target == "meta":
        with empty_init():
            m = Tied()
    else:
        m = filled(Tied())
    assert load_into_module(m, source, assign=target == "assign") == ([], [])
    assert m.head.weight is m.emb.weight
    assert raw_bytes(m.emb.weight) == raw_bytes(w)


@pytest.mark.parametrize("live", [True, False], ids=["live", "meta"])
def test_to_module_in_place_of_a_tree_giving_tied_names_different_values_is_refused(live) -> None:
    tree = TensorTree({"emb": {"weight": random_tensor((6, 4), torch.float32, 1)},
                       "head": {"weight": random_tensor((6, 4), torch.float32, 2)}})
    if live:
        m = filled(Tied())
    else:
        with empty_init():
            m = Tied()
    before = snapshot(m)
    with pytest.raises(SourceError, match=r"'emb\.weight' and 'head\.weight' different values"):
        tree.to_module(m, inplace=True)
    assert snapshot(m) == before


@pytest.mark.parametrize("live", [True, False], ids=["live", "meta"])
def test_to_module_binds_tied_names_given_different_tensors_each_to_its_own(live) -> None:
    emb, head = random_tensor((6, 4), torch.float32, 1), random_tensor((6, 4), torch.float32, 2)
    tree = TensorTree({"emb": {"weight": emb}, "head": {"weight": head}})
    if live:
        m = filled(Tied())
    else:
        with empty_init():
            m = Tied()
    tied = m.emb.weight
    swap = tree.to_module(m)  # binding: each name is the tree's tensor, so the tie is undone
    assert m.emb.weight.data_ptr() == emb.data_ptr() and m.head.weight.data_ptr() == head.data_ptr()
    swap.to_module(m)  # and bound back: tied again, to the very object
    assert m.emb.weight is tied and m.head.weight is tied


@pytest.mark.parametrize("kind", KINDS)
def test_one_name_of_a_tied_pair_loads_both(tmp_path, kind) -> None:
    w = random_tensor((6, 4), torch.float32, 4)
    for name in ("emb.weight", "head.weight"):
        source = write_source({name: w}, kind, tmp_path / name)
        m = filled(Tied())
        assert load_into_module(m, source) == ([], [])
        assert m.head.weight is m.emb.weight and raw_bytes(m.head.weight) == raw_bytes(w)


class SharedStorage(nn.Module):
    """Parameters that are views of one storage (a fused projection split by the constructor).

    ``layout``: (storage offset, strides) of ``q`` (3, 4), ``k`` (3, 4) and ``v`` (2, 3).
    """

    SPLIT = [(0, (4, 1)), (12, (4, 1)), (24, (3, 1))]
    OVERLAP = [(0, (4, 1)), (8, (4, 1)), (24, (3, 1))]
    INTERLEAVED = [(0, (8, 2)), (1, (8, 2)), (24, (3, 1))]  # disjoint elements, overlapping ranges

    def __init__(self, layout: list[tuple[int, tuple[int, int]]] | None = None) -> None:
        super().__init__()
        base = torch.zeros(128)  # room for any layout the fuzz below draws
        shapes = [(3, 4), (3, 4), (2, 3)]
        q, k, v = (base.as_strided(shape, stride, off) for shape, (off, stride) in zip(shapes, layout or self.SPLIT))
        self.q, self.k, self.v = nn.Parameter(q), nn.Parameter(k), nn.Parameter(v)


@pytest.mark.parametrize("kind", KINDS)
def test_parameters_sharing_one_storage_are_each_filled_with_their_own_bytes(tmp_path, kind) -> None:
    state = {"q": random_tensor((3, 4), torch.float32, 1), "k": random_tensor((3, 4), torch.float32, 2),
             "v": random_tensor((2, 3), torch.float32, 3)}
    source = write_source(state, kind, tmp_path)
    m = filled(SharedStorage())
    storage = m.q.untyped_storage().data_ptr()
    assert load_into_module(m, source) == ([], [])
    assert all(p.untyped_storage().data_ptr() == storage for p in m.parameters())
    assert snapshot(m) == snapshot(reference(SharedStorage, state))


@pytest.mark.parametrize("layout", ["SPLIT", "INTERLEAVED"])
@pytest.mark.parametrize("kind", KINDS)
def test_parameters_sharing_one_storage_without_sharing_elements_load(tmp_path, kind, layout) -> None:
    state = {"q": random_tensor((3, 4), torch.float32, 1), "k": random_tensor((3, 4), torch.float32, 2),
             "v": random_tensor((2, 3), torch.float32, 3)}
    source = write_source(state, kind, tmp_path)
    m = filled(SharedStorage(getattr(SharedStorage, layout)))
    assert load_into_module(m, source) == ([], [])
    assert snapshot(m) == snapshot(reference(lambda: SharedStorage(getattr(SharedStorage, layout)), state))


@pytest.mark.parametrize("kind", KINDS)
def test_overlapping_parameters_given_disagreeing_bytes_are_refused(tmp_path, kind) -> None:
    """Two parameters over the same bytes cannot both hold what the source says for them;
    ``load_state_dict`` keeps the last copy, a threaded fill any of them. memtree refuses."""
    state = {"q": random_tensor((3, 4), torch.float32, 1), "k": random_tensor((3, 4), torch.float32, 2),
             "v": random_tensor((2, 3), torch.float32, 3)}
    source = write_source(state, kind, tmp_path)
    m = filled(SharedStorage(SharedStorage.OVERLAP))
    before = snapshot(m)
    with pytest.raises(SourceError, match=r"'q', 'k'.*share memory.*assign=True"):
        load_into_module(m, source)
    assert snapshot(m) == before
    assert load_into_module(m, source, assign=True) == ([], [])  # binding: each its own tensor
    assert all(raw_bytes(getattr(m, k)) == raw_bytes(v) for k, v in state.items())


@pytest.mark.parametrize("kind", KINDS)
def test_overlapping_parameters_given_agreeing_bytes_load(tmp_path, kind) -> None:
    base = random_tensor((64,), torch.float32, 5)
    state = {"q": base[0:12].view(3, 4).clone(), "k": base[8:20].view(3, 4).clone(), "v": base[24:30].view(2, 3).clone()}
    source = write_source(state, kind, tmp_path)
    m = filled(SharedStorage(SharedStorage.OVERLAP))
    assert load_into_module(m, source) == ([], [])
    assert snapshot(m) == snapshot(reference(lambda: SharedStorage(SharedStorage.OVERLAP), state))


@pytest.mark.parametrize("kind", KINDS)
def test_a_parameter_whose_elements_share_memory_is_refused_before_any_change(tmp_path, kind) -> None:
    """An expanded view cannot be filled in place (``copy_`` into it raises in torch)."""
    state = {"q": random_tensor((3, 4), torch.float32, 1), "k": random_tensor((3, 4), torch.float32, 2),
             "v": random_tensor((2, 3), torch.float32, 3)}
    source = write_source(state, kind, tmp_path)
    m = filled(SharedStorage([(0, (4, 1)), (12, (0, 1)), (24, (3, 1))]))
    before = snapshot(m)
    with pytest.raises(memtree.InvalidArgumentError, match=r"'k'.*share memory.*assign=True"):
        load_into_module(m, source)
    assert snapshot(m) == before


@SETTINGS
@given(
    layout=st.lists(
        st.tuples(
            st.integers(0, 30),
            *(st.one_of(st.sampled_from([1, 1, 2, 3, 4, 8]), st.integers(0, 6)) for _ in range(2)),
        ),
        min_size=3,
        max_size=3,
    ),
    agree=st.booleans(),
    kind=st.sampled_from(KINDS),
)
def test_fuzzed_storage_sharing_targets_load_as_load_state_dict_or_are_refused_unchanged(
    tmp_path_factory, layout, agree, kind
) -> None:
    """Any layout of three parameters over one storage. Oracle: ``load_state_dict`` (sequential
    copies); where its result leaves each parameter holding its own source value, memtree must
    give the same bits; where it does not (the source disagrees on shared memory, or copy_
    refuses a self-overlapping view), memtree must refuse and change nothing."""
    shape_layout = [(off, (s0, s1)) for off, s0, s1 in layout]
    make = lambda: SharedStorage(shape_layout)  # noqa: E731
    base = random_tensor((128,), torch.float32, sum(map(sum, layout)))
    if agree:
        state = {k: base.as_strided(p.shape, p.stride(), p.storage_offset()).clone() for k, p in make().named_parameters()}
    else:
        state = {k: random_tensor(tuple(getattr(make(), k).shape), torch.float32, i) for i, k in enumerate("qkv")}
    try:
        expected = reference(make, state)
        consistent = all(raw_bytes(getattr(expected, k)) == raw_bytes(v) for k, v in state.items())
    except RuntimeError:  # torch refuses to copy into a view whose elements overlap
        consistent = False
    source = write_source(state, kind, tmp_path_factory.mktemp("shared"))
    m = filled(make())
    before = snapshot(m)
    event("loaded" if consistent else "refused")
    if consistent:
        assert load_into_module(m, source) == ([], [])
        assert snapshot(m) == snapshot(expected)
    else:
        with pytest.raises((SourceError, memtree.InvalidArgumentError)):
            load_into_module(m, source)
        assert snapshot(m) == before


# ------------------------------------------------- 8. the optimizer order, assign=, bound training
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.fc(x))))


_X = torch.randn(16, 6, generator=torch.Generator().manual_seed(3))


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model.train()
    opt.zero_grad()
    model(_X).square().mean().backward()
    opt.step()


def _trained_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    m = Net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    _step(m, opt)
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


OPTIMIZERS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.01),
}


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("kind", ["st-index", "bin-index", "safetensors", "torch"])
def test_model_then_optimizer_then_load_from_files_and_shard_indexes_trains_the_model(tmp_path, kind, opt_name) -> None:
    state = _trained_state()
    source = write_source(state, kind, tmp_path)
    torch.manual_seed(1)
    model = Net()
    opt = OPTIMIZERS[opt_name](model.parameters())
    load_into_module(model, source)
    _step(model, opt)
    _step(model, opt)
    ref = Net()
    ref.load_state_dict(state)
    ref_opt = OPTIMIZERS[opt_name](ref.parameters())
    _step(ref, ref_opt)
    _step(ref, ref_opt)
    assert snapshot(model) == snapshot(ref)
    assert not torch.equal(model.fc.weight, state["fc.weight"])


@pytest.mark.parametrize("kind", KINDS)
def test_assign_binds_new_objects_keeping_requires_grad_and_values(tmp_path, kind) -> None:
    state = _trained_state()
    source = write_source(state, kind, tmp_path)
    model = filled(Net())
    model.fc.bias.requires_grad_(False)
    old = dict(model.named_parameters())
    assert load_into_module(model, source, assign=True) == ([], [])
    new = dict(model.named_parameters())
    assert all(new[k] is not old[k] for k in old)
    assert [n for n, p in new.items() if not p.requires_grad] == ["fc.bias"]
    assert all(type(p) is nn.Parameter for p in new.values())
    assert snapshot(model) == snapshot(reference(Net, state))
    opt = torch.optim.SGD(old.values(), lr=0.1)  # built on the replaced objects: trains nothing
    before = snapshot(model)
    _step(model, opt)
    assert {k: v for k, v in snapshot(model).items() if k.startswith("p:")} == {
        k: v for k, v in before.items() if k.startswith("p:")
    }


def _file_bytes(source: Any) -> dict[str, bytes]:
    if isinstance(source, dict):
        return {}
    root = str(source) if os.path.isdir(source) else os.path.dirname(str(source))
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                out[os.path.join(dirpath, f)] = fh.read()
    return out


@pytest.mark.parametrize("how", ["meta", "assign"])
@pytest.mark.parametrize("kind", FILE_KINDS)
def test_training_bound_weights_never_writes_the_checkpoint(tmp_path, kind, how) -> None:
    """Bound tensors are copy-on-write views of the files: an optimizer step, BatchNorm statistics
    and a direct write change the model, never a byte of the source."""
    state = _trained_state()
    source = write_source(state, kind, tmp_path)
    files = _file_bytes(source)
    assert files
    if how == "meta":
        with empty_init():
            model = Net()
    else:
        model = filled(Net())
    load_into_module(model, source, assign=how == "assign")
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        _step(model, opt)
    with torch.no_grad():
        model.out.bias.fill_(7.0)
    assert not torch.equal(model.fc.weight, state["fc.weight"])
    assert _file_bytes(source) == files


# ------------------------------------------------------------ 9. a source changed during the load
def _during_fill(monkeypatch: pytest.MonkeyPatch, action: Callable[[], None]) -> None:
    """Run ``action`` after the source is opened and planned, right before its bytes are read."""
    for mod in (loading_mod, fill_mod):  # the tree reader imports fill where it reads
        real = mod.fill

        def late(jobs: Any, _real: Any = real, **kw: Any) -> None:
            action()
            _real(jobs, **kw)

        monkeypatch.setattr(mod, "fill", late)


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_a_source_replaced_by_rename_during_the_load_is_read_whole_from_the_old_files(tmp_path, kind, monkeypatch) -> None:
    """A writer that publishes a new checkpoint by rename (as every careful writer does) never
    mixes into a load in progress: the files opened are read."""
    old = _trained_state()  # nested: a memtree directory has a level per sub-module
    new = {k: v.detach().clone() for k, v in filled(Net(), seed=99).state_dict().items()}
    source = write_source(old, kind, tmp_path / "old")
    replacement = write_source(new, kind, tmp_path / "new")
    old_root = str(source) if os.path.isdir(source) else os.path.dirname(str(source))
    new_root = str(replacement) if os.path.isdir(replacement) else os.path.dirname(str(replacement))
    replaced = []

    def swap() -> None:
        for dirpath, _, files in os.walk(new_root):
            for f in files:
                target = os.path.join(old_root, os.path.relpath(os.path.join(dirpath, f), new_root))
                if os.path.exists(target):
                    os.replace(os.path.join(dirpath, f), target)
                    replaced.append(target)

    _during_fill(monkeypatch, swap)
    m = filled(Net())
    assert load_into_module(m, source) == ([], [])
    assert replaced
    assert snapshot(m) == snapshot(reference(Net, old))


# ----------------------------------------------------- 10. torch.save layouts that lie about records
class _Storage:
    """Pickled as a persistent id ``('storage', torch.FloatStorage, key, 'cpu', numel)``."""

    def __init__(self, key: str, numel: int, cls: Any = torch.FloatStorage) -> None:
        self.key, self.numel, self.cls = key, numel, cls


class _Tensor:
    def __init__(self, storage: _Storage, offset: int, size: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.args = (storage, offset, size, stride)

    def __reduce__(self) -> Any:
        import collections

        return torch._utils._rebuild_tensor_v2, (*self.args, False, collections.OrderedDict())


def torch_zip(path: Any, tensors: dict[str, _Tensor], records: dict[str, bytes]) -> None:
    """A ``torch.save`` zip written by hand: any layout, any record size."""
    import io
    import pickle
    import zipfile

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            if isinstance(obj, _Storage):
                return ("storage", obj.cls, obj.key, "cpu", obj.numel)
            return None

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump(tensors)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", buf.getvalue())
        z.writestr("archive/byteorder", "little")
        for key, data in records.items():
            z.writestr(f"archive/data/{key}", data)
        z.writestr("archive/version", "3\n")


def test_the_hand_written_torch_zip_is_what_torch_load_reads(tmp_path) -> None:
    record = raw_bytes(random_tensor((40,), torch.float32, 1))
    s = _Storage("0", 40)
    torch_zip(tmp_path / "m.pt", {"a": _Tensor(s, 2, (4, 3), (3, 1)), "b": _Tensor(s, 30, (5,), (2,))}, {"0": record})
    loaded = torch.load(tmp_path / "m.pt", weights_only=True)
    m = filled(Pair())
    assert load_into_module(m, tmp_path / "m.pt", strict=False) == (["n"], [])
    assert raw_bytes(m.a) == raw_bytes(loaded["a"]) and raw_bytes(m.b) == raw_bytes(loaded["b"])


@SETTINGS
@given(
    numel=st.one_of(st.just(48), st.integers(0, 48)),
    record_delta=st.sampled_from([0, 0, 0, 0, -4, 4, -1]),
    layout_a=st.tuples(st.integers(0, 30), st.sampled_from([0, 1, 3, 4, 8]), st.sampled_from([0, 1, 2, 5])),
    layout_b=st.tuples(st.integers(0, 50), st.integers(0, 8)),
    meta=st.booleans(),
)
def test_fuzzed_torch_layouts_load_exactly_the_record_bytes_they_name_or_are_refused_unchanged(
    tmp_path_factory, numel, record_delta, layout_a, layout_b, meta
) -> None:
    """Offsets, strides and storage sizes that may reach past a record, records whose size
    disagrees with their storage: the bytes named, or a CheckpointFormatError and no change."""
    record = raw_bytes(random_tensor((64,), torch.float32, numel))[: max(numel * 4 + record_delta, 0)]
    s = _Storage("0", numel)
    off_a, s0, s1 = layout_a
    off_b, sb = layout_b
    path = tmp_path_factory.mktemp("tz") / "m.pt"
    torch_zip(path, {"a": _Tensor(s, off_a, (4, 3), (s0, s1)), "b": _Tensor(s, off_b, (5,), (sb,))}, {"0": record})
    if meta:
        with empty_init():
            m = Pair()
    else:
        m = filled(Pair())
    before = snapshot(m)
    fits = record_delta == 0 and all(
        off + sum((n - 1) * st_ for n, st_ in zip(shape, strides)) < numel
        for off, shape, strides in ((off_a, (4, 3), (s0, s1)), (off_b, (5,), (sb,)))
    )
    event("refused" if not fits else "loaded")
    if not fits:
        with pytest.raises(CheckpointFormatError) as info:
            load_into_module(m, path, strict=False)
        assert str(path) in str(info.value) or "storage" in str(info.value)
        assert snapshot(m) == before
        return
    assert load_into_module(m, path, strict=False) == (["n"], [])
    storage = torch.frombuffer(bytearray(record), dtype=torch.float32) if record else torch.empty(0)
    assert raw_bytes(m.a) == raw_bytes(storage.as_strided((4, 3), (s0, s1), off_a))
    assert raw_bytes(m.b) == raw_bytes(storage.as_strided((5,), (sb,), off_b))


# ------------------------------------- 11. memtree directories that lie, read by the in-place loader
def _seq() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))


_META_LIES = {
    "dtype": ["bfloat16", "float64", "int32", "bool", "float8_e4m3fn", "complex64", "float128", 7, None],
    "shape": [[3, 2], [6], [2, 4], [1, 2, 3], [], [0], [-1, 6], [2**40, 2**40], "2,3", [2.0, 3]],
    "file": ["bias.memmap", "../1/running_mean.memmap", "/etc/passwd", "sub/weight.memmap", "", ".",
             "meta.json", "weight.memmap/", "..", "w\0.memmap"],
    "key": ["bias", "we.ight", "__tied__", "", "weight ", 5],
    "kind": ["tree", "json", "nontensor", "tensor "],
}


@SETTINGS
@given(
    entry=st.sampled_from([0, 1]),
    field=st.sampled_from(sorted(_META_LIES)),
    pick=st.integers(0, 9),
    meta=st.booleans(),
)
def test_a_lying_level_loads_into_a_live_module_as_load_memmap_reads_it_or_is_refused_unchanged(
    tmp_path_factory, entry, field, pick, meta
) -> None:
    """The in-place loader opens a memtree directory with its own reader (no mapping): it must
    accept nothing that ``load_memmap`` refuses, read the same bytes, and change nothing when
    it refuses."""
    donor = filled(_seq(), seed=31)
    d = tmp_path_factory.mktemp("lie") / "tree"
    TensorTree.from_module(donor).memmap(d)
    doc = json.loads((d / "0" / "meta.json").read_text())
    value = _META_LIES[field][pick % len(_META_LIES[field])]
    doc["entries"][entry][field] = value
    (d / "0" / "meta.json").write_text(json.dumps(doc))
    try:
        tree = memtree.load_memmap(d, mode="r")
        reference_leaves: dict[str, Any] | None = {
            ".".join(k): v for k, v in tree.items(include_nested=True, leaves_only=True) if isinstance(v, torch.Tensor)
        }
    except MemtreeError:
        reference_leaves = None
    if meta:
        with empty_init():
            m = _seq()
    else:
        m = filled(_seq())
    before = snapshot(m)
    try:
        result = load_into_module(m, d, strict=False)
    except MemtreeError:
        event("refused")
        assert snapshot(m) == before
        return
    event("loaded")
    assert reference_leaves is not None, "load_into_module accepted a tree that load_memmap refuses"
    loaded = dict(m.state_dict())
    for name in loaded:
        if name in reference_leaves and name not in result.missing:
            assert raw_bytes(loaded[name]) == raw_bytes(reference_leaves[name]), name
    assert sorted(result.unexpected) == sorted(set(reference_leaves) - set(loaded))


@pytest.mark.parametrize("what", ["fifo", "directory", "dev-null-link", "socket"])
@pytest.mark.parametrize("kind", ["memtree-leaf", "safetensors", "torch", "hf-dir", "index-shard"])
def test_a_source_that_is_not_a_regular_file_is_refused_without_hanging(tmp_path, kind, what) -> None:
    """A FIFO would block ``open`` forever, a socket or device is no checkpoint: a MemtreeError
    naming the path, quickly, and nothing changes."""
    import signal
    import socket

    def make(path: Any) -> None:
        if os.path.lexists(path):
            os.remove(path)
        if what == "fifo":
            os.mkfifo(path)
        elif what == "directory":
            os.mkdir(path)
        elif what == "dev-null-link":
            os.symlink("/dev/null", path)
        else:
            s = socket.socket(socket.AF_UNIX)
            s.bind(str(path))
            s.close()

    if kind == "memtree-leaf":
        TensorTree.from_module(filled(Pair())).memmap(tmp_path / "tree")
        victim, source = tmp_path / "tree" / "a.memmap", tmp_path / "tree"
    elif kind in ("safetensors", "torch"):
        victim = source = tmp_path / ("m.safetensors" if kind == "safetensors" else "m.pt")
    elif kind == "hf-dir":
        victim, source = tmp_path / "model.safetensors", tmp_path
    else:
        save_safetensors({"a": values()["a"]}, tmp_path / "s1.safetensors")
        (tmp_path / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors", "n": "s2.safetensors"}})
        )
        victim, source = tmp_path / "s2.safetensors", tmp_path
    make(victim)

    def hang(*_: Any) -> None:
        raise AssertionError(f"load_into_module hung on a {what}")

    old = signal.signal(signal.SIGALRM, hang)
    m = filled(Pair())
    before = snapshot(m)
    signal.alarm(60)
    try:
        with pytest.raises(MemtreeError) as info:
            load_into_module(m, source)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert os.path.basename(victim) in str(info.value)
    assert snapshot(m) == before


# ------------------------------------------------------------------- 12. concurrent loads of one source
@pytest.mark.parametrize("kind", FILE_KINDS)
def test_threads_loading_one_source_into_their_own_modules_all_get_the_exact_bits(tmp_path, kind) -> None:
    import threading

    state = _trained_state()
    source = write_source(state, kind, tmp_path)
    expected = snapshot(reference(Net, state))
    errors: list[BaseException] = []
    modules = [filled(Net(), seed=i) for i in range(6)]

    def load(m: nn.Module) -> None:
        try:
            for _ in range(3):
                load_into_module(m, source)
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=load, args=(m,)) for m in modules]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert all(snapshot(m) == expected for m in modules)


# ------------------------------------------------------------- 13. the prefix= rule, as documented
def module_with(names: list[str]) -> nn.Module:
    """A module with one float32 parameter (of 2 elements) at each dotted name."""
    root = nn.Module()
    for name in names:
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            if part not in owner._modules:
                owner.add_module(part, nn.Module())
            owner = owner._modules[part]
        owner.register_parameter(leaf, nn.Parameter(torch.zeros(2)))
    return root


def _a_tree(names: list[str]) -> list[str]:
    """``names`` without duplicates and without a name that another is under (a leaf cannot
    also be a sub-module)."""
    names = list(dict.fromkeys(names))
    return [n for n in names if not any(o != n and (o.startswith(n + ".") or n.startswith(o + ".")) for o in names)]


_PARTS = ["model", "models", "h", "0", "w", "transformer"]


@SETTINGS
@given(data=st.data(), prefix=st.sampled_from(["model", "model.", "models", "transformer.h", "h.0", "w"]))
def test_prefix_follows_its_documented_table_for_any_names(data, prefix) -> None:
    p = prefix.rstrip(".") + "."
    sides = {}
    for side in ("module", "source"):  # each side's names, some put under the prefix
        names = data.draw(st.lists(st.lists(st.sampled_from(_PARTS), min_size=1, max_size=3).map(".".join), min_size=1, max_size=6))
        mode = data.draw(st.sampled_from(["none", "some", "all"]))  # which names are under the prefix
        under = [mode == "all"] * len(names)
        if mode == "some":
            under = data.draw(st.lists(st.booleans(), min_size=len(names), max_size=len(names)))
        if side == "source" and data.draw(st.booleans()):
            under.append(not under[0])  # the same name with and without the prefix
            names.append(names[0])
        sides[side] = _a_tree([p + n if u else n for n, u in zip(names, under)])
    module_names, source_names = sides["module"], sides["source"]
    state = {n: torch.full((2,), float(i + 1)) for i, n in enumerate(source_names)}
    m = module_with(module_names)
    in_src = any(n.startswith(p) for n in source_names)
    in_mod = any(n.startswith(p) for n in module_names)
    if in_src and not in_mod:
        renamed = {(n[len(p):] if n.startswith(p) else n): v for n, v in state.items()}
        collide = len(renamed) < len(state)
    elif in_mod and not in_src:
        renamed, collide = {p + n: v for n, v in state.items()}, False
    else:
        renamed, collide = dict(state), False
    before = snapshot(m)
    if not in_src and not in_mod:
        event("neither side")
        with pytest.raises(MemtreeKeyError, match="prefix="):
            load_into_module(m, state, prefix=prefix, strict=False)
        assert snapshot(m) == before
        return
    if collide:
        event("collision")
        with pytest.raises(SourceError, match="would both become"):
            load_into_module(m, state, prefix=prefix, strict=False)
        assert snapshot(m) == before
        return
    event("strip" if in_src and not in_mod else "add" if in_mod and not in_src else "as is")
    result = load_into_module(m, state, prefix=prefix, strict=False)
    assert sorted(result.missing) == sorted(set(module_names) - set(renamed))
    assert sorted(result.unexpected) == sorted(set(renamed) - set(module_names))
    loaded = dict(m.named_parameters())
    for name in module_names:
        want = renamed.get(name, torch.zeros(2))
        assert torch.equal(loaded[name], want), name


# ------------------------------------------------ 14. live targets in other layouts (staged fill)
class Layouts(nn.Module):
    """A channels-last convolution, a transposed weight, and a bfloat16 parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
        self.t = nn.Parameter(torch.zeros(5, 3).t())
        self.low = nn.Parameter(torch.zeros(6, 2, dtype=torch.bfloat16))


@pytest.mark.parametrize("cast", [False, True], ids=["same-dtype", "from-float16"])
@pytest.mark.parametrize("kind", KINDS)
def test_channels_last_and_transposed_parameters_are_filled_in_place_in_their_layout(tmp_path, kind, cast) -> None:
    donor = filled(Layouts(), seed=41)
    state = {k: v.detach().contiguous() for k, v in donor.state_dict().items()}
    if cast:
        state = {k: v.to(torch.float16) for k, v in state.items()}
    source = write_source(state, kind, tmp_path)
    m = filled(Layouts())
    if cast:
        with pytest.raises(ShapeMismatchError):  # float16 into float32 and bfloat16: dtype= covers one
            load_into_module(m, source)
        m.low.data = m.low.data.float()
        ref_state = {k: v.float() for k, v in state.items()}
    else:
        ref_state = state
    strides = {k: v.stride() for k, v in m.state_dict().items()}
    params = list(m.parameters())
    assert load_into_module(m, source, dtype=torch.float32 if cast else None) == ([], [])
    assert list(m.parameters()) == params
    assert {k: v.stride() for k, v in m.state_dict().items()} == strides
    assert m.conv.weight.is_contiguous(memory_format=torch.channels_last)
    for k, v in m.state_dict().items():
        assert raw_bytes(v) == raw_bytes(ref_state[k]), k


@pytest.mark.parametrize("kind", ["torch", "bin-index"])
def test_a_record_rewritten_in_place_during_the_load_fails_its_crc_and_says_the_module_was_written(
    tmp_path, kind, monkeypatch
) -> None:
    """The CRC-32 of a ``torch.save`` record is checked on the bytes as they are read into the
    module: the error must say that the module now holds them (not "nothing was changed")."""
    import zipfile

    state = values(6)
    source = write_source(state, kind, tmp_path)
    files = [str(source)] if kind == "torch" else [str(p) for p in tmp_path.glob("*.bin")]

    def damage() -> None:
        for path in files:
            with zipfile.ZipFile(path) as z:
                records = [i for i in z.infolist() if "/data/" in i.filename]
            with open(path, "r+b") as f:
                for info in records:
                    f.seek(info.header_offset + 26)
                    name_len, extra_len = struct.unpack("<HH", f.read(4))
                    f.seek(info.header_offset + 30 + name_len + extra_len)
                    byte = f.read(1)
                    f.seek(-1, 1)
                    f.write(bytes([byte[0] ^ 0x5A]))

    _during_fill(monkeypatch, damage)
    m = filled(Pair())
    with pytest.raises(CheckpointFormatError, match=r"CRC-32.*(?s:.*)partly overwritten"):
        load_into_module(m, source)


# ------------------------------------------- 15. convert to a sharded model directory and back
class TiedOdd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.odd = Odd()
        self.lm = Tied()


@SETTINGS
@given(
    limit=st.sampled_from([1, 8, 40, 100, 300, 10_000]),
    seed=st.integers(0, 2**16),
    source_kind=st.sampled_from(["memtree", "torch"]),
    target=st.sampled_from(["live", "meta"]),
)
def test_any_model_converted_to_shards_of_any_size_loads_back_bit_exact_and_tied(
    tmp_path_factory, limit, seed, source_kind, target
) -> None:
    donor = filled(TiedOdd(), seed=seed)
    d = tmp_path_factory.mktemp("conv")
    if source_kind == "memtree":
        TensorTree.from_module(donor).memmap(d / "src")
        src = d / "src"
    else:
        torch.save(donor.state_dict(), d / "src.pt")  # both tied names, one storage
        src = d / "src.pt"
    result = memtree.convert(src, d / "hf", format="safetensors", max_shard_size=limit)
    assert all((d / "hf" / f).is_file() for f in result.files)
    for f in result.files:
        with memtree.interop.open_checkpoint(d / "hf" / f) as shard:
            held = sum(shard.tensor_spec(k)[0].numel() * shard.tensor_spec(k)[1].itemsize for k in shard.keys())
            assert held <= limit or len(shard.keys()) == 1, (f, held)
    if target == "meta":
        with empty_init():
            m = TiedOdd()
    else:
        m = filled(TiedOdd())
    assert load_into_module(m, d / "hf") == ([], [])
    assert m.lm.head.weight is m.lm.emb.weight
    assert snapshot(m) == snapshot(donor)


# ------------------------------------------------ a refused file never closes someone else's descriptor
@pytest.mark.parametrize("make", ["directory", "fifo"])
def test_a_refused_checkpoint_path_leaves_later_descriptors_open(tmp_path, make) -> None:
    """A checkpoint path refused after it was opened (a directory, a FIFO) closed its descriptor
    and then closed the same number again when the half-built reader was collected: by then the
    number belonged to another open file, whose reads failed with EBADF (found as a flaky
    ``Bad file descriptor`` in later tests)."""
    import gc

    from memtree.interop.checkpoint_file import CheckpointFile

    bad = tmp_path / "bad"
    if make == "directory":
        bad.mkdir()
    else:
        os.mkfifo(bad)
    (tmp_path / "other").write_bytes(b"x" * 16)
    gc.disable()  # the half-built reader is collected exactly when the test says
    try:
        with pytest.raises(MemtreeError) as caught:
            CheckpointFile(bad)
        fd = os.open(tmp_path / "other", os.O_RDONLY)  # the number the refused reader had
        try:
            del caught  # drops the traceback, the frame and the half-built reader
            gc.collect()
            assert os.pread(fd, 4, 0) == b"xxxx"
        finally:
            os.close(fd)
    finally:
        gc.enable()
