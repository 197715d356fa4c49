"""Every value ``torch.load(weights_only=True)`` accepts by default is accepted by memtree's
``torch.save`` reader (``open_checkpoint``, ``convert``, ``load_into_module``): kept exactly, or
for tensors memtree cannot read, refused by key or left out and reported when asked
(``skip_unsupported=True``). Values ``torch.load(weights_only=True)`` refuses are refused too,
and ``torch.serialization.add_safe_globals`` is not honoured (``allow_pickle=True`` is the
opt-in). Each case is a real ``torch.save`` file, checked against ``torch.load``.
"""

from __future__ import annotations

import math
import pickle
import struct
import zipfile
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

import memtree
from memtree.interop import open_checkpoint

DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
LAYOUTS = sorted({v for v in vars(torch).values() if isinstance(v, torch.layout)}, key=str)
QSCHEMES = sorted({v for v in vars(torch).values() if isinstance(v, torch.qscheme)}, key=str)


def same(a: Any, b: Any) -> bool:
    """Equal with the same types all the way down (``1 == 1.0 == True`` is not enough), NaN
    equal to NaN, ``-0.0`` apart from ``0.0``."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, complex):
        return same(a.real, b.real) and same(a.imag, b.imag)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def saved(tmp_path: Path, obj: dict[str, Any], name: str = "c.pt") -> tuple[Path, dict[str, Any]]:
    """``obj`` saved with ``torch.save``, and what ``torch.load(weights_only=True)`` gives."""
    path = tmp_path / name
    torch.save(obj, path)
    return path, torch.load(path, weights_only=True)


# -- kept exactly ---------------------------------------------------------------------------------
ACCEPTED = {
    "set": {1, "a", (2, 3)},
    "empty set": set(),
    "device": torch.device("cuda", 1),
    "device cpu": torch.device("cpu"),
    "device str": torch.device("meta"),
    "bytearray": bytearray(b"\x00\xffab"),
    "empty bytearray": bytearray(),
    "bytes": b"\x00\xff",
    "complex": 1.5 - 2j,
    "size": torch.Size([2, 0, 3]),
    "counter": Counter({"a": 2, (1, 2): 3}),
    "ordered": OrderedDict([(2, "x"), ("a", None)]),
    "tuple keys": {(1, 2): 3, 1.5: "f", True: "t", None: "n", b"k": 0},
    "empty-str key": {"": 1},
    "big int": 2**100,
    "nan": float("nan"),
    "neg zero": -0.0,
    "nested": [({1, 2}, torch.device("cpu")), {"k": (torch.float16, torch.strided)}],
    **{f"dtype {d}": d for d in DTYPES},
    **{f"layout {layout}": layout for layout in LAYOUTS},
    **{f"qscheme {q}": q for q in QSCHEMES},
}


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_every_value_weights_only_accepts_is_kept_exactly(tmp_path: Path, name: str) -> None:
    value = ACCEPTED[name]
    path, ref = saved(tmp_path, {"w": torch.ones(2), "v": [value]})  # in a list: one value
    with open_checkpoint(path) as ckpt:
        assert same(ckpt.non_tensors["v"], ref["v"]), (ckpt.non_tensors["v"], ref["v"])
        assert ckpt["w"].tolist() == [1.0, 1.0]
    assert memtree.load_into_module(nn.Linear(2, 2), path, strict=False).missing == ["weight", "bias"]


def test_sets_and_devices_no_longer_refuse_the_whole_file(tmp_path: Path) -> None:
    """Issue 29: open_checkpoint refused a whole file for a set or a torch.device."""
    model = nn.Linear(3, 2)
    path, ref = saved(tmp_path, {"model": model.state_dict(), "seen": {1, 2}, "device": torch.device("cpu")})
    with open_checkpoint(path) as ckpt:
        assert ckpt.non_tensors == {"seen": {1, 2}, "device": torch.device("cpu")}
        assert torch.equal(ckpt["model.weight"], ref["model"]["weight"])
    fresh = nn.Linear(3, 2)
    memtree.load_into_module(fresh, path, prefix="model.")
    assert torch.equal(fresh.weight, model.weight)
    result = memtree.convert(path, tmp_path / "tree")
    assert sorted(result.dropped) == ["device", "seen"] and result.tensors == 2  # JSON holds neither


def test_dicts_with_other_keys_are_one_value(tmp_path: Path) -> None:
    obj = {"w": torch.ones(1), "by_pair": {(0, 1): 0.5}, "flags": {True: "on"}, "c": Counter("aab")}
    path, ref = saved(tmp_path, obj)
    with open_checkpoint(path) as ckpt:
        assert ckpt.non_tensors["by_pair"] == {(0, 1): 0.5} and ckpt.non_tensors["flags"] == {True: "on"}
        assert ckpt.non_tensors["c.a"] == 2 and ckpt.non_tensors["c.b"] == 1  # str keys: flattened


_ATOMS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=3),
    st.binary(max_size=3), st.binary(max_size=3).map(bytearray),
    st.complex_numbers(),
    st.sampled_from(DTYPES + LAYOUTS + QSCHEMES), st.builds(torch.Size, st.lists(st.integers(0, 9), max_size=3)),
    st.sampled_from([torch.device("cpu"), torch.device("cuda", 3), torch.device("meta")]),
    st.sampled_from([slice(1, 2), range(2), ...]),  # refused by both
)  # fmt: skip
_HASHABLE = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=2), st.tuples(st.integers(0, 3)))
_VALUES = st.recursive(
    _ATOMS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=2), inner, max_size=3),
        st.dictionaries(st.text(max_size=2), inner, max_size=3).map(OrderedDict),
        st.dictionaries(_HASHABLE, inner, max_size=3),
        st.sets(_HASHABLE, max_size=3),
        st.frozensets(_HASHABLE, max_size=2),  # refused by both
        st.dictionaries(st.text(max_size=2), st.integers(0, 5), max_size=3).map(Counter),
    ),
    max_leaves=10,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=_VALUES)
def test_property_values_read_as_torch_load_reads_them(tmp_path_factory: pytest.TempPathFactory, value: Any) -> None:
    """memtree accepts a value exactly when ``torch.load(weights_only=True)`` does, and then
    gives the same value (types, NaN, -0.0 and all)."""
    path = tmp_path_factory.mktemp("v") / "c.pt"
    torch.save({"w": torch.zeros(1), "v": [value]}, path)
    try:
        ref = torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        event("refused")
        with pytest.raises(memtree.UnsafePickleError):
            open_checkpoint(path)
        return
    event("accepted")
    with open_checkpoint(path) as ckpt:
        assert same(ckpt.non_tensors["v"], ref["v"]), (ckpt.non_tensors["v"], ref["v"])


# -- refused as torch.load(weights_only=True) refuses them ----------------------------------------
@pytest.mark.parametrize(
    "value", [frozenset({1}), slice(1, 2), range(3), ..., b"", NotImplemented], ids=repr
)
def test_what_weights_only_refuses_is_refused(tmp_path: Path, value: Any) -> None:
    path = tmp_path / "c.pt"
    torch.save({"v": value}, path)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    with pytest.raises(memtree.UnsafePickleError, match="nothing was executed"):
        open_checkpoint(path)
    assert same(open_checkpoint(path, allow_pickle=True).non_tensors["v"], value)


@dataclass
class _Registered:
    built = 0
    x: int = 0

    def __setstate__(self, state: Any) -> None:
        type(self).built += 1
        self.__dict__.update(state)


def test_add_safe_globals_are_not_honoured(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    torch.save({"w": torch.ones(1), "obj": _Registered(3)}, path)
    with torch.serialization.safe_globals([_Registered]):
        assert torch.load(path, weights_only=True)["obj"].x == 3
        built = _Registered.built
        with pytest.raises(memtree.UnsafePickleError, match="_Registered.*add_safe_globals"):
            open_checkpoint(path)
        assert _Registered.built == built  # nothing of it ran
        assert open_checkpoint(path, allow_pickle=True).non_tensors["obj"].x == 3  # the opt-in


# -- tensors: Parameters, attributes, requires_grad, devices --------------------------------------
def test_parameters_and_tensors_with_attributes_read_as_plain_tensors(tmp_path: Path) -> None:
    param = nn.Parameter(torch.arange(3.0))
    param.note = "kept by torch.load, not by memtree"  # saved with _rebuild_parameter_with_state
    tagged = torch.arange(2)
    tagged.tag = 1  # saved with _rebuild_from_type_v2
    path, ref = saved(tmp_path, {"p": param, "t": tagged, "g": torch.ones(2, requires_grad=True)})
    with open_checkpoint(path) as ckpt:
        for key in ("p", "t", "g"):
            got = ckpt[key]
            assert type(got) is torch.Tensor and not got.requires_grad
            assert torch.equal(got, ref[key].detach()), key
    assert ref["p"].note == "kept by torch.load, not by memtree" and ref["g"].requires_grad


def _device_copy_pickle() -> bytes:
    """``{"x": <an XLA tensor saved through a CPU copy>}``, as torch.save writes it for devices
    without storage (``_rebuild_device_tensor_from_cpu_tensor(cpu, dtype, "xla:0", False)``)."""

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            if isinstance(obj, torch.storage.TypedStorage):
                return ("storage", torch.FloatStorage, "0", "cpu", 2)
            return None

        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, torch.Tensor) and obj.device.type == "meta":
                cpu = torch.ones(2)
                args = (cpu, torch.float32, "xla:0", False)
                return torch._utils._rebuild_device_tensor_from_cpu_tensor, args
            return NotImplemented

    import io

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump({"x": torch.empty(2, device="meta")})
    return buf.getvalue()


def test_a_device_tensor_saved_through_a_cpu_copy_is_read_on_the_cpu(tmp_path: Path) -> None:
    """As ``torch.load(weights_only=True, map_location="cpu")`` reads it (memtree reads every
    tensor to the CPU)."""
    path = tmp_path / "xla.pt"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", _device_copy_pickle())
        zf.writestr("archive/byteorder", "little")
        zf.writestr("archive/version", "3\n")
        zf.writestr("archive/data/0", struct.pack("<2f", 1.0, 2.0))
    ref = torch.load(path, weights_only=True, map_location="cpu")
    assert torch.equal(open_checkpoint(path)["x"], ref["x"])


# -- tensors memtree cannot read: refused by key, or skipped with a report ------------------------
def _quantized() -> torch.Tensor:
    return torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8)


UNREADABLE = {  # key: (tensor, what the error says it is)
    "quantized": (_quantized, "a quantized tensor"),
    "per_channel": (
        lambda: torch.quantize_per_channel(torch.ones(2, 3), torch.tensor([0.1, 0.2]), torch.tensor([0, 0]), 0, torch.qint8),
        "a quantized tensor",
    ),
    "coo": (lambda: torch.eye(2).to_sparse(), "a sparse_coo tensor"),
    "csr": (lambda: torch.eye(2).to_sparse_csr(), "a sparse_csr tensor"),
    "nested": (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "a nested tensor"),
    "meta": (lambda: torch.empty(2, device="meta"), "a tensor on the meta device"),
    "neg_bool": (lambda: torch._neg_view(torch.ones(2, dtype=torch.bool)), "a negative view of a torch.bool"),
    "in_set": (lambda: {torch.ones(1)}, "a set with tensors inside"),
    "float_key": (lambda: {1.5: torch.ones(1)}, "a dict with tensors under keys other than str and int"),
}


@pytest.mark.parametrize("name", list(UNREADABLE))
def test_unreadable_tensors_are_refused_by_key_or_skipped_when_asked(tmp_path: Path, name: str) -> None:
    make, what = UNREADABLE[name]
    path, ref = saved(tmp_path, {"w": torch.arange(3.0), "sub": {name: make()}})  # torch reads it
    with pytest.raises(memtree.DtypeError, match=f"'sub.{name}' is {what}.*skip_unsupported=True"):
        open_checkpoint(path)
    with pytest.raises(memtree.DtypeError, match="skip_unsupported"):
        memtree.convert(path, tmp_path / "tree")
    assert not (tmp_path / "tree").exists()
    with open_checkpoint(path, skip_unsupported=True) as ckpt:
        assert list(ckpt) == ["w"] and ckpt["w"].tolist() == [0.0, 1.0, 2.0]
        assert what in ckpt.skipped[f"sub.{name}"] and list(ckpt.skipped) == [f"sub.{name}"]
        with pytest.raises(memtree.MemtreeKeyError, match="left out"):
            ckpt[f"sub.{name}"]
        module = nn.Module()
        module.register_buffer("w", torch.zeros(3))
        memtree.load_into_module(module, ckpt, strict=False)
        assert module.w.tolist() == [0.0, 1.0, 2.0]
    result = memtree.convert(path, tmp_path / "tree", skip_unsupported=True)
    assert result.tensors == 1 and what in result.skipped[f"sub.{name}"]
    assert memtree.load_memmap(tmp_path / "tree")["w"].tolist() == [0.0, 1.0, 2.0]
    assert torch.is_tensor(ref["w"])


def test_a_sharded_checkpoint_skips_what_its_shards_skip(tmp_path: Path) -> None:
    import json

    torch.save({"a": torch.ones(2), "q": _quantized()}, tmp_path / "pytorch_model-1.bin")
    torch.save({"b": torch.zeros(2)}, tmp_path / "pytorch_model-2.bin")
    weight_map = {"a": "pytorch_model-1.bin", "q": "pytorch_model-1.bin", "b": "pytorch_model-2.bin"}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(memtree.DtypeError, match="'q' is a quantized tensor"):
        open_checkpoint(tmp_path)
    with open_checkpoint(tmp_path, skip_unsupported=True) as ckpt:
        assert sorted(ckpt) == ["a", "b"] and ckpt.skipped == {"q": "a quantized tensor"}
        with pytest.raises(memtree.MemtreeKeyError, match="left out .* a quantized tensor"):
            ckpt["q"]
