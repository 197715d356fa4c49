"""What an incremental save costs when one small leaf changed: a file per leaf, or packs.

    python benchmarks/pack_incremental.py

W10's tree (5,000 float32 leaves of 4 KiB in 50 groups) is saved, one leaf is changed, and the
next save links from the first (``link_from``, as ``Checkpointer`` does): with ``pack_below=0``
every unchanged leaf is a hard link to its old file and the changed one is written; packed, the
pack holding the changed leaf (all 5,000 here: 20 MB) is written again, whole. Printed per
save: bytes written (``wchar`` of ``/proc/self/io``), files created or linked, and CPU time of
this process (user and system, best of 3): counts of work that a loaded machine leaves
comparable. ``docs/format.md`` ("Packs of small leaves", "Incremental saves") holds the result.
"""

from __future__ import annotations

import os
import resource
import shutil
import tempfile

import torch

from memtree.format.level import Level
from memtree.store.reading.options import WriteOptions
from memtree.store.writing.write import WriteStats, write_tree


def _wchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    g = torch.Generator().manual_seed(0)
    groups = {f"g{i}": Level((), {f"x{j}": torch.rand(1024, generator=g) for j in range(100)}) for i in range(50)}
    base = tempfile.mkdtemp(prefix="pack-incremental-")
    print("layout       bytes written   files written  files linked  CPU s (best of 3)")
    try:
        for label, pack_below in (("file a leaf", 0), ("packed", None)):
            rows = []
            for r in range(3):
                tree = Level((), {k: Level((), dict(v.entries)) for k, v in groups.items()})
                old, new = f"{base}/{label}-{r}-old", f"{base}/{label}-{r}-new"
                write_tree(old, tree, WriteOptions.of(pack_below=pack_below))
                tree.entries["g25"].entries["x50"] = tree.entries["g25"].entries["x50"] + 1
                stats = WriteStats()
                w, c = _wchar(), _cpu()
                write_tree(new, tree, WriteOptions.of(pack_below=pack_below, link_from=old), stats=stats)
                rows.append((_wchar() - w, stats.files_written, stats.files_linked, _cpu() - c))
            best = min(rows, key=lambda x: x[3])
            print(f"{label:<12} {best[0]:>13,} {best[1]:>15,} {best[2]:>13,} {best[3]:>10.3f}")
            shutil.rmtree(base)
            os.mkdir(base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
