"""Hostile and broken servers against remote loads: each class of attack or fault, on loopback.

Classes: names that try to leave the tree's prefix (and legitimate escaped names), redirects,
bodies larger than they say (meta.json streamed without a size, inflating gzip), leaves whose
meta.json lies about their size, answers that lie about their range, servers that drip, and
downloads killed by ``kill -9``. The server is ``tests/remote_server.py`` (a
``ThreadingHTTPServer`` on ``127.0.0.1`` with a backlog of 128).
"""

from __future__ import annotations

import gzip
import multiprocessing
import os
import signal
import time
import tracemalloc
from urllib.parse import unquote

import pytest
import torch

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

import fsspec  # noqa: E402
import remote_server  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import memtree  # noqa: E402
from memtree import TensorTree  # noqa: E402
from memtree.format.names import META_NAME, SCRATCH_MARK  # noqa: E402
from memtree.format.schema import MAX_META_BYTES, ChildMeta, LeafMeta, LevelMeta, dump_level  # noqa: E402
from memtree.store.primitives import faults  # noqa: E402

pytestmark = pytest.mark.timeout(120)
FORK = multiprocessing.get_context("fork")


@pytest.fixture(scope="module")
def server():
    srv, _ = remote_server.start()
    yield srv
    remote_server.stop(srv)


@pytest.fixture(scope="module")
def other_server():
    """A second server: another origin (another port)."""
    srv, _ = remote_server.start()
    yield srv
    remote_server.stop(srv)


@pytest.fixture()
def fresh(server, other_server):
    for srv in (server, other_server):
        srv.reset()
        srv.files.clear()
    return server


def publish_tree(server, tmp_path, tree: TensorTree, prefix: str = "t") -> str:
    local = tmp_path / f"src-{prefix}"
    tree.memmap(str(local))
    server.publish(str(local), prefix)
    return f"{server.url}/{prefix}"


def small_tree() -> TensorTree:
    g = torch.Generator().manual_seed(1)
    return TensorTree({"w": torch.randn(50, 7, generator=g), "sub": {"b": torch.arange(9, dtype=torch.int16)}})


def scratch_dirs(cache: str) -> list[str]:
    return sorted(n for n in os.listdir(cache) if SCRATCH_MARK in n) if os.path.isdir(cache) else []


def entries(cache: str) -> list[str]:
    return sorted(n for n in os.listdir(cache) if not n.startswith(".")) if os.path.isdir(cache) else []


# ---------------------------------------------------------------------------------------------
# names: quoted into URLs, never leaving the prefix


@pytest.mark.parametrize("key", ["a b", "50%", "x/y", "../up", "..", "CON", "ü~é", "#frag?q=1"])
def test_escaped_keys_load_over_http(fresh, tmp_path, key):
    tree = TensorTree({key: torch.arange(5), "nested": {key: torch.ones(2, dtype=torch.float64)}})
    url = publish_tree(fresh, tmp_path, tree)
    loaded = memtree.load_memmap(url)
    assert torch.equal(loaded[key], tree[key])
    assert torch.equal(loaded["nested", key], tree["nested", key])


@pytest.mark.parametrize("hostile", ["%2E%2E%2Fsecret.memmap", "%2e%2e%2fsecret.memmap", "a%2F%2E%2E%2F%2E%2E%2Fsecret.memmap"])
def test_a_leaf_name_that_decodes_outside_the_prefix_reaches_nothing(fresh, tmp_path, hostile):
    secret = bytes(range(16))
    fresh.files["/secret.memmap"] = secret  # outside the tree at /t/
    meta = LevelMeta((), (LeafMeta("x", hostile, torch.uint8, (16,)),))
    fresh.files["/t/meta.json"] = dump_level(meta)
    with pytest.raises(memtree.MissingLeafError):
        memtree.load_memmap(f"{fresh.url}/t")
    assert fresh.served["/secret.memmap"] == 0
    assert ("HEAD", f"/t/{hostile}") in [(m, p) for m, p, _ in fresh.requests]  # the literal name


