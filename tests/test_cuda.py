"""device= paths on CUDA: the tests marked ``needs_cuda`` are skipped on machines without a GPU
(run them on a GPU machine when one is lent); the others check what a machine without CUDA gets,
and the pinned ring's allocation, on any machine."""

import pytest
import torch
from torch import nn

import memtree
import memtree.store.primitives.fill as fill_mod

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def cuda_tree():
    return memtree.TensorTree(
        {"w": torch.randn(64, 32, device="cuda"), "b": {"x": torch.arange(64, device="cuda")}},
        batch_size=[64],
    )


@needs_cuda
def test_memmap_of_a_cuda_tree_writes_cpu_files(tmp_path, cuda_tree):
    m = cuda_tree.memmap(tmp_path / "t", num_threads=4)
    assert m.is_memmap() and m["w"].device.type == "cpu"
    assert torch.equal(m["w"], cuda_tree["w"].cpu())


@needs_cuda
@pytest.mark.parametrize("mmap", [True, False])
def test_load_memmap_to_cuda(tmp_path, cuda_tree, mmap):
    cuda_tree.memmap(tmp_path / "t")
    g = memtree.load_memmap(tmp_path / "t", device="cuda:0", mmap=mmap)
    assert g["w"].is_cuda and torch.equal(g["w"], cuda_tree["w"])
    assert torch.equal(g["b", "x"], cuda_tree["b", "x"])


@needs_cuda
def test_cuda_values_assigned_into_memmapped_rows(tmp_path, cuda_tree):
    m = cuda_tree.memmap(tmp_path / "t")
    m[0:2] = cuda_tree[0:2].apply(lambda x: x * 0)
    assert m["w"][0:2].abs().sum().item() == 0
    assert torch.equal(m["w"][2:], cuda_tree["w"][2:].cpu())


@needs_cuda
def test_memory_mapped_tensor_from_cuda_tensor(tmp_path):
    mt = memtree.MemoryMappedTensor.from_tensor(torch.ones(3, device="cuda"), filename=tmp_path / "one.memmap")
    assert mt.device.type == "cpu" and mt.sum().item() == 3


@needs_cuda
def test_to_cuda_and_memmap_like(tmp_path, cuda_tree):
    m = cuda_tree.memmap(tmp_path / "t")
    tc = m.to("cuda")
    assert tc.device == torch.device("cuda") and tc["w"].is_cuda
    like = cuda_tree.memmap_like(tmp_path / "like")
    assert like["w"].shape == (64, 32) and like["w"].device.type == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_loading_onto_cuda_without_cuda_raises_a_typed_error_naming_the_device(tmp_path, device):
    memtree.TensorTree({"x": torch.ones(2)}).memmap(tmp_path / "m")
    with pytest.raises(memtree.InvalidArgumentError, match=rf"device='{device}', but .*CUDA.*Nothing was loaded"):
        memtree.load_memmap(tmp_path / "m", device=device)
    with memtree.empty_init():
        target = nn.Linear(2, 2)
    with pytest.raises(memtree.InvalidArgumentError, match=rf"device='{device}'"):
        memtree.load_into_module(target, tmp_path / "m", device=device, strict=False)
    assert target.weight.is_meta


@needs_cuda
def test_loading_onto_a_cuda_device_this_process_lacks_raises_a_typed_error(tmp_path):
    memtree.TensorTree({"x": torch.ones(2)}).memmap(tmp_path / "m")
    missing = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(memtree.InvalidArgumentError, match=rf"device='{missing}', but this process has"):
        memtree.load_memmap(tmp_path / "m", device=missing)


class _RecordingCudart:
    """Stands for ``torch.cuda.cudart()``: records every call; ``cudaHostRegister`` fails as it
    does under a memlock limit (where the real one leaves its error pending)."""

    def __init__(self, real=None):
        self.calls = []
        self.real = real

    def cudaHostRegister(self, ptr, size, flags):
        self.calls.append("cudaHostRegister")
        if self.real is not None:  # a real failure: invalid flags (cudaErrorInvalidValue)
            return self.real.cudaHostRegister(ptr, size, 0xFFFF)
        return 1

    def __getattr__(self, name):
        self.calls.append(name)
        return getattr(self.real, name)


class _Stream:
    """Stands for ``torch.cuda.Stream`` where there is no CUDA."""

    def __init__(self, device=None):
        pass

    def wait_stream(self, other):
        pass


def test_the_pinned_ring_is_allocated_by_torch_never_registered_by_hand(monkeypatch):
    cudart = _RecordingCudart(torch.cuda.cudart() if torch.cuda.is_available() else None)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "Stream", _Stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    copier = fill_mod.CudaCopier(torch.device("cuda"))
    buf = copier.buffer(4096)
    assert buf.dtype == torch.uint8 and buf.shape == (4096,) and buf.device.type == "cpu"
    assert buf.is_pinned() == torch.cuda.is_available()  # without CUDA: pageable, still correct
    copier.release(buf)
    assert cudart.calls == []


@needs_cuda
def test_a_load_onto_cuda_leaves_no_cuda_error_pending_for_the_next_kernel(tmp_path, monkeypatch, cuda_tree):
    cuda_tree.memmap(tmp_path / "t")
    cudart = _RecordingCudart(torch.cuda.cudart())
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)  # pinning by hand would fail
    g = memtree.load_memmap(tmp_path / "t", device="cuda")
    assert torch.equal(g["w"], cuda_tree["w"])
    assert (torch.ones(8, device="cuda") * 2).sum().item() == 16  # no stale error raised here
    assert "cudaHostRegister" not in cudart.calls


@needs_cuda
def test_a_ring_buffer_that_cannot_be_pinned_leaves_no_cuda_error_pending():
    copier = fill_mod.CudaCopier(torch.device("cuda"))
    try:
        copier.buffer(1 << 42)  # 4 TiB: more than a host can pin (its pageable fallback may fail too)
    except RuntimeError:
        pass
    assert (torch.ones(8, device="cuda") * 2).sum().item() == 16


@needs_cuda
def test_to_module_binds_a_cuda_tree_zero_copy_and_the_swap_binds_back():
    model = nn.Linear(32, 4).cuda()
    before = (model.weight, model.bias)
    params = memtree.TensorTree({"weight": torch.randn(4, 32, device="cuda"), "bias": torch.zeros(4, device="cuda")})
    swap = params.to_module(model)
    assert model.weight.data_ptr() == params["weight"].data_ptr() and model.weight.is_cuda
    swap.to_module(model)
    assert model.weight is before[0] and model.bias is before[1]


@pytest.mark.skipif(hasattr(torch, "xpu") and torch.xpu.is_available(), reason="checks a machine without XPU")
def test_loading_onto_another_device_this_process_lacks_raises_a_typed_error(tmp_path):
    memtree.TensorTree({"x": torch.ones(2)}).memmap(tmp_path / "m")
    with pytest.raises(memtree.InvalidArgumentError, match=r"device='xpu' cannot hold tensors in this process"):
        memtree.load_memmap(tmp_path / "m", device="xpu")
