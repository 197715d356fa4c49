"""Tensors of ``torch.save`` files come back with ``torch.load(weights_only=True)``'s values
through every memtree read path, whatever view they are: conjugate and negative views (the
``conj``/``neg`` bits of a tensor's metadata), transposed, strided, expanded, offset views
sharing one storage, 0-dim and 0-element tensors, of every dtype memtree holds.

The read paths: ``open_checkpoint`` (mapped and read), ``convert`` to a memtree directory (then
``load_memmap``) and to safetensors, ``load_into_module`` into live and meta modules. Legacy
(pre-zip) files are refused by each, with how to convert them.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import memtree
from memtree.format.dtypes import DTYPE_NAMES, dtype_from_name
from memtree.interop import open_checkpoint
from memtree.interop.safetensors_file import SAFETENSORS_DTYPES
from treeutil import random_tensor, raw_bytes

def torch_saves(dtype: torch.dtype) -> bool:
    """Whether ``torch.save`` can write a tensor of ``dtype`` (not the sub-byte int1-7/uint1-7:
    torch has no storage type for them)."""
    try:
        torch.save(torch.empty(0, dtype=torch.uint8).view(dtype), io.BytesIO())
    except (KeyError, RuntimeError):
        return False
    return True


DTYPES = [d for d in map(dtype_from_name, DTYPE_NAMES) if d is not None and torch_saves(d)]


def negatable(dtype: torch.dtype) -> bool:
    """Whether torch computes the values of a negative view of ``dtype`` (not for bool,
    uint16-64 or float8: ``neg`` is not implemented for them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            torch._neg_view(torch.zeros(1, dtype=dtype)).resolve_neg()
        except RuntimeError:
            return False
    return True


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a new C-contiguous tensor (``copy_`` resolves the conj/neg bits)."""
    fresh = torch.empty(t.shape, dtype=t.dtype)
    fresh.copy_(t.detach())
    return fresh


def assert_same_values(got: torch.Tensor, expected: torch.Tensor, where: Any) -> None:
    """The same dtype, shape and values, bit for bit; except that the NaNs of a conjugate or
    negative view are compared as NaNs: torch's kernels disagree on the sign and payload of
    ``-nan`` (``resolve_neg`` flips the sign bit, a ``copy_`` of the view may not), so such a
    view has no one bit pattern, in ``torch.load``'s result either."""
    g, e = dense(got), dense(expected)
    if expected.is_conj() or expected.is_neg():
        for t in (g, e):
            real = torch.view_as_real(t) if t.is_complex() else t
            if real.is_floating_point():
                real[real.isnan()] = float("nan")
    assert (g.dtype, g.shape, raw_bytes(g)) == (e.dtype, e.shape, raw_bytes(e)), where


def by_key(tree: memtree.TensorTree, key: str) -> Any:
    return tree[tuple(key.split("."))]


def module_for(ref: dict[str, torch.Tensor], device: str) -> nn.Module:
    """A module with one buffer per dotted key of ``ref``, of its shape and dtype."""
    root = nn.Module()
    for key, t in ref.items():
        *parents, name = key.split(".")
        m = root
        for part in parents:
            if not hasattr(m, part):
                m.add_module(part, nn.Module())
            m = getattr(m, part)
        zeros = torch.zeros((*t.shape, t.dtype.itemsize), dtype=torch.uint8, device=device)
        m.register_buffer(name, zeros.view(t.dtype).reshape(t.shape))  # bits, float4: no fill kernel
    return root


def assert_every_path_gives_torch_load(path: Path, tmp: Path) -> None:
    """Every read path of ``path`` gives exactly ``torch.load(path, weights_only=True)``."""
    ref = torch.load(path, weights_only=True)
    flat: dict[str, torch.Tensor] = {}

    def walk(obj: Any, prefix: str) -> None:
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for k, v in items:
            if isinstance(v, torch.Tensor):
                flat[f"{prefix}{k}"] = v
            elif isinstance(v, (dict, list, tuple)):
                walk(v, f"{prefix}{k}.")

    walk(ref, "")
    with open_checkpoint(path) as ckpt:
        assert list(ckpt) == list(flat)
        for key, expected in flat.items():
            for mmap in (True, False):
                got = ckpt.read(key, mmap=mmap)
                assert_same_values(got, expected, (key, mmap))
                # the same view as torch.load's: bits and strides too
                assert (got.is_conj(), got.is_neg()) == (expected.is_conj(), expected.is_neg()), key
                assert got.stride() == expected.stride(), key
    memtree.convert(path, tmp / "tree")
    tree = memtree.load_memmap(tmp / "tree")
    for key, expected in flat.items():
        assert_same_values(by_key(tree, key), expected, key)
    if all(t.dtype in SAFETENSORS_DTYPES.values() for t in flat.values()):
        result = memtree.convert(path, tmp / "st.safetensors")
        with open_checkpoint(tmp / "st.safetensors") as st_file:
            for key, expected in flat.items():
                written = result.altered.get(key, "").removeprefix("tied to ").partition(":")[0] or key
                assert_same_values(st_file[written], expected, key)
    else:
        with pytest.raises(memtree.DtypeError, match="safetensors"):
            memtree.convert(path, tmp / "st.safetensors")
    for device in ("cpu", "meta"):
        module = module_for(flat, device)
        memtree.load_into_module(module, path)
        for key, expected in flat.items():
            assert_same_values(module.get_buffer(key), expected, (key, device))


# -- the regressions: each fails on a reader that ignores the metadata ---------------------------
@pytest.fixture
def views_file(tmp_path: Path) -> Path:
    z = random_tensor((3, 4), torch.complex64, 1)
    x = random_tensor((3, 4), torch.float32, 2)
    state = {
        "z": z,
        "conj": z.conj(),  # the same storage, offset, size and stride as "z": only the bit differs
        "neg": torch._neg_view(x),
        "conj_neg": torch._neg_view(z).conj(),
        "conj_t": z.conj().t(),
        "neg_row": torch._neg_view(x)[1],
        "nested": {"conj": [z[0].conj()]},
    }
    path = tmp_path / "views.pt"
    torch.save(state, path)
    return path


def test_conjugate_and_negative_views_read_as_torch_load(views_file: Path) -> None:
    ref = torch.load(views_file, weights_only=True)
    with open_checkpoint(views_file) as ckpt:
        assert ckpt["conj"].is_conj() and torch.equal(ckpt["conj"], ref["conj"])
        assert ckpt["neg"].is_neg() and torch.equal(ckpt["neg"], ref["neg"])
        assert torch.equal(ckpt["conj_neg"], ref["conj_neg"])
        assert torch.equal(ckpt["nested.conj.0"], ref["nested"]["conj"][0])
        assert not torch.equal(ckpt["conj"], ckpt["z"])  # the bytes are the same, the values not
        # their bytes are not their values: never copied as they lie in the file
        assert ckpt.fill_range("conj") is None and ckpt.fill_range("neg") is None
        assert ckpt.fill_range("z") is not None


def test_every_read_path_applies_the_bits(views_file: Path, tmp_path: Path) -> None:
    assert_every_path_gives_torch_load(views_file, tmp_path)


def test_a_conjugate_view_is_not_taken_for_a_tied_weight(views_file: Path, tmp_path: Path) -> None:
    """Going to safetensors, a tensor that is the same view of a storage as an earlier one is
    written once (a tied weight); a conjugate of it is not that view."""
    result = memtree.convert(views_file, tmp_path / "m.safetensors")
    assert "conj" not in result.altered
    ref = torch.load(views_file, weights_only=True)
    with open_checkpoint(tmp_path / "m.safetensors") as st_file:
        assert torch.equal(st_file["conj"], ref["conj"]) and torch.equal(st_file["z"], ref["z"])


def test_legacy_files_are_refused_by_every_path(tmp_path: Path) -> None:
    path = tmp_path / "old.pt"
    torch.save({"w": torch.ones(2).conj()}, path, _use_new_zipfile_serialization=False)
    reads: list[Callable[[], Any]] = [
        lambda: open_checkpoint(path),
        lambda: memtree.convert(path, tmp_path / "tree"),
        lambda: memtree.load_into_module(module_for({"w": torch.ones(2)}, "cpu"), path),
    ]
    for read in reads:
        with pytest.raises(memtree.LegacyCheckpointError, match="re-save"):
            read()
    assert not (tmp_path / "tree").exists()


# -- the property ---------------------------------------------------------------------------------
def _conj(t: torch.Tensor) -> torch.Tensor | None:
    return t.conj() if t.dtype.is_complex else None


def _neg(t: torch.Tensor) -> torch.Tensor | None:
    return torch._neg_view(t) if negatable(t.dtype) else None


def _transpose(t: torch.Tensor) -> torch.Tensor | None:
    return t.transpose(0, -1) if t.dim() >= 2 else None


def _step(t: torch.Tensor) -> torch.Tensor | None:
    return t[..., ::2] if t.dim() >= 1 else None


def _offset(t: torch.Tensor) -> torch.Tensor | None:
    return t[1:] if t.dim() >= 1 and t.shape[0] > 1 else None


def _select(t: torch.Tensor) -> torch.Tensor | None:  # 0-dim when t is 1-d
    return t[-1] if t.dim() >= 1 and t.shape[0] > 0 else None


def _expand(t: torch.Tensor) -> torch.Tensor | None:
    return t.unsqueeze(0).expand(2, *t.shape)


VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor | None]] = {
    "conj": _conj, "neg": _neg, "transpose": _transpose, "step": _step, "offset": _offset,
    "select": _select, "expand": _expand,
}  # fmt: skip


