"""W3 dataset: ``datum.expand(N).memmap_like(dir)`` for a (3, 64, 64) uint8 image + int64 label,
then random single-index writes ``data[i] = item`` and random batch reads of 256.

Systems:

* ``memtree tN`` / ``tensordict tN``: ``memmap_like(dir, num_threads=N)``; the ``t0`` rows also
  fill by index and read random batches;
* ``raw`` (the limit): ``mkdir`` + for each leaf ``open``/``ftruncate``/``mmap``; writes are
  bare ``os.pwrite`` of the same bytes at the same offsets; batch reads index the mappings;
* ``raw mmap-store``: the same writes stored through the sparse shared mapping (what a plain
  ``mapped[i] = item`` costs: one page fault and one block allocation per page).

Comparisons (interleaved rounds, every run checked, the target reset before every run):

* ``memmap_like``: a fresh path each run; checked: every leaf of the right shape and dtype, its
  file of exactly its size, its first and last rows zero;
* ``write N``: each run starts from a fresh sparse tree (untimed); checked: every row written
  reads back bit-exact;
* ``read batch 256``: from a tree holding the largest write's items (written untimed); checked:
  every batch equals the expected rows (the written items, zeros elsewhere). The time is
  that of all the batches of a run.
"""

from __future__ import annotations

import mmap
import os
import warnings
from typing import Any, Callable, Iterator

import torch

from checks import CheckFailed, expect_equal
from harness import Comparison, System, remove, wanted

IMG = (3, 64, 64)
BATCH = 256


def _sizes(cfg: dict[str, Any]) -> tuple[int, tuple[int, ...], int]:
    """(items, write counts, read batches)."""
    if cfg["quick"]:
        return 2_000, (50, 100), 5
    return 1_000_000, (1_000, 10_000), 50


SYSTEMS = [
    "memtree t0", "memtree t2", "memtree t8",
    "tensordict t0", "tensordict t2", "tensordict t8",
    "raw", "raw mmap-store",
]  # fmt: skip


def describe(cfg: dict[str, Any]) -> str:
    n, writes, batches = _sizes(cfg)
    return (
        f"{n:,} items of img uint8{list(IMG)} + label int64 ({n * (12288 + 8) / 2**30:.2f} GiB "
        f"apparent); writes {', '.join(f'{w:,}' for w in writes)}; {batches} batches of {BATCH}"
    )


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


def _kind(name: str) -> tuple[str, int]:
    """(``memtree``/``tensordict``/``raw``/``raw mmap-store``, threads) of a system name."""
    if name.startswith("raw"):
        return name, 0
    kind, _, t = name.partition(" t")
    return kind, int(t)


def _missing(kind: str) -> str | None:
    if kind in ("memtree", "tensordict"):
        try:
            __import__(kind)
        except ImportError as err:
            return f"N/A: {err}"
    return None


def _check_fresh(name: str, n: int, path: str) -> Callable[[Any, Any], None]:
    """A ``memmap_like`` result: the right leaves, files of exactly their size, zero rows."""
    kind, _ = _kind(name)

    def check(_: Any, data: Any) -> None:
        img, label = _leaves(kind, data)
        if img.shape != (n, *IMG) or img.dtype != torch.uint8 or label.shape != (n,) or label.dtype != torch.int64:
            raise CheckFailed(f"{name}: leaves {tuple(img.shape)} {img.dtype}, {tuple(label.shape)} {label.dtype}")
        sizes = {f: os.path.getsize(os.path.join(path, f)) for f in ("img.memmap", "label.memmap")
                 if os.path.exists(os.path.join(path, f))}
        if kind == "raw" and sizes != {"img.memmap": n * 12288, "label.memmap": n * 8}:
            raise CheckFailed(f"{name}: files {sizes}")
        for i in (0, n - 1):
            if img[i].any() or int(label[i]) != 0:
                raise CheckFailed(f"{name}: row {i} of a fresh dataset is not zero")

    return check


