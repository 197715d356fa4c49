"""W3 dataset: ``datum.expand(N).memmap_like(dir)`` for a (3, 64, 64) uint8 image + int64 label,
then random single-index writes ``data[i] = item`` and random batch reads of 256.

Rows:

* ``memtree tN`` / ``tensordict tN``: ``memmap_like(dir, num_threads=N)``; the ``t0`` rows also
  fill by index (each timed run starts from a fresh sparse tree) and read random batches;
* ``raw`` (the limit): ``mkdir`` + for each leaf ``open``/``ftruncate``/``mmap``; writes are
  bare ``os.pwrite`` of the same bytes at the same offsets; batch reads index the mappings;
* ``raw mmap-store``: the same writes stored through the sparse shared mapping (what a plain
  ``mapped[i] = item`` costs: one page fault and one block allocation per page).

After every write run the last item written is read back through the mapping and compared.
"""

from __future__ import annotations

import mmap
import os
import warnings
from dataclasses import replace
from typing import Any, Callable

import torch

from harness import Result, Settings, disk_usage, measure, remove

IMG = (3, 64, 64)
BATCH = 256


def _sizes(cfg: dict[str, Any]) -> tuple[int, tuple[int, ...], int]:
    """(items, write counts, read batches)."""
    if cfg["quick"]:
        return 2_000, (50, 100), 5
    return 1_000_000, (1_000, 10_000), 50


def systems(cfg: dict[str, Any]) -> list[str]:
    return [
        "memtree t0", "memtree t2", "memtree t8",
        "tensordict t0", "tensordict t2", "tensordict t8",
        "raw", "raw mmap-store",
    ]  # fmt: skip


def prepare(cfg: dict[str, Any]) -> str:
    n, writes, batches = _sizes(cfg)
    return (
        f"{n:,} items of img uint8{list(IMG)} + label int64 ({n * (12288 + 8) / 2**30:.2f} GiB "
        f"apparent); writes {', '.join(f'{w:,}' for w in writes)}; {batches} batches of {BATCH}"
    )


def limit_of(row: Result) -> str | None:
    return "raw"


