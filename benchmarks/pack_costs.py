"""What packing small leaves saves and costs (format version 3): the work counts behind its choices.

    python benchmarks/pack_costs.py

Two tables, each printing the CPU time of this process (``resource.getrusage``: user and system
time, the best of 3): a count of work that a loaded machine leaves comparable, unlike wall time.

* **threshold**: for leaf sizes from 1 KiB to 1 MiB, a tree of up to 4,000 float32 leaves (at
  most 32 MiB) in groups of 100 is written with a file per leaf (``pack_below=0``) and packed
  (``pack_below`` over the leaf size), then loaded (``lazy=False``) and a byte of each leaf
  touched; CPU time per leaf. No checksum, so that only the layout differs. Where packing stops
  paying is where the default threshold goes (64 KiB, ``docs/format.md``, "Packs of small
  leaves").
* **incremental**: W11's tree (5,000 float32 leaves of 4 KiB in 50 groups) is saved, one leaf
  changed, and the next save links from the first (``link_from``, as ``Checkpointer`` does): a
  file per leaf links 4,999 files and writes one; packed, the pack holding the changed leaf (all
  5,000 here: 20 MB) is written again, whole. Bytes written (``wchar`` of ``/proc/self/io``),
  files written and linked, CPU time of the save.
"""

from __future__ import annotations

import os
import resource
import shutil
import tempfile
from typing import Callable

import torch

import memtree
from memtree.format.level import Level
from memtree.store.reading.options import WriteOptions
from memtree.store.writing.write import WriteStats, write_tree

SIZES = [1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20]
ROUNDS = 3


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _wchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def _best(fn: Callable[[int], object]) -> float:
    """The least CPU time of :data:`ROUNDS` calls ``fn(round)``."""
    out = []
    for r in range(ROUNDS):
        start = _cpu()
        fn(r)
        out.append(_cpu() - start)
    return min(out)


def _groups(n: int, size: int, seed: int = 0) -> Level:
    """``n`` float32 leaves of ``size`` bytes in groups of 100."""
    g = torch.Generator().manual_seed(seed)
    return Level((), {
        f"g{i}": Level((), {f"x{j}": torch.rand(size // 4, generator=g) for j in range(min(100, n - i * 100))})
        for i in range(-(-n // 100))
    })


def threshold(base: str) -> None:
    print("leaf size  leaves | write: files  packed | load+touch: files  packed   (CPU µs per leaf)")
    for size in SIZES:
        n = max(64, min(4000, (32 << 20) // size))
        level = _groups(n, size)
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


def incremental(base: str) -> None:
    print("layout       bytes written   files written  files linked  CPU s")
    for label, pack_below in (("file a leaf", 0), ("packed", None)):
        rows = []
        for r in range(ROUNDS):
            tree = _groups(5000, 4096)
            old, new = f"{base}/{r}-old", f"{base}/{r}-new"
            write_tree(old, tree, WriteOptions.of(pack_below=pack_below))
            tree.entries["g25"].entries["x50"] = tree.entries["g25"].entries["x50"] + 1
            stats = WriteStats()
            w, c = _wchar(), _cpu()
            write_tree(new, tree, WriteOptions.of(pack_below=pack_below, link_from=old), stats=stats)
            rows.append((_wchar() - w, stats.files_written, stats.files_linked, _cpu() - c))
        best = min(rows, key=lambda x: x[3])
        print(f"{label:<12} {best[0]:>13,} {best[1]:>15,} {best[2]:>13,} {best[3]:>6.3f}")
        shutil.rmtree(base)
        os.mkdir(base)


def main() -> None:
    base = tempfile.mkdtemp(prefix="pack-costs-")
    try:
        threshold(base)
        print()
        incremental(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
