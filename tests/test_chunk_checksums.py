"""Per-chunk checksums (format version 3, issue 25): a leaf larger than one chunk records the
checksum of each chunk; writers hash the chunks in parallel; readers check each chunk, a ranged
check reads only the chunks that cover its range.

Most tests shrink the chunk size to the format's smallest (64 KiB) so that leaves of a few hundred
KiB have several chunks.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import orjson
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memtree
import memtree.format.chunks as chunks_mod
from memtree.format.chunks import ChunkSums, chunk_bytes_for, chunk_count, chunk_span, chunks_covering
from memtree.format.schema import parse_level
from memtree.store.primitives import checksums
from memtree.store.primitives.checksums import available_checksums, view_sums
from memtree.store.primitives.chunk_check import check_range, file_reader, read_range
from memtree.store.primitives.files import FileRange
from memtree.store.primitives.fill import FillJob, fill

KIB = 1024
CHUNK = 64 * KIB


@pytest.fixture
def small_chunks(monkeypatch):
    """Writers record 64 KiB chunks (the format's smallest)."""
    monkeypatch.setattr(chunks_mod, "CHUNK_BYTES", CHUNK)
    return CHUNK


def data_of(nbytes: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def raw_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def meta_of(path: Path) -> dict:
    return orjson.loads((path / "meta.json").read_bytes())


def entry_of(path: Path, key: str) -> dict:
    return next(e for e in meta_of(path)["entries"] if e["key"] == key)


def flip_bit(path: Path, offset: int, bit: int = 0) -> None:
    st_before = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))
    os.utime(path, ns=(st_before.st_atime_ns, st_before.st_mtime_ns))  # damage, not a write in place


class CountingReader:
    """A chunk_check reader of a file that counts the bytes it reads."""

    def __init__(self, fd: int) -> None:
        self.read = file_reader(fd, "leaf")
        self.bytes = 0

    def __call__(self, offset: int, view: memoryview) -> None:
        self.bytes += len(view)
        self.read(offset, view)


# -- what is written ------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", available_checksums())
def test_a_leaf_larger_than_a_chunk_records_each_chunks_checksum(tmp_path, small_chunks, algorithm):
    big, small = data_of(3 * CHUNK + 5), data_of(CHUNK, seed=1)
    memtree.TensorTree({"big": big, "small": small}).memmap(tmp_path / "t", checksum=algorithm)
    doc = meta_of(tmp_path / "t")
    assert doc["version"] == 3
    entry = entry_of(tmp_path / "t", "big")
    assert "checksum" not in entry
    assert entry["chunks"] == {
        "algorithm": algorithm,
        "chunk_bytes": CHUNK,
        "digests": view_sums(raw_bytes(big), algorithm, CHUNK).digests,
    }
    for i in range(4):  # each digest is the chunk's own checksum
        a, b = chunk_span(i, big.numel(), CHUNK)
        assert ChunkSums(algorithm, CHUNK, entry["chunks"]["digests"]).digest(i) == checksums.tensor_checksum(big[a:b], algorithm)
    assert entry_of(tmp_path / "t", "small")["checksum"] == checksums.tensor_checksum(small, algorithm)  # one chunk


def test_only_levels_holding_chunked_leaves_are_version_3(tmp_path, small_chunks):
    tree = memtree.TensorTree({"a": {"big": data_of(2 * CHUNK + 1)}, "b": {"x": torch.ones(3)}, "c": torch.ones(2)})
    tree.memmap(tmp_path / "t")
    assert meta_of(tmp_path / "t")["version"] == 2
    assert meta_of(tmp_path / "t" / "a")["version"] == 3
    assert meta_of(tmp_path / "t" / "b")["version"] == 2
    memtree.TensorTree({"x": data_of(2 * CHUNK + 1)}).memmap(tmp_path / "u", checksum=None)
    assert meta_of(tmp_path / "u")["version"] == 2  # no checksum, no chunks


