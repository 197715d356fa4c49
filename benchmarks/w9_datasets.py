"""W9 datasets: a map-style dataset filled by index and read in random batches, six ways.

The dataset of issue 28: ``n`` rows (50,000; quick 512) of ``img`` uint8 (3, 32, 32), ``vec``
float32 (8,) and ``y`` float32, stored by each system in its own way:

* ``memtree``: a tree (``memmap_like`` to fill, ``memmap`` to read), ``tree[idx]``;
* ``numpy memmap``: one ``.npy`` file per leaf (``open_memmap``), fancy indexing
  ``arr[idx]``, wrapped with ``torch.from_numpy`` (no copy);
* ``tensordict``: ``TensorDict.memmap_like`` / ``memmap``, ``td[idx]``;
* ``h5py``: one HDF5 file, a dataset per leaf (contiguous; chunked by 256 rows where it must
  grow); HDF5 reads rows in increasing order without repeats, so a batch is read as its sorted
  unique rows and put back in order;
* ``zarr``: a zarr v3 group, an array per leaf, chunks of one row in shards of 64 KiB
  (as many rows as fit, at least one), uncompressed, ``arr.oindex[idx]``;
* ``arrow``: a pyarrow IPC file (memory-mapped), a ``FixedSizeBinary`` column per leaf,
  ``table.take(idx)``; a file written once, in order: it cannot be filled by index or grown.

Comparisons (interleaved rounds, every run checked):

* ``fill N items``: a new empty dataset (untimed), then ``N`` random rows (2,000) written one
  item at a time, in this process (``dataset[i] = item``); checked: every row written reads
  back exactly;
* ``fill <S> rows``, S = 4 KiB, 64 KiB, 1 MiB: a dataset of one leaf of S-byte rows (32 MiB;
  quick 1 MiB) filled by index in random order by ``1 writer`` or ``2 writers``: processes
  forked and opened before the clock starts, each writing its share (interleaved) of the rows;
  checked: every row of the dataset is the one written (a row lost by a concurrent writer fails
  the check); HDF5 has no concurrent writers without parallel HDF5 (MPI), and Arrow files are
  written once (N/A);
* ``random batch 256``, warm and cold: batches of 256 random rows (repeats allowed; 200 warm,
  20 cold), the files read first (warm: the handle opened before the clock starts) or evicted
  (cold, verified with ``mincore``: the handle is opened by the timed run, since a mapping made
  before would keep the pages it touched); checked: every batch against the source rows; disk
  used (apparent and allocated bytes, files) is recorded on these rows;
* ``DataLoader 2 workers``, warm and cold: ``DataLoader(dataset, sampler=..., batch_size=None,
  num_workers=2)`` (fork) over the batches of memtree's ``BatchIndexSampler`` (shuffled,
  sorted within a batch), one epoch of ``dl_batches`` batches timed from the loader's creation
  (worker start included) to the last batch; memtree's dataset is the tree itself, the others a
  ``Dataset`` whose ``__getitem__(idx)`` reads the batch as above; checked: every batch;
* ``append K rows``: a dataset of ``n`` rows (untimed), then ``K`` rows appended in chunks of
  256 (memtree ``extend_``; h5py ``resize`` + assignment; zarr ``append``); checked: the length
  and the appended rows. A ``.npy`` memmap, tensordict's memmap and an Arrow file cannot grow in
  place (N/A).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import warnings
from typing import Any, Iterator

import numpy as np
import torch

from checks import CheckFailed
from harness import Comparison, System, Unsupported, remove, wanted

LEAVES: dict[str, tuple[tuple[int, ...], Any]] = {
    "img": ((3, 32, 32), np.uint8),
    "vec": ((8,), np.float32),
    "y": ((), np.float32),
}
BATCH = 256
SHARD_BYTES = 64 << 10  # zarr: bytes per shard (one row per chunk, as many rows as fit)
H5_CHUNK = 256  # h5py: rows per chunk of a dataset that grows
SYSTEMS = ["memtree", "numpy memmap", "tensordict", "h5py", "zarr", "arrow"]
ROW_SIZES = ((4096, "4 KiB"), (65536, "64 KiB"), (1 << 20, "1 MiB"))
FORK = mp.get_context("fork")
TIMEOUT = 600.0  # seconds a writer process may take to report


def sizes(cfg: dict[str, Any]) -> dict[str, int]:
    """The workload's sizes (``quick``: a smoke test)."""
    if cfg["quick"]:
        return {"n": 512, "fill": 40, "warm_batches": 2, "cold_batches": 2, "dl_batches": 3, "grow": 256,
                "writer_bytes": 256 << 10}
    return {"n": 50_000, "fill": 2_000, "warm_batches": 200, "cold_batches": 20, "dl_batches": 100, "grow": 10_240,
            "writer_bytes": 32 << 20}


