"""W11 (issue 28): 5,000 float32 leaves of 4 KiB in 50 groups (20 MB): many small leaves.

W2's comparisons on this layout (``store_workloads.StoreWorkload``: ``save``, ``open``,
``open+touch`` (every byte read), ``open+read one``, warm and cold, every system of
``stores.store_systems``), plus:

* ``copy (cp -r)``, warm: the artifact each system saved, copied with ``cp -r`` (what a backup,
  an upload or a move to another disk costs: per-file work for a tree of many files); the copy
  is read back and checked;
* the files each memtree save made, as the metric ``files beyond one per level and per 64 MiB
  packed``: its files minus one per level (its ``meta.json``) and one per 64 MiB of the packs
  the root lists (format version 3, ``docs/format.md``, "Packs of small leaves"); 0 or less when
  the layout is as the issue asks.

Quick: 5 groups of 20 leaves.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any, Iterator

import orjson
import torch

from checks import expect_digests
from harness import Comparison, System, remove, slug, wanted
from store_workloads import StoreWorkload
from stores import Handle, Key, Layout, Store, expected, make_tensors, reading_store

#: A pack holds at most this many bytes (memtree.format.packs.PACK_MAX_BYTES).
PACK_BYTES = 64 * 1024 * 1024
FILES_METRIC = "files beyond one per level and per 64 MiB packed"


def w11_layout(cfg: dict[str, Any]) -> Layout:
    """50 groups of 100 float32 leaves of 1,024 elements (quick: 5 × 20, enough to be packed)."""
    groups, per = (5, 20) if cfg["quick"] else (50, 100)
    return [((f"g{i}", f"x{j}"), (1024,), torch.float32) for i in range(groups) for j in range(per)]


def files_beyond_the_bound(path: str) -> int:
    """Files of a memtree directory beyond one per level and one per 64 MiB of packed data."""
    files = levels = 0
    for _, _, names in os.walk(path):
        files += len(names)
        levels += "meta.json" in names
    with open(os.path.join(path, "meta.json"), "rb") as f:
        packed = sum(p["nbytes"] for p in orjson.loads(f.read()).get("packs", []))
    return files - levels - -(-packed // PACK_BYTES)


class SmallLeaves(StoreWorkload):
    """W11: W2's comparisons on 5,000 leaves of 4 KiB, the files metric and ``cp -r``."""

    def __init__(self) -> None:
        super().__init__("w11", w11_layout)

    def comparisons(self, cfg: dict[str, Any]) -> Iterator[Comparison]:
        yield from super().comparisons(cfg)
        layout = self.layout(cfg)
        wd = os.path.join(cfg["workdir"], self.name)
        want = expected(layout, make_tensors(layout))
        savers = [s for s in self.stores() if s.saves and s.reader is not None and wanted(s.name, cfg)]
        yield Comparison("copy (cp -r)", "warm", [self._copier(s, layout, wd, want) for s in savers])

    def _saver(self, s: Store, layout: Layout, tensors: list[torch.Tensor], want: dict[Key, Any], wd: str) -> System:
        system = super()._saver(s, layout, tensors, want, wd)
        if s.kind != "memtree":
            return system
        path = os.path.join(wd, slug(s.name))
        check = system.check

        def with_files(state: Any, out: Any) -> dict[str, float]:
            check(state, out)
            return {FILES_METRIC: float(files_beyond_the_bound(path))}

        system.check = with_files
        return system

    def _copier(self, s: Store, layout: Layout, wd: str, want: dict[Key, Any]) -> System:
        source = os.path.join(wd, slug(s.name))
        target = os.path.join(wd, slug(s.name) + ".copy")

        def setup() -> None:
            remove(target)
            os.sync()  # the previous copy's dirty pages must not slow this one

        def run(_: Any) -> None:
            subprocess.run(["cp", "-r", source, target], check=True)

        def check(_: Any, out: Any) -> None:
            h = Handle(reading_store(s), layout, target)
            try:
                expect_digests(h.get, want, f"{s.name}: the copy read back")
            finally:
                h.close()

        missing = s.missing() or (None if os.path.exists(source) else f"N/A: {s.name} saved nothing to copy")
        return System(s.name, run=run, check=check, setup=setup, files=[source], limit=s.limit,
                      missing=missing, output=[target])


W11 = SmallLeaves()