class _Raw:
    """The bare files: ``ftruncate`` + shared ``mmap``."""

    def __init__(self, path: str, n: int) -> None:
        os.mkdir(path)
        self.path = path
        self.maps: list[mmap.mmap] = []
        self.img = self._leaf("img.memmap", n * 12288, torch.uint8, (n, *IMG))
        self.label = self._leaf("label.memmap", n * 8, torch.int64, (n,))

    def _leaf(
        self, name: str, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:
        fd = os.open(
            os.path.join(self.path, name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644
        )
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.maps.append(mm)
        return torch.frombuffer(mm, dtype=dtype).view(shape)


def _create(kind: str, threads: int, path: str, n: int) -> Any:
    datum = {
        "img": torch.zeros(IMG, dtype=torch.uint8),
        "label": torch.zeros((), dtype=torch.int64),
    }
    if kind == "memtree":
        from memtree import TensorTree

        return TensorTree(datum).expand(n).memmap_like(path, num_threads=threads)
    if kind == "tensordict":
        from tensordict import TensorDict

        return TensorDict(datum, batch_size=[]).expand(n).memmap_like(path, num_threads=threads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _Raw(path, n)


def _leaves(kind: str, data: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if kind.startswith("raw"):
        return data.img, data.label
    return data["img"], data["label"]


def _writer(
    kind: str, path: str, idx: list[int], imgs: torch.Tensor, labels: torch.Tensor
) -> Callable[[Any], Any]:
    if kind == "memtree":
        from memtree import TensorTree

        items: list[Any] = [
            TensorTree({"img": imgs[j], "label": labels[j]}) for j in range(len(idx))
        ]
    elif kind == "tensordict":
        from tensordict import TensorDict

        items = [
            TensorDict({"img": imgs[j], "label": labels[j]}, batch_size=[]) for j in range(len(idx))
        ]

    def by_index(data: Any) -> None:
        for j, i in enumerate(idx):
            data[i] = items[j]

    def by_mapping(data: Any) -> None:
        img, label = data.img, data.label
        for j, i in enumerate(idx):
            img[i] = imgs[j]
            label[i] = labels[j]

    img_bytes = memoryview(imgs.reshape(-1).numpy())
    lbl_bytes = memoryview(labels.view(torch.uint8).numpy())

    def by_pwrite(data: Any) -> None:
        fi = os.open(os.path.join(path, "img.memmap"), os.O_WRONLY | os.O_CLOEXEC)
        fl = os.open(os.path.join(path, "label.memmap"), os.O_WRONLY | os.O_CLOEXEC)
        try:
            for j, i in enumerate(idx):
                os.pwrite(fi, img_bytes[j * 12288 : (j + 1) * 12288], i * 12288)
                os.pwrite(fl, lbl_bytes[j * 8 : (j + 1) * 8], i * 8)
        finally:
            os.close(fi)
            os.close(fl)

    if kind == "raw":
        return by_pwrite
    return by_mapping if kind == "raw mmap-store" else by_index


def run_system(name: str, cfg: dict[str, Any]) -> list[Result]:
    kind, _, t = name.partition(" t")
    threads = int(t) if t else 0
    if kind == "raw mmap-store" or name == "raw":
        kind = name
    lib = {"memtree": "memtree", "tensordict": "tensordict"}.get(kind)
    if lib is not None:
        try:
            __import__(lib)
        except ImportError as err:
            return [Result("w3", name, "*", note=f"N/A: {err}")]
    settings = Settings(**cfg["settings"])
    n, write_counts, batches = _sizes(cfg)
    wd = os.path.join(cfg["workdir"], "w3")
    os.makedirs(wd, exist_ok=True)
    path = os.path.join(wd, name.replace(" ", "_"))
    rows: list[Result] = []

    def fresh() -> None:
        remove(path)

    if kind != "raw mmap-store":
        sec, runs, rss, anon, note = measure(
            settings, lambda _: _create(kind, threads, path, n), setup=fresh
        )
        app, alloc, files = disk_usage([path])
        rows.append(
            Result(
                "w3",
                name,
                "memmap_like",
                "",
                sec,
                runs,
                rss,
                anon,
                app,
                alloc,
                files,
                kind == "raw",
                note,
            )
        )
    if threads != 0:
        remove(path)
        return rows

    gen = torch.Generator().manual_seed(3)
    for count in write_counts:
        idx = torch.randperm(n, generator=gen)[:count].tolist()
        imgs = torch.randint(0, 256, (count, *IMG), dtype=torch.uint8, generator=gen)
        labels = torch.randint(0, 1000, (count,), dtype=torch.int64, generator=gen)
        write = _writer(kind, path, idx, imgs, labels)
        checks: list[str] = []

        def setup() -> Any:
            remove(path)
            os.sync()
            return _create(kind if kind != "raw mmap-store" else "raw", 0, path, n)

        def check(data: Any, _: Any) -> None:
            img, label = _leaves(kind, data)
            if not (torch.equal(img[idx[-1]], imgs[-1]) and int(label[idx[-1]]) == int(labels[-1])):
                checks.append("WRONG DATA read back")

        # the larger count runs after the smaller one warmed the path up
        s = settings if count == write_counts[0] else replace(settings, warmup=0)
        sec, runs, rss, anon, note = measure(
            s, lambda data: write(data), setup=setup, teardown=check
        )
        app, alloc, files = disk_usage([path])
        note = "; ".join(x for x in [note, *sorted(set(checks))] if x)
        rows.append(
            Result(
                "w3",
                name,
                f"write {count:,}",
                "",
                sec,
                runs,
                rss,
                anon,
                app,
                alloc,
                files,
                kind == "raw",
                note,
            )
        )

    if kind == "raw mmap-store":
        remove(path)
        return rows
    remove(path)
    data = _create(kind, 0, path, n)
    batch_idx = [torch.randint(0, n, (BATCH,), generator=gen) for _ in range(batches)]

    def read(_: Any) -> None:
        for b in batch_idx:
            if kind == "raw":
                out = (data.img[b], data.label[b])
            else:
                out = data[b]
            del out

    sec, runs, rss, anon, note = measure(settings, read)
    rows.append(
        Result(
            "w3",
            name,
            f"read batch {BATCH}",
            "",
            sec / batches,
            [r / batches for r in runs],
            rss,
            anon,
            limit=kind == "raw",
            note=(note + "; " if note else "") + "seconds per batch",
        )
    )
    del data
    remove(path)
    return rows