def describe(cfg: dict[str, Any]) -> str:
    s = sizes(cfg)
    return (f"[read_ahead_kb {_read_ahead_kb(cfg['workdir'])} where the files are: a cold fault through a mapping "
            "reads up to that much around it] " + f"{s['n']:,} rows of img uint8[3, 32, 32], vec float32[8], y float32; fill {s['fill']:,} items; "
            f"{s['warm_batches']} (warm) / {s['cold_batches']} (cold) random batches of {BATCH} in-process, "
            f"{s['dl_batches']} through a DataLoader; "
            f"append {s['grow']:,} rows; writers: {s['writer_bytes'] >> 10:,} KiB of 4 KiB / 64 KiB / 1 MiB rows")


def _read_ahead_kb(path: str) -> str:
    """The read-ahead of the block device holding ``path`` (what a cold mapping reads per fault)."""
    st = os.stat(path)
    base = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    for where in (f"{base}/queue/read_ahead_kb", f"{base}/../queue/read_ahead_kb"):
        try:
            with open(where) as f:
                return f.read().strip()
        except OSError:
            continue
    return "unknown"


# -- the systems --------------------------------------------------------------------------------
class Layout:
    """How one system stores, fills, reads and grows a dataset of :data:`LEAVES`-like leaves."""

    name = ""
    module = ""  # the package it needs
    concurrent: str | None = None  # why several writer processes cannot fill it (None: they can)
    fillable: str | None = None  # why it cannot be filled by index
    growable: str | None = None  # why it cannot grow in place

    def missing(self) -> str | None:
        try:
            __import__(self.module)
        except ImportError as err:
            return f"N/A: {err}"
        return None

    def create(self, path: str, n: int, leaves: dict[str, Any], growable: bool = False) -> Any:
        """An empty dataset of ``n`` rows, preallocated (sparse where the system allows)."""
        raise NotImplementedError

    def build(self, path: str, src: dict[str, np.ndarray], growable: bool = False) -> None:
        """The whole dataset written from ``src`` (untimed set-up of the reads)."""
        h = self.create(path, len(next(iter(src.values()))), {k: (v.shape[1:], v.dtype) for k, v in src.items()},
                        growable)
        self.write_rows(h, np.arange(len(next(iter(src.values())))), src)
        self.close(h)

    def open(self, path: str, write: bool = False) -> Any:
        """A handle to read (or, ``write``, also write) the dataset, ready to use."""
        raise NotImplementedError

    def close(self, h: Any) -> None:
        """Flush and release a handle."""

    def item(self, src: dict[str, np.ndarray], i: int) -> Any:
        """Row ``i`` of ``src`` as this system writes one item."""
        return {k: v[i, ...] for k, v in src.items()}

    def write_item(self, h: Any, i: int, item: Any) -> None:
        """Row ``i``, leaf by leaf (``h[key][i] = value``)."""
        for k, v in item.items():
            h[k][i] = v

    def write_rows(self, h: Any, idx: np.ndarray, rows: dict[str, np.ndarray]) -> None:
        """Rows ``idx`` (the first ``len(idx)`` rows in one assignment per leaf)."""
        if np.array_equal(idx, np.arange(len(idx))):
            for k, v in rows.items():
                h[k][: len(idx)] = v
        else:
            for j, i in enumerate(idx.tolist()):
                self.write_item(h, i, {k: v[j] for k, v in rows.items()})

    def read(self, h: Any, idx: np.ndarray) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def append(self, h: Any, rows: dict[str, np.ndarray]) -> None:
        raise NotImplementedError

    def length(self, h: Any) -> int:
        raise NotImplementedError

    def dataset(self, path: str) -> Any:
        """The ``Dataset`` a DataLoader reads batches from (each process opens it on first use)."""
        return _Batches(self, path)


