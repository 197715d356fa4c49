"""store/primitives/fill.py's pinned ring (:class:`~memtree.store.primitives.fill.PinnedRing`) and memory sources.

The ring's page-locking allocator is replaced by one that counts what it allocates (pageable
buffers: the ring's bookkeeping is the same on any machine), and its device copies by a copier
(of CPU destinations, whose buffers are at most ``BOUNCE_BYTES``) that copies only when the
copy is waited for (as an asynchronous device copy would finish
later), so a buffer lent again before its copy was waited for shows up as wrong bytes. The
CUDA-only parts (page-locked buffers, streams) are in tests/test_cuda.py.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memtree.store.primitives.fill as fill_mod
from memtree import InvalidArgumentError, StorageError
from memtree.store.primitives.files import FileRange
from memtree.store.primitives.fill import FillJob, MemoryRange, PinnedRing, fill, memory_job

from test_fill import MIXED, Case, FakeCopier, fail_preadv_at, no_reader_threads, raw, sample, write_file


class Allocator:
    """Counts the buffers made and the bytes alive (a freed buffer is no longer alive)."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.made = 0
        self.fail_after = fail_after
        self.unpins = 0
        self.alive: dict[int, int] = {}
        self.lock = threading.Lock()

    def __call__(self, nbytes: int) -> torch.Tensor:
        with self.lock:
            if self.fail_after is not None and self.made >= self.fail_after:
                raise RuntimeError("CUDA error: out of memory (pinning)")
            self.made += 1
        buf = torch.empty(nbytes, dtype=torch.uint8)
        ptr = buf.data_ptr()
        with self.lock:
            self.alive[ptr] = nbytes
        buf.untyped_storage()._memtree_test_finalizer = _Finalizer(self, ptr)  # type: ignore[attr-defined]
        return buf

    def unpin(self) -> None:
        self.unpins += 1

    @property
    def bytes_alive(self) -> int:
        with self.lock:
            return sum(self.alive.values())


class _Finalizer:
    def __init__(self, owner: Allocator, ptr: int) -> None:
        self.owner, self.ptr = owner, ptr

    def __del__(self) -> None:
        with self.owner.lock:
            self.owner.alive.pop(self.ptr, None)


def ring_of(alloc: Allocator) -> PinnedRing:
    return PinnedRing(allocate=alloc, unpin=alloc.unpin)


class RingCopier(FakeCopier):
    """:class:`FakeCopier`'s copies, from the buffers of ``ring``; ``in_use`` (shared by the
    copiers of concurrent loads) records the buffers every load holds, to catch two loads
    sharing one."""

    def __init__(self, ring: PinnedRing, in_use: dict[int, int] | None = None, fail_at: int | None = None) -> None:
        super().__init__(fail_at)
        self.ring = ring
        self.in_use = {} if in_use is None else in_use
        self.shared = False

    def buffers(self, nbytes: int, count: int) -> list[torch.Tensor]:
        slots = self.ring.take(nbytes, count)
        with self.lock:
            for s in slots:
                if s.data_ptr() in self.in_use:
                    self.shared = True
                self.in_use[s.data_ptr()] = id(self)
            self.allocated += len(slots)
        return slots

    def release(self, buffers: list[torch.Tensor], reuse: bool) -> None:
        with self.lock:
            for s in buffers:
                self.in_use.pop(s.data_ptr(), None)
                self.released += 1
        self.ring.give(buffers, reuse)


@pytest.fixture
def threaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fill_mod, "READ_MIN_WORK", 1)


def cast_job(tmp_path: Any, n: int, name: str = "f") -> tuple[int, torch.Tensor, FillJob]:
    """A float32 file read into float64 (a staged job); the caller closes the descriptor."""
    src = sample((n,), torch.float32, n)
    path, (off,) = write_file(tmp_path, name, [raw(src)])
    fd = os.open(path, os.O_RDONLY)
    return fd, src, FillJob(torch.zeros(n, dtype=torch.float64), FileRange(fd, off, src.nbytes, "w"), torch.float32)