def test_default_chunk_size_is_4_mib_and_grows_for_huge_leaves():
    assert chunk_bytes_for(4 << 20) is None and chunk_bytes_for((4 << 20) + 1) == 4 << 20
    assert chunk_count(1 << 44, chunk_bytes_for(1 << 44)) <= chunks_mod.MAX_CHUNKS  # 16 TiB


@pytest.mark.parametrize("num_threads", [0, 2, 3])
def test_every_writer_records_the_same_chunks(tmp_path, small_chunks, num_threads, monkeypatch):
    monkeypatch.setattr("memtree.store.writing.write.THREAD_MIN_WORK", 1)  # threads even for small trees
    tree = memtree.TensorTree({"a": data_of(7 * CHUNK + 3), "b": data_of(2 * CHUNK, 1), "c": torch.arange(10)})
    tree.memmap(tmp_path / "t", num_threads=num_threads, checksum="crc32")
    for key in ("a", "b"):
        assert entry_of(tmp_path / "t", key)["chunks"]["digests"] == view_sums(raw_bytes(tree[key]), "crc32", CHUNK).digests
    loaded = memtree.load_memmap(tmp_path / "t", verify=True)
    assert all(torch.equal(loaded[k], tree[k]) for k in ("a", "b", "c"))


def test_a_large_leaf_is_shared_by_the_writer_threads(tmp_path, small_chunks, monkeypatch):
    """One leaf of 16 chunks with 2 threads: both threads write (and hash) pieces of it."""
    import memtree.store.writing.pieces as pieces

    monkeypatch.setattr("memtree.store.writing.write.THREAD_MIN_WORK", 1)
    seen: set[str] = set()
    real = pieces.write_view

    def spy(fd, view, offset, digest=None):
        seen.add(threading.current_thread().name)
        threading.Event().wait(0.001)  # a piece takes a moment: the other thread takes the next
        return real(fd, view, offset, digest)

    monkeypatch.setattr(pieces, "write_view", spy)
    tree = memtree.TensorTree({"w": data_of(16 * CHUNK)})
    tree.memmap(tmp_path / "t", num_threads=2, checksum="crc32")
    assert seen == {"memtree-write-0", "memtree-write-1"}
    assert memtree.verify_tree(tmp_path / "t").ok


def test_without_threads_a_hashing_thread_hashes_while_the_caller_writes(tmp_path, small_chunks, monkeypatch):
    import memtree.store.writing.pieces as pieces

    hashed_in: set[str] = set()
    real = checksums._factories()["crc32"]

    class Spy:
        def __init__(self) -> None:
            self.d = real()

        def update(self, data) -> None:
            if len(memoryview(data)) == CHUNK:  # a chunk of the leaf (not a meta.json of the tree hash)
                hashed_in.add(threading.current_thread().name)
            self.d.update(data)

        def hexdigest(self) -> str:
            return self.d.hexdigest()

    monkeypatch.setitem(checksums._factories(), "crc32", Spy)
    monkeypatch.setattr("memtree.store.writing.write.THREAD_MIN_WORK", 1)
    tree = memtree.TensorTree({"w": data_of(8 * CHUNK)})
    tree.memmap(tmp_path / "t", checksum="crc32")
    assert "memtree-hash" in hashed_in and threading.current_thread().name not in hashed_in
    assert not any(t.name == "memtree-hash" for t in threading.enumerate())  # stopped
    assert pieces.HASH_AHEAD >= 1 and memtree.verify_tree(tmp_path / "t").ok