class Memtree(Layout):
    name, module = "memtree", "memtree"

    def create(self, path: str, n: int, leaves: dict[str, Any], growable: bool = False) -> Any:
        from memtree import TensorTree

        datum = TensorTree({k: torch.zeros(shape, dtype=_torch_dtype(dt)) for k, (shape, dt) in leaves.items()})
        return datum.expand(n).memmap_like(path)

    def build(self, path: str, src: dict[str, np.ndarray], growable: bool = False) -> None:
        from memtree import TensorTree

        n = len(next(iter(src.values())))
        TensorTree({k: torch.from_numpy(v) for k, v in src.items()}, batch_size=[n]).memmap(path)

    def open(self, path: str, write: bool = False) -> Any:
        import memtree

        tree = memtree.load_memmap(path, mode="r+" if write else "r")
        tree.keys(include_nested=True)  # every level loaded: its leaves mapped (no page read)
        return tree

    def item(self, src: dict[str, np.ndarray], i: int) -> Any:
        return {k: torch.from_numpy(v[i, ...]) for k, v in src.items()}

    def write_item(self, h: Any, i: int, item: Any) -> None:
        h[i] = item

    def read(self, h: Any, idx: np.ndarray) -> Any:
        return h[torch.from_numpy(idx)]

    def append(self, h: Any, rows: dict[str, np.ndarray]) -> None:
        h.extend_({k: torch.from_numpy(v) for k, v in rows.items()})

    def length(self, h: Any) -> int:
        return len(h)

    def dataset(self, path: str) -> Any:
        return self.open(path)  # the tree is the dataset: tree[idx] per batch


class NumpyMemmap(Layout):
    name, module = "numpy memmap", "numpy"
    growable = "a .npy memmap cannot grow in place (a bigger array is a new file, every row copied)"

    def create(self, path: str, n: int, leaves: dict[str, Any], growable: bool = False) -> Any:
        os.mkdir(path)
        return {k: np.lib.format.open_memmap(os.path.join(path, f"{k}.npy"), mode="w+", dtype=dt, shape=(n, *shape))
                for k, (shape, dt) in leaves.items()}

    def open(self, path: str, write: bool = False) -> Any:
        mode = "r+" if write else "r"
        return {f[:-4]: np.load(os.path.join(path, f), mmap_mode=mode) for f in sorted(os.listdir(path))}

    def close(self, h: Any) -> None:
        for a in h.values():
            if a.flags.writeable:
                a.flush()

    def read(self, h: Any, idx: np.ndarray) -> dict[str, torch.Tensor]:
        return {k: torch.from_numpy(a[idx]) for k, a in h.items()}


class Tensordict(Layout):
    name, module = "tensordict", "tensordict"
    growable = "a memory-mapped TensorDict cannot grow in place (torchrl preallocates its maximum size)"

    def create(self, path: str, n: int, leaves: dict[str, Any], growable: bool = False) -> Any:
        from tensordict import TensorDict

        datum = TensorDict({k: torch.zeros(shape, dtype=_torch_dtype(dt)) for k, (shape, dt) in leaves.items()},
                           batch_size=[])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return datum.expand(n).memmap_like(path)

    def build(self, path: str, src: dict[str, np.ndarray], growable: bool = False) -> None:
        from tensordict import TensorDict

        n = len(next(iter(src.values())))
        TensorDict({k: torch.from_numpy(v) for k, v in src.items()}, batch_size=[n]).memmap(path)

    def open(self, path: str, write: bool = False) -> Any:
        from tensordict import TensorDict

        return TensorDict.load_memmap(path)

    def item(self, src: dict[str, np.ndarray], i: int) -> Any:
        return {k: torch.from_numpy(v[i, ...]) for k, v in src.items()}

    def write_item(self, h: Any, i: int, item: Any) -> None:
        h[i] = item

    def read(self, h: Any, idx: np.ndarray) -> dict[str, torch.Tensor]:
        got = h[torch.from_numpy(idx)]
        return {k: got[k] for k in got.keys()}