def test_a_child_dir_that_decodes_to_dotdot_reaches_nothing(fresh, tmp_path):
    fresh.files["/meta.json"] = dump_level(LevelMeta((), (LeafMeta("s", "secret.memmap", torch.uint8, (4,)),)))
    fresh.files["/secret.memmap"] = b"abcd"
    fresh.files["/t/meta.json"] = dump_level(LevelMeta((), (ChildMeta("up", "%2E%2E"),)))
    with pytest.raises(memtree.MissingLeafError):
        memtree.load_memmap(f"{fresh.url}/t")
    assert fresh.gets["/meta.json"] == 0 and fresh.served["/secret.memmap"] == 0


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abcXYZ019_-.~%", min_size=1, max_size=40))
def test_every_url_decodes_once_to_the_recorded_name(name):
    """A server that decodes the path once gets the recorded name, inside the prefix."""
    from memtree.format.names import is_safe_name
    from memtree.store.urls.http import HttpTransport

    t = HttpTransport(fsspec.filesystem("http"), "http://h:1/tree dir", timeout=5, allow_redirects="any")
    if not is_safe_name(name):
        with pytest.raises(memtree.UnsafePathError):
            t.url(f"sub/{name}")
        return
    url = t.url(f"sub/{name}")
    assert unquote(url.raw_path) == f"/tree dir/sub/{name}"
    assert url.host == "h" and url.port == 1


# ---------------------------------------------------------------------------------------------
# redirects


def test_same_origin_redirect_is_followed(fresh, tmp_path):
    url = publish_tree(fresh, tmp_path, small_tree())
    fresh.files["/mirror/w.memmap"] = fresh.files.pop("/t/w.memmap")
    fresh.redirects["/t/w.memmap"] = "/mirror/w.memmap"
    assert torch.equal(memtree.load_memmap(url)["w"], small_tree()["w"])


def test_cross_origin_redirect_is_refused_unless_allowed(fresh, other_server, tmp_path):
    url = publish_tree(fresh, tmp_path, small_tree())
    other_server.files["/w.memmap"] = fresh.files.pop("/t/w.memmap")
    fresh.redirects["/t/w.memmap"] = f"{other_server.url}/w.memmap"
    with pytest.raises(memtree.RemoteError, match="another origin"):
        memtree.load_memmap(url)
    assert other_server.requests == []
    auth = {"headers": {"Authorization": "Bearer secret-token"}}
    loaded = memtree.load_memmap(url, allow_redirects="any", storage_options=auth)
    assert torch.equal(loaded["w"], small_tree()["w"])
    assert other_server.requests and all("Authorization" not in h for _, _, h in other_server.requests)
    assert all(h.get("Authorization") == "Bearer secret-token" for _, _, h in fresh.requests[-3:])


def test_no_redirect_is_followed_with_allow_redirects_none(fresh, tmp_path):
    url = publish_tree(fresh, tmp_path, small_tree())
    fresh.files["/mirror/w.memmap"] = fresh.files.pop("/t/w.memmap")
    fresh.redirects["/t/w.memmap"] = "/mirror/w.memmap"
    with pytest.raises(memtree.RemoteError, match="allow_redirects='none'"):
        memtree.load_memmap(url, allow_redirects="none")
    with pytest.raises(ValueError, match="allow_redirects"):
        memtree.load_memmap(url, allow_redirects="sometimes")


def test_redirect_loops_end(fresh, tmp_path):
    url = publish_tree(fresh, tmp_path, small_tree())
    fresh.redirects["/t/w.memmap"] = "/t/w.memmap"
    with pytest.raises(memtree.RemoteError, match="redirects in a row"):
        memtree.load_memmap(url)


# ---------------------------------------------------------------------------------------------
# bodies larger than they say


@pytest.mark.parametrize("where", ["/t/meta.json", "/t/sub/meta.json"])
def test_an_endless_meta_json_is_cut_at_the_limit(fresh, tmp_path, where):
    publish_tree(fresh, tmp_path, small_tree())
    fresh.streams[where] = 96 * 1024 * 1024  # no Content-Length, Range ignored
    fresh.head_sizes[where] = 100  # and a HEAD that says it is small
    with pytest.raises(memtree.LimitError):
        memtree.load_memmap(f"{fresh.url}/t")
    assert fresh.served[where] < MAX_META_BYTES + 24 * 1024 * 1024  # the limit + socket buffers


def test_a_meta_json_that_says_it_is_too_large_is_not_read(fresh, tmp_path):
    publish_tree(fresh, tmp_path, small_tree())
    fresh.files["/t/sub/meta.json"] = b" " * (MAX_META_BYTES + 1)
    with pytest.raises(memtree.LimitError):
        memtree.load_memmap(f"{fresh.url}/t")
    assert fresh.served["/t/sub/meta.json"] < MAX_META_BYTES // 2  # socket buffers at most


