"""The write path's performance properties, as relative facts (no timings; issue 9).

What a save costs in system calls and threads, checked by counting calls with ``monkeypatch``:
each leaf file is created once and filled from the tensor's memory; large leaves are
preallocated in one ``fallocate`` (small ones are not); a failed preallocation behaves like a
failed write.
"""

from __future__ import annotations

import errno
import os

import pytest
import torch

import memtree
from memtree import TensorTree, fileio
from treeutil import assert_tree_equal_to, leaf_dict

pytestmark = pytest.mark.timeout(120)

BIG = fileio.PREALLOCATE_MIN // 4  # float32 elements of a leaf that is just large enough


def mixed_tree() -> TensorTree:
    g = torch.Generator().manual_seed(0)
    return TensorTree(
        {
            "big": torch.randn(BIG, generator=g),
            "small": torch.randn(7, generator=g),
            "half": torch.randn(4, 3, generator=g).to(torch.bfloat16),
            "empty": torch.zeros(0, 5),
            "scalar": torch.tensor(3, dtype=torch.int64),
            "strided": torch.arange(12.0).reshape(3, 4).t(),  # non-contiguous: copied once
            "sub": {"big": torch.randn(2, BIG, generator=g), "flag": torch.tensor([True, False])},
        }
    )


@pytest.fixture
def creates(monkeypatch):
    """Paths opened with O_CREAT (in order), recorded through os.open."""
    seen: list[str] = []
    real = os.open

    def spy(path, flags, mode=0o777, *, dir_fd=None):
        if flags & os.O_CREAT:
            seen.append(os.fspath(path))
        return real(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", spy)
    return seen


@pytest.fixture
def fallocations(monkeypatch):
    """The requested length of every preallocation."""
    seen: list[int] = []
    real = fileio._fallocate

    def spy(fd, mode, offset, length):
        seen.append(length)
        return real(fd, mode, offset, length)

    monkeypatch.setattr(fileio, "_fallocate", spy)
    return seen


@pytest.mark.parametrize("num_threads", [0, 2])
def test_each_leaf_file_is_created_once(tmp_path, creates, num_threads):
    tree = mixed_tree()
    out = tree.memmap(tmp_path / "t", num_threads=num_threads)
    leaves = [p for p in creates if p.endswith(".memmap")]
    assert len(leaves) == len(set(leaves)) == 8
    assert_tree_equal_to(out, leaf_dict(tree))
    assert_tree_equal_to(memtree.load_memmap(tmp_path / "t"), leaf_dict(tree))


@pytest.mark.skipif(fileio._fallocate is None, reason="no fallocate(2) on this platform")
def test_only_large_leaves_are_preallocated(tmp_path, fallocations):
    tree = mixed_tree()
    tree.memmap(tmp_path / "t")
    assert sorted(fallocations) == [BIG * 4, 2 * BIG * 4]
    for rel in ("big.memmap", "sub/big.memmap"):  # exactly the data's size, not rounded up
        assert os.path.getsize(tmp_path / "t" / rel) == leaf_dict(tree)[tuple(rel[:-7].split("/"))].nbytes
    fallocations.clear()
    tree.memmap_like(tmp_path / "like")  # no data written: sparse files, no preallocation
    assert fallocations == []


@pytest.mark.skipif(fileio._fallocate is None, reason="no fallocate(2) on this platform")
@pytest.mark.parametrize("err", [errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL])
def test_unsupported_preallocation_is_skipped(tmp_path, monkeypatch, err):
    def unsupported(fd, mode, offset, length):
        import ctypes

        ctypes.set_errno(err)
        return -1

    monkeypatch.setattr(fileio, "_fallocate", unsupported)
    tree = mixed_tree()
    assert_tree_equal_to(tree.memmap(tmp_path / "t"), leaf_dict(tree))


@pytest.mark.skipif(fileio._fallocate is None, reason="no fallocate(2) on this platform")
@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
def test_full_disk_at_preallocation_is_a_storage_error(tmp_path, monkeypatch, overwrite):
    prefix = tmp_path / "t"
    old = TensorTree({"x": torch.ones(3)})
    if overwrite:
        old.memmap(prefix)

    def full(fd, mode, offset, length):
        import ctypes

        ctypes.set_errno(errno.ENOSPC)
        return -1

    monkeypatch.setattr(fileio, "_fallocate", full)
    with pytest.raises(memtree.StorageError) as ei:
        mixed_tree().memmap(prefix)
    assert ei.value.errno == errno.ENOSPC
    assert "'big'" in str(ei.value) or "('sub', 'big')" in str(ei.value)
    assert os.listdir(tmp_path) == (["t"] if overwrite else [])
    if overwrite:
        assert_tree_equal_to(memtree.load_memmap(prefix), leaf_dict(old))


def test_write_fd_writes_every_kind_of_tensor_exactly(tmp_path):
    """The no-copy view of a plain tensor, and the fallback for everything else."""
    src = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    cases = {
        "plain": src,
        "offset view": src[1:3],
        "scalar": torch.tensor(7, dtype=torch.int16),
        "empty": torch.zeros(0),
        "transposed": src.t(),
        "bfloat16": src.to(torch.bfloat16),
        "complex": torch.complex(src, -src),
    }
    for name, t in cases.items():
        path = tmp_path / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fileio.write_fd(fd, t, 3)
        finally:
            os.close(fd)
        expected = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert path.read_bytes() == (b"\0" * 3 + expected if expected else b""), name