@pytest.mark.parametrize("where", ["write", "hash"])
@pytest.mark.parametrize("num_threads", [0, 2])
def test_a_failure_in_a_piece_leaves_the_destination_unchanged(tmp_path, small_chunks, monkeypatch, where, num_threads):
    import memtree.store.writing.pieces as pieces

    monkeypatch.setattr("memtree.store.writing.write.THREAD_MIN_WORK", 1)
    old = memtree.TensorTree({"w": torch.ones(3)})
    old.memmap(tmp_path / "t")
    calls = {"n": 0}
    lock = threading.Lock()

    def failing(*a, **kw):
        with lock:
            calls["n"] += 1
            n = calls["n"]
        if n == 3:
            raise OSError(5, "injected")
        return real(*a, **kw)

    if where == "write":
        real = pieces.write_view
        monkeypatch.setattr(pieces, "write_view", failing)
        expected = memtree.StorageError
    else:
        real_factory = checksums._factories()["crc32"]

        class Failing:
            def __init__(self) -> None:
                self.d = real_factory()

            def update(self, data) -> None:
                with lock:
                    calls["n"] += 1
                    n = calls["n"]
                if n == 3:
                    raise RuntimeError("injected")
                self.d.update(data)

            def hexdigest(self) -> str:
                return self.d.hexdigest()

        monkeypatch.setitem(checksums._factories(), "crc32", Failing)
        expected = RuntimeError
    with pytest.raises(expected, match="injected"):
        memtree.TensorTree({"w": data_of(10 * CHUNK)}).memmap(tmp_path / "t", num_threads=num_threads, checksum="crc32")
    assert os.listdir(tmp_path) == ["t"]  # the staging directory is gone, the lock released
    assert memtree.load_memmap(tmp_path / "t")["w"].tolist() == [1.0, 1.0, 1.0]
    assert not any(t.name.startswith(("memtree-write-", "memtree-hash")) for t in threading.enumerate())


def test_a_file_range_leaf_is_copied_and_hashed_in_pieces(tmp_path, small_chunks):
    from memtree.format.level import Level
    from memtree.store.reading.options import WriteOptions
    from memtree.store.writing.write import write_tree

    data = data_of(5 * CHUNK + 7)
    src = tmp_path / "src.bin"
    src.write_bytes(b"xyz" + bytes(raw_bytes(data)))
    fd = os.open(src, os.O_RDONLY)

    class Ranged(torch.Tensor):  # a lazy leaf whose bytes lie in a file (as a checkpoint's tensor)
        pass

    leaf = torch.empty(data.numel(), dtype=torch.uint8).as_subclass(Ranged)
    leaf.file_range = lambda: FileRange(fd, 3, data.numel(), "the source")  # type: ignore[attr-defined]
    try:
        write_tree(tmp_path / "t", Level((), {"x": leaf}), WriteOptions.of(checksum="crc32", num_threads=2))
    finally:
        os.close(fd)
    assert entry_of(tmp_path / "t", "x")["chunks"]["digests"] == view_sums(raw_bytes(data), "crc32", CHUNK).digests
    assert torch.equal(memtree.load_memmap(tmp_path / "t", verify=True)["x"], data)


# -- what is read ---------------------------------------------------------------------------