def comparisons(cfg: dict[str, Any]) -> Iterator[Comparison]:
    n, write_counts, batches = _sizes(cfg)
    wd = os.path.join(cfg["workdir"], "w3")
    os.makedirs(wd, exist_ok=True)
    names = [s for s in SYSTEMS if wanted(s, cfg)]

    def path_of(name: str) -> str:
        return os.path.join(wd, name.replace(" ", "_"))

    def created(name: str) -> System:
        kind, threads = _kind(name)
        p = path_of(name)
        return System(
            name,
            run=lambda _: _create(kind, threads, p, n),
            check=_check_fresh(name, n, p),
            setup=lambda: remove(p),
            limit=kind == "raw",
            missing=_missing(kind),
            output=[p],
        )

    yield Comparison("memmap_like", "", [created(s) for s in names if s != "raw mmap-store"])
    gen = torch.Generator().manual_seed(3)
    by_index = [s for s in names if s.endswith(" t0") or s.startswith("raw")]
    last: tuple[list[int], torch.Tensor, torch.Tensor] | None = None
    for count in write_counts:
        idx = torch.randperm(n, generator=gen)[:count].tolist()
        imgs = torch.randint(0, 256, (count, *IMG), dtype=torch.uint8, generator=gen)
        labels = torch.randint(0, 1000, (count,), dtype=torch.int64, generator=gen)
        last = (idx, imgs, labels)
        yield Comparison(f"write {count:,}", "", [_writing(s, path_of(s), n, idx, imgs, labels) for s in by_index])
    assert last is not None
    readers = [s for s in by_index if s != "raw mmap-store"]
    yield Comparison(f"read batch {BATCH}", "", [_reading(s, path_of(s), n, batches, gen, last) for s in readers])
    for s in names:
        remove(path_of(s))


def _writing(name: str, path: str, n: int, idx: list[int], imgs: torch.Tensor, labels: torch.Tensor) -> System:
    kind, _ = _kind(name)
    write = _writer(kind, path, idx, imgs, labels)

    def setup() -> Any:  # the target reset: a fresh sparse tree
        remove(path)
        os.sync()
        return _create(kind if kind != "raw mmap-store" else "raw", 0, path, n)

    def check(data: Any, _: Any) -> None:
        img, label = _leaves(kind, data)
        at = torch.tensor(idx)
        expect_equal(img[at], imgs, f"{name}: the {len(idx):,} images written")
        expect_equal(label[at], labels, f"{name}: the {len(idx):,} labels written")

    return System(name, run=write, check=check, setup=setup, limit=kind == "raw",
                  missing=_missing(kind.split()[0]), output=[path])


def _reading(
    name: str, path: str, n: int, batches: int, gen: torch.Generator,
    written: tuple[list[int], torch.Tensor, torch.Tensor],
) -> System:
    """Random batches from a tree holding ``written`` (written here, untimed)."""
    kind, _ = _kind(name)
    batch_idx = [torch.randint(0, n, (BATCH,), generator=gen) for _ in range(batches)]
    idx, imgs, labels = written
    where = {i: j for j, i in enumerate(idx)}
    missing = _missing(kind)
    data: Any = None
    if missing is None:
        remove(path)
        data = _create(kind, 0, path, n)
        _writer(kind, path, idx, imgs, labels)(data)
    expect_img, expect_label = [], []
    for b in batch_idx:  # the written items, zeros elsewhere
        ei = torch.zeros((BATCH, *IMG), dtype=torch.uint8)
        el = torch.zeros(BATCH, dtype=torch.int64)
        for row, i in enumerate(b.tolist()):
            if i in where:
                ei[row], el[row] = imgs[where[i]], labels[where[i]]
        expect_img.append(ei)
        expect_label.append(el)

    def read(_: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for b in batch_idx:
            if kind == "raw":
                out.append((data.img[b], data.label[b]))
            else:
                got = data[b]
                out.append((got["img"], got["label"]))
        return out

    def check(_: Any, out: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for k, (img, label) in enumerate(out):
            expect_equal(img, expect_img[k], f"{name}: batch {k}")
            expect_equal(label, expect_label[k], f"{name}: batch {k}")

    return System(name, run=read, check=check, limit=kind == "raw", missing=missing)