class H5py(Layout):
    name, module = "h5py", "h5py"
    concurrent = "HDF5 has one writing process per file without parallel HDF5 (MPI-IO)"

    def create(self, path: str, n: int, leaves: dict[str, Any], growable: bool = False) -> Any:
        import h5py

        f = h5py.File(os.path.join(_mkdir(path), "data.h5"), "w")
        for k, (shape, dt) in leaves.items():
            if growable:
                f.create_dataset(k, shape=(n, *shape), dtype=dt, maxshape=(None, *shape), chunks=(H5_CHUNK, *shape))
            else:
                f.create_dataset(k, shape=(n, *shape), dtype=dt)
        return f

    def open(self, path: str, write: bool = False) -> Any:
        import h5py

        return h5py.File(os.path.join(path, "data.h5"), "r+" if write else "r")

    def close(self, h: Any) -> None:
        h.close()

    def read(self, h: Any, idx: np.ndarray) -> dict[str, torch.Tensor]:
        rows, back = np.unique(idx, return_inverse=True)  # HDF5: increasing rows, no repeats
        return {k: torch.from_numpy(h[k][rows][back]) for k in h.keys()}

    def append(self, h: Any, rows: dict[str, np.ndarray]) -> None:
        for k, v in rows.items():
            ds = h[k]
            n = ds.shape[0]
            ds.resize(n + len(v), axis=0)
            ds[n:] = v

    def length(self, h: Any) -> int:
        return int(h[next(iter(h.keys()))].shape[0])


class Zarr(Layout):
    name, module = "zarr", "zarr"

    def create(self, path: str, n: int, leaves: dict[str, Any], growable: bool = False) -> Any:
        import zarr

        g = zarr.open_group(path, mode="w")
        for k, (shape, dt) in leaves.items():
            rows = max(1, SHARD_BYTES // (int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize))
            g.create_array(k, shape=(n, *shape), chunks=(1, *shape), shards=(rows, *shape), dtype=dt,
                           compressors=None, fill_value=0)
        return g

    def open(self, path: str, write: bool = False) -> Any:
        import zarr

        return zarr.open_group(path, mode="r+" if write else "r")

    def read(self, h: Any, idx: np.ndarray) -> dict[str, torch.Tensor]:
        return {k: torch.from_numpy(h[k].oindex[idx]) for k in sorted(h.array_keys())}

    def append(self, h: Any, rows: dict[str, np.ndarray]) -> None:
        for k, v in rows.items():
            h[k].append(v)

    def length(self, h: Any) -> int:
        return int(h[next(iter(h.array_keys()))].shape[0])


class Arrow(Layout):
    name, module = "arrow", "pyarrow"
    concurrent = fillable = "an Arrow IPC file is written once, in order: rows cannot be written by index"
    growable = "an Arrow IPC file is written once: appending rows is writing a new file"

    def build(self, path: str, src: dict[str, np.ndarray], growable: bool = False) -> None:
        import pyarrow as pa

        n = len(next(iter(src.values())))
        cols = {}
        for k, v in src.items():
            width = v[:1].nbytes
            cols[k] = pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), n, [None, pa.py_buffer(np.ascontiguousarray(v))])
        table = pa.table(cols)
        with pa.OSFile(os.path.join(_mkdir(path), "data.arrow"), "wb") as f:
            with pa.ipc.new_file(f, table.schema) as w:
                w.write_table(table, max_chunksize=4096)

    def open(self, path: str, write: bool = False) -> Any:
        import pyarrow as pa

        return pa.ipc.open_file(pa.memory_map(os.path.join(path, "data.arrow"))).read_all()

    def read(self, h: Any, idx: np.ndarray) -> dict[str, torch.Tensor]:
        import pyarrow as pa

        got = h.take(pa.array(idx))
        out = {}
        for k in got.column_names:
            col = got.column(k).combine_chunks()
            width = col.type.byte_width
            raw = np.frombuffer(col.buffers()[1], np.uint8)[col.offset * width:(col.offset + len(col)) * width]
            shape, dt = LEAVES[k]
            out[k] = torch.from_numpy(raw.view(dt).reshape(len(col), *shape))
        return out


