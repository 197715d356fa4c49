"""device= paths on CUDA (skipped on machines without a GPU; run on a GPU machine when one is lent)."""

import pytest
import torch

import memtree

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def cuda_tree():
    return memtree.TensorTree(
        {"w": torch.randn(64, 32, device="cuda"), "b": {"x": torch.arange(64, device="cuda")}},
        batch_size=[64],
    )


def test_memmap_of_a_cuda_tree_writes_cpu_files(tmp_path, cuda_tree):
    m = cuda_tree.memmap(tmp_path / "t", num_threads=4)
    assert m.is_memmap() and m["w"].device.type == "cpu"
    assert torch.equal(m["w"], cuda_tree["w"].cpu())


@pytest.mark.parametrize("mmap", [True, False])
def test_load_memmap_to_cuda(tmp_path, cuda_tree, mmap):
    cuda_tree.memmap(tmp_path / "t")
    g = memtree.load_memmap(tmp_path / "t", device="cuda:0", mmap=mmap)
    assert g["w"].is_cuda and torch.equal(g["w"], cuda_tree["w"])
    assert torch.equal(g["b", "x"], cuda_tree["b", "x"])


def test_cuda_values_assigned_into_memmapped_rows(tmp_path, cuda_tree):
    m = cuda_tree.memmap(tmp_path / "t")
    m[0:2] = cuda_tree[0:2].apply(lambda x: x * 0)
    assert m["w"][0:2].abs().sum().item() == 0
    assert torch.equal(m["w"][2:], cuda_tree["w"][2:].cpu())


def test_memory_mapped_tensor_from_cuda_tensor(tmp_path):
    mt = memtree.MemoryMappedTensor.from_tensor(torch.ones(3, device="cuda"), filename=tmp_path / "one.memmap")
    assert mt.device.type == "cpu" and mt.sum().item() == 3


def test_to_cuda_and_memmap_like(tmp_path, cuda_tree):
    m = cuda_tree.memmap(tmp_path / "t")
    tc = m.to("cuda")
    assert tc.device == torch.device("cuda") and tc["w"].is_cuda
    like = cuda_tree.memmap_like(tmp_path / "like")
    assert like["w"].shape == (64, 32) and like["w"].device.type == "cpu"