def test_a_gzip_meta_json_is_inflated_only_up_to_the_limit(fresh, tmp_path):
    publish_tree(fresh, tmp_path, small_tree())
    fresh.encoded["/t/sub/meta.json"] = ("gzip", gzip.compress(b"{" + b" " * (256 * 1024 * 1024), 1))
    tracemalloc.start()
    try:
        with pytest.raises(memtree.LimitError):
            memtree.load_memmap(f"{fresh.url}/t")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * MAX_META_BYTES, f"peak {peak / 2**20:.0f} MiB while inflating"


def test_a_gzip_meta_json_within_the_limit_loads(fresh, tmp_path):
    url = publish_tree(fresh, tmp_path, small_tree())
    fresh.encoded["/t/sub/meta.json"] = ("gzip", gzip.compress(fresh.files.pop("/t/sub/meta.json")))
    assert torch.equal(memtree.load_memmap(url)["sub", "b"], small_tree()["sub", "b"])


@pytest.mark.parametrize("encoding, body", [("br", b"\x0b\x01\x80{}\x03"), ("gzip", b"not gzip at all")])
def test_a_meta_json_in_an_unknown_or_broken_encoding_is_refused(fresh, tmp_path, encoding, body):
    publish_tree(fresh, tmp_path, small_tree())
    fresh.encoded["/t/sub/meta.json"] = (encoding, body)
    with pytest.raises(memtree.RemoteError, match=encoding):
        memtree.load_memmap(f"{fresh.url}/t")


def test_a_server_without_head_and_one_ignoring_range_for_whole_files(fresh, tmp_path):
    url = publish_tree(fresh, tmp_path, small_tree())
    fresh.no_head = True  # sizes come from a GET of byte 0 (Content-Range)
    assert torch.equal(memtree.load_memmap(url)["w"], small_tree()["w"])
    fresh.no_head = False
    fresh.ignore_range = True  # fine when each leaf is asked whole, in one range
    assert torch.equal(memtree.load_memmap(url, chunk_bytes=1 << 20)["w"], small_tree()["w"])


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("checksum", [None, "crc32:00000000"])
def test_a_leaf_larger_than_its_object_is_refused_before_allocating(fresh, tmp_path, cached, checksum):
    fresh.files["/t/meta.json"] = dump_level(LevelMeta((), (LeafMeta("x", "x.memmap", torch.uint8, (2**40,), checksum),)))
    fresh.files["/t/x.memmap"] = b"0123456789abcdef"
    cache = str(tmp_path / "cache")
    with pytest.raises(memtree.LeafSizeError, match="'x'"):
        memtree.load_memmap(f"{fresh.url}/t", cache_dir=cache if cached else None)
    assert fresh.leaf_bytes() == 0
    assert entries(cache) == [] and scratch_dirs(cache) == []


@pytest.mark.parametrize(
    "lie, error, match",
    [
        ("shifted Content-Range", memtree.RemoteRangeError, "Content-Range"),
        ("Range ignored", memtree.RemoteRangeError, "ignores Range"),
        ("object changed size", memtree.RemoteChangedError, "changed meanwhile"),
        ("compressed object", memtree.RemoteError, "compresses"),
        ("compressed range", memtree.RemoteRangeError, "compressed its answer"),
    ],
)
def test_range_answers_that_lie_are_refused(fresh, tmp_path, lie, error, match):
    url = publish_tree(fresh, tmp_path, small_tree())
    if lie == "shifted Content-Range":
        fresh.content_range_shift = 8
    elif lie == "Range ignored":
        fresh.ignore_range = True
    elif lie == "object changed size":  # HEAD saw one size, range answers report another
        full = fresh.files["/t/w.memmap"]
        fresh.files["/t/w.memmap"] = full + b"more"
        fresh.head_sizes["/t/w.memmap"] = len(full)
    elif lie == "compressed object":
        fresh.encoded["/t/w.memmap"] = ("gzip", gzip.compress(fresh.files.pop("/t/w.memmap")))
    else:
        fresh.compress_ranges = True
    with pytest.raises(error, match=match):
        memtree.load_memmap(url, keys=["w"], chunk_bytes=512)


# ---------------------------------------------------------------------------------------------
# servers that drip


@pytest.mark.parametrize("suffix", [".memmap", "meta.json"])
def test_a_dripping_server_fails_at_the_timeout(fresh, tmp_path, suffix):
    url = publish_tree(fresh, tmp_path, small_tree())
    fresh.drip = (suffix, 0.05)  # 20 bytes per second, forever
    t0 = time.monotonic()
    with pytest.raises(memtree.RemoteError, match="timeout=1 s"):
        memtree.load_memmap(url, timeout=1.0, retries=3)
    assert time.monotonic() - t0 < 20
    with pytest.raises(ValueError, match="timeout"):
        memtree.load_memmap(url, timeout=0)


