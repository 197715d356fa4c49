"""Remote trees over fsspec: HTTP (an in-test Range server), S3 (moto) and memory://, loopback only.

The HTTP server (``tests/remote_server.py``) is switchable (ignore Range, short bodies, dropped
connections, 503s, latency, content changed mid-read) and counts what it serves, so the tests can assert that a partial
load downloads only the selected bytes and that a faulty server never yields a corrupt tree.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

import fsspec  # noqa: E402
import remote_server  # noqa: E402

import memtree  # noqa: E402
from memtree import TensorTree  # noqa: E402
from memtree.remote import upload  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server():
    srv, _ = remote_server.start()
    yield srv
    remote_server.stop(srv)


@pytest.fixture()
def http(server, tmp_path):
    """A sample tree written locally and served at ``<server>/t``; returns (url, tree)."""
    server.reset()
    server.files.clear()
    tree = sample_tree()
    tree.memmap(str(tmp_path / "src"))
    server.publish(str(tmp_path / "src"), "t")
    return f"{server.url}/t", tree


def sample_tree() -> TensorTree:
    g = torch.Generator().manual_seed(0)
    return TensorTree(
        {
            "f32": torch.randn(300, 7, generator=g),
            "bf16": torch.randn(5, 9, generator=g).to(torch.bfloat16),
            "i64": torch.randint(-(2**62), 2**62, (33,), generator=g),
            "flags": torch.rand(17, generator=g) > 0.5,
            "c64": torch.randn(4, dtype=torch.complex64, generator=g),
            "f8": torch.randn(6, generator=g).to(torch.float8_e4m3fn),
            "scalar": torch.tensor(3.5, dtype=torch.float64),
            "empty": torch.empty(0, 3),
            "nested": {"w": torch.randn(64, 64, generator=g), "deep": {"b": torch.arange(10, dtype=torch.int16)}},
            "cfg": memtree.NonTensor({"lr": 0.1, "name": "x"}),
        }
    )


def assert_bit_exact(a: TensorTree, b: TensorTree) -> None:
    ka = a.keys(include_nested=True, leaves_only=True)
    assert ka == b.keys(include_nested=True, leaves_only=True)
    for k in ka:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape, k
            assert torch.equal(x.contiguous().view(-1).view(torch.uint8), y.contiguous().view(-1).view(torch.uint8)), k
        else:
            assert x == y, k


def leaf_bytes(server: remote_server.FaultyServer) -> int:
    return server.leaf_bytes()


def cache_entries(cache: str) -> list[str]:
    return sorted(os.listdir(cache)) if os.path.isdir(cache) else []


# ---------------------------------------------------------------------------------------------
# HTTP


def test_http_round_trip_is_bit_exact(http, server):
    url, tree = http
    loaded = memtree.load_memmap(url, num_threads=4, chunk_bytes=1000)
    assert_bit_exact(loaded, tree)
    assert leaf_bytes(server) == sum(
        v.numel() * v.element_size() for v in tree.values(include_nested=True, leaves_only=True) if isinstance(v, torch.Tensor)
    )


def test_http_keys_download_only_the_selected_bytes(http, server):
    url, tree = http
    loaded = memtree.load_memmap(url, keys=[("nested", "deep", "b"), "bf16"], chunk_bytes=7)
    assert loaded.keys(include_nested=True, leaves_only=True) == [("nested", "deep", "b"), "bf16"]
    assert torch.equal(loaded["nested", "deep", "b"], tree["nested", "deep", "b"])
    assert torch.equal(loaded["bf16"].view(torch.int16), tree["bf16"].view(torch.int16))
    assert leaf_bytes(server) == 10 * 2 + 5 * 9 * 2
    served_paths = {p for p in server.served if p.endswith(".memmap")}
    assert served_paths == {"/t/nested/deep/b.memmap", "/t/bf16.memmap"}
    assert "/t/nested/meta.json" in server.gets and "/t/nested/deep/meta.json" in server.gets


def test_http_meta_device_fetches_no_leaf(http, server):
    url, tree = http
    loaded = memtree.load_memmap(url, device="meta")
    assert loaded["f32"].device.type == "meta" and loaded["f32"].shape == (300, 7)
    assert leaf_bytes(server) == 0


def test_http_server_ignoring_range_is_refused(http, server):
    url, _ = http
    server.ignore_range = True
    with pytest.raises(memtree.RemoteRangeError, match="ignores Range"):
        memtree.load_memmap(url, keys=["f32"], chunk_bytes=1024)


def test_http_short_bodies_are_retried(http, server):
    url, tree = http
    server.short_first = 2
    loaded = memtree.load_memmap(url, keys=["f32"], num_threads=1, chunk_bytes=4096)
    assert torch.equal(loaded["f32"], tree["f32"])
    assert server.short_first == 0


def test_http_always_short_body_is_a_clear_error_and_no_cache_entry(http, server, tmp_path):
    url, _ = http
    server.short_first = 10**6
    cache = str(tmp_path / "cache")
    with pytest.raises(memtree.RemoteRangeError, match="attempts"):
        memtree.load_memmap(url, cache_dir=cache, retries=2, chunk_bytes=4096)
    assert cache_entries(cache) == []  # the staging directory was removed, nothing committed


def test_http_dropped_connections_are_retried_then_fail_cleanly(http, server, tmp_path):
    url, tree = http
    server.drop_first = 2
    loaded = memtree.load_memmap(url, keys=[("nested", "w")], num_threads=1)
    assert torch.equal(loaded["nested", "w"], tree["nested", "w"])
    server.drop_first = 10**6
    cache = str(tmp_path / "cache")
    with pytest.raises(memtree.RemoteError) as info:
        memtree.load_memmap(url, keys=[("nested", "w")], cache_dir=cache, retries=1)
    assert "attempts" in str(info.value)
    assert cache_entries(cache) == []


def test_http_transient_503_is_retried(http, server):
    url, tree = http
    server.fail_first = 3
    assert_bit_exact(memtree.load_memmap(url, retries=3), tree)


def test_http_retries_are_bounded(http, server):
    url, _ = http
    server.fail_first = 10**6
    with pytest.raises(memtree.RemoteError, match="3 attempts"):
        memtree.load_memmap(url, retries=2)


def test_http_content_changed_mid_read_is_detected(http, server):
    url, _ = http
    server.change_after = 3
    with pytest.raises(memtree.RemoteChangedError):
        memtree.load_memmap(url, num_threads=1, chunk_bytes=512)


def test_http_leaf_of_wrong_size_is_refused_before_reading(http, server):
    url, _ = http
    server.files["/t/f32.memmap"] = server.files["/t/f32.memmap"][:-4]
    with pytest.raises(memtree.LeafSizeError, match="f32"):
        memtree.load_memmap(url)
    assert leaf_bytes(server) == 0


def test_http_missing_tree_is_not_a_memtree(server):
    with pytest.raises(memtree.NotAMemtreeError):
        memtree.load_memmap(f"{server.url}/nothing-here")


def test_http_cache_dir_is_a_committed_memtree_reused_without_leaf_requests(http, server, tmp_path):
    url, tree = http
    cache = str(tmp_path / "cache")
    first = memtree.load_memmap(url, cache_dir=cache, num_threads=3, chunk_bytes=2000)
    assert first.is_memmap()
    assert_bit_exact(first, tree)
    (entry,) = cache_entries(cache)
    assert first["f32"].filename.startswith(os.path.join(os.path.realpath(cache), entry))
    assert_bit_exact(memtree.load_memmap(os.path.join(cache, entry), mode="r"), tree)  # a normal tree
    before = leaf_bytes(server)
    again = memtree.load_memmap(url, cache_dir=cache, keys=["bf16"], mode="r")
    assert leaf_bytes(server) == before  # served from the full entry
    assert torch.equal(again["bf16"].view(torch.int16), tree["bf16"].view(torch.int16))
    with pytest.raises(memtree.ReadOnlyError):
        again["bf16"][0] = 0


def _download_into(url: str, cache: str) -> None:
    memtree.load_memmap(url, cache_dir=cache, num_threads=1, chunk_bytes=4096)


def test_killed_download_leaves_no_cache_entry_and_the_next_load_completes(http, server, tmp_path):
    url, tree = http
    cache = str(tmp_path / "cache")
    server.hold_after = 3  # the 4th range waits: the child is killed mid-download however slow we are
    child = multiprocessing.get_context("fork").Process(target=_download_into, args=(url, cache))
    child.start()
    deadline = time.monotonic() + 100
    while server.leaf_gets <= 3 and time.monotonic() < deadline and child.is_alive():
        time.sleep(0.01)
    os.kill(child.pid, signal.SIGKILL)  # mid-download: 3 of about 90 ranges fetched
    child.join()
    server.hold_after = None
    server.release.set()
    assert server.leaf_gets == 4
    assert [n for n in cache_entries(cache) if not n.startswith(".")] == []  # nothing committed
    loaded = memtree.load_memmap(url, cache_dir=cache)
    assert loaded.is_memmap()
    assert_bit_exact(loaded, tree)


# ---------------------------------------------------------------------------------------------
# memory:// (no sockets): upload, commit marker, checksums


@pytest.fixture()
def mem_url(request):
    url = f"memory://memtree-tests/{request.node.name}"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


def test_upload_then_load_round_trip_with_checksums(mem_url):
    tree = sample_tree()
    upload(tree, mem_url, num_threads=3)
    meta = fsspec.filesystem("memory").cat(f"{mem_url}/meta.json")
    assert b'"checksum":"crc32:' in meta
    assert_bit_exact(memtree.load_memmap(mem_url, chunk_bytes=999), tree)


def test_upload_of_a_local_directory(mem_url, tmp_path):
    tree = sample_tree()
    tree.memmap(str(tmp_path / "src"))
    upload(str(tmp_path / "src"), mem_url, checksum="sha256")
    assert b'"checksum":"sha256:' in fsspec.filesystem("memory").cat(f"{mem_url}/meta.json")
    assert_bit_exact(memtree.load_memmap(mem_url), tree)


def test_corrupt_leaf_fails_its_checksum_and_leaves_no_cache_entry(mem_url, tmp_path):
    upload(sample_tree(), mem_url)
    fs = fsspec.filesystem("memory")
    data = bytearray(fs.cat(f"{mem_url}/f32.memmap"))
    data[100] ^= 1
    fs.pipe_file(f"{mem_url}/f32.memmap", bytes(data))
    with pytest.raises(memtree.IntegrityError, match="f32"):
        memtree.load_memmap(mem_url)
    cache = str(tmp_path / "cache")
    with pytest.raises(memtree.IntegrityError):
        memtree.load_memmap(mem_url, cache_dir=cache)
    assert cache_entries(cache) == []


def test_truncated_leaf_with_checksum_is_refused_by_its_size(mem_url):
    upload(sample_tree(), mem_url)  # a checksum does not spare the size check before allocating
    fs = fsspec.filesystem("memory")
    fs.pipe_file(f"{mem_url}/f32.memmap", fs.cat(f"{mem_url}/f32.memmap")[:-3])
    with pytest.raises(memtree.LeafSizeError, match="f32"):
        memtree.load_memmap(mem_url, retries=1)


def test_tree_without_root_marker_is_not_committed(mem_url):
    upload(sample_tree(), mem_url)
    fsspec.filesystem("memory").rm_file(f"{mem_url}/meta.json")
    with pytest.raises(memtree.NotCommittedError, match="never committed"):
        memtree.load_memmap(mem_url)


def test_upload_refuses_an_existing_tree_unless_existsok(mem_url):
    upload(TensorTree({"old": torch.zeros(3), "sub": {"x": torch.ones(1)}}), mem_url)
    with pytest.raises(memtree.DestinationExistsError):
        upload(TensorTree({"new": torch.ones(2)}), mem_url)
    upload(TensorTree({"new": torch.ones(2)}), mem_url, existsok=True)
    fs = fsspec.filesystem("memory")
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.find(mem_url))
    assert names == ["meta.json", "new.memmap"]  # the old tree's objects are gone
    assert memtree.load_memmap(mem_url)["new"].tolist() == [1.0, 1.0]


def test_bad_meta_json_is_refused_like_a_local_one(mem_url):
    upload(sample_tree(), mem_url)
    fs = fsspec.filesystem("memory")
    fs.pipe_file(f"{mem_url}/nested/meta.json", b'{"format":"memtree","version":1,"a":1,"a":2}')
    with pytest.raises(memtree.MetaFormatError):
        memtree.load_memmap(mem_url)
    fs.pipe_file(f"{mem_url}/meta.json", b'{"format":"memtree","version":7}')
    with pytest.raises(memtree.UnsupportedVersionError):
        memtree.load_memmap(mem_url)


def test_pickled_leaves_need_allow_pickle(mem_url):
    tree = TensorTree({"obj": memtree.NonTensor({1, 2})})
    upload(tree, mem_url, allow_pickle=True)
    with pytest.raises(memtree.PickleNotAllowedError):
        memtree.load_memmap(mem_url)
    assert memtree.load_memmap(mem_url, allow_pickle=True)["obj"] == {1, 2}


def test_missing_key_and_remote_only_options(mem_url, tmp_path):
    upload(sample_tree(), mem_url)
    with pytest.raises(memtree.MemtreeKeyError, match="nope"):
        memtree.load_memmap(mem_url, keys=[("nested", "nope")])
    TensorTree({"a": torch.ones(1)}).memmap(str(tmp_path / "local"))
    with pytest.raises(memtree.InvalidArgumentError, match="cache_dir"):
        memtree.load_memmap(str(tmp_path / "local"), cache_dir=str(tmp_path))


# ---------------------------------------------------------------------------------------------
# S3 through moto's server on 127.0.0.1


@pytest.fixture(scope="module")
def s3_options():
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                            "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1", AWS_CONFIG_FILE="", AWS_SHARED_CREDENTIALS_FILE="")
    srv = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    srv.start()
    host, port = srv.get_host_and_port()
    options = {"client_kwargs": {"endpoint_url": f"http://{host}:{port}"}, "skip_instance_cache": True}
    fsspec.filesystem("s3", **options).mkdir("memtree-bucket")
    yield options
    srv.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_s3_upload_and_load_round_trip(s3_options, tmp_path):
    url = "s3://memtree-bucket/round-trip"
    tree = sample_tree()
    upload(tree, url, storage_options=s3_options, num_threads=4)
    assert_bit_exact(memtree.load_memmap(url, storage_options=s3_options, chunk_bytes=3000), tree)
    part = memtree.load_memmap(url, storage_options=s3_options, keys=[("nested", "w")],
                               cache_dir=str(tmp_path / "c"))
    assert part["nested", "w"].filename is not None
    assert torch.equal(part["nested", "w"], tree["nested", "w"])


def test_s3_without_root_marker_is_not_committed(s3_options):
    url = "s3://memtree-bucket/uncommitted"
    upload(sample_tree(), url, storage_options=s3_options)
    fsspec.filesystem("s3", **s3_options).rm_file("memtree-bucket/uncommitted/meta.json")
    with pytest.raises(memtree.NotCommittedError):
        memtree.load_memmap(url, storage_options=s3_options)


def test_s3_leaf_shorter_than_meta_is_refused(s3_options):
    url = "s3://memtree-bucket/short"
    upload(sample_tree(), url, storage_options=s3_options, checksum=None)
    fs = fsspec.filesystem("s3", **s3_options)
    fs.pipe_file("memtree-bucket/short/f32.memmap", fs.cat("memtree-bucket/short/f32.memmap")[:-8])
    with pytest.raises(memtree.LeafSizeError):
        memtree.load_memmap(url, storage_options=s3_options)


def test_s3_second_writer_cannot_clobber_a_commit(s3_options):
    from memtree.store.urls.remote import commit_root
    from memtree.store.urls.fsspec_storage import FsspecStorage

    url = "s3://memtree-bucket/conflict"
    upload(TensorTree({"a": torch.ones(1)}), url, storage_options=s3_options)
    with pytest.raises(memtree.DestinationExistsError, match="another writer"):
        commit_root(FsspecStorage(url, storage_options=s3_options, retries=0), b"{}")
    assert memtree.load_memmap(url, storage_options=s3_options)["a"].tolist() == [1.0]


def test_concurrent_requests_overlap_on_a_latency_bound_server(server, tmp_path):
    """RELIABILITY §8c.4: on a latency-bound server, num_threads=8 keeps several requests in
    flight at once and num_threads=1 one at a time. (Asserted on the server's count of requests
    answered at once, not on wall time: the speed-up is a benchmark's claim, and a timed
    assertion failed once on this 2-core machine at load 7.)"""
    server.reset()
    server.files.clear()
    tree = TensorTree({f"x{i}": torch.full((16384,), float(i)) for i in range(32)})  # 32 x 64 KiB
    tree.memmap(str(tmp_path / "src"))
    server.publish(str(tmp_path / "src"), "c")
    in_flight = {}
    for threads, latency in ((1, 0.02), (8, 0.2)):  # 0.2 s: 8 threads' requests overlap even under load
        server.latency = latency
        server.max_in_flight = 0
        loaded = memtree.load_memmap(f"{server.url}/c", num_threads=threads)
        in_flight[threads] = server.max_in_flight
        assert_bit_exact(loaded, tree)
    assert in_flight[1] == 1 and in_flight[8] >= 4, in_flight