def load(job: FillJob, copier: FakeCopier, **kw: Any) -> None:
    fill([job], copier=lambda _d: copier, **kw)


# -- the ring is allocated once and reused -------------------------------------------------------
def test_the_ring_is_allocated_by_the_first_load_and_reused_by_the_next_ones(
    tmp_path: Any, threaded: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: every fill() allocated (and pinned) its buffers again, 32 MiB each whatever
    the load; load_memmap(device="cuda") calls fill() every 64 leaves."""
    monkeypatch.setattr(fill_mod, "BOUNCE_BYTES", 4096)  # the most bytes of a buffer, for CPU destinations
    alloc = Allocator()
    ring = ring_of(alloc)
    fds = []
    try:
        for i in range(4):
            fd, src, job = cast_job(tmp_path, 40_000, f"f{i}")
            fds.append(fd)
            load(job, RingCopier(ring), ring_bytes=1 << 20, num_threads=4)
            assert torch.equal(job.dest, src.double())
            if i == 0:
                first = alloc.made
        assert first > 1 and alloc.made == first  # the next loads pinned nothing
        assert ring.held == alloc.bytes_alive == first * 4096
    finally:
        for fd in fds:
            os.close(fd)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(1, 30_000),
    threads=st.sampled_from([0, 2, 4]),
    cap=st.sampled_from([8, 1000, 4096, 1 << 16, 1 << 20]),
    chunk=st.sampled_from([64, 4096, 1 << 20]),
)
def test_property_the_ring_is_sized_to_the_load_and_its_cap(
    tmp_path_factory: Any, monkeypatch: pytest.MonkeyPatch, n: int, threads: int, cap: int, chunk: int
) -> None:
    """A fresh ring holds no more than the load's bytes (one element at least), the cap
    (PINNED_RING_BYTES) and 2 * threads + 2 buffers; the load is bit-exact, and every buffer is
    back in the ring."""
    monkeypatch.setattr(fill_mod, "READ_MIN_WORK", 1)
    monkeypatch.setattr(fill_mod, "PINNED_RING_BYTES", cap)
    monkeypatch.setattr(fill_mod, "BOUNCE_BYTES", chunk)  # the most bytes of a buffer, for CPU destinations
    alloc = Allocator()
    ring = ring_of(alloc)
    fd, src, job = cast_job(tmp_path_factory.mktemp("ring"), n)
    copier = RingCopier(ring)
    try:
        fill([job], copier=lambda _d: copier, num_threads=threads, ring_bytes=cap)
    finally:
        os.close(fd)
    assert torch.equal(job.dest, src.double())
    assert 0 < ring.held <= max(4, min(src.nbytes, cap)) and ring.held <= max(4, chunk) * (2 * threads + 2)
    assert ring.held == alloc.bytes_alive and copier.in_use == {} and no_reader_threads()


def test_a_small_load_borrows_a_larger_buffer_rather_than_pinning_a_new_one(tmp_path: Any) -> None:
    alloc = Allocator()
    ring = ring_of(alloc)
    ring.give(ring.take(1 << 16, 2), reuse=True)
    fd, src, job = cast_job(tmp_path, 300)
    try:
        load(job, RingCopier(ring))
    finally:
        os.close(fd)
    assert torch.equal(job.dest, src.double()) and alloc.made == 2 and ring.held == 2 << 16


def test_a_larger_load_replaces_the_buffers_and_frees_the_smaller_ones() -> None:
    alloc = Allocator()
    ring = ring_of(alloc)
    ring.give(ring.take(1000, 3), reuse=True)
    assert ring.held == 3 * 1024 and alloc.unpins == 0
    slots = ring.take(5000, 2)
    assert [len(s) for s in slots] == [8192, 8192] and ring.held == 2 * 8192
    assert alloc.bytes_alive == 2 * 8192 and alloc.unpins == 1  # the small ones freed, unpinned


def test_a_load_asking_for_more_slots_than_the_idle_buffers_gets_new_ones_of_their_size() -> None:
    alloc = Allocator()
    ring = ring_of(alloc)
    ring.give(ring.take(4096, 1), reuse=True)
    slots = ring.take(1024, 12)  # 12 KiB: the idle 4 KiB buffer and two new ones, in 1 KiB slots
    assert len(slots) == 12 and {len(s) for s in slots} == {1024} and ring.held == 3 * 4096
    assert len({s.data_ptr() for s in slots}) == 12


# -- several loads at once -----------------------------------------------------------------------
def test_two_loads_at_once_never_share_a_buffer_and_stay_within_the_cap(
    tmp_path: Any, threaded: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    cap = 6 * 4096
    monkeypatch.setattr(fill_mod, "PINNED_RING_BYTES", cap)
    monkeypatch.setattr(fill_mod, "BOUNCE_BYTES", 4096)  # the most bytes of a buffer, for CPU destinations
    alloc = Allocator()
    ring = ring_of(alloc)
    in_use: dict[int, int] = {}
    most = [0]
    real_take = ring.take

    def take(nbytes: int, count: int) -> list[torch.Tensor]:
        slots = real_take(nbytes, count)
        most[0] = max(most[0], alloc.bytes_alive, ring.held)
        return slots

    monkeypatch.setattr(ring, "take", take)
    cases = [cast_job(tmp_path, 60_000, f"f{i}") for i in range(6)]
    copiers = [RingCopier(ring, in_use) for _ in cases]
    errors: list[BaseException] = []
    start = threading.Barrier(len(cases))

    def run(i: int) -> None:
        try:
            start.wait()
            for _ in range(3):
                load(cases[i][2], copiers[i], ring_bytes=cap, num_threads=2)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for fd, _, _ in cases:
        os.close(fd)
    assert errors == []
    for _, src, job in cases:
        assert torch.equal(job.dest, src.double())
    assert not any(c.shared for c in copiers) and in_use == {}
    assert most[0] <= cap and ring.held <= cap and ring.held == alloc.bytes_alive


def test_a_load_that_finds_the_ring_all_lent_gets_no_buffer_and_never_waits() -> None:
    import memtree.store.primitives.fill as f

    alloc = Allocator()
    ring = ring_of(alloc)
    old = f.PINNED_RING_BYTES
    try:
        f.PINNED_RING_BYTES = 8192
        held = ring.take(4096, 2)
        pageable = ring.take(4096, 2)  # no room: pageable buffers of its own, not the ring's
        assert [len(b) for b in pageable] == [4096, 4096] and alloc.made == 2 and ring.held == 8192
        ring.give(pageable, reuse=True)
        ring.give(held, reuse=True)
        assert ring.held == 8192 and alloc.made == 2
        assert len(ring.take(4096, 2)) == 2
    finally:
        f.PINNED_RING_BYTES = old


def test_a_request_larger_than_the_cap_gets_pageable_buffers_and_leaves_the_ring_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    alloc = Allocator()
    ring = ring_of(alloc)
    ring.give(ring.take(4096, 2), reuse=True)
    monkeypatch.setattr(fill_mod, "PINNED_RING_BYTES", 1 << 16)
    assert [len(b) for b in ring.take(1 << 17, 1)] == [1 << 17]
    assert ring.held == 8192 and alloc.made == 2 and alloc.unpins == 0
    ring.take(4096, 2)
    assert alloc.made == 2  # its buffers were kept


# -- freeing -------------------------------------------------------------------------------------
def test_release_frees_the_idle_buffers_now_and_the_lent_ones_when_given_back() -> None:
    alloc = Allocator()
    ring = ring_of(alloc)
    ring.give(ring.take(4096, 2), reuse=True)
    lent = ring.take(4096, 1)
    assert ring.release() == 4096 and ring.held == 4096 and alloc.unpins == 1
    ring.give(lent, reuse=True)  # lent before the release: dropped, not kept
    del lent
    assert ring.held == 0 and alloc.bytes_alive == 0
    assert ring.release() == 0 and alloc.unpins == 2  # what the load still held is unpinned now


@pytest.mark.parametrize("emptied", ["released", "dropped"])
def test_an_emptied_ring_pins_buffers_of_the_next_loads_size(emptied: str) -> None:
    """Regression: after a release (or once a failed copy dropped every buffer) the ring kept
    its old, larger size, so smaller loads found no buffer and staged through pageable memory."""
    alloc = Allocator()
    ring = ring_of(alloc)
    slots = ring.take(1 << 16, 2)
    if emptied == "released":
        ring.give(slots, reuse=True)
        ring.release()
    else:
        ring.give(slots, reuse=False)
    del slots
    assert ring.held == 0
    assert [len(s) for s in ring.take(1024, 2)] == [1024, 1024] and ring.held == 2048 and alloc.made == 4


def test_release_pinned_memory_empties_the_process_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    alloc = Allocator()
    monkeypatch.setattr(fill_mod, "PINNED", ring_of(alloc))
    fill_mod.PINNED.give(fill_mod.PINNED.take(1 << 16, 3), reuse=True)
    assert fill_mod.release_pinned_memory() == 3 << 16
    assert fill_mod.PINNED.held == 0 and alloc.bytes_alive == 0 and alloc.unpins == 1


def test_a_lowered_cap_trims_the_ring_at_the_next_load(monkeypatch: pytest.MonkeyPatch) -> None:
    alloc = Allocator()
    ring = ring_of(alloc)
    ring.give(ring.take(4096, 8), reuse=True)
    monkeypatch.setattr(fill_mod, "PINNED_RING_BYTES", 2 * 4096)
    assert len(ring.take(4096, 1)) == 1 and ring.held <= 2 * 4096 and alloc.bytes_alive <= 2 * 4096
    monkeypatch.setattr(fill_mod, "PINNED_RING_BYTES", 1024)  # below the buffers' size
    assert [len(s) for s in ring.take(512, 1)] == [512] and alloc.unpins == 2


def test_pinning_that_fails_gives_the_load_what_was_pinned(tmp_path: Any, threaded: None) -> None:
    alloc = Allocator(fail_after=1)
    ring = ring_of(alloc)
    assert len(ring.take(1024, 4)) == 1 and ring.held == 1024  # nothing reserved for the failures
    fd, src, job = cast_job(tmp_path, 20_000)
    try:
        load(job, RingCopier(ring), ring_bytes=1 << 16, num_threads=4)
    finally:
        os.close(fd)
    assert torch.equal(job.dest, src.double())


def test_an_interrupt_while_pinning_lends_nothing() -> None:
    alloc = Allocator()
    ring = ring_of(alloc)
    ring.give(ring.take(4096, 1), reuse=True)
    calls = {"n": 0}

    def interrupted(nbytes: int) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return alloc(nbytes)

    ring._allocate = interrupted
    with pytest.raises(KeyboardInterrupt):
        ring.take(4096, 4)
    assert ring.held == 2 * 4096 == alloc.bytes_alive and ring._lent == {}
    ring._allocate = alloc
    assert len(ring.take(4096, 2)) == 2 and alloc.made == 2  # the two kept are lent again


def test_without_pinned_memory_the_cuda_copier_stages_through_pageable_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    class Stream:  # stands for torch.cuda.Stream where there is none
        def __init__(self, device: Any = None) -> None:
            pass

        def wait_stream(self, other: Any) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    alloc = Allocator(fail_after=0)
    copier = fill_mod.CudaCopier(torch.device("cuda"), ring_of(alloc))
    bufs = copier.buffers(4096, 3)
    assert [len(b) for b in bufs] == [4096] * 3 and copier.ring.held == 0
    copier.release(bufs, True)
    assert copier.ring.held == 0


# -- errors: threads joined, ring drained ---------------------------------------------------------
@pytest.mark.parametrize("fail_at", [1, 9])
def test_the_buffers_of_a_failed_copy_are_never_lent_again(tmp_path: Any, threaded: None, fail_at: int) -> None:
    alloc = Allocator()
    ring = ring_of(alloc)
    fd, src, job = cast_job(tmp_path, 30_000)
    copier = RingCopier(ring, fail_at=fail_at)
    try:
        with pytest.raises(RuntimeError, match="device copy failed"):
            load(job, copier, ring_bytes=1 << 14, num_threads=4)
        assert no_reader_threads() and copier.in_use == {} and ring.held == 0
        del copier
        made = alloc.made
        load(job, RingCopier(ring), ring_bytes=1 << 14, num_threads=4)  # new buffers: fine
    finally:
        os.close(fd)
    assert torch.equal(job.dest, src.double()) and alloc.made > made


def test_a_failed_read_gives_every_buffer_back_for_the_next_load(
    tmp_path: Any, threaded: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    alloc = Allocator()
    ring = ring_of(alloc)
    fd, src, job = cast_job(tmp_path, 30_000)
    calls = fail_preadv_at(monkeypatch, 5)
    copier = RingCopier(ring)
    try:
        with pytest.raises(StorageError, match="reading w"):
            load(job, copier, ring_bytes=1 << 14, num_threads=4)
        assert no_reader_threads() and copier.in_use == {}
        held, made = ring.held, alloc.made
        assert held > 0  # every copy was waited for: the buffers are reusable
        calls["n"] = -(10**9)
        load(job, RingCopier(ring), ring_bytes=1 << 14, num_threads=4)
    finally:
        os.close(fd)
    assert torch.equal(job.dest, src.double()) and alloc.made == made and ring.held == held


# -- memory sources --------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cases=MIXED, threads=st.sampled_from([0, 2, 4]), ring=st.sampled_from([2, 40, 1 << 20]))
def test_property_memory_sources_fill_bit_exact_through_the_ring(
    monkeypatch: pytest.MonkeyPatch, cases: list[Case], threads: int, ring: int
) -> None:
    """Tensors in memory, into cast and strided destinations: exactly what copy_ gives."""
    monkeypatch.setattr(fill_mod, "READ_MIN_WORK", 1)
    jobs, wants = [], []
    for i, (s, d, want) in enumerate(cases):
        job = memory_job(d, s, f"t{i}")
        assert job is not None and not job.direct and isinstance(job.source, MemoryRange)
        jobs.append(job)
        wants.append(want)
    fake = FakeCopier()
    fill(jobs, num_threads=threads, copier=lambda _d: fake, ring_bytes=ring)
    for job, w in zip(jobs, wants):
        assert raw(job.dest) == raw(w)
    assert fake.live == {} and no_reader_threads()


def test_memory_job_takes_only_plain_host_memory_of_the_destinations_shape(tmp_path: Any) -> None:
    import memtree

    x = torch.arange(12.0).reshape(3, 4)
    assert memory_job(torch.zeros(3, 4), x.t(), "x") is None  # not contiguous
    assert memory_job(torch.zeros(4, 3), x, "x") is None  # another shape
    assert memory_job(torch.zeros(3, 4), torch.nn.Parameter(x), "x") is None  # a subclass: detach it
    assert memory_job(torch.nn.Parameter(torch.zeros(3, 4)), x, "x") is None
    assert memory_job(torch.zeros(3, 4), torch.zeros(3, 4, device="meta"), "x") is None
    mapped = memtree.TensorTree({"x": x}).memmap(tmp_path / "t")["x"]
    assert memory_job(torch.zeros(3, 4), mapped, "x") is None
    job = memory_job(torch.zeros(3, 4), mapped.as_subclass(torch.Tensor), "x")
    assert job is not None
    fill([job])
    assert torch.equal(job.dest, x)


def test_a_checksum_is_refused_on_a_memory_source() -> None:
    job = memory_job(torch.zeros(4), torch.ones(4), "tensor 'x'")
    assert job is not None
    with pytest.raises(InvalidArgumentError, match="tensor 'x': a checksum is checked on a file"):
        fill([FillJob(job.dest, job.source, checksum=("crc32", lambda _found: None))])
    assert torch.equal(job.dest, torch.zeros(4))