@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    nbytes=st.integers(CHUNK + 1, 9 * CHUNK),
    log_chunk=st.integers(16, 18),
    flip=st.floats(0, 1, exclude_max=True),
    bit=st.integers(0, 7),
    data=st.data(),
)
def test_any_flipped_bit_is_found_in_its_chunk_and_only_there(tmp_path_factory, monkeypatch, nbytes, log_chunk, flip, bit, data):
    """Any leaf size and chunk size: a flipped bit fails every check of its chunk, names the
    chunk, and a ranged check of bytes outside it passes reading only the chunks of its range."""
    size = 1 << log_chunk
    monkeypatch.setattr(chunks_mod, "CHUNK_BYTES", size)
    tmp = tmp_path_factory.mktemp("flip")
    tree = memtree.TensorTree({"x": data_of(nbytes, seed=nbytes)})
    tree.memmap(tmp / "t", checksum="crc32")
    entry = parse_level((tmp / "t" / "meta.json").read_bytes(), "meta.json").entries[0]
    count = chunk_count(nbytes, size) if nbytes > size else 1
    assert (entry.chunks.count if entry.chunks else 1) == count
    where = int(flip * nbytes)
    bad_chunk = where // size
    flip_bit(tmp / "t" / "x.memmap", where, bit)
    if count > 1:
        with pytest.raises(memtree.IntegrityError, match=rf"for chunk {bad_chunk} of {count} "):
            memtree.load_memmap(tmp / "t", verify=True)["x"]
    else:
        with pytest.raises(memtree.IntegrityError, match="is damaged"):
            memtree.load_memmap(tmp / "t", verify=True)["x"]
    with pytest.raises(memtree.IntegrityError):
        memtree.load_memmap(tmp / "t", verify=True, mmap=False)["x"]
    problems = memtree.verify_tree(tmp / "t").problems
    assert [p.kind for p in problems] == ["checksum"]
    start = data.draw(st.integers(0, nbytes))
    stop = data.draw(st.integers(start, nbytes))
    fd = os.open(tmp / "t" / "x.memmap", os.O_RDONLY)
    try:
        reader = CountingReader(fd)
        covering = list(chunks_covering(start, stop, nbytes, size if count > 1 else nbytes))
        if bad_chunk in covering and count > 1 or (count == 1 and start < stop):
            with pytest.raises(memtree.IntegrityError, match="is damaged"):
                check_range(reader, entry, start, stop, "x")
        else:
            assert check_range(reader, entry, start, stop, "x") == reader.bytes
            assert reader.bytes == sum(b - a for a, b in (chunk_span(k, nbytes, size) for k in covering))
    finally:
        os.close(fd)


def test_read_range_reads_the_covering_chunks_once(tmp_path, small_chunks):
    data = data_of(6 * CHUNK + 100)
    memtree.TensorTree({"x": data}).memmap(tmp_path / "t", checksum="crc32")
    entry = parse_level((tmp_path / "t" / "meta.json").read_bytes(), "meta.json").entries[0]
    fd = os.open(tmp_path / "t" / "x.memmap", os.O_RDONLY)
    try:
        for start, stop in [(0, 1), (CHUNK - 1, 3 * CHUNK + 1), (CHUNK, 3 * CHUNK), (6 * CHUNK, 6 * CHUNK + 100), (5, 5)]:
            out = bytearray(stop - start)
            reader = CountingReader(fd)
            got = read_range(reader, entry, start, stop, memoryview(out), "x")
            assert bytes(out) == bytes(raw_bytes(data)[start:stop])
            want = sum(b - a for a, b in (chunk_span(k, data.numel(), CHUNK) for k in chunks_covering(start, stop, data.numel(), CHUNK)))
            assert got == reader.bytes == want
        with pytest.raises(memtree.InvalidArgumentError, match="not within"):
            read_range(file_reader(fd, "x"), entry, 0, 7 * CHUNK, memoryview(bytearray(7 * CHUNK)), "x")
        for start, stop in [(-1, 5), (5, 4), (0, data.numel() + 1)]:
            with pytest.raises(memtree.InvalidArgumentError, match=r"x: bytes .* not within .* 0 <= start <= stop"):
                check_range(file_reader(fd, "x"), entry, start, stop, "x")
    finally:
        os.close(fd)


def test_ranged_check_refuses_a_leaf_without_checksums(tmp_path):
    memtree.TensorTree({"x": torch.ones(4)}).memmap(tmp_path / "t", checksum=None)
    entry = parse_level((tmp_path / "t" / "meta.json").read_bytes(), "meta.json").entries[0]
    with pytest.raises(memtree.InvalidArgumentError, match="records no checksum"):
        check_range(lambda o, v: None, entry, 0, 4, "x")