# ---------------------------------------------------------------------------------------------
# downloads killed by kill -9


def _download(url: str, cache: str, fault: str | None) -> None:
    if fault:
        os.environ[faults.ENV] = fault
    faults.reload()
    memtree.load_memmap(url, cache_dir=cache, num_threads=1, chunk_bytes=64)


def _kill_mid_download(server, url: str, cache: str) -> None:
    server.latency = 0.02
    child = FORK.Process(target=_download, args=(url, cache, None))
    child.start()
    deadline = time.monotonic() + 60
    while server.leaf_gets < 4 and time.monotonic() < deadline and child.is_alive():
        time.sleep(0.005)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    server.latency = 0.0
    assert child.exitcode == -signal.SIGKILL and server.leaf_gets >= 4


def test_kill9_mid_download_then_recover_removes_the_scratch(fresh, tmp_path):
    url = publish_tree(fresh, tmp_path, small_tree())
    cache = str(tmp_path / "cache")
    _kill_mid_download(fresh, url, cache)
    left = scratch_dirs(cache)
    assert left and entries(cache) == []  # a locked scratch directory (and its lock file), no entry
    actions = memtree.recover(cache)
    assert any("killed download" in a for a in actions), actions
    assert scratch_dirs(cache) == []
    assert entries(cache) == []


def test_kill9_mid_download_then_the_next_load_removes_the_scratch(fresh, tmp_path):
    url = publish_tree(fresh, tmp_path, small_tree())
    cache = str(tmp_path / "cache")
    _kill_mid_download(fresh, url, cache)
    assert scratch_dirs(cache)
    loaded = memtree.load_memmap(url, cache_dir=cache)
    assert loaded.is_memmap() and torch.equal(loaded["w"], small_tree()["w"])
    assert scratch_dirs(cache) == [] and len(entries(cache)) == 1


@pytest.mark.parametrize("fault", ["after_leaf:1", "after_leaf:2", "before_publish"])
def test_fault_point_kill_leaves_no_entry_and_is_cleaned(fresh, tmp_path, fault):
    url = publish_tree(fresh, tmp_path, small_tree())
    cache = str(tmp_path / "cache")
    child = FORK.Process(target=_download, args=(url, cache, fault))
    child.start()
    child.join(60)
    assert child.exitcode == faults.EXIT_CODE
    assert entries(cache) == [] and scratch_dirs(cache)
    assert memtree.load_memmap(url, cache_dir=cache, mode="r")["sub", "b"].tolist() == list(range(9))
    assert scratch_dirs(cache) == []


def test_stale_download_cleanup_takes_each_lock(tmp_path):
    from memtree.store.writing.cache import remove_stale_downloads
    from memtree.store.primitives.commit import WriterLock

    names = [f".{c * 32}{SCRATCH_MARK}{c * 32}" for c in "abc"]
    (tmp_path / names[0]).mkdir()  # a directory whose lock file never got written
    (tmp_path / (names[1] + ".lock")).write_bytes(b"")  # a lock file left alone
    (tmp_path / names[2]).mkdir()  # a live download: its lock is held
    (tmp_path / "keep").mkdir()
    with WriterLock(str(tmp_path / (names[2] + ".lock")), "live", timeout=0):
        actions = remove_stale_downloads(tmp_path)
        assert len(actions) == 2
        assert sorted(os.listdir(tmp_path)) == sorted([names[2], names[2] + ".lock", "keep"])


def test_recover_never_touches_a_live_download(fresh, tmp_path):
    url = publish_tree(fresh, tmp_path, small_tree())
    cache = str(tmp_path / "cache")
    fresh.latency = 0.01
    child = FORK.Process(target=_download, args=(url, cache, None))
    child.start()
    deadline = time.monotonic() + 60
    while fresh.leaf_gets < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    live = [n for n in scratch_dirs(cache) if not n.endswith(".lock")]
    assert live, "the download never started"
    assert memtree.recover(cache) == []
    assert all(os.path.isdir(os.path.join(cache, n)) for n in live) or entries(cache)
    child.join(60)
    assert child.exitcode == 0
    assert len(entries(cache)) == 1 and scratch_dirs(cache) == []
    assert os.path.isfile(os.path.join(cache, entries(cache)[0], META_NAME))
