"""``staged_commit``, the one definition of a directory write's steps (``write_tree`` and
``staged_directory`` use it): what a block that fails, or ends without publishing, leaves behind;
what it does after the publish; and that a staged directory replacing a tree keeps the trees this
process opened from it readable, as ``write_tree`` does. (The kill -9 matrix of both writers is in
test_faults.py and test_convert_hf.py.)"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

import memtree
from memtree import TensorTree
from memtree.store.primitives.commit import WriterLock
from memtree.store.writing.staged import staged_commit, staged_directory
from memtree.format.names import lock_path


def _lock_is_free(dest: Path) -> bool:
    with WriterLock(lock_path(str(dest.parent), dest.name), str(dest), timeout=0):
        return True


@pytest.mark.parametrize("existing", [False, True], ids=["new", "overwrite"])
def test_an_os_error_in_the_block_is_a_storage_error_and_changes_nothing(tmp_path: Path, existing: bool) -> None:
    dest = tmp_path / "t"
    if existing:
        TensorTree({"x": torch.arange(3)}).memmap(dest)
    with pytest.raises(memtree.StorageError, match=f"writing {dest}") as info:
        with staged_commit(str(dest), existsok=True) as staging:
            (Path(staging.path) / "half").write_bytes(b"x")
            raise OSError(errno.EIO, "disk")
    assert info.value.errno == errno.EIO
    assert os.listdir(tmp_path) == (["t"] if existing else [])  # no staging directory, no lock file
    if existing:
        assert memtree.load_memmap(dest)["x"].tolist() == [0, 1, 2]
    assert _lock_is_free(dest)


def test_a_block_that_does_not_publish_leaves_nothing(tmp_path: Path) -> None:
    dest = tmp_path / "t"
    with staged_commit(str(dest), existsok=False) as staging:
        (Path(staging.path) / "a").write_bytes(b"x")
    assert os.listdir(tmp_path) == []


def test_after_the_publish_the_block_still_holds_the_lock_and_its_errors_pass_unchanged(tmp_path: Path) -> None:
    dest = tmp_path / "t"
    with pytest.raises(KeyError, match="after"):
        with staged_commit(str(dest), existsok=False) as staging:
            (Path(staging.path) / "a").write_bytes(b"new")
            staging.publish(fsync=True)
            assert staging.published and (dest / "a").read_bytes() == b"new"
            with pytest.raises(memtree.LockError):
                _lock_is_free(dest)
            raise KeyError("after")
    assert os.listdir(tmp_path) == ["t"] and (dest / "a").read_bytes() == b"new"
    assert _lock_is_free(dest)


def test_a_staged_directory_over_a_tree_keeps_a_lazily_opened_tree_readable(tmp_path: Path) -> None:
    dest = tmp_path / "t"
    TensorTree({"sub": {"x": torch.arange(4)}}).memmap(dest)
    opened = memtree.load_memmap(dest)  # lazy: "sub" is not loaded yet
    with staged_directory(dest, existsok=True) as staging:
        (Path(staging) / "model.safetensors").write_bytes(b"{}")
    assert os.listdir(dest) == ["model.safetensors"]
    assert opened["sub", "x"].tolist() == [0, 1, 2, 3]  # loaded before the old tree was removed
