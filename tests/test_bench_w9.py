"""W9's systems (``benchmarks/w9_datasets.py``) store, read, fill and grow the same rows, and its
checks catch what they must: a batch with a wrong row, a row a writer lost. No timing."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(autouse=True, scope="module")
def _bench_on_path() -> Iterator[None]:
    sys.path.insert(0, str(BENCH))
    yield
    sys.path.remove(str(BENCH))


@pytest.mark.parametrize("name", ["memtree", "numpy memmap", "tensordict", "h5py", "zarr", "arrow"])
def test_every_system_reads_back_the_rows_it_stored(name, tmp_path):
    import w9_datasets as w

    layout = w.LAYOUTS[name]
    if layout.missing():
        pytest.skip(layout.missing())
    src = w.source(100)
    layout.build(str(tmp_path / "d"), src)
    h = layout.open(str(tmp_path / "d"))
    idx = np.array([99, 0, 5, 5, 42])
    w._expect_batch(layout.read(h, idx), src, idx, name)
    with pytest.raises(w.CheckFailed):
        w._expect_batch(layout.read(h, idx[::-1].copy()), src, idx, name)
    layout.close(h)
    if not layout.fillable:
        h = layout.create(str(tmp_path / "f"), 100, {k: (v.shape[1:], v.dtype) for k, v in src.items()})
        for i in (7, 3):
            layout.write_item(h, i, layout.item(src, i))
        layout.close(h)
        h = layout.open(str(tmp_path / "f"))
        w._expect_batch(layout.read(h, np.array([3, 7])), src, np.array([3, 7]), name)
        layout.close(h)
    if not layout.growable:
        layout.build(str(tmp_path / "g"), src, growable=True)
        h = layout.open(str(tmp_path / "g"), write=True)
        layout.append(h, {k: v[:10] for k, v in src.items()})
        assert layout.length(h) == 110
        w._expect_batch(layout.read(h, np.arange(100, 110)), src, np.arange(10), name)
        layout.close(h)


@pytest.mark.parametrize("writers", [1, 2])
def test_the_writers_check_counts_a_lost_row(writers, tmp_path):
    import w9_datasets as w

    system = w._writers(w.LAYOUTS["memtree"], str(tmp_path), w._pool(4096), 40, writers)
    state = system.setup()
    try:
        out = system.run(state)
    finally:
        system.teardown(state, None)
    system.check(state, out)  # every row written
    import memtree

    tree = memtree.load_memmap(tmp_path / "writers-memtree_1_writer" if writers == 1
                               else tmp_path / "writers-memtree_2_writers")
    tree["x"][17] = torch.zeros(4096, dtype=torch.uint8)  # a row lost
    with pytest.raises(w.CheckFailed, match="1 of 40 rows lost"):
        system.check(state, out)