LAYOUTS: dict[str, Layout] = {x.name: x for x in (Memtree(), NumpyMemmap(), Tensordict(), H5py(), Zarr(), Arrow())}


class _Batches(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A system's dataset for a DataLoader: ``dataset[idx]`` is a batch (a dict of tensors);
    each process opens the files on first use (HDF5 and zarr handles do not survive a fork)."""

    def __init__(self, layout: Layout, path: str) -> None:
        self.layout, self.path = layout, path
        self.handle: Any = None
        self.pid = -1

    def __len__(self) -> int:
        return 1 << 62  # the sampler decides

    def __getitem__(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.pid != os.getpid():
            self.handle, self.pid = self.layout.open(self.path), os.getpid()
        return self.layout.read(self.handle, idx.numpy())


def _torch_dtype(dt: Any) -> torch.dtype:
    return torch.from_numpy(np.zeros(1, dt)).dtype


def _mkdir(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    return path


def source(n: int, seed: int = 9) -> dict[str, np.ndarray]:
    """The dataset's rows, the same for every system."""
    g = torch.Generator().manual_seed(seed)
    return {
        "img": torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=g).numpy(),
        "vec": torch.randn(n, 8, generator=g).numpy(),
        "y": torch.randn(n, generator=g).numpy(),
    }


def _as_tensors(batch: Any) -> dict[str, torch.Tensor]:
    return {k: batch[k] for k in LEAVES}


def _expect_batch(got: Any, src: dict[str, np.ndarray], idx: np.ndarray, what: str) -> None:
    for k, v in src.items():
        want = torch.from_numpy(v[idx])
        t = got[k]
        if t.dtype != want.dtype or t.shape != want.shape or not torch.equal(t.as_subclass(torch.Tensor), want):
            raise CheckFailed(f"{what}: leaf {k!r} differs ({tuple(t.shape)} {t.dtype})")