@pytest.mark.parametrize("read_chunk", [5 * KIB, 100 * KIB, 16 * 1024 * KIB])
@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_fill_checks_chunks_whatever_its_pieces(tmp_path, small_chunks, monkeypatch, read_chunk, staged):
    """A fill's pieces may cut chunks (a read size that is no multiple of the chunk, a cast's ring
    buffer): every chunk is still checked once, from the destination or the file."""
    import memtree.store.primitives.fill as fill_mod

    monkeypatch.setattr(fill_mod, "READ_CHUNK", read_chunk)
    data = data_of(5 * CHUNK + 12, seed=3)
    memtree.TensorTree({"x": data}).memmap(tmp_path / "t", checksum="crc32")
    sums = view_sums(raw_bytes(data), "crc32", CHUNK)
    path = tmp_path / "t" / "x.memmap"
    for damaged in (False, True):
        if damaged:
            flip_bit(path, 3 * CHUNK + 17)
        found: list[dict[int, str]] = []
        dest = torch.zeros(data.numel(), dtype=torch.int16 if staged else torch.uint8)
        fd = os.open(path, os.O_RDONLY)
        try:
            job = FillJob(dest, FileRange(fd, 0, data.numel(), "x"), torch.uint8 if staged else None, (sums, found.append))
            fill([job], num_threads=2, ring_bytes=read_chunk if staged else None)
        finally:
            os.close(fd)
        assert len(found) == 1 and sorted(found[0]) == list(range(sums.count))
        differ = [k for k, d in found[0].items() if d != sums.digest(k).partition(":")[2]]
        assert differ == ([3] if damaged else [])


