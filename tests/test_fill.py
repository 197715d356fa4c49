"""store/primitives/fill.py: threaded preadv fills of existing tensors, the staging ring and its failures.

The device copy of the ring is abstracted (a :class:`~memtree.store.primitives.fill.Copier`): here a fake
copier that copies only when its copy is waited for (as an asynchronous device copy would
finish later), so a buffer handed back to the readers before its copy was waited for shows
up as wrong bytes; it also counts buffers, bytes held and releases.
"""

from __future__ import annotations

import errno
import os
import threading
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memtree.store.primitives.fill as fill_mod
from memtree import IntegrityError, InvalidArgumentError, StorageError
from memtree.store.primitives.files import FileRange
from memtree.store.primitives.fill import FillJob, fill, mapped_range, read_exact

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int64,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex64,
]


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def sample(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Bit patterns any dtype holds (bool: 0/1 only)."""
    n = 1
    for d in shape:
        n *= d
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return (torch.randint(0, 2, (n,), generator=g) == 1).reshape(shape)
    size = torch.empty((), dtype=dtype).element_size()
    bits = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    out = bits.view(dtype).reshape(shape)
    if dtype.is_floating_point or dtype.is_complex:  # no NaN payloads: equal() must hold
        out = torch.nan_to_num(out) if dtype.itemsize > 1 else out
    return out.clone()


@pytest.fixture
def threaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads and many pieces even for small tensors."""
    monkeypatch.setattr(fill_mod, "READ_MIN_WORK", 1)
    monkeypatch.setattr(fill_mod, "READ_CHUNK", 64)


def write_file(tmp_path: Any, name: str, parts: list[bytes], pad: int = 0) -> tuple[str, list[int]]:
    path = os.path.join(str(tmp_path), name)
    offsets, pos = [], pad
    with open(path, "wb") as f:
        f.write(b"\xee" * pad)
        for p in parts:
            offsets.append(pos)
            f.write(p)
            pos += len(p)
        f.write(b"\xee" * 7)  # bytes after the last range are never read
    return path, offsets


class FakeCopier:
    """Copies when the copy is waited for; records the ring's use."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at
        self.copies = 0
        self.live: dict[int, int] = {}
        self.most = 0
        self.released = 0
        self.allocated = 0
        self.lock = threading.Lock()

    def buffers(self, nbytes: int, count: int) -> list[torch.Tensor]:
        bufs = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(count)]
        with self.lock:
            for buf in bufs:
                self.live[buf.data_ptr()] = nbytes
            self.allocated += count
            self.most = max(self.most, sum(self.live.values()))
        return bufs

    def release(self, buffers: list[torch.Tensor], reuse: bool) -> None:
        with self.lock:
            for buf in buffers:
                del self.live[buf.data_ptr()]
                self.released += 1

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        self.copies += 1
        if self.fail_at is not None and self.copies == self.fail_at:
            raise RuntimeError("device copy failed")
        return (dst, src)

    def wait(self, token: Any) -> None:
        dst, src = token
        dst.copy_(src)


def no_reader_threads() -> bool:
    return not any(t.name.startswith("memtree-read") for t in threading.enumerate())


def fail_preadv_at(monkeypatch: pytest.MonkeyPatch, n: int) -> dict[str, int]:
    """Make the ``n``-th ``os.preadv`` (counted over every thread) raise ``EIO``. Returns the
    counter: set ``counter["n"]`` far below ``n`` to stop failing."""
    real = os.preadv
    calls = {"n": 0}
    lock = threading.Lock()

    def failing(fd: int, buffers: Any, offset: int) -> int:
        with lock:
            calls["n"] += 1
            hit = calls["n"] == n
        if hit:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", failing)
    return calls


# -- direct fills ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_direct_fill_is_bit_exact_for_every_dtype(tmp_path: Any, threaded: None, dtype: torch.dtype) -> None:
    srcs = [sample((37, 5), dtype, 1), sample((0,), dtype, 2), sample((), dtype, 3), sample((1000,), dtype, 4)]
    path, offsets = write_file(tmp_path, "f", [raw(s) for s in srcs], pad=3)
    fd = os.open(path, os.O_RDONLY)
    try:
        dests = [torch.zeros_like(s) for s in srcs]
        fill([FillJob(d, FileRange(fd, o, d.numel() * d.element_size(), f"t{i}")) for i, (d, o) in enumerate(zip(dests, offsets))])
    finally:
        os.close(fd)
    assert [raw(d) for d in dests] == [raw(s) for s in srcs]


def test_fill_reads_into_the_destinations_own_memory(tmp_path: Any) -> None:
    src = torch.arange(4096, dtype=torch.float32)
    path, (off,) = write_file(tmp_path, "f", [raw(src)])
    dest = torch.zeros(64, 64)
    ptr = dest.data_ptr()
    fd = os.open(path, os.O_RDONLY)
    fill([FillJob(dest, FileRange(fd, off, src.nbytes, "w"))])
    os.close(fd)
    assert dest.data_ptr() == ptr and torch.equal(dest.reshape(-1), src)


Case = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def mixed_cases(shapes: list[list[int]], dtypes: list[torch.dtype], cast: list[bool], strided: list[bool]) -> list[Case]:
    """``(source, zeroed destination, what it must hold once filled)`` per shape: floating
    sources cast to float64 where ``cast``, 2-d destinations transposed where ``strided``."""
    cases = []
    for i, shape in enumerate(shapes):
        s = sample(tuple(shape), dtypes[i], i)
        to = torch.float64 if cast[i] and s.is_floating_point() else s.dtype
        if strided[i] and s.dim() == 2:
            d = torch.zeros(tuple(reversed(s.shape)), dtype=to).transpose(0, -1)
        else:
            d = torch.zeros(s.shape, dtype=to)
        cases.append((s, d, s.to(to)))
    return cases


#: Sources of any shape and dtype, cast or not, into contiguous or strided destinations.
MIXED = st.builds(
    mixed_cases,
    shapes=st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=3), min_size=1, max_size=5),
    dtypes=st.lists(st.sampled_from(DTYPES), min_size=5, max_size=5),
    cast=st.lists(st.booleans(), min_size=5, max_size=5),
    strided=st.lists(st.booleans(), min_size=5, max_size=5),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    cases=MIXED,
    threads=st.sampled_from([0, 1, 2, 4]),
    chunk=st.sampled_from([1, 3, 16, 1 << 20]),
    ring=st.sampled_from([2, 40, 1 << 20]),
    short=st.integers(0, 7),
)
def test_property_any_mix_of_jobs_fills_bit_exact(
    tmp_path_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
    cases: list[Case],
    threads: int,
    chunk: int,
    ring: int,
    short: int,
) -> None:
    """Direct, cast and strided destinations together, any thread count, piece size, ring
    size, and preadv returning at most ``short`` bytes (0: whole reads): the destinations hold
    exactly the source (cast as ``copy_`` casts), and nothing is left behind."""
    tmp = tmp_path_factory.mktemp("prop")
    monkeypatch.setattr(fill_mod, "READ_MIN_WORK", 1)
    monkeypatch.setattr(fill_mod, "READ_CHUNK", chunk)
    if short:
        real = os.preadv

        def shorter(fd: int, buffers: list[Any], offset: int) -> int:
            return real(fd, [memoryview(buffers[0])[:short]], offset)

        monkeypatch.setattr(os, "preadv", shorter)
    srcs, dests, wants = (list(x) for x in zip(*cases))
    path, offsets = write_file(tmp, "f", [raw(s) for s in srcs], pad=5)
    fake = FakeCopier()
    fd = os.open(path, os.O_RDONLY)
    try:
        fill(
            [FillJob(d, FileRange(fd, o, s.nbytes, f"t{i}"), s.dtype if s.dtype != d.dtype else None)
             for i, (d, s, o) in enumerate(zip(dests, srcs, offsets))],
            num_threads=threads,
            copier=lambda _dev: fake,
            ring_bytes=ring,
        )
    finally:
        os.close(fd)
    for d, w in zip(dests, wants):
        assert raw(d) == raw(w)
    assert fake.live == {} and fake.released == fake.allocated
    assert fake.most <= max(ring, 2 * 16)  # at least two buffers of the widest element
    assert no_reader_threads()


@settings(max_examples=60, deadline=None)
@given(
    count=st.integers(0, 40),
    threads=st.sampled_from([0, 1, 2, 4]),
    fail_work=st.one_of(st.none(), st.integers(0, 39)),
    fail_make=st.one_of(st.none(), st.integers(0, 39)),
)
def test_property_threads_take_items_from_a_generator_once_each(
    count: int, threads: int, fail_work: int | None, fail_make: int | None
) -> None:
    """``_run`` feeds the threads from a generator (the jobs' pieces are made as the threads
    ask for them): every item is worked on exactly once; a failure in the work or in making
    an item is raised, after which no item is taken and no thread is left."""
    done: list[int] = []
    lock = threading.Lock()

    def make() -> Any:
        for i in range(count):
            if i == fail_make:
                raise RuntimeError("making item failed")
            yield i

    def work(i: int) -> int:
        if i == fail_work:
            raise RuntimeError("work failed")
        with lock:
            done.append(i)
        return 1

    fails = [x for x in (fail_work, fail_make) if x is not None and x < count]
    if fails:
        with pytest.raises(RuntimeError, match="failed"):
            fill_mod._run(make(), work, threads)
        assert len(done) == len(set(done)) and min(fails) not in done
        if threads <= 1:  # one taker: exactly the items before the failure
            assert done == list(range(min(fails)))
    else:
        fill_mod._run(make(), work, threads)
        assert sorted(done) == list(range(count))
    assert no_reader_threads()


# -- short reads, EOF, files that change ----------------------------------------------------------
def test_read_exact_continues_short_reads(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = write_file(tmp_path, "f", [bytes(range(200))])
    calls = []
    real = os.preadv

    def one_byte(fd: int, buffers: list[Any], offset: int) -> int:
        calls.append(offset)
        return real(fd, [memoryview(buffers[0])[:1]], offset)

    monkeypatch.setattr(os, "preadv", one_byte)
    fd = os.open(path, os.O_RDONLY)
    buf = bytearray(50)
    read_exact(fd, memoryview(buf), 10, "x")
    os.close(fd)
    assert bytes(buf) == bytes(range(10, 60)) and len(calls) == 50


def test_eintr_is_retried_and_other_errors_name_the_tensor(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = write_file(tmp_path, "f", [bytes(range(64))])
    real = os.preadv
    state = {"n": 0}

    def flaky(fd: int, buffers: list[Any], offset: int) -> int:
        state["n"] += 1
        if state["n"] == 1:  # Python retries EINTR itself (PEP 475): a signal shows as a short read
            return real(fd, [memoryview(buffers[0])[:3]], offset)
        if state["n"] == 3:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", flaky)
    fd = os.open(path, os.O_RDONLY)
    try:
        dest = torch.zeros(64, dtype=torch.uint8)
        fill([FillJob(dest, FileRange(fd, 0, 64, "tensor 'a'"))])
        assert raw(dest) == bytes(range(64))
        with pytest.raises(StorageError, match="tensor 'b'") as info:
            fill([FillJob(torch.zeros(64, dtype=torch.uint8), FileRange(fd, 0, 64, "tensor 'b'"))])
        assert info.value.errno == errno.EIO
    finally:
        os.close(fd)


def test_a_file_already_too_short_raises_before_anything_is_written(tmp_path: Any, threaded: None) -> None:
    path, _ = write_file(tmp_path, "f", [bytes(100)])
    fd = os.open(path, os.O_RDONLY)
    a, b = torch.full((40,), 7, dtype=torch.uint8), torch.full((40,), 7, dtype=torch.uint8)
    try:
        with pytest.raises(StorageError, match="tensor 'b'.*Nothing was written"):
            fill([FillJob(a, FileRange(fd, 0, 40, "tensor 'a'")), FillJob(b, FileRange(fd, 80, 40, "tensor 'b'"))])
    finally:
        os.close(fd)
    assert (a == 7).all() and (b == 7).all()


def test_huge_offsets_are_refused_before_any_read(tmp_path: Any) -> None:
    path, _ = write_file(tmp_path, "f", [bytes(16)])
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(StorageError, match="Nothing was written"):
            fill([FillJob(torch.zeros(4), FileRange(fd, 2**62, 16, "w"))])
        with pytest.raises(InvalidArgumentError, match="needs 16"):
            fill([FillJob(torch.zeros(4), FileRange(fd, 0, 12, "w"))])
        with pytest.raises(InvalidArgumentError, match="meta"):
            fill([FillJob(torch.zeros(4, device="meta"), FileRange(fd, 0, 16, "w"))])
    finally:
        os.close(fd)


@pytest.mark.parametrize("staged", [False, True])
def test_a_file_that_shrinks_while_read_raises_naming_the_tensor(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, staged: bool
) -> None:
    """The fstat check passed, then the file is truncated under the reader: a clear error that
    says the destination may be partly written; nothing hangs; every thread and buffer is gone."""
    monkeypatch.setattr(fill_mod, "READ_MIN_WORK", 1)
    monkeypatch.setattr(fill_mod, "READ_CHUNK", 256)
    path, _ = write_file(tmp_path, "f", [bytes(range(256)) * 64])
    real = os.preadv
    state = {"n": 0}

    def truncating(fd: int, buffers: list[Any], offset: int) -> int:
        state["n"] += 1
        if state["n"] == 5:
            os.truncate(path, 1000)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", truncating)
    fake = FakeCopier()
    fd = os.open(path, os.O_RDONLY)
    dest = torch.zeros(16384, dtype=torch.uint8 if not staged else torch.int16)
    try:
        with pytest.raises(StorageError, match="tensor 'w'.*partly overwritten"):
            fill(
                [FillJob(dest, FileRange(fd, 0, 16384, "tensor 'w'"), torch.uint8 if staged else None)],
                copier=lambda _d: fake,
                ring_bytes=1024,
            )
    finally:
        os.close(fd)
    assert no_reader_threads() and fake.live == {}


def test_a_file_that_grows_while_read_is_read_only_within_its_range(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = write_file(tmp_path, "f", [bytes(range(100))])
    real = os.preadv
    seen: list[tuple[int, int]] = []

    def growing(fd: int, buffers: list[Any], offset: int) -> int:
        with open(path, "ab") as f:
            f.write(b"\xff" * 1000)
        seen.append((offset, len(memoryview(buffers[0]))))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", growing)
    fd = os.open(path, os.O_RDONLY)
    dest = torch.zeros(90, dtype=torch.uint8)
    fill([FillJob(dest, FileRange(fd, 10, 90, "w"))])
    os.close(fd)
    assert raw(dest) == bytes(range(10, 100))
    assert all(off + n <= 100 for off, n in seen)


def test_checksums_are_checked_on_the_bytes_read(tmp_path: Any, threaded: None) -> None:
    from memtree.store.primitives.checksums import tensor_checksum

    src = torch.arange(300, dtype=torch.int32)
    path, (off,) = write_file(tmp_path, "f", [raw(src)])
    good = tensor_checksum(src, "crc32")
    found: list[str] = []

    def check(value: str) -> None:
        found.append(value)
        if value != good:
            raise IntegrityError(f"bad {value}")

    fd = os.open(path, os.O_RDONLY)
    try:
        fill([FillJob(torch.zeros(300, dtype=torch.int32), FileRange(fd, off, 1200, "w"), checksum=("crc32", check))])
        fill([FillJob(torch.zeros(300, dtype=torch.float64), FileRange(fd, off, 1200, "w"), torch.int32, ("crc32", check))])
        with pytest.raises(IntegrityError):  # one byte further: other bytes, other checksum
            fill([FillJob(torch.zeros(299, dtype=torch.int32), FileRange(fd, off + 4, 1196, "w"), checksum=("crc32", check))])
    finally:
        os.close(fd)
    assert found[:2] == [good, good]


# -- the ring --------------------------------------------------------------------------------------
def _ring_case(tmp_path: Any, n: int = 50_000) -> tuple[int, torch.Tensor, torch.Tensor]:
    src = sample((n,), torch.float32, 9)
    path, (off,) = write_file(tmp_path, "f", [raw(src)])
    return os.open(path, os.O_RDONLY), src, torch.zeros(n, dtype=torch.float64)


def test_ring_stays_within_its_bound_with_back_pressure(tmp_path: Any, threaded: None) -> None:
    fd, src, dest = _ring_case(tmp_path)
    fake = FakeCopier()
    try:
        fill([FillJob(dest, FileRange(fd, 0, src.nbytes, "w"), torch.float32)], copier=lambda _d: fake, ring_bytes=4096, num_threads=4)
    finally:
        os.close(fd)
    assert torch.equal(dest, src.to(torch.float64))
    assert fake.copies >= src.nbytes // 2048 and fake.most <= 4096 and fake.live == {}


@pytest.mark.parametrize("fail_at", [1, 7])
def test_a_failing_copy_stops_the_readers_and_frees_the_ring(tmp_path: Any, threaded: None, fail_at: int) -> None:
    fd, src, dest = _ring_case(tmp_path)
    fake = FakeCopier(fail_at=fail_at)
    try:
        with pytest.raises(RuntimeError, match="device copy failed"):
            fill([FillJob(dest, FileRange(fd, 0, src.nbytes, "w"), torch.float32)], copier=lambda _d: fake, ring_bytes=4096)
    finally:
        os.close(fd)
    assert no_reader_threads() and fake.live == {} and fake.released == fake.allocated > 0
    assert fake.copies == fail_at  # no copy after the failure


def test_a_failing_reader_stops_the_pipeline_and_frees_the_ring(tmp_path: Any, threaded: None, monkeypatch: pytest.MonkeyPatch) -> None:
    fd, src, dest = _ring_case(tmp_path)
    fail_preadv_at(monkeypatch, 10)
    fake = FakeCopier()
    try:
        with pytest.raises(StorageError, match="reading w"):
            fill([FillJob(dest, FileRange(fd, 0, src.nbytes, "w"), torch.float32)], copier=lambda _d: fake, ring_bytes=4096)
    finally:
        os.close(fd)
    assert no_reader_threads() and fake.live == {} and fake.released == fake.allocated


def test_an_interrupt_in_the_copier_joins_every_thread(tmp_path: Any, threaded: None) -> None:
    fd, src, dest = _ring_case(tmp_path)

    class Interrupted(FakeCopier):
        def copy(self, dst: torch.Tensor, src_: torch.Tensor) -> Any:
            if self.copies == 3:
                raise KeyboardInterrupt
            return super().copy(dst, src_)

    fake = Interrupted()
    try:
        with pytest.raises(KeyboardInterrupt):
            fill([FillJob(dest, FileRange(fd, 0, src.nbytes, "w"), torch.float32)], copier=lambda _d: fake, ring_bytes=4096)
    finally:
        os.close(fd)
    assert no_reader_threads() and fake.live == {}


def test_strided_destination_is_filled_piece_by_piece(tmp_path: Any) -> None:
    src = sample((30, 700), torch.bfloat16, 5)
    path, (off,) = write_file(tmp_path, "f", [raw(src)])
    base = torch.zeros(700, 30, dtype=torch.bfloat16)
    dest = base.t()  # not contiguous
    fake = FakeCopier()
    fd = os.open(path, os.O_RDONLY)
    fill([FillJob(dest, FileRange(fd, off, src.nbytes, "w"))], copier=lambda _d: fake, ring_bytes=512)
    os.close(fd)
    assert torch.equal(dest, src) and fake.copies > 30  # rows split into pieces of <= 256 bytes


# -- mapped leaves ---------------------------------------------------------------------------------
def test_mapped_range_only_for_the_very_file_that_was_mapped(tmp_path: Any) -> None:
    import memtree

    d = str(tmp_path / "t")
    t = memtree.TensorTree({"x": torch.arange(10.0)}).memmap(d)
    x = t["x"]
    span = mapped_range(x[2:])
    assert span is not None and (span.offset, span.nbytes) == (8, 32)
    os.close(span.fd)
    assert mapped_range(x[::2]) is None and mapped_range(torch.ones(3)) is None
    memtree.TensorTree({"x": torch.zeros(10)}).memmap(d)  # re-saved: the path names a new file
    assert mapped_range(x) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_ring_fills_bit_exact(tmp_path: Any) -> None:  # pragma: no cover - GPU machines
    fd, src, _ = _ring_case(tmp_path, 3_000_000)
    dest = torch.zeros(src.shape, dtype=torch.float32, device="cuda")
    cast = torch.zeros(src.shape, dtype=torch.float64, device="cuda")
    try:
        fill([FillJob(dest, FileRange(fd, 0, src.nbytes, "w")), FillJob(cast, FileRange(fd, 0, src.nbytes, "c"), torch.float32)], ring_bytes=1 << 20)
    finally:
        os.close(fd)
    assert torch.equal(dest.cpu(), src) and torch.equal(cast.cpu(), src.double())


def test_a_ring_of_one_buffer_still_completes(tmp_path: Any, threaded: None) -> None:
    """Regression: with one buffer, a copy left in flight would leave the readers none."""
    fd, src, dest = _ring_case(tmp_path, 2000)
    fake = FakeCopier()
    try:
        fill([FillJob(dest, FileRange(fd, 0, src.nbytes, "w"), torch.float32)], copier=lambda _d: fake, ring_bytes=4)
    finally:
        os.close(fd)
    assert torch.equal(dest, src.double()) and fake.allocated == 1 and fake.copies == 2000


def test_gpu_benchmark_imports_and_runs_without_a_gpu() -> None:
    """benchmarks/gpu_load.py must import anywhere and say so where there is no GPU."""
    import subprocess
    import sys

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, os.path.join(here, "benchmarks", "gpu_load.py")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device" in proc.stdout
