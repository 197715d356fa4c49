"""The read seam (``memtree.store.reading.storage``) and the level walker (``memtree.store.reading.walk``).

A local directory and an fsspec URL holding the same tree must read the same: same levels in
the same order, same bytes. ``LocalStorage`` keeps the loader's rules (no links, regular files,
the meta.json size cap); ``split_rel`` keeps every path inside the tree.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memtree
from memtree import TensorTree
from memtree.format.names import META_NAME
from memtree.format.schema import MAX_META_BYTES, ChildMeta, LeafMeta, LevelMeta, dump_level
from memtree.store.reading.storage import LocalStorage, split_rel
from memtree.store.reading.options import ReadOptions, normalize_keys
from memtree.store.reading.walk import walk


def nested_tree() -> TensorTree:
    return TensorTree(
        {
            "a": torch.arange(6, dtype=torch.int32),
            "b": {"c": torch.ones(2, 3), "d": {"e": torch.zeros(4, dtype=torch.uint8)}},
            "f": {"g": torch.full((3,), 7, dtype=torch.int64)},
            "v": memtree.NonTensor("text"),
        }
    )


class CountingStorage:
    """A storage that records which ``meta.json`` files were read."""

    def __init__(self, inner: LocalStorage) -> None:
        self.inner = inner
        self.metas: list[str] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def read_meta(self, rel: str) -> bytes:
        self.metas.append(rel)
        return self.inner.read_meta(rel)


@pytest.fixture()
def tree_dir(tmp_path):
    d = str(tmp_path / "t")
    nested_tree().memmap(d)
    return d


# -- split_rel ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["..", ".", "a/../b", "/abs", "a//b", "a/", ".hidden", "a\\b", "meta.json/x", "a\0b"])
def test_split_rel_refuses_paths_that_could_leave_the_tree(bad):
    with pytest.raises(memtree.UnsafePathError):
        split_rel(bad)


def test_split_rel_accepts_tree_paths():
    assert split_rel("b/d/e.memmap") == ["b", "d", "e.memmap"]
    assert split_rel("b/meta.json") == ["b", "meta.json"]
    assert split_rel("%2E%2E%2Fx.memmap") == ["%2E%2E%2Fx.memmap"]  # a literal name, escaped by memtree


# -- LocalStorage ------------------------------------------------------------------------------


def test_local_storage_reads_exact_bytes(tree_dir):
    with LocalStorage(tree_dir) as s:
        info = s.stat("b/d/e.memmap")
        assert info.size == 4 and dict(info.identity)["size"] == "4"
        out = bytearray(8)
        s.read_into("a.memmap", 4, memoryview(out), s.stat("a.memmap"))
        assert bytes(out) == torch.arange(6, dtype=torch.int32)[1:3].numpy().tobytes()
        with pytest.raises(memtree.LeafSizeError):
            s.read_into("a.memmap", 20, memoryview(bytearray(8)))
        assert s.read_meta("b").startswith(b"{")


def test_local_storage_refuses_links_fifos_and_missing_files(tree_dir):
    os.symlink("/etc/passwd", os.path.join(tree_dir, "link.memmap"))
    os.mkfifo(os.path.join(tree_dir, "fifo.memmap"))
    os.symlink(os.path.join(tree_dir, "b"), os.path.join(tree_dir, "dirlink"))
    with LocalStorage(tree_dir) as s:
        with pytest.raises(memtree.UnsafePathError):
            s.stat("link.memmap")
        with pytest.raises(memtree.UnsafePathError):
            s.read_into("fifo.memmap", 0, memoryview(bytearray(1)))
        with pytest.raises(memtree.UnsafePathError):
            s.read_meta("dirlink")
        with pytest.raises(memtree.MissingLeafError, match="nope.memmap is missing"):
            s.stat("nope.memmap")


def test_local_storage_root_errors(tmp_path, tree_dir):
    (tmp_path / "empty").mkdir()
    with LocalStorage(tmp_path / "empty") as s:
        with pytest.raises(memtree.NotAMemtreeError):
            s.stat(META_NAME)
        with pytest.raises(memtree.NotAMemtreeError):
            s.read_meta("")
    with pytest.raises(memtree.NotAMemtreeError):
        LocalStorage(tmp_path / "missing")
    staging = tmp_path / (".t.memtree-tmp-" + "0" * 32)
    staging.mkdir()
    with pytest.raises(memtree.NotCommittedError):
        LocalStorage(staging)


def test_local_storage_meta_over_the_limit_is_not_read(tree_dir):
    with open(os.path.join(tree_dir, "b", META_NAME), "r+b") as f:
        f.truncate(MAX_META_BYTES + 1)  # sparse: nothing to read, the size says it all
    with LocalStorage(tree_dir) as s:
        with pytest.raises(memtree.LimitError):
            s.read_meta("b")


# -- walk --------------------------------------------------------------------------------------


def test_walk_orders(tree_dir):
    with LocalStorage(tree_dir) as s:
        assert [lvl.keys for lvl in walk(s)] == [(), ("b",), ("f",), ("b", "d")]
        assert [lvl.keys for lvl in walk(s, order="depth")] == [(), ("b",), ("b", "d"), ("f",)]
        with ThreadPoolExecutor(3) as pool:
            assert [lvl.rel for lvl in walk(s, pool=pool)] == ["", "b", "f", "b/d"]
        with pytest.raises(ValueError):
            list(walk(s, order="sideways"))


def test_walk_reads_only_the_selected_levels(tree_dir):
    with LocalStorage(tree_dir) as inner:
        s = CountingStorage(inner)
        levels = list(walk(s, selection=normalize_keys([("b", "d", "e")])))
        assert s.metas == ["", "b", "b/d"]  # never f/
        assert [[e.key for e in lvl.meta.entries] for lvl in levels] == [["b"], ["d"], ["e"]]
        with pytest.raises(memtree.MemtreeKeyError, match="nope"):
            list(walk(inner, selection=normalize_keys([("b", "nope")])))
        with pytest.raises(memtree.MemtreeKeyError, match="not a sub-tree"):
            list(walk(inner, selection=normalize_keys([("a", "x")])))


def test_walk_checks_batch_sizes_nest_and_reports_with_on_error(tmp_path):
    d = tmp_path / "t"
    (d / "s").mkdir(parents=True)
    (d / "bad").mkdir()
    (d / META_NAME).write_bytes(dump_level(LevelMeta((2,), (ChildMeta("s", "s"), ChildMeta("bad", "bad")))))
    (d / "s" / META_NAME).write_bytes(dump_level(LevelMeta((3,), (LeafMeta("x", "x.memmap", torch.uint8, (3,)),))))
    (d / "bad" / META_NAME).write_bytes(b"{not json")
    with LocalStorage(d) as s:
        with pytest.raises(memtree.MetaFormatError, match="does not start with the parent"):
            list(walk(s))
        seen = []
        levels = list(walk(s, on_error=lambda where, keys, err: seen.append((keys, type(err).__name__))))
        assert [lvl.keys for lvl in levels] == [(), ("s",)]  # the unreadable level is skipped
        assert sorted(seen) == [(("bad",), "MetaFormatError"), (("s",), "NestingError")]  # a MetaFormatError


# -- the two storages agree ----------------------------------------------------------------------

_leaf = st.builds(
    lambda n, dt: torch.arange(n).to(dt),
    st.integers(0, 40),
    st.sampled_from([torch.float32, torch.bfloat16, torch.int16, torch.uint8, torch.bool, torch.complex64]),
)
_keys = st.text(st.characters(codec="utf-8", exclude_characters="\0"), min_size=1, max_size=12)
_trees = st.recursive(
    st.dictionaries(_keys, _leaf, min_size=1, max_size=4),
    lambda sub: st.dictionaries(_keys, st.one_of(_leaf, sub), min_size=1, max_size=4),
    max_leaves=12,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=_trees)
def test_local_and_fsspec_storage_walk_and_fetch_the_same(tmp_path_factory, data):
    pytest.importorskip("fsspec")
    import fsspec

    from memtree.remote import upload
    from memtree.store.urls.fsspec_storage import FsspecStorage
    from memtree.store.urls.remote import fetch_tree

    tree = TensorTree(data)
    local = str(tmp_path_factory.mktemp("seam") / "t")
    tree.memmap(local)
    url = f"memory://seam-{os.path.basename(os.path.dirname(local))}/t"
    upload(local, url)
    try:
        remote = FsspecStorage(url)
        with LocalStorage(local) as s:
            a = [(lvl.keys, lvl.dirs, lvl.meta.entries) for lvl in walk(s)]
            b = [(lvl.keys, lvl.dirs, lvl.meta.entries) for lvl in walk(remote)]
            strip = lambda levels: [(k, d, [e for e in es if not isinstance(e, LeafMeta)]) for k, d, es in levels]  # noqa: E731
            assert strip(a) == strip(b)  # the uploaded leaves also carry checksums
            one = fetch_tree(s, ReadOptions(), cache_key=local, chunk_bytes=7)
            two = fetch_tree(remote, ReadOptions(), cache_key=url, chunk_bytes=7)
        for key in tree.keys(include_nested=True, leaves_only=True):
            want = tree[key].contiguous().view(-1).view(torch.uint8)
            assert _get(one, key).reshape(-1).view(torch.uint8).equal(want)
            assert _get(two, key).reshape(-1).view(torch.uint8).equal(want)
    finally:
        fsspec.filesystem("memory").rm(url.rsplit("/", 1)[0], recursive=True)


def _get(level, key):
    for k in key if isinstance(key, tuple) else (key,):
        level = level.entries[k]
    return level
