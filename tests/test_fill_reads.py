"""How fill() reads: in file order, neighbouring ranges of one file in one preadv, CRC-32 fast.

Single-file checkpoints (safetensors, torch.save) hold hundreds of small tensors one after
another; :func:`memtree.store.primitives.fill.fill` reads them in file order, a run of neighbours into
their several destinations with one ``preadv`` (the few bytes between two ``torch.save``
records land in a scratch buffer). These tests pin that the destinations get exactly their
bytes whatever the layout (gaps, overlapping views of one storage, any order of the jobs, any
piece size, short reads at any buffer boundary), that checksums still see each tensor's own
bytes, and that the number of reads is what the layout allows. Also :func:`memtree.store.primitives.checksums.crc32`
(ISA-L's where installed) against zlib's.
"""

from __future__ import annotations

import errno
import os
import random
import sys
import zlib
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import memtree.store.primitives.checksums as checksums_mod
import memtree.store.primitives.fill as fill_mod
from memtree import CheckpointFormatError, StorageError, load_into_module
from memtree.store.primitives.files import FileRange
from memtree.store.primitives.checksums import crc32
from memtree.store.primitives.fill import FillJob, fill, read_views


def raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def preadv_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """Every ``os.preadv``: (offset, buffers, bytes asked)."""
    calls: list[tuple[int, int, int]] = []
    real = os.preadv

    def spy(fd: int, buffers: Any, offset: int) -> int:
        calls.append((offset, len(buffers), sum(len(memoryview(b)) for b in buffers)))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", spy)
    return calls


def _file(tmp_path: Any, data: bytes) -> int:
    path = os.path.join(str(tmp_path), "f")
    with open(path, "wb") as f:
        f.write(data)
    return os.open(path, os.O_RDONLY)


# -- read_views ------------------------------------------------------------------------------------
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=8), short=st.integers(0, 9), offset=st.integers(0, 20))
def test_read_views_fills_every_buffer_and_continues_short_reads_at_any_boundary(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, sizes: list[int], short: int, offset: int
) -> None:
    data = bytes(random.Random(len(sizes)).randrange(256) for _ in range(400))
    fd = _file(tmp_path, data)
    real = os.preadv

    def shorter(fd: int, buffers: Any, at: int) -> int:  # at most `short` bytes, across buffers
        n = real(fd, buffers, at)
        return min(n, short) if short else n

    monkeypatch.setattr(os, "preadv", shorter)
    bufs = [bytearray(n) for n in sizes]
    try:
        read_views(fd, [memoryview(b) for b in bufs], offset, "x")
    finally:
        os.close(fd)
    assert b"".join(bufs) == data[offset : offset + sum(sizes)]


def test_read_views_raises_where_the_file_ends_inside_a_later_buffer(tmp_path: Any) -> None:
    fd = _file(tmp_path, bytes(range(100)))
    a, b = bytearray(60), bytearray(60)
    try:
        with pytest.raises(StorageError, match=r"tensor 't'.*ends at byte 100.*\[10, 130\)") as info:
            read_views(fd, [memoryview(a), memoryview(b)], 10, "tensor 't'")
    finally:
        os.close(fd)
    assert info.value.errno == errno.EIO


# -- reads in file order, neighbours together ------------------------------------------------------
def test_neighbouring_ranges_of_one_file_are_read_in_one_preadv_in_file_order(
    tmp_path: Any, preadv_calls: list[tuple[int, int, int]]
) -> None:
    """200 small tensors one after another (jobs given in shuffled order): one read."""
    srcs = [torch.arange(i, i + 5 + i % 7, dtype=torch.float32) for i in range(200)]
    blob = b"".join(raw(s) for s in srcs)
    offsets = [0]
    for s in srcs:
        offsets.append(offsets[-1] + s.nbytes)
    fd = _file(tmp_path, blob)
    dests = [torch.zeros_like(s) for s in srcs]
    jobs = [FillJob(d, FileRange(fd, o, s.nbytes, f"t{i}")) for i, (d, s, o) in enumerate(zip(dests, srcs, offsets))]
    random.Random(0).shuffle(jobs)
    try:
        fill(jobs, num_threads=0)
    finally:
        os.close(fd)
    assert [raw(d) for d in dests] == [raw(s) for s in srcs]
    assert preadv_calls == [(0, 200, len(blob))]


