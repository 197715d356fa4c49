"""Disk-offloaded weights: OffloadedTensor and memtree.offload."""

from __future__ import annotations

import copy
import io
import os

import pytest
import torch
from torch import nn

import memtree
from memtree import (
    LoadResult,
    MemtreeKeyError,
    ReadOnlyError,
    SourceError,
    TensorTree,
    empty_init,
    load_memmap,
    offload,
)
from memtree.nn.offloading import OffloadedTensor

from test_module import TinyLM, convnet, tokens, trained_convnet

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture()
def weight(tmp_path) -> OffloadedTensor:
    tree = TensorTree({"w": torch.arange(12.0).reshape(3, 4)}).memmap(tmp_path / "w")
    return OffloadedTensor(tree["w"])


def _mapped_rss(address: int) -> int:
    """Resident bytes of the memory mapping of this process that contains ``address``."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping contains {address:#x}")


# ------------------------------------------------------------------------ OffloadedTensor
def test_operations_materialise_and_return_ordinary_tensors(weight) -> None:
    expected = torch.arange(12.0).reshape(3, 4)
    out = weight * 2 + 1
    assert type(out) is torch.Tensor and torch.equal(out, expected * 2 + 1)
    assert torch.equal(torch.cat([weight, weight]), torch.cat([expected, expected]))
    assert weight.sum().item() == 66.0 and weight.tolist() == expected.tolist()
    copy_ = weight.materialize()
    copy_ += 1  # materialize() is a copy: the file is unchanged
    assert torch.equal(weight.materialize(), expected)
    assert weight.numpy().sum() == 66.0
    assert torch.equal(weight[torch.tensor([0, 2])], expected[[0, 2]])


def test_views_stay_on_disk_and_read_only_their_part(weight) -> None:
    expected = torch.arange(12.0).reshape(3, 4)
    for view, want in [(weight[1], expected[1]), (weight.t(), expected.t()),
                       (weight[:, 1:3], expected[:, 1:3]), (weight.view(-1), expected.view(-1))]:
        assert isinstance(view, OffloadedTensor)
        assert view.shape == want.shape and torch.equal(view.materialize(), want)
    assert weight.detach().filename == weight.filename
    # as_strided is relative to the storage, as for the tensor the view stands for
    assert torch.equal(weight[1].as_strided((2,), (1,), 5).materialize(), expected.view(-1)[5:7])


def test_to_and_casts_stay_offloaded_and_cast_on_materialisation(weight) -> None:
    half = weight.half()
    assert isinstance(half, OffloadedTensor) and half.dtype == torch.float16
    assert torch.equal(half.materialize(), torch.arange(12.0, dtype=torch.float16).reshape(3, 4))
    assert isinstance(weight.to("cpu", torch.float64), OffloadedTensor)
    moved = weight.to("meta").cpu()  # device moves retarget, in both directions
    assert isinstance(moved, OffloadedTensor) and moved.device.type == "cpu"
    assert (weight.double() + 0).dtype == torch.float64


def test_assigning_data_retargets_it_as_module_to_does_on_some_torch_versions(weight) -> None:
    param = nn.Parameter(weight, requires_grad=False)
    param.data = param.to(torch.float64)  # Module._apply's set_data path
    assert isinstance(param, OffloadedTensor) and param.dtype == torch.float64
    assert (param + 0).dtype == torch.float64 and param.materialize().dtype == torch.float64


def test_writes_are_refused_and_the_file_is_unchanged(weight, tmp_path) -> None:
    for write in (lambda: weight.add_(1), lambda: weight.copy_(torch.zeros(3, 4)),
                  lambda: weight.__setitem__(0, 5.0), lambda: weight[1].zero_()):
        with pytest.raises(ReadOnlyError, match="offloaded tensors are read-only"):
            write()
    assert torch.equal(load_memmap(tmp_path / "w")["w"], torch.arange(12.0).reshape(3, 4))


def test_needs_a_file_backed_source() -> None:
    with pytest.raises(SourceError, match="file-backed MemoryMappedTensor"):
        OffloadedTensor(torch.ones(2))
    with pytest.raises(SourceError, match="file-backed"):
        OffloadedTensor(memtree.MemoryMappedTensor.from_tensor(torch.ones(2)))  # shared memory


def test_pickle_torch_save_and_deepcopy(weight) -> None:
    buf = io.BytesIO()
    torch.save({"w": weight}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)["w"]
    assert type(loaded) is torch.Tensor and torch.equal(loaded, torch.arange(12.0).reshape(3, 4))
    clone = copy.deepcopy(weight)
    assert isinstance(clone, OffloadedTensor) and clone.filename == weight.filename
    assert "OffloadedTensor(float32[3, 4], device=cpu" in repr(weight)


def test_pages_read_by_an_operation_are_released_afterwards(tmp_path) -> None:
    tree = TensorTree({"w": torch.randn(512, 1024)}).memmap(tmp_path / "big")  # 2 MiB
    w = OffloadedTensor(load_memmap(tmp_path / "big", mode="r")["w"])
    address = w._source.data_ptr()
    assert _mapped_rss(address) == 0
    assert torch.equal(w.sum(dim=0), tree["w"].sum(dim=0))
    assert _mapped_rss(address) == 0  # read for the op, then handed back to the kernel
    w._data().sum()  # the same read without the release: the pages stay resident
    assert _mapped_rss(address) >= 2 * 2**20


# ----------------------------------------------------------------------- offloaded models
def _offloaded_copy(model: nn.Module, path, factory, **kw) -> nn.Module:
    TensorTree.from_module(model).memmap(path)
    with empty_init():
        lazy = factory().eval()
    assert offload(lazy, path, **kw) == LoadResult([], [])
    return lazy


def test_offloaded_transformer_forward_equals_the_in_memory_one(tmp_path) -> None:
    torch.manual_seed(0)
    model = TinyLM().eval()
    lazy = _offloaded_copy(model, tmp_path / "lm", TinyLM)
    assert isinstance(lazy.encoder.layers[0].linear1.weight, OffloadedTensor)
    assert isinstance(lazy.encoder.layers[0].linear1.weight, nn.Parameter)
    assert lazy.head.weight is lazy.embed.weight  # still tied
    with torch.no_grad():
        assert torch.equal(lazy(tokens()), model(tokens()))
    # offloaded parameters do not require grad; with the same setting, torch takes the same path
    model.requires_grad_(False)
    assert torch.equal(lazy(tokens()), model(tokens()))


def test_offloaded_convnet_with_batchnorm_equals_the_in_memory_one(tmp_path) -> None:
    model = trained_convnet()
    lazy = _offloaded_copy(model, tmp_path / "cnn", convnet)
    assert isinstance(lazy[1].running_mean, OffloadedTensor)
    x = torch.randn(2, 3, 12, 12)
    assert torch.equal(lazy(x), model(x))


def test_gradients_flow_to_inputs_through_offloaded_layers(tmp_path) -> None:
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    lazy = _offloaded_copy(model, tmp_path / "mlp", lambda: nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)))
    assert not any(p.requires_grad for p in lazy.parameters())
    x1 = torch.randn(4, 5, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    lazy(x1).square().sum().backward()
    model(x2).square().sum().backward()
    assert torch.equal(x1.grad, x2.grad)


def test_state_dict_of_an_offloaded_model_composes(tmp_path) -> None:
    model = trained_convnet()
    lazy = _offloaded_copy(model, tmp_path / "cnn", convnet)
    sd = lazy.state_dict()
    assert isinstance(sd["0.weight"], OffloadedTensor)
    plain = convnet().eval()
    plain.load_state_dict(sd)  # copies out of the files
    assert torch.equal(plain[0].weight, model[0].weight)
    TensorTree.from_module(lazy).memmap(tmp_path / "copy")  # re-saving reads each leaf once
    assert torch.equal(load_memmap(tmp_path / "copy")["1", "running_var"], model[1].running_var)
    with pytest.raises(RuntimeError, match="offloaded tensors are read-only"):  # torch wraps it
        lazy.load_state_dict(model.state_dict())


def test_module_to_dtype_keeps_weights_on_disk(tmp_path) -> None:
    model = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 2))
    lazy = _offloaded_copy(model, tmp_path / "mlp", lambda: nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 2)))
    weight = lazy[0].weight
    lazy.double()
    assert lazy[0].weight is weight and isinstance(weight, OffloadedTensor) and weight.dtype == torch.float64
    x = torch.randn(3, 6, dtype=torch.float64)
    assert torch.equal(lazy(x), model.double()(x))
    clone = copy.deepcopy(lazy)
    assert isinstance(clone[2].bias, OffloadedTensor) and torch.equal(clone(x), lazy(x))


def test_device_map_keeps_chosen_sub_modules_resident(tmp_path) -> None:
    model = trained_convnet()
    TensorTree.from_module(model).memmap(tmp_path / "cnn")
    lazy = convnet().eval()
    offload(lazy, tmp_path / "cnn", device_map={"": "disk", "8": "cpu", "1.running_mean": "cpu"})
    assert type(lazy[8].weight) is nn.Parameter and type(lazy[1].running_mean) is torch.Tensor
    assert isinstance(lazy[0].weight, OffloadedTensor) and isinstance(lazy[1].running_var, OffloadedTensor)
    x = torch.randn(2, 3, 12, 12)
    assert torch.equal(lazy(x), model(x))


def test_offload_checks_before_changing_anything(tmp_path) -> None:
    TensorTree.from_module(convnet()).exclude(("8", "bias")).memmap(tmp_path / "part")
    target = convnet()
    before = target[0].weight
    with pytest.raises(MemtreeKeyError, match="missing from the source: '8.bias'"):
        offload(target, tmp_path / "part")
    assert target[0].weight is before
    assert offload(target, tmp_path / "part", strict=False) == LoadResult(["8.bias"], [])
    assert type(target[8].bias) is nn.Parameter


def test_offload_refuses_leaves_that_are_not_files() -> None:
    with pytest.raises(SourceError, match="not a file-backed leaf"):
        offload(convnet(), TensorTree.from_module(convnet()))


# ----------------------------------------------------------------------------------- CUDA
@cuda
def test_cuda_offloaded_forward_equals_in_memory_and_holds_one_layer_at_a_time(tmp_path) -> None:
    torch.manual_seed(0)
    width, depth = 1024, 8
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]).eval()
    TensorTree.from_module(model).memmap(tmp_path / "mlp")
    with empty_init():
        lazy = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]).eval()
    offload(lazy, tmp_path / "mlp", device="cuda")
    assert lazy[0].weight.device.type == "cuda" and isinstance(lazy[0].weight, OffloadedTensor)
    x = torch.randn(4, width, device="cuda")
    on_gpu = model.to("cuda")
    with torch.no_grad():
        expected = on_gpu(x)
        del on_gpu
        model.to("cpu")
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = lazy(x)
        peak = torch.cuda.max_memory_allocated() - base
    assert torch.equal(out, expected)
    layer_bytes = (width * width + width) * 4
    assert peak < 3 * layer_bytes < depth * layer_bytes  # never the whole model on the device


@cuda
def test_cuda_module_to_retargets_offloaded_weights(tmp_path) -> None:
    model = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 2))
    lazy = _offloaded_copy(model, tmp_path / "mlp", lambda: nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 2)))
    lazy.to("cuda")
    assert isinstance(lazy[0].weight, OffloadedTensor) and lazy[0].weight.device.type == "cuda"
    x = torch.randn(3, 6)
    out = lazy(x.cuda())
    assert out.device.type == "cuda" and torch.allclose(out.cpu(), model(x), atol=1e-5)
    assert isinstance(lazy[0].weight.cpu(), OffloadedTensor)
    assert os.path.exists(lazy[0].weight.filename)
