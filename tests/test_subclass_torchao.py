"""torchao's tensor types as tree leaves: the matrix of what quantizes on CPU with torch 2.13.

Each type round-trips with the same class and bit-identical inner tensors, and a model quantized
with it gives bit-identical outputs after a reload: bound (``to_module``), filled in place into a
quantized model (``load_into_module``), bound into an ``empty_init`` skeleton. torchao's
optimizer states go through the Checkpointer; torchao's safetensors convention through
``convert``; the types stock DCP rejects through ``memtree.dcp``.

Not in the matrix (they do not quantize on a CPU with this torchao 0.18): ``Int4Tensor`` and
``Int4PreshuffledTensor`` (need the ``mslk`` package), ``Int4PlainInt32Tensor`` (no CPU),
``Int4TilePackedTo4dTensor`` (CUDA), ``IntxOpaqueTensor`` (torchao's kernel library),
``Float8OpaqueTensor`` (``float8_linear_prepack_cpu``), dynamic float8 (CUDA capability 8.9).
"""

from __future__ import annotations

import io
import json
import logging
import pickle
import warnings

import pytest
import torch

import memtree
from memtree.format.subclass_registry import BUILTIN, inner_tensors, is_known

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)  # torchao's messages about its optional CUDA kernels
    torchao = pytest.importorskip("torchao")
    import torchao.quantization as q
    from torchao.optim import AdamW4bit, AdamW8bit, AdamWFp8
    from torchao.prototype import mx_formats
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, to_nf4
    logging.disable(logging.NOTSET)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same class, and the same inner tensors bit for bit."""
    ia, ib = inner_tensors(a), inner_tensors(b)
    return type(a) is type(b) and [p for p, _ in ia] == [p for p, _ in ib] and all(
        x.dtype == y.dtype and x.shape == y.shape
        and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        for (_, x), (_, y) in zip(ia, ib)
    )


def _mlp(dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32)).to(dtype)


#: name -> (config, model dtype, whether the quantized forward runs on a CPU)
CONFIGS = {
    "Int8Tensor-weight-only": (q.Int8WeightOnlyConfig, torch.float32, True),
    "Int8Tensor-dynamic": (q.Int8DynamicActivationInt8WeightConfig, torch.float32, True),
    "Float8Tensor-weight-only": (q.Float8WeightOnlyConfig, torch.float32, True),
    "IntxUnpackedToInt8Tensor-weight-only": (q.IntxWeightOnlyConfig, torch.float32, True),
    "IntxUnpackedToInt8Tensor-dynamic": (q.Int8DynamicActivationIntxWeightConfig, torch.float32, True),
    "Int4OpaqueTensor": (lambda: PrototypeInt4WeightOnlyConfig(group_size=32), torch.bfloat16, True),
    "NVFP4Tensor": (mx_formats.NVFP4WeightOnlyConfig, torch.bfloat16, True),
    "MXTensor": (mx_formats.MXDynamicActivationMXWeightConfig, torch.bfloat16, False),
}


def _quantized(name: str, seed: int = 0) -> torch.nn.Module:
    config, dtype, _ = CONFIGS[name]
    model = _mlp(dtype, seed)
    q.quantize_(model, config())
    return model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_quantized_models_round_trip_bit_exactly(tmp_path, name):
    model = _quantized(name)
    assert type(model[0].weight).__name__ == name.split("-")[0]
    memtree.TensorTree.from_module(model).memmap(tmp_path / "m")
    loaded = memtree.load_memmap(tmp_path / "m")
    for key in ("0", "2"):
        assert _same(loaded[key, "weight"], model.get_submodule(key).weight)
        assert isinstance(inner_tensors(loaded[key, "weight"])[0][1], memtree.MemoryMappedTensor)  # zero-copy
    filled, bound = _quantized(name, seed=1), _quantized(name, seed=2)
    weight = filled[0].weight
    assert memtree.load_into_module(filled, tmp_path / "m") == memtree.LoadResult([], [])
    assert filled[0].weight is weight and _same(filled[0].weight, model[0].weight)
    loaded.to_module(bound)
    with memtree.empty_init():
        skeleton = _mlp(CONFIGS[name][1])
    memtree.load_into_module(skeleton, tmp_path / "m")
    assert type(skeleton[0].weight) is type(model[0].weight)
    if CONFIGS[name][2]:
        x = torch.randn(4, 128, dtype=CONFIGS[name][1])
        expected = model(x)
        for fresh in (filled, bound, skeleton):
            assert torch.equal(fresh(x), expected)


@pytest.mark.parametrize(
    "make",
    [
        lambda: MXTensor.to_mx(torch.randn(64, 64), torch.float8_e4m3fn, 32),
        lambda: MXTensor.to_mx(torch.randn(64, 64), torch.float4_e2m1fn_x2, 32),
        lambda: to_nf4(torch.randn(256, 256, dtype=torch.bfloat16)),
    ],
    ids=["MXTensor-fp8", "MXTensor-fp4", "NF4Tensor"],
)
def test_tensors_made_directly_round_trip(tmp_path, make):
    value = make()
    memtree.TensorTree({"w": value}).memmap(tmp_path / "t")
    got = memtree.load_memmap(tmp_path / "t")["w"]
    assert _same(got, value)
    if isinstance(value, NF4Tensor):
        assert torch.equal(got.get_original_weight(), value.get_original_weight())
    else:
        assert torch.equal(got.dequantize(), value.dequantize())


@pytest.mark.parametrize("optimizer", [AdamW8bit, AdamW4bit, AdamWFp8], ids=lambda o: o.__name__)
def test_low_bit_optimizer_states_resume_exactly(tmp_path, optimizer):
    def train(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
        torch.manual_seed(seed)
        model(torch.randn(4, 256)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    model = _mlp(torch.float32)
    model[0] = torch.nn.Linear(256, 64)  # 8-bit states need blocks of 256
    opt = optimizer(model.parameters())
    train(model, opt, 0)
    ckpt = memtree.Checkpointer(tmp_path / "ck")
    ckpt.save(1, {"model": model.state_dict(), "optim": opt.state_dict()})
    state = opt.state[model[0].weight]
    saved = {k: v for k, v in state.items() if k != "step"}
    assert all(type(v).__name__.startswith("OptimState") for v in saved.values())
    on_disk = sum(p.stat().st_size for p in (tmp_path / "ck" / "1" / "optim").rglob("*.memmap"))
    assert on_disk <= 1.01 * sum(t.nbytes for s in opt.state.values() for v in s.values() for _, t in inner_tensors(v))

    fresh = _mlp(torch.float32, seed=9)
    fresh[0] = torch.nn.Linear(256, 64)
    fresh_opt = optimizer(fresh.parameters())  # built before the restore: the usual resume order
    ckpt.restore(into={"model": fresh, "optim": fresh_opt})
    for k, v in saved.items():
        assert _same(fresh_opt.state[fresh[0].weight][k], v)
    train(model, opt, 1)
    train(fresh, fresh_opt, 1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


def test_tensordict_changes_what_memtree_keeps(tmp_path):
    """tensordict's memmap stores an 8-bit optimizer state as a plain float32 tensor (4 times
    the bytes, another class); memtree keeps the class and the inner tensors' bytes."""
    tensordict = pytest.importorskip("tensordict")
    model = torch.nn.Linear(256, 256)
    opt = AdamW8bit(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    state = opt.state[model.weight]["exp_avg"]
    try:
        td = tensordict.TensorDict({"exp_avg": state}, []).memmap(tmp_path / "td")
        kept = td["exp_avg"]
        td_bytes = sum(p.stat().st_size for p in (tmp_path / "td").rglob("*.memmap"))
        assert type(kept) is not type(state) or td_bytes >= 3 * state.codes.nbytes
    except Exception:  # noqa: BLE001 - tensordict refusing is not what memtree is held to here
        pass
    memtree.TensorTree({"exp_avg": state}).memmap(tmp_path / "mt")
    kept = memtree.load_memmap(tmp_path / "mt")["exp_avg"]
    mt_bytes = sum(p.stat().st_size for p in (tmp_path / "mt").rglob("*.memmap"))
    assert _same(kept, state) and mt_bytes == sum(t.nbytes for _, t in inner_tensors(state))


def test_every_builtin_name_resolves_with_this_torchao():
    missing = [name for name in BUILTIN if not is_known(name)]
    assert missing == []


def test_loading_torchao_types_never_runs_pickle(tmp_path, monkeypatch):
    model = _quantized("Int8Tensor-weight-only")
    memtree.TensorTree.from_module(model).memmap(tmp_path / "m")

    def refuse(*args, **kwargs):
        raise AssertionError("pickle ran")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    fresh = _quantized("Int8Tensor-weight-only", seed=3)
    memtree.load_into_module(fresh, tmp_path / "m")
    assert _same(fresh[0].weight, model[0].weight)


# ---------------------------------------------------------------------------------------------
# torchao's safetensors convention, both ways


def _read_safetensors(path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    st = pytest.importorskip("safetensors.torch")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        metadata = json.loads(f.read(n))["__metadata__"]
    return st.load_file(str(path)), metadata


@pytest.mark.parametrize("name", ["Int8Tensor-weight-only", "Float8Tensor-weight-only", "IntxUnpackedToInt8Tensor-dynamic", "NVFP4Tensor"])
def test_a_memtree_export_loads_in_torchao_and_a_torchao_file_in_memtree(tmp_path, name):
    st = pytest.importorskip("safetensors.torch")
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict, unflatten_tensor_state_dict

    model = _quantized(name)
    x = torch.randn(4, 128, dtype=CONFIGS[name][1])
    expected = model(x)
    memtree.TensorTree.from_module(model).memmap(tmp_path / "m")
    memtree.convert(tmp_path / "m", tmp_path / "m.safetensors")
    tensors, metadata = _read_safetensors(tmp_path / "m.safetensors")
    state, rest = unflatten_tensor_state_dict(tensors, metadata)
    assert rest == {} and _same(state["0.weight"], model[0].weight)
    fresh = _quantized(name, seed=1)
    fresh.load_state_dict(state, assign=True)
    assert torch.equal(fresh(x), expected)

    data, meta = flatten_tensor_state_dict(model.state_dict())
    st.save_file(data, str(tmp_path / "ao.safetensors"), metadata=meta)
    memtree.convert(tmp_path / "ao.safetensors", tmp_path / "from-ao")
    loaded = memtree.load_memmap(tmp_path / "from-ao")
    assert _same(loaded["0", "weight"], model[0].weight)
    with memtree.empty_init():
        skeleton = _mlp(CONFIGS[name][1])
    memtree.load_into_module(skeleton, tmp_path / "from-ao")
    assert torch.equal(skeleton(x), expected)


def test_save_safetensors_of_a_state_dict_writes_torchao_convention(tmp_path):
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

    model = _quantized("Int8Tensor-weight-only")
    memtree.save_safetensors(model.state_dict(), tmp_path / "m.safetensors")
    state, _ = unflatten_tensor_state_dict(*_read_safetensors(tmp_path / "m.safetensors"))
    assert sorted(state) == ["0.bias", "0.weight", "2.bias", "2.weight"] and _same(state["2.weight"], model[2].weight)


def test_types_torchao_safetensors_cannot_hold_are_refused(tmp_path):
    memtree.TensorTree({"m": {"w": to_nf4(torch.randn(256, 256, dtype=torch.bfloat16))}}).memmap(tmp_path / "t")
    with pytest.raises(memtree.SubclassError, match="NF4Tensor, which torchao's safetensors convention cannot hold"):
        memtree.convert(tmp_path / "t", tmp_path / "t.safetensors")
    assert not (tmp_path / "t.safetensors").exists()


# ---------------------------------------------------------------------------------------------
# memtree.dcp: types stock DCP rejects


@pytest.mark.parametrize("name", ["IntxUnpackedToInt8Tensor-weight-only", "Int4OpaqueTensor", "Int8Tensor-weight-only"])
def test_dcp_round_trips_types_stock_dcp_rejects(tmp_path, name):
    import memtree.dcp
    import torch.distributed.checkpoint as dcp

    model = _quantized(name)
    x = torch.randn(2, 128, dtype=CONFIGS[name][1])
    if name != "Int8Tensor-weight-only":
        with pytest.raises(BaseException, match="is_pinned"):  # stock DCP fails on these
            dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "stock"), no_dist=True)
    memtree.dcp.save({"model": model.state_dict()}, tmp_path / "c")
    fresh = _quantized(name, seed=1)
    weights = [t for p in fresh.parameters() for _, t in inner_tensors(p)]
    memtree.dcp.load({"model": fresh.state_dict()}, tmp_path / "c")
    assert [t for p in fresh.parameters() for _, t in inner_tensors(p)] == weights  # filled in place
    assert torch.equal(fresh(x), model(x))


def test_dcp_refuses_a_target_quantized_another_way(tmp_path):
    import memtree.dcp

    memtree.dcp.save({"model": _quantized("Int8Tensor-weight-only").state_dict()}, tmp_path / "c")
    other = _quantized("IntxUnpackedToInt8Tensor-weight-only")
    with pytest.raises(memtree.SubclassError, match="was saved as .*torchao.Int8Tensor.*holds .*IntxUnpackedToInt8Tensor"):
        memtree.dcp.load({"model": other.state_dict()}, tmp_path / "c")