def test_checkpointer_restore_checks_chunks(tmp_path, small_chunks):
    ckpt = memtree.Checkpointer(tmp_path / "ckpt")
    state = {"w": torch.randn(5 * CHUNK // 4)}
    ckpt.save(1, state)
    step = tmp_path / "ckpt" / "1"
    leaf = next(step.rglob("w.memmap"))
    assert "chunks" in orjson.loads((leaf.parent / "meta.json").read_bytes())["entries"][0]
    assert torch.equal(ckpt.restore(1)["w"], state["w"])
    flip_bit(leaf, 2 * CHUNK + 1)
    with pytest.raises(memtree.IntegrityError, match="for chunk 2 of 5"):
        ckpt.restore(1)


# -- incremental saves, diff, growth, remote -------------------------------------------------


def test_link_from_links_chunked_leaves_and_writes_changed_ones(tmp_path, small_chunks):
    from memtree.store.writing.linking import WriteStats
    from memtree.store.reading.options import WriteOptions
    from memtree.store.writing.write import write_tree

    a, b = data_of(4 * CHUNK + 9), data_of(3 * CHUNK, seed=2)
    memtree.TensorTree({"a": a, "b": b}).memmap(tmp_path / "1")
    b2 = b.clone()
    b2[2 * CHUNK] ^= 1  # one chunk changed
    stats = WriteStats()
    write_tree(tmp_path / "2", memtree.TensorTree({"a": a, "b": b2}), WriteOptions.of(link_from=tmp_path / "1"), stats=stats)
    assert (stats.files_linked, stats.files_written) == (1, 1)
    assert os.stat(tmp_path / "2" / "a.memmap").st_ino == os.stat(tmp_path / "1" / "a.memmap").st_ino
    assert entry_of(tmp_path / "2", "a")["chunks"] == entry_of(tmp_path / "1", "a")["chunks"]
    assert memtree.verify_tree(tmp_path / "2").ok


def test_link_from_a_version_2_tree_compares_in_its_whole_leaf_checksum(tmp_path, small_chunks, monkeypatch):
    """A previous step written before per-chunk checksums (one checksum per leaf) still links."""
    a, b = data_of(4 * CHUNK + 9), data_of(3 * CHUNK, seed=2)
    monkeypatch.setattr(chunks_mod, "CHUNK_BYTES", 1 << 30)  # as version 2 wrote: one checksum
    memtree.TensorTree({"a": a, "b": b}).memmap(tmp_path / "1")
    assert "checksum" in entry_of(tmp_path / "1", "a")
    monkeypatch.setattr(chunks_mod, "CHUNK_BYTES", CHUNK)
    from memtree.store.writing.linking import WriteStats
    from memtree.store.reading.options import WriteOptions
    from memtree.store.writing.write import write_tree

    stats = WriteStats()
    b2 = b.clone()
    b2[0] ^= 1
    write_tree(tmp_path / "2", memtree.TensorTree({"a": a, "b": b2}), WriteOptions.of(link_from=tmp_path / "1"), stats=stats)
    assert (stats.files_linked, stats.files_written) == (1, 1)
    assert entry_of(tmp_path / "2", "a")["checksum"] == entry_of(tmp_path / "1", "a")["checksum"]  # the linked file's
    assert "chunks" in entry_of(tmp_path / "2", "b")  # written anew: this write's chunks
    assert memtree.verify_tree(tmp_path / "2").ok


def test_diff_compares_chunks_without_reading_and_names_the_chunk(tmp_path, small_chunks):
    from memtree.cli.diff import diff_trees

    a = data_of(4 * CHUNK)
    b = a.clone()
    b[3 * CHUNK + 1] ^= 1
    memtree.TensorTree({"w": a}).memmap(tmp_path / "a")
    memtree.TensorTree({"w": b}).memmap(tmp_path / "b")
    memtree.TensorTree({"w": a}).memmap(tmp_path / "c", checksum=None)
    report = diff_trees(str(tmp_path / "a"), str(tmp_path / "b"))
    assert report.bytes_read == 0 and report.changed[0]["a"].endswith("(chunk 3 of 4)")
    report = diff_trees(str(tmp_path / "a"), str(tmp_path / "c"))
    assert report.identical and report.bytes_read == 4 * CHUNK  # the side without checksums hashed in a's chunks


def test_growth_drops_chunks(tmp_path, small_chunks):
    tree = memtree.TensorTree({"x": torch.zeros(3 * CHUNK // 8, 2, dtype=torch.float32)}, batch_size=[3 * CHUNK // 8])
    out = tree.memmap(tmp_path / "t")
    assert "chunks" in entry_of(tmp_path / "t", "x")
    out.extend_(memtree.TensorTree({"x": torch.ones(1, 2)}, batch_size=[1]))
    entry = entry_of(tmp_path / "t", "x")
    assert "chunks" not in entry and "checksum" not in entry
    assert memtree.verify_tree(tmp_path / "t").ok
    assert memtree.load_memmap(tmp_path / "t")["x"][-1].tolist() == [1.0, 1.0]


def test_remote_upload_records_chunks_and_load_checks_them(tmp_path, small_chunks):
    fsspec = pytest.importorskip("fsspec")
    import memtree.remote

    data = data_of(3 * CHUNK + 1)
    url = f"memory://memtree-tests/{tmp_path.name}"
    fs = fsspec.filesystem("memory")
    try:
        memtree.remote.upload(memtree.TensorTree({"x": data}), url)
        chunks = orjson.loads(fs.cat(f"{url}/meta.json"))["entries"][0]["chunks"]
        assert chunks["chunk_bytes"] == CHUNK and chunks["digests"] == view_sums(raw_bytes(data), "crc32", CHUNK).digests
        cached = memtree.load_memmap(url, cache_dir=str(tmp_path / "cache"), verify=True)
        assert torch.equal(cached["x"], data)
        entry = next((tmp_path / "cache").glob("*/meta.json"))
        assert orjson.loads(entry.read_bytes())["entries"][0]["chunks"] == chunks  # the cache keeps them
        damaged = bytearray(fs.cat(f"{url}/x.memmap"))
        damaged[2 * CHUNK] ^= 1
        fs.pipe_file(f"{url}/x.memmap", bytes(damaged))
        with pytest.raises(memtree.IntegrityError, match="for chunk 2 of 4"):
            memtree.load_memmap(url)
    finally:
        if fs.exists(url):
            fs.rm(url, recursive=True)


# -- hostile and older files -------------------------------------------------------------------


def _doc(chunks: object, *, version: int = 3, nbytes: int = 3 * CHUNK, checksum: str | None = None) -> bytes:
    entry: dict = {"key": "x", "kind": "tensor", "file": "x.memmap", "dtype": "uint8", "shape": [nbytes]}
    if checksum is not None:
        entry["checksum"] = checksum
    entry["chunks"] = chunks
    return orjson.dumps({"format": "memtree", "version": version, "type": "TensorTree", "byteorder": "little",
                         "batch_size": [], "entries": [entry]})


GOOD = {"algorithm": "crc32", "chunk_bytes": CHUNK, "digests": "0" * 24}


@pytest.mark.parametrize(
    "chunks, message",
    [
        ({**GOOD, "digests": "0" * 16}, r"chunks.digests must be 24 lowercase hex digits"),
        ({**GOOD, "digests": "0" * 23 + "G"}, r"chunks.digests must be 24 lowercase hex"),
        ({**GOOD, "digests": "0" * 23 + "A"}, r"chunks.digests must be 24 lowercase hex"),
        ({**GOOD, "digests": 5}, r"chunks.digests"),
        ({**GOOD, "chunk_bytes": CHUNK + 1}, r"chunks.chunk_bytes must be a power of two"),
        ({**GOOD, "chunk_bytes": 4096}, r"chunks.chunk_bytes must be a power of two"),
        ({**GOOD, "chunk_bytes": 1 << 31}, r"chunks.chunk_bytes must be a power of two"),
        ({**GOOD, "chunk_bytes": True}, r"chunks.chunk_bytes"),
        ({**GOOD, "chunk_bytes": 4 * CHUNK, "digests": "0" * 8}, r"a leaf of one chunk records 'checksum'"),
        ({**GOOD, "algorithm": "md5"}, r"chunks.algorithm must be one of"),
        ({**GOOD, "extra": 1}, r"chunks must have exactly the fields"),
        ({"algorithm": "crc32", "chunk_bytes": CHUNK}, r"chunks must have exactly the fields"),
        ([1, 2], r"chunks must be a JSON object"),
    ],
)
def test_hostile_chunks_are_refused_naming_the_field(chunks, message):
    with pytest.raises(memtree.MetaFormatError, match=message):
        parse_level(_doc(chunks), "t/meta.json")


def test_chunks_in_a_version_2_level_or_next_to_a_checksum_are_refused():
    parse_level(_doc(GOOD), "meta.json")  # well-formed
    with pytest.raises(memtree.MetaFormatError, match="only a version 3 level has"):
        parse_level(_doc(GOOD, version=2), "meta.json")
    with pytest.raises(memtree.MetaFormatError, match="records both checksum and chunks"):
        parse_level(_doc(GOOD, checksum="crc32:00000000"), "meta.json")


def test_a_huge_digest_list_costs_its_bytes_only():
    """A leaf of 2**62 bytes in 64 KiB chunks would need 2**46 digests: refused by their count,
    without building anything that large."""
    with pytest.raises(memtree.MetaFormatError, match="lowercase hex digits"):
        parse_level(_doc(GOOD, nbytes=2**62), "meta.json")


def test_an_older_reader_sees_version_3(tmp_path, small_chunks, monkeypatch):
    """A reader of versions 1 and 2 refuses the level holding per-chunk checksums, by its version."""
    import memtree.format.schema as schema

    memtree.TensorTree({"a": {"x": data_of(2 * CHUNK + 1)}, "b": torch.ones(2)}).memmap(tmp_path / "t")
    monkeypatch.setattr(schema, "READ_VERSIONS", (1, 2))
    parse_level((tmp_path / "t" / "meta.json").read_bytes(), "meta.json")  # the root needs nothing new
    with pytest.raises(memtree.UnsupportedVersionError, match="format version 3 is not supported"):
        parse_level((tmp_path / "t" / "a" / "meta.json").read_bytes(), "a/meta.json")