def test_small_gaps_are_read_into_scratch_large_gaps_and_overlaps_start_a_new_read(
    tmp_path: Any, preadv_calls: list[tuple[int, int, int]]
) -> None:
    gap = fill_mod.READ_GAP
    data = bytes(random.Random(1).randrange(256) for _ in range(3 * gap))
    fd = _file(tmp_path, data)
    # [0, 10) and [40, 50): a 30-byte gap, one read of 3 buffers; [50 + gap + 1, ...): a new read;
    # a range inside the previous one (a view of one storage): a new read too
    ranges = [(0, 10), (40, 10), (50 + gap + 1, 20), (50 + gap + 5, 8)]
    dests = [torch.zeros(n, dtype=torch.uint8) for _, n in ranges]
    try:
        fill([FillJob(d, FileRange(fd, o, n, f"t{i}")) for i, (d, (o, n)) in enumerate(zip(dests, ranges))], num_threads=0)
    finally:
        os.close(fd)
    assert [raw(d) for d in dests] == [data[o : o + n] for o, n in ranges]
    assert preadv_calls == [(0, 3, 50), (50 + gap + 1, 1, 20), (50 + gap + 5, 1, 8)]


def test_a_read_takes_at_most_iov_max_buffers_and_read_chunk_bytes(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, preadv_calls: list[tuple[int, int, int]]
) -> None:
    monkeypatch.setattr(fill_mod, "_IOV_MAX", 4)
    monkeypatch.setattr(fill_mod, "READ_CHUNK", 64)
    data = bytes(range(256)) * 4
    fd = _file(tmp_path, data)
    # 10-byte ranges every 12 bytes: gaps of 2 (each gap one more buffer)
    ranges = [(12 * i, 10) for i in range(60)]
    dests = [torch.zeros(10, dtype=torch.uint8) for _ in ranges]
    try:
        fill([FillJob(d, FileRange(fd, o, n, f"t{i}")) for i, (d, (o, n)) in enumerate(zip(dests, ranges))], num_threads=0)
    finally:
        os.close(fd)
    assert [raw(d) for d in dests] == [data[o : o + n] for o, n in ranges]
    assert all(bufs <= 4 and nbytes <= 64 for _, bufs, nbytes in preadv_calls)
    assert len(preadv_calls) == 30  # two tensors (3 buffers: one gap) per read


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    layout=st.lists(st.tuples(st.integers(-30, 40), st.integers(0, 90)), min_size=1, max_size=25),
    seed=st.integers(0, 1000),
    threads=st.sampled_from([0, 2, 4]),
    chunk=st.sampled_from([7, 32, 1 << 20]),
    read_gap=st.sampled_from([0, 5, 4096]),
    two_files=st.booleans(),
)
def test_property_any_layout_fills_bit_exact_and_checks_each_tensor_on_its_own_bytes(
    tmp_path_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
    layout: list[tuple[int, int]],
    seed: int,
    threads: int,
    chunk: int,
    read_gap: int,
    two_files: bool,
) -> None:
    """Ranges after a gap (or overlapping the previous one: views of one storage), jobs in any
    order, one or two files, any piece size and gap rule: every destination holds exactly its
    range, every checksum is called once with the CRC-32 of that range."""
    monkeypatch.setattr(fill_mod, "READ_MIN_WORK", 1)
    monkeypatch.setattr(fill_mod, "READ_CHUNK", chunk)
    monkeypatch.setattr(fill_mod, "READ_GAP", read_gap)
    tmp = tmp_path_factory.mktemp("layout")
    data = bytes(random.Random(seed).randrange(256) for _ in range(4000))
    fds = [_file(tmp, data)] + ([_file(tmp_path_factory.mktemp("second"), data[::-1])] if two_files else [])
    contents = [data, data[::-1]]
    ranges, pos = [], 0
    for i, (gap, n) in enumerate(layout):
        pos = max(0, pos + gap)
        ranges.append((i % len(fds), pos, n))
        pos += n
    seen: dict[int, list[str]] = {}
    dests = [torch.full((n,), 0xAA, dtype=torch.uint8) for _, _, n in ranges]

    def checker(i: int) -> Any:
        return lambda found: seen.setdefault(i, []).append(found)

    jobs = [
        FillJob(d, FileRange(fds[f], o, n, f"t{i}"), checksum=("crc32", checker(i)))
        for i, (d, (f, o, n)) in enumerate(zip(dests, ranges))
    ]
    random.Random(seed).shuffle(jobs)
    try:
        fill(jobs, num_threads=threads)
    finally:
        for fd in fds:
            os.close(fd)
    for i, (d, (f, o, n)) in enumerate(zip(dests, ranges)):
        want = contents[f][o : o + n]
        assert raw(d) == want
        assert seen[i] == [f"crc32:{zlib.crc32(want):08x}"]


