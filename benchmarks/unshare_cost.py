"""What a ``mode="r+"`` load of a checkpoint step that shares its files costs (issue 24).

A ``Checkpointer`` saves a state of ``LEAVES`` float32 tensors (``MIB`` MiB in all) twice: the
second step hard-links every leaf of the first. ``load_memmap(step 2, lazy=False)`` then maps it:

* ``mode="r"``: copy-on-write mappings, nothing copied;
* ``mode="r+"`` (the default), first time: each shared leaf gets its own copy first
  (``memtree.store.reading.unshare``: ``copy_file_range`` into a new file, ``fsync``, rename);
* ``mode="r+"`` again: the leaves have their own files already, nothing copied.

Prints the median and minimum over ``ROUNDS`` rounds (a new root each), and the load average,
since the copy is disk-bound and shares the disk with whatever else runs.

Usage, from a checkout:

    PYTHONPATH=. .venv/bin/python benchmarks/unshare_cost.py DEST_DIR [ROUNDS] [MIB] [LEAVES]
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time

import torch

import memtree


def main(dest: str, rounds: int = 5, mib: int = 100, leaves: int = 4) -> None:
    times: dict[str, list[float]] = {"r": [], "r+ first": [], "r+ again": []}
    numel = mib * 2**20 // 4 // leaves
    for _ in range(rounds):
        root = tempfile.mkdtemp(dir=dest)
        ckpt = memtree.Checkpointer(root)
        state = {f"w{i}": torch.randn(numel) for i in range(leaves)}
        ckpt.save(1, state)
        ckpt.save(2, state)
        assert ckpt.last_stats is not None and ckpt.last_stats.files_linked == leaves, ckpt.last_stats
        for name, kw in (("r", {"mode": "r"}), ("r+ first", {}), ("r+ again", {})):
            start = time.perf_counter()
            tree = memtree.load_memmap(ckpt.path(2), lazy=False, **kw)
            times[name].append(time.perf_counter() - start)
            del tree
        shutil.rmtree(root)
    for name, values in times.items():
        print(f"{name:>9}: median {statistics.median(values) * 1e3:8.1f} ms, min {min(values) * 1e3:8.1f} ms")
    with open("/proc/loadavg") as f:
        print(f"{leaves} leaves, {mib} MiB, {rounds} rounds; load average {f.read().split()[:3]}")


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args:
        sys.exit(__doc__)
    main(args[0], *(int(a) for a in args[1:4]))