@st.composite
def states(draw: st.DrawFn) -> dict[str, Any]:
    """A state of 1 to 3 bases, each with 1 to 3 views of it (chains of up to 3 view kinds),
    some nested in a dict or a list."""
    state: dict[str, Any] = {}
    for i in range(draw(st.integers(1, 3))):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # complex32 is experimental
            base = random_tensor(shape, dtype, draw(st.integers(0, 2**16)))
        for j in range(draw(st.integers(1, 3))):
            view = base
            for kind in draw(st.lists(st.sampled_from(sorted(VIEWS)), max_size=3)):
                made = VIEWS[kind](view)
                view = view if made is None else made
            where = draw(st.sampled_from(["top", "dict", "list"]))
            if where == "top":
                state[f"t{i}_{j}"] = view
            elif where == "dict":
                state.setdefault("sub", {})[f"t{i}_{j}"] = view
            else:
                state.setdefault("seq", []).append(view)
    return state


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state=states())
def test_property_every_read_path_gives_torch_loads_values(
    tmp_path_factory: pytest.TempPathFactory, state: dict[str, Any]
) -> None:
    tmp = tmp_path_factory.mktemp("views")
    path = tmp / "state.pt"
    torch.save(state, path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is experimental
        assert_every_path_gives_torch_load(path, tmp)
    torch.save(state, tmp / "legacy.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(memtree.LegacyCheckpointError):
        open_checkpoint(tmp / "legacy.pt")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_torch_saves_is_read_exactly_by_every_path(tmp_path: Path, dtype: torch.dtype) -> None:
    """bits8, float4, float8_e8m0fnu...: read as torch.load reads them, not refused."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 is experimental
        base = random_tensor((3, 2), dtype, 7)
        torch.save({"t": base, "sub": {"u": base.t()}}, tmp_path / "s.pt")
        assert_every_path_gives_torch_load(tmp_path / "s.pt", tmp_path)
