"""The pure parts of a collective write (memtree.dist): a leaf's chunk checksums combined from the pieces
the ranks wrote, and the first difference between the ranks' trees; no process group.
"""

from __future__ import annotations

import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memtree.dist.compare import first_difference, summary_digest, tree_summary
from memtree.dist.sums import combine_pieces
from memtree.errors import DistributedCheckpointError
from memtree.dist.placement import split_runs
from memtree.format.schema import ChildMeta, JsonMeta, LeafMeta, LevelMeta
from memtree.store.primitives import checksums


def _crc(algorithm: str, data: bytes) -> int:
    digest = checksums.new_digest(algorithm)
    digest.update(data)
    return int(digest.hexdigest(), 16)


@settings(max_examples=150, deadline=None)
@given(
    data=st.binary(min_size=0, max_size=3000),
    cuts=st.lists(st.integers(0, 3000), max_size=12),
    chunk=st.sampled_from([64, 500, 4096]),
    algorithm=st.sampled_from([a for a in checksums.COMBINABLE if a in checksums.available_checksums()]),
    order=st.randoms(use_true_random=False),
)
def test_pieces_in_any_order_make_the_leafs_chunks_checksums(data, cuts, chunk, algorithm, order):
    """However the ranks cut the file (pieces cut again at chunk boundaries, sent in any order),
    rank 0's checksums are what a writer hashing the whole file records: each chunk's is that
    chunk's, and a leaf of one chunk records the checksum of its bytes."""
    bounds = sorted({0, len(data), *(c for c in cuts if c < len(data))})
    runs = [(a, b - a) for a, b in zip(bounds, bounds[1:]) if b > a]
    pieces = [(o, n, _crc(algorithm, data[o : o + n])) for o, n in split_runs(iter(runs), chunk)]
    order.shuffle(pieces)
    sums = combine_pieces(algorithm, len(data), chunk, pieces, "leaf 'w'")
    assert sums == checksums.view_sums(memoryview(data), algorithm, chunk)
    assert sums.count == max(1, -(-len(data) // chunk))
    entry = LeafMeta("w", "w.memmap", "uint8", (len(data),)).with_sums(sums)
    if sums.count == 1:
        assert entry.chunks is None and entry.checksum == f"{algorithm}:{_crc(algorithm, data):08x}"
    else:
        assert entry.checksum is None and entry.chunks == sums


@pytest.mark.parametrize("pieces, problem", [
    ([(0, 4, 1)], "bytes 4 to 10 were written by no rank"),  # a rank's bytes missing at the end
    ([(0, 4, 1), (6, 2, 1), (8, 2, 1)], "bytes 4 to 6 were written by no rank"),  # a hole
    ([(0, 6, 1), (4, 2, 1)], "bytes 4 to 6 were written twice"),
    ([(0, 10, 1)], "bytes 0 to 10 crosses a chunk boundary"),  # chunks of 8
])
def test_pieces_that_do_not_tile_the_leaf_are_refused(pieces, problem):
    with pytest.raises(DistributedCheckpointError, match=problem):
        combine_pieces("crc32", 10, 8, pieces, "leaf 'w'")


def test_an_empty_leaf_has_the_checksum_of_no_bytes():
    sums = combine_pieces("crc32", 0, 1, [], "leaf 'w'")
    assert LeafMeta("w", "w.memmap", "uint8", (0,)).with_sums(sums).checksum == f"crc32:{zlib.crc32(b''):08x}"


def _summary(**change):
    """A planned tree: 'w' (a DTensor), 'step' (a plain tensor), 'cfg' (a value), 'sub' (a level)."""
    from memtree.dist.placement import Layout, to_annotation

    leaves = {"w": LeafMeta("w", "w.memmap", "float32", (4, 2), layout=to_annotation(Layout((2,), ("S(0)",)))),
              "step": LeafMeta("step", "step.memmap", "int64", ())}
    leaves.update({k: v for k, v in change.items() if isinstance(v, LeafMeta)})
    entries = [*leaves.values(), JsonMeta("cfg", change.get("cfg", {"lr": 0.5})), ChildMeta("sub", "sub")]
    levels = {"": LevelMeta((), tuple(entries)), "sub": LevelMeta((), ())}
    tensors = {"w.memmap": ([0, 1], None), "step.memmap": (None, change.get("crc", 7)), "x.memmap": (None, 1)}
    return tree_summary(levels, tensors, {}, {"dest": "/t", "existsok": change.get("existsok", True)})


@pytest.mark.parametrize("change, problem", [
    ({"x": LeafMeta("x", "x.memmap", "int8", (1,))}, "'x' is in the tree of rank 1 only"),
    ({"w": LeafMeta("w", "w.memmap", "float32", (5, 2))}, "'w' is a DTensor of float32 [4, 2]"),
    ({"crc": 8}, "the plain tensor 'step' holds different values on rank 0 and rank 1"),
    ({"cfg": {"lr": 0.1}}, "'cfg' is the value {\"lr\":0.5} on rank 0 and the value {\"lr\":0.1} on rank 1"),
    ({"existsok": False}, "different options or destinations"),
])
def test_the_first_difference_between_two_ranks_is_named(change, problem):
    same, other = _summary(), _summary(**change)
    assert summary_digest(same) == summary_digest(_summary()) != summary_digest(other)
    assert problem in first_difference([same, other])


def test_a_key_only_rank_0_has_names_rank_0():
    assert "'x' is in the tree of ranks 0 and 2 only" in first_difference(
        [_summary(x=LeafMeta("x", "x.memmap", "int8", (1,))), _summary(), _summary(x=LeafMeta("x", "x.memmap", "int8", (1,)))]
    )


def test_the_same_keys_in_another_order_are_refused():
    a = _summary()
    b = [a[0], *reversed(a[1:])]
    assert summary_digest(a) != summary_digest(b)
    assert "different orders" in first_difference([a, b])


def _column_read_peak(tmp_path, rows: int) -> int:
    """Python memory a rank's read of half the columns of a ``rows`` x 64 float32 leaf holds at
    its peak (tensor storage is not Python's: this is the bookkeeping of its ranges)."""
    import os
    import tracemalloc

    import torch

    from memtree.dist.shards import ShardRead, fill_shards
    from memtree.store.primitives.files import FileRange

    full = torch.arange(rows * 64, dtype=torch.float32).reshape(rows, 64)
    path = tmp_path / f"w{rows}.memmap"
    path.write_bytes(full.numpy().tobytes())
    local = torch.zeros(rows, 32)
    fd = os.open(path, os.O_RDONLY)
    try:
        read = ShardRead(local, FileRange(fd, 0, full.nbytes, "w"), (rows, 64), (((0, rows),), ((32, 64),)), torch.float32)
        tracemalloc.start()
        fill_shards([read])
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    finally:
        os.close(fd)
    assert torch.equal(local, full[:, 32:])
    return peak


def test_a_column_shards_bookkeeping_does_not_grow_with_its_rows(tmp_path):
    """One range per row, read a batch of ranges at a time: 16 times the rows, not 16 times the
    memory beside the shard."""
    small, large = _column_read_peak(tmp_path, 1024), _column_read_peak(tmp_path, 16384)
    assert large < 2 * small, (small, large)


# -- a rank's checked read of its ranges (chunk_check.read_ranges): each covering chunk once -----


@settings(max_examples=150, deadline=None)
@given(
    data=st.binary(min_size=1, max_size=3000),
    cuts=st.lists(st.integers(0, 3000), max_size=10),
    keep=st.lists(st.booleans(), max_size=11),
    chunk=st.sampled_from([64, 256, 1 << 20]),
    buffer=st.sampled_from([16, 100, 1 << 20]),
    flip=st.none() | st.integers(0, 2999),
)
def test_read_ranges_reads_each_covering_chunk_once_and_checks_it(data, cuts, keep, chunk, buffer, flip):
    """Any ranges of a leaf (a rank's rows), any chunk and buffer size: the bytes of the ranges
    come back, each chunk that covers one is read once and no other byte is read; a bit flipped
    in a covering chunk raises IntegrityError naming that chunk, one flipped elsewhere is never
    seen."""
    from memtree.errors import IntegrityError
    from memtree.store.primitives.chunk_check import read_ranges

    bounds = sorted({0, len(data), *(c for c in cuts if c < len(data))})
    runs = [(a, b - a) for (a, b), k in zip(zip(bounds, bounds[1:]), keep + [True] * len(bounds)) if k]
    entry = LeafMeta("w", "w.memmap", "uint8", (len(data),)).with_sums(
        checksums.view_sums(memoryview(data), "crc32", chunk if len(data) > chunk else None)
    )
    stored = bytearray(data)
    if flip is not None:
        flip %= len(data)
        stored[flip] ^= 1
    reads: list[tuple[int, int]] = []

    def read(offset: int, view: memoryview) -> None:
        reads.append((offset, len(view)))
        view[:] = stored[offset : offset + len(view)]

    size = chunk if len(data) > chunk else len(data)
    covering = sorted({k for o, n in runs for k in range(o // size, (o + n - 1) // size + 1) if n})
    out = bytearray(sum(n for _, n in runs))
    if flip is not None and flip // size in covering:
        with pytest.raises(IntegrityError, match=f"leaf 'w' at w.memmap is damaged.*crc32") as err:
            read_ranges(read, entry, runs, memoryview(out), "w.memmap")
        if entry.chunks is not None:
            assert f"chunk {flip // size} of" in str(err.value)
        return
    done = read_ranges(read, entry, runs, memoryview(out), "w.memmap", buffer=buffer)
    assert bytes(out) == b"".join(data[o : o + n] for o, n in runs)
    read_bytes = sorted(b for o, n in reads for b in range(o, o + n))
    want = [b for k in covering for b in range(k * size, min((k + 1) * size, len(data)))]
    assert read_bytes == want and done == len(want)  # each covering chunk's bytes once, nothing else
    assert all(n <= max(buffer, 1) for _, n in reads)