# -- comparisons --------------------------------------------------------------------------------
def comparisons(cfg: dict[str, Any]) -> Iterator[Comparison]:
    s = sizes(cfg)
    wd = os.path.join(cfg["workdir"], "w9")
    os.makedirs(wd, exist_ok=True)
    names = [n for n in SYSTEMS if wanted(n, cfg)]
    src = source(s["n"])
    gen = torch.Generator().manual_seed(4)

    yield Comparison(f"fill {s['fill']:,} items", "", [_filling(LAYOUTS[n], wd, src, s["fill"], gen) for n in names])
    for row_bytes, label in ROW_SIZES:
        rows = max(8, s["writer_bytes"] // row_bytes)
        pool = _pool(row_bytes)
        systems = [_writers(LAYOUTS[n], wd, pool, rows, w) for n in names for w in (1, 2)]
        yield Comparison(f"fill {label} rows", "", systems)
    built = {n: os.path.join(wd, f"read-{_slug(n)}") for n in names}
    for n in names:
        if LAYOUTS[n].missing() is None:
            remove(built[n])
            LAYOUTS[n].build(built[n], src)
    batches = [torch.randint(0, s["n"], (BATCH,), generator=gen).numpy() for _ in range(s["warm_batches"])]
    from memtree import BatchIndexSampler

    epoch = list(BatchIndexSampler(s["n"], BATCH, shuffle=True, generator=gen))[: s["dl_batches"]]
    for cache in cfg.get("caches", ["warm", "cold"]):
        count = s["warm_batches"] if cache == "warm" else s["cold_batches"]
        yield Comparison(f"random batch {BATCH}", cache,
                         [_reading(LAYOUTS[n], built[n], src, batches[:count], cache) for n in names])
        yield Comparison("DataLoader 2 workers", cache,
                         [_loading(LAYOUTS[n], built[n], src, epoch) for n in names])
    yield Comparison(f"append {s['grow']:,} rows", "", [_growing(LAYOUTS[n], wd, src, s["grow"], gen) for n in names])
    for p in built.values():
        remove(p)


def _slug(name: str) -> str:
    return name.replace(" ", "_")


def _filling(layout: Layout, wd: str, src: dict[str, np.ndarray], count: int, gen: torch.Generator) -> System:
    n = len(src["y"])
    path = os.path.join(wd, f"fill-{_slug(layout.name)}")
    order = torch.randperm(n, generator=gen)[:count].numpy()
    leaves = {k: (v.shape[1:], v.dtype) for k, v in src.items()}
    items = [layout.item(src, int(i)) for i in order] if layout.missing() is None and not layout.fillable else []

    def setup() -> Any:
        if layout.fillable:
            raise Unsupported(layout.fillable)
        remove(path)
        return layout.create(path, n, leaves)

    def run(h: Any) -> None:
        for i, item in zip(order.tolist(), items):
            layout.write_item(h, i, item)
        layout.close(h)

    def check(_: Any, __: Any) -> None:
        h = layout.open(path)
        try:
            _expect_batch(layout.read(h, np.sort(order)), src, np.sort(order), f"{layout.name}: rows filled")
        finally:
            layout.close(h)

    return System(layout.name, run=run, check=check, setup=setup, missing=layout.missing(), output=[path])


def _pool(row_bytes: int) -> torch.Tensor:
    """The rows the writers write (row ``i`` is ``pool[i % len(pool)]``; no byte is zero, so a
    row never written is told apart): a prime number of them, 16 MiB at most."""
    count = next(p for p in (251, 61, 13, 7) if p * row_bytes <= 16 << 20 or p == 7)
    return torch.randint(1, 256, (count, row_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(count))


def _writers(layout: Layout, wd: str, pool: torch.Tensor, rows: int, writers: int) -> System:
    """``writers`` forked processes filling every row of a one-leaf dataset by index."""
    name = f"{layout.name} {writers} writer{'s' if writers > 1 else ''}"
    path = os.path.join(wd, f"writers-{_slug(name)}")
    leaves = {"x": (tuple(pool.shape[1:]), np.uint8)}
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(rows)).numpy()
    why = layout.fillable or (layout.concurrent if writers > 1 else None)

    def setup() -> list[Any]:
        if why:
            raise Unsupported(why)
        remove(path)
        layout.close(layout.create(path, rows, leaves))
        procs = []
        for w in range(writers):
            go_recv, go_send = FORK.Pipe(duplex=False)
            done_recv, done_send = FORK.Pipe(duplex=False)
            p = FORK.Process(target=_writer, args=(layout, path, order[w::writers], pool, go_recv, done_send))
            p.start()
            go_recv.close()
            done_send.close()
            if not done_recv.poll(TIMEOUT) or done_recv.recv() != "ready":
                raise CheckFailed(f"{name}: a writer did not start")
            procs.append((p, go_send, done_recv))
        return procs

    def run(procs: list[Any]) -> list[str]:
        for _, go, _ in procs:
            go.send("go")
        return [done.recv() if done.poll(TIMEOUT) else "no answer" for _, _, done in procs]

    def teardown(procs: Any, _: Any) -> None:
        for p, go, done in procs or []:
            p.join(TIMEOUT)
            if p.is_alive():
                p.kill()
            go.close()
            done.close()

    def check(_: Any, answers: list[str]) -> None:
        if answers != ["done"] * writers:
            raise CheckFailed(f"{name}: writers reported {answers}")
        h = layout.open(path)
        try:
            got = layout.read(h, np.arange(rows))["x"]
        finally:
            layout.close(h)
        lost = int((got != pool[torch.arange(rows) % len(pool)]).any(1).sum())
        if lost:
            raise CheckFailed(f"{name}: {lost} of {rows} rows lost")

    return System(name, run=run, check=check, setup=setup, teardown=teardown,
                  missing=layout.missing(), output=[path])


def _writer(layout: Layout, path: str, mine: np.ndarray, pool: torch.Tensor, go: Any, done: Any) -> None:
    try:
        torch.set_num_threads(1)  # as a DataLoader worker does: the parent's OpenMP threads do not survive fork
        h = layout.open(path, write=True)
        rows = [layout.item({"x": pool.numpy()}, int(i) % len(pool)) for i in mine]
        done.send("ready")
        go.recv()
        for i, item in zip(mine.tolist(), rows):
            layout.write_item(h, i, item)
        layout.close(h)
        done.send("done")
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which fails the check
        done.send(f"{type(err).__name__}: {err}")
    finally:
        os._exit(0)


def _reading(layout: Layout, path: str, src: dict[str, np.ndarray], batches: list[np.ndarray], cache: str) -> System:
    """Random batches from an open handle (warm: opened before the clock; cold: opened by the run,
    as a mapping made before would keep the pages it touched in the cache)."""
    def setup() -> Any:
        return layout.open(path) if cache == "warm" else None

    def run(h: Any) -> tuple[Any, list[Any]]:
        h = layout.open(path) if h is None else h
        return h, [layout.read(h, b) for b in batches]

    def check(_: Any, out: tuple[Any, list[Any]]) -> None:
        for k, (b, got) in enumerate(zip(batches, out[1])):
            _expect_batch(got, src, b, f"{layout.name}: batch {k}")

    def teardown(_: Any, out: Any) -> None:
        if out is not None:
            layout.close(out[0])

    return System(layout.name, run=run, check=check, setup=setup, teardown=teardown, files=[path],
                  limit=layout.name == "numpy memmap", missing=layout.missing(), output=[path])


def _loading(layout: Layout, path: str, src: dict[str, np.ndarray], epoch: list[torch.Tensor]) -> System:
    def setup() -> Any:
        return layout.dataset(path)

    def run(dataset: Any) -> list[Any]:
        loader = torch.utils.data.DataLoader(dataset, sampler=epoch, batch_size=None, num_workers=2,
                                             multiprocessing_context="fork")
        return list(loader)

    def check(_: Any, out: list[Any]) -> None:
        if len(out) != len(epoch):
            raise CheckFailed(f"{layout.name}: {len(out)} batches of {len(epoch)}")
        for k, (b, got) in enumerate(zip(epoch, out)):
            _expect_batch(got, src, b.numpy(), f"{layout.name}: batch {k}")

    return System(layout.name, run=run, check=check, setup=setup, files=[path], limit=layout.name == "numpy memmap",
                  missing=layout.missing())


def _growing(layout: Layout, wd: str, src: dict[str, np.ndarray], count: int, gen: torch.Generator) -> System:
    path = os.path.join(wd, f"grow-{_slug(layout.name)}")
    n = len(src["y"])
    new = source(count, seed=11)
    chunks = [{k: v[a : a + BATCH] for k, v in new.items()} for a in range(0, count, BATCH)]

    def setup() -> Any:
        if layout.growable:
            raise Unsupported(layout.growable)
        remove(path)
        layout.build(path, src, growable=True)
        return layout.open(path, write=True)

    def run(h: Any) -> None:
        for chunk in chunks:
            layout.append(h, chunk)
        layout.close(h)

    def check(_: Any, __: Any) -> None:
        h = layout.open(path)
        try:
            if layout.length(h) != n + count:
                raise CheckFailed(f"{layout.name}: {layout.length(h)} rows after appending, expected {n + count}")
            _expect_batch(layout.read(h, np.arange(n, n + count)), new, np.arange(count), f"{layout.name}: appended")
        finally:
            layout.close(h)

    return System(layout.name, run=run, check=check, setup=setup, missing=layout.missing(), output=[path])

