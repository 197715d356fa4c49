"""The workloads: their sizes, their systems (rows) and how one system is measured.

W1 and W2 (stores: save / open / touch / read one) are defined here; W3, W4 and W5 live in
``w3_dataset.py``, ``w4_model.py`` and ``w5_convert.py``. Each workload module offers
``systems(cfg)``, ``prepare(cfg)``, ``run_system(name, cfg)`` and ``limit_of(row)``.
"""

from __future__ import annotations

import os
from math import isqrt
from typing import Any, Callable

import torch

from harness import Result, Settings, disk_usage, measure, remove
from stores import (
    Handle,
    Key,
    Layout,
    Store,
    make_tensors,
    prepare_index,
    read_one,
    save,
    store_systems,
    touch_all,
)

GiB = 1024**3


def slug(name: str) -> str:
    """A file name for a system's output."""
    return "".join(c if c.isalnum() or c in "-." else "_" for c in name)


def caches(settings: Settings) -> list[str]:
    """``["warm", "cold"]``, or ``["warm"]`` when eviction is off."""
    return ["warm"] if settings.cold == "none" else ["warm", "cold"]


# -- W1 big / W2 many small -----------------------------------------------------------------
def w1_layout(cfg: dict[str, Any]) -> Layout:
    """~``size_gib`` of float32 in 16 transformer blocks (12 tensors each) + embedding + norm.

    Quick: 2 tiny blocks (27 tensors).
    """
    layers, vocab = (2, 100) if cfg["quick"] else (16, 32000)
    if cfg["quick"]:
        d = 16
    else:  # 192 d^2 + vocab d = size / 4
        n = cfg["size_gib"] * GiB / 4
        d = max(
            64,
            (-vocab + isqrt(int(vocab * vocab + 4 * 12 * layers * n)))
            // (2 * 12 * layers)
            // 64
            * 64,
        )
    f32 = torch.float32
    out: Layout = [(("embed", "weight"), (vocab, d), f32)]
    for i in range(layers):
        p = ("layers", str(i))
        for sub, shapes in (
            (("attn", "qkv"), ((3 * d, d), (3 * d,))),
            (("attn", "proj"), ((d, d), (d,))),
            (("ln1",), ((d,), (d,))),
            (("mlp", "fc1"), ((4 * d, d), (4 * d,))),
            (("mlp", "fc2"), ((d, 4 * d), (d,))),
            (("ln2",), ((d,), (d,))),
        ):
            out.append((p + sub + ("weight",), shapes[0], f32))
            out.append((p + sub + ("bias",), shapes[1], f32))
    out.append((("ln_f", "weight"), (d,), f32))
    out.append((("ln_f", "bias"), (d,), f32))
    return out


def w2_layout(cfg: dict[str, Any]) -> Layout:
    """20 x 20 x 50 = 20,000 leaves of 256 float32, three levels deep (quick: 2 x 3 x 5)."""
    a, b, c = (2, 3, 5) if cfg["quick"] else (20, 20, 50)
    return [
        ((f"g{i}", f"s{j}", f"x{k}"), (256,), torch.float32)
        for i in range(a)
        for j in range(b)
        for k in range(c)
    ]


def _one_key(workload: str, layout: Layout) -> Key:
    if workload == "w1":  # the middle block's first MLP weight
        blocks = {k[1] for k, _, _ in layout if k[0] == "layers"}
        return ("layers", str(len(blocks) // 2), "mlp", "fc1", "weight")
    return layout[len(layout) // 2][0]


class StoreWorkload:
    """W1 or W2."""

    def __init__(self, name: str, layout: Callable[[dict[str, Any]], Layout]) -> None:
        self.name = name
        self.layout = layout

    def _stores(self) -> dict[str, Store]:
        return {s.name: s for s in store_systems(many_files=self.name == "w2")}

    def systems(self, cfg: dict[str, Any]) -> list[str]:
        return list(self._stores())

    def prepare(self, cfg: dict[str, Any]) -> str:
        layout = self.layout(cfg)
        total = sum(torch.Size(s).numel() * 4 for _, s, _ in layout)
        return f"{len(layout)} tensors, {total / 2**20:,.1f} MiB float32"

    def limit_of(self, row: Result) -> str | None:
        if self.name == "w1" and row.op == "open+touch":
            return "raw"  # target: touch-all <= 1.2x raw mmap
        if self.name == "w2" and row.op == "save":
            return "raw-files"  # target: <= 1.3x the bare file-creation floor
        return None

    def run_system(self, name: str, cfg: dict[str, Any]) -> list[Result]:
        s = self._stores()[name]
        wl = self.name
        miss = s.missing()
        if miss:
            return [Result(wl, name, "*", note=miss)]
        settings = Settings(**cfg["settings"])
        layout = self.layout(cfg)
        prepare_index(layout)
        wd = os.path.join(cfg["workdir"], wl)
        os.makedirs(wd, exist_ok=True)
        path = os.path.join(wd, slug(s.source or s.name))
        rows: list[Result] = []
        if not s.saves and not os.path.exists(path):
            return [Result(wl, name, "*", note=f"N/A: {s.source} wrote no file to read")]
        if s.saves:
            tensors = make_tensors(layout)

            def setup() -> None:
                remove(path)
                os.sync()  # the previous run's dirty pages must not slow this one

            try:
                sec, runs, rss, anon, note = measure(
                    settings, lambda _: save(s, layout, tensors, path), setup=setup
                )
            except Exception as err:  # noqa: BLE001 - an incumbent's limit is a result too
                remove(path)
                if s.limit or s.kind == "memtree":
                    raise
                return [
                    Result(wl, name, "save", note=f"N/A: save fails: {type(err).__name__}: {err}")
                ]
            app, alloc, n = disk_usage([path])
            rows.append(
                Result(wl, name, "save", "", sec, runs, rss, anon, app, alloc, n, s.limit, note)
            )
            del tensors
            if s.reader is None:
                remove(path)
        if s.reader is not None:
            one = _one_key(wl, layout)
            ops: list[tuple[str, Callable[[Handle], Any]]] = [
                ("open", lambda h: None),
                ("open+touch", touch_all),
                ("open+read one", lambda h: read_one(h, one)),
            ]
            for cache in caches(settings):
                for opname, fn in ops:

                    def op(_: Any, fn: Callable[[Handle], Any] = fn) -> tuple[Handle, Any]:
                        h = Handle(s, layout, path)
                        return h, fn(h)

                    sec, runs, rss, anon, note = measure(
                        settings,
                        op,
                        teardown=lambda _, out: out[0].close(),
                        cold_paths=(lambda: [path]) if cache == "cold" else None,
                    )
                    rows.append(
                        Result(
                            wl, name, opname, cache, sec, runs, rss, anon, limit=s.limit, note=note
                        )
                    )
        return rows


def registry() -> dict[str, Any]:
    """Workload name -> workload object."""
    import w3_dataset
    import w4_model
    import w5_convert

    return {
        "w1": StoreWorkload("w1", w1_layout),
        "w2": StoreWorkload("w2", w2_layout),
        "w3": w3_dataset,
        "w4": w4_model,
        "w5": w5_convert,
    }


def run_system(workload: str, system: str, cfg: dict[str, Any]) -> list[Result]:
    """Measure one system of one workload in this process."""
    return registry()[workload].run_system(system, cfg)
