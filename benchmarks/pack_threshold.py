"""Where packing small leaves stops paying: CPU time per leaf, written as a file each or packed.

    python benchmarks/pack_threshold.py

For leaf sizes from 1 KiB to 1 MiB, a tree of up to 4,000 float32 leaves (at most 32 MiB) in
groups of 100 is written with ``pack_below=0`` (a file per leaf) and packed (``pack_below`` over
the leaf size), then loaded (``lazy=False``) and a byte of each leaf touched. It prints the CPU
time (``time.process_time``: user and system time of this process, the best of 3) per leaf: a
count of work that a loaded machine leaves comparable, unlike wall time. No checksum, so that
only the layout differs. ``docs/format.md`` ("Why 64 KiB") holds the table this printed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import torch

import memtree
from memtree.format.level import Level
from memtree.store.reading.options import WriteOptions
from memtree.store.writing.write import write_tree

SIZES = [1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20]
ROUNDS = 3


def _tree(size: int) -> tuple[Level, int]:
    n = max(64, min(4000, (32 << 20) // size))
    per = 100
    groups = {
        f"g{i}": Level((), {f"x{j}": torch.rand(size // 4) for j in range(min(per, n - i * per))})
        for i in range(-(-n // per))
    }
    return Level((), groups), n


def _best(fn: object) -> float:
    out = []
    for r in range(ROUNDS):
        start = time.process_time()
        fn(r)  # type: ignore[operator]
        out.append(time.process_time() - start)
    return min(out)


def main() -> None:
    base = tempfile.mkdtemp(prefix="pack-threshold-")
    print("leaf size  leaves | write: files  packed | load+touch: files  packed   (CPU µs per leaf)")
    try:
        for size in SIZES:
            level, n = _tree(size)
            cells = []
            for pack_below in (0, 64 << 20):
                def write(r: int, pack_below: int = pack_below) -> None:
                    write_tree(f"{base}/{pack_below}-{r}", level, WriteOptions.of(pack_below=pack_below, checksum=None))

                cells.append(_best(write) / n * 1e6)
            for pack_below in (0, 64 << 20):
                def load(r: int, pack_below: int = pack_below) -> None:
                    tree = memtree.load_memmap(f"{base}/{pack_below}-{r}", lazy=False)
                    for leaf in tree.values(include_nested=True, leaves_only=True):
                        float(leaf.view(-1)[0])

                cells.append(_best(load) / n * 1e6)
            print(f"{size:>9} {n:>7} | {cells[0]:12.1f} {cells[1]:7.1f} | {cells[2]:17.1f} {cells[3]:7.1f}")
            shutil.rmtree(base)
            os.mkdir(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
