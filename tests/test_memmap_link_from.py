"""``tree.memmap(prefix, link_from=previous)``/``memmap_``: the public incremental save.

Unchanged leaves are hard links to the previous tree's files; the tree returned maps them
read-only (a write through it must never change the tree it shares files with); a ``link_from``
that names no committed tree is an error, never a full write that silently links nothing.
"""

from __future__ import annotations

import os

import pytest
import torch

import memtree
from memtree import InvalidArgumentError, NotAMemtreeError, NotCommittedError, ReadOnlyError


def _tree(step: int) -> memtree.TensorTree:
    return memtree.TensorTree({"w": torch.arange(64.0), "opt": {"step": torch.tensor(step)}, "lr": 0.1})


def _nlink(path) -> int:
    return os.stat(path).st_nlink


def test_memmap_links_the_unchanged_leaves_of_link_from(tmp_path):
    _tree(1).memmap(tmp_path / "1")
    new = _tree(2).memmap(tmp_path / "2", link_from=tmp_path / "1")
    assert os.stat(tmp_path / "1/w.memmap").st_ino == os.stat(tmp_path / "2/w.memmap").st_ino
    assert os.stat(tmp_path / "1/opt/step.memmap").st_ino != os.stat(tmp_path / "2/opt/step.memmap").st_ino
    assert int(new["opt", "step"]) == 2 and torch.equal(new["w"], torch.arange(64.0)) and new["lr"] == 0.1
    assert _nlink(tmp_path / "2/w.memmap") == 2  # reading the returned tree copied nothing
    assert memtree.verify_tree(tmp_path / "2").ok


def test_the_tree_returned_is_read_only_and_the_linked_tree_never_changes(tmp_path):
    _tree(1).memmap(tmp_path / "1")
    new = _tree(1).memmap(tmp_path / "2", link_from=tmp_path / "1")
    with pytest.raises(ReadOnlyError, match="mode='r\\+'"):
        new["w"][0] = 5.0
    writable = memtree.load_memmap(tmp_path / "2")  # r+: the linked file gets its own copy first
    writable["w"][0] = 5.0
    assert float(memtree.load_memmap(tmp_path / "1", mode="r")["w"][0]) == 0.0
    assert float(memtree.load_memmap(tmp_path / "2", mode="r")["w"][0]) == 5.0


def test_memmap_in_place_links_and_maps_read_only(tmp_path):
    _tree(1).memmap(tmp_path / "1")
    tree = _tree(1)
    assert tree.memmap_(tmp_path / "2", link_from=str(tmp_path / "1")) is tree
    assert tree.is_memmap() and _nlink(tmp_path / "2/w.memmap") == 2 and _nlink(tmp_path / "2/opt/step.memmap") == 2
    with pytest.raises(ReadOnlyError):
        tree["opt", "step"].fill_(3)


@pytest.mark.parametrize(
    ("where", "error", "what"),
    [
        ("missing", NotAMemtreeError, "does not exist"),
        ("plain_dir", NotAMemtreeError, "no meta.json"),
        ("a_file", NotAMemtreeError, "not a directory"),
        ("staging", NotCommittedError, "never finished"),
    ],
)
def test_a_link_from_that_is_no_committed_tree_is_refused_before_anything_is_written(tmp_path, where, error, what):
    (tmp_path / "plain_dir").mkdir()
    (tmp_path / "a_file").write_bytes(b"x")
    (tmp_path / ".new.memtree-tmp-0123abcd").mkdir()
    source = {"staging": tmp_path / ".new.memtree-tmp-0123abcd"}.get(where, tmp_path / where)
    for write in (lambda: _tree(1).memmap(tmp_path / "new", link_from=source),
                  lambda: _tree(1).memmap_(tmp_path / "new", link_from=source)):
        with pytest.raises(error, match=f"link_from=.*{what}.*link_from=None"):
            write()
        assert not (tmp_path / "new").exists()


def test_link_from_needs_a_prefix_and_data(tmp_path):
    _tree(1).memmap(tmp_path / "1")
    with pytest.raises(InvalidArgumentError, match="needs a prefix"):
        _tree(1).memmap(None, link_from=tmp_path / "1")
    with pytest.raises(InvalidArgumentError, match="checksum"):
        _tree(1).memmap(tmp_path / "2", link_from=tmp_path / "1", checksum=None)
    with pytest.raises(memtree.UnknownKeywordError):  # memmap_like copies no data: nothing to link
        _tree(1).memmap_like(tmp_path / "3", link_from=tmp_path / "1")  # type: ignore[call-arg]