# -- CRC-32 ----------------------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=3000), start=st.integers(0, 2**32 - 1))
def test_property_crc32_is_zlibs(data: bytes, start: int) -> None:
    assert crc32(data, start) == zlib.crc32(data, start)
    assert crc32(memoryview(data)) == zlib.crc32(data)


def test_crc32_falls_back_to_zlib_without_isal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checksums_mod, "_CRC32", None)
    monkeypatch.setitem(sys.modules, "isal.isal_zlib", None)  # import isal.isal_zlib now fails
    assert crc32(b"hello world") == zlib.crc32(b"hello world")
    assert checksums_mod._CRC32 is zlib.crc32


def test_crc32_uses_isal_where_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    isal_zlib = pytest.importorskip("isal.isal_zlib")
    monkeypatch.setattr(checksums_mod, "_CRC32", None)
    data = os.urandom(1 << 20)
    assert crc32(data, 7) == zlib.crc32(data, 7)
    assert checksums_mod._CRC32 is isal_zlib.crc32


# -- torch.save files: small records read together, each still checked ----------------------------
class Many(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(3, 2) for _ in range(30))


def test_a_torch_file_of_small_records_is_read_in_few_preadv_calls(
    tmp_path: Any, preadv_calls: list[tuple[int, int, int]]
) -> None:
    src = Many()
    torch.save(src.state_dict(), tmp_path / "m.pt")
    net = Many()
    preadv_calls.clear()
    load_into_module(net, str(tmp_path / "m.pt"))
    assert {k: raw(v) for k, v in net.state_dict().items()} == {k: raw(v) for k, v in src.state_dict().items()}
    data_reads = [c for c in preadv_calls if c[1] > 1]
    assert len(data_reads) == 1 and data_reads[0][1] == 2 * 60 - 1  # 60 records, 59 gaps between


@pytest.mark.parametrize("victim", [0, 17, 59])
def test_a_damaged_small_record_read_with_its_neighbours_fails_its_own_crc(tmp_path: Any, victim: int) -> None:
    import zipfile

    src = Many()
    path = str(tmp_path / "m.pt")
    torch.save(src.state_dict(), path)
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(f"/data/{victim}"))
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        f.seek(info.header_offset + 30 + name_len + extra_len + 3)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    name = list(src.state_dict())[victim]
    with pytest.raises(CheckpointFormatError, match=rf"tensor '{name}' fails its CRC-32"):
        load_into_module(Many(), path)


def test_opening_a_torch_file_asks_for_every_record_header_at_once(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The local headers the unpickler reads one by one are prefetched (WILLNEED) in file order
    first; advice refused by the filesystem changes nothing."""
    import zipfile

    from memtree.interop import open_checkpoint

    path = str(tmp_path / "m.pt")
    torch.save(Many().state_dict(), path)
    with zipfile.ZipFile(path) as z:
        headers = sorted(i.header_offset for i in z.infolist() if "/data/" in i.filename)
    advised: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, how: advised.append((off, how)))
    with open_checkpoint(path) as ckpt:
        assert len(ckpt) == 60
    assert advised == [(h, os.POSIX_FADV_WILLNEED) for h in headers]

    def refuse(fd: int, off: int, n: int, how: int) -> None:
        raise OSError(errno.EINVAL, "no advice here")

    monkeypatch.setattr(os, "posix_fadvise", refuse)
    net, src = Many(), Many()
    torch.save(src.state_dict(), path)
    load_into_module(net, path)
    assert {k: raw(v) for k, v in net.state_dict().items()} == {k: raw(v) for k, v in src.state_dict().items()}
