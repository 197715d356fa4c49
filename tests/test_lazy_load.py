"""load_memmap opens a tree in O(metadata of the root) and loads each level on first use.

What these tests pin: which files an open and a key access touch (counted with monkeypatch, never
timed), that a lazily opened tree always shows the version of the tree it opened, and the clear
errors and consistency rules around that.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import threading

import pytest
import torch

import memtree
from memtree import TensorTree
from treeutil import assert_leaf_equal

FORK = mp.get_context("fork")


def nested(n_outer: int = 3, n_inner: int = 4, n_leaves: int = 5, fill: float = 0.0) -> TensorTree:
    return TensorTree(
        {
            f"o{i}": {
                f"i{j}": {f"x{k}": torch.full((3,), fill + 100 * i + 10 * j + k) for k in range(n_leaves)}
                for j in range(n_inner)
            }
            for i in range(n_outer)
        }
        | {"top": torch.arange(4), "note": "hello"}
    )


@pytest.fixture
def opened(monkeypatch):
    """Record every file opened through os.open (memtree opens everything that way)."""
    calls: list[str] = []
    real = os.open

    def spy(path, flags, mode=0o777, *, dir_fd=None):
        calls.append(os.fsdecode(path))
        return real(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", spy)
    return calls


def test_open_reads_only_the_root_meta(tmp_path, opened):
    nested().memmap(tmp_path / "t")
    opened.clear()
    tree = memtree.load_memmap(tmp_path / "t")
    assert not any(p.endswith(".memmap") for p in opened), opened
    # the root meta.json twice: the layout check (memtree or tensordict?) reads it with the same
    # safe opener as the loader; no other directory is opened, so no other meta.json is read
    assert sum(p.endswith("meta.json") for p in opened) == 2
    assert [p for p in opened if not p.endswith("meta.json")] == [str(tmp_path / "t")] * 2
    assert tree.batch_size == torch.Size([])


def test_a_key_loads_only_the_levels_on_its_path(tmp_path, opened):
    expected = nested()
    expected.memmap(tmp_path / "t")
    tree = memtree.load_memmap(tmp_path / "t")
    opened.clear()
    assert_leaf_equal(tree["o1", "i2", "x3"], expected["o1", "i2", "x3"])
    leaves = [p for p in opened if p.endswith(".memmap")]
    # the root's leaf, then the five leaves of the level o1/i2: no other level's leaf
    assert sorted(leaves) == sorted(["top.memmap"] + [f"x{k}.memmap" for k in range(5)])
    metas = [p for p in opened if p.endswith("meta.json")]
    assert len(metas) == 3 + 4 + 0  # root's children o0..o2, then o1's children i0..i3
    opened.clear()
    tree["o1", "i2", "x0"]
    assert opened == []  # loaded once


def test_every_leaf_file_is_opened_once_over_a_full_walk(tmp_path, opened):
    expected = nested()
    expected.memmap(tmp_path / "t")
    opened.clear()
    tree = memtree.load_memmap(tmp_path / "t")
    for key, value in expected.items(include_nested=True, leaves_only=True):
        assert_leaf_equal(tree[key], value, str(key))
    leaves = [p for p in opened if p.endswith(".memmap")]
    assert len(leaves) == 3 * 4 * 5 + 1
    assert sum(p.endswith("meta.json") for p in opened) == 2 + 3 + 12  # the root's: see above


def test_lazy_false_loads_everything_at_once(tmp_path, opened):
    nested().memmap(tmp_path / "t")
    opened.clear()
    memtree.load_memmap(tmp_path / "t", lazy=False)
    assert len([p for p in opened if p.endswith(".memmap")]) == 61


def test_keys_selection_loads_its_paths_and_checks_them_at_load(tmp_path, opened):
    nested().memmap(tmp_path / "t")
    with pytest.raises(memtree.MemtreeKeyError, match="nope"):
        memtree.load_memmap(tmp_path / "t", keys=[("o1", "i2", "nope")])
    opened.clear()
    tree = memtree.load_memmap(tmp_path / "t", keys=[("o1", "i2")])
    assert not any(p.endswith(".memmap") for p in opened)  # o1/i2 itself is still lazy
    assert tree.keys(include_nested=True, leaves_only=True) == [("o1", "i2", f"x{k}") for k in range(5)]


def test_damage_in_a_level_raises_when_that_level_is_first_used(tmp_path):
    nested().memmap(tmp_path / "t")
    os.truncate(tmp_path / "t" / "o2" / "i0" / "x1.memmap", 4)
    tree = memtree.load_memmap(tmp_path / "t")
    assert tree["o1", "i0", "x1"].tolist() == [101.0] * 3  # other levels are fine
    with pytest.raises(memtree.LeafSizeError, match=r"o2/i0/x1\.memmap"):
        tree["o2", "i0", "x0"]  # the level o2/i0 loads as a whole
    with pytest.raises(memtree.LeafSizeError):
        memtree.load_memmap(tmp_path / "t", lazy=False)


def test_resaving_the_prefix_in_this_process_keeps_the_opened_version(tmp_path):
    old = nested(fill=0.0)
    old.memmap(tmp_path / "t")
    tree = memtree.load_memmap(tmp_path / "t")
    nested(fill=0.5).memmap(tmp_path / "t")  # replaces the directory: the old one is deleted
    for key, value in old.items(include_nested=True, leaves_only=True):
        assert_leaf_equal(tree[key], value, str(key))
    assert memtree.load_memmap(tmp_path / "t")["o0", "i0", "x0"].tolist() == [0.5] * 3


def test_any_writer_to_the_prefix_keeps_the_opened_version(tmp_path):
    from memtree.format.level import Level
    from memtree.store.writing.write import write_tree

    old = nested(fill=0.0)
    old.memmap(tmp_path / "t")
    tree = memtree.load_memmap(tmp_path / "t")
    write_tree(tmp_path / "t", Level((), {"other": torch.ones(2)}))  # the store layer directly
    assert_leaf_equal(tree["o2", "i3", "x4"], old["o2", "i3", "x4"])
    assert list(memtree.load_memmap(tmp_path / "t").keys()) == ["other"]


def _resave(path: str) -> None:
    nested(fill=0.5).memmap(path)


def test_resaving_in_another_process_gives_a_clear_error_never_mixed_data(tmp_path):
    nested().memmap(tmp_path / "t")
    tree = memtree.load_memmap(tmp_path / "t")
    p = FORK.Process(target=_resave, args=(str(tmp_path / "t"),))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    with pytest.raises(memtree.MissingLeafError, match="deleted or replaced"):
        tree["o0", "i0", "x0"]


def test_a_leaf_grown_after_open_still_loads_with_its_old_shape(tmp_path):
    d = tmp_path / "buf"
    buf = TensorTree({"obs": torch.zeros(0, 3)}, batch_size=[0]).memmap(d)
    stale = memtree.load_memmap(d)
    for i in range(5):
        buf.append_(TensorTree({"obs": torch.full((3,), float(i))}))
    assert stale["obs"].shape == (0, 3)
    assert memtree.load_memmap(d)["obs"][:, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_pickle_and_copy_load_everything_first(tmp_path):
    expected = nested()
    expected.memmap(tmp_path / "t")
    back = pickle.loads(pickle.dumps(memtree.load_memmap(tmp_path / "t")))
    for key, value in expected.items(include_nested=True, leaves_only=True):
        assert_leaf_equal(back[key], value, str(key))
    assert back["note"] == "hello"


def test_threads_share_one_loaded_level(tmp_path):
    nested(n_outer=8).memmap(tmp_path / "t")
    tree = memtree.load_memmap(tmp_path / "t")
    seen: list[object] = []
    barrier = threading.Barrier(8)

    def work(i: int) -> None:
        barrier.wait()
        seen.append(tree[f"o{i % 2}"])
        seen.append(tree["o0", "i0"])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(s) for s in seen}) == 3  # o0, o1 and o0/i0: one object each


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_the_root_descriptor_is_released_once_every_level_is_loaded(tmp_path):
    nested().memmap(tmp_path / "t")
    before = _fds()
    tree = memtree.load_memmap(tmp_path / "t")
    assert _fds() == before + 1  # the opened root directory
    tree.keys(include_nested=True)
    assert _fds() == before


def test_each_level_directory_is_opened_once_over_a_full_walk(tmp_path, opened):
    nested().memmap(tmp_path / "t")
    opened.clear()
    memtree.load_memmap(tmp_path / "t").keys(include_nested=True)
    dirs = [p for p in opened if not p.endswith((".memmap", "meta.json"))]
    # the root (twice: the layout check, then the load), then each sub-level once (kept open
    # from its parent's load, not re-walked)
    assert sorted(dirs) == sorted([str(tmp_path / "t")] * 2 + [f"o{i}" for i in range(3)] + [f"i{j}" for j in range(4)] * 3)


def test_held_level_directories_are_bounded_and_released(tmp_path, monkeypatch):
    from memtree.store.reading import read

    monkeypatch.setattr(read, "MAX_HELD_DIRS", 5)
    expected = TensorTree({f"s{i}": {"x": torch.full((2,), float(i))} for i in range(12)})
    expected.memmap(tmp_path / "t")
    before = _fds()
    tree = memtree.load_memmap(tmp_path / "t")
    tree.keys()  # loads the root: 12 pending sub-levels, at most 5 keep their directory open
    assert _fds() == before + 1 + 5
    for key, value in expected.items(include_nested=True, leaves_only=True):  # the others re-open
        assert_leaf_equal(tree[key], value, str(key))
    assert _fds() == before
    tree = memtree.load_memmap(tmp_path / "t")
    tree.keys()
    del tree  # dropped before its levels loaded: the held directories close with it
    assert _fds() == before


def test_meta_device_and_mode_r_stay_lazy(tmp_path, opened):
    nested().memmap(tmp_path / "t")
    opened.clear()
    meta = memtree.load_memmap(tmp_path / "t", device="meta")
    assert meta["o0", "i1", "x2"].device.type == "meta"
    assert not any(p.endswith(".memmap") for p in opened)
    ro = memtree.load_memmap(tmp_path / "t", mode="r")
    with pytest.raises(memtree.ReadOnlyError):
        ro["top"][0] = 5
