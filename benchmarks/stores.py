"""The systems compared by W1 (big tensors) and W2 (many small leaves): save a nested dict of
tensors, open it, touch every byte, read one tensor.

Every system is a :class:`Store` row; its ``kind`` says which library does the work:

* ``memtree`` / ``tensordict``: ``memmap(path, num_threads=n)`` and ``load_memmap(path)``
  (memtree's is lazy: the root ``meta.json`` at open, each level on first use; the ``memtree
  eager`` row reads the same files with ``load_memmap(path, lazy=False)``);
* ``safetensors``: ``save_file``; read with ``safe_open`` (lazy) or ``load_file`` (eager);
* ``torch``: ``torch.save``; read with ``torch.load`` or ``torch.load(mmap=True)``;
* ``tensorizer``: ``TensorSerializer.write_state_dict``; read eagerly or with ``lazy_load``;
* raw limits: ``raw`` (one file preallocated with ``posix_fallocate``, filled with
  ``os.write``; read by ``mmap``, or by ``preadv``/``readinto`` into one buffer), ``raw-noprealloc``
  (the same without the preallocation), ``raw-files`` (one file per leaf, bare
  ``os.open``/``os.write``/``os.close`` into the same directories; read by mapping every file
  with ``torch.from_file``, which opens, maps privately and closes: the O(files) reference).

The data: W1 (:func:`w1_layout`, a 16-block transformer's 195 float32 tensors, ~1 GiB) and W2
(:func:`w2_layout`, 20,000 leaves of 256 float32), filled by :func:`make_tensors` (seeded).
"""

from __future__ import annotations

import importlib
import mmap
import os
import warnings
from dataclasses import dataclass
from math import isqrt, prod
from typing import Any, Iterator

import torch

from checks import Digest, digest

Key = tuple[str, ...]
Layout = list[tuple[Key, tuple[int, ...], torch.dtype]]


@dataclass
class Store:
    """One system of a store workload."""

    name: str
    kind: str
    threads: int = 0
    saves: bool = True
    reader: str | None = None  # how it reads (None: this row only saves)
    source: str | None = None  # row whose files it reads (default: itself)
    limit: bool = False
    checksum: str | None = "default"  # memtree's checksum= ("default": not given)

    @property
    def requires(self) -> str | None:
        """The module this system needs, or None."""
        return {
            "safetensors": "safetensors",
            "tensordict": "tensordict",
            "tensorizer": "tensorizer",
        }.get(self.kind)

    def missing(self) -> str | None:
        """Why this system cannot run here (not installed), or None."""
        mod = self.requires or "memtree"
        try:
            importlib.import_module(mod)
        except Exception as err:  # noqa: BLE001 - any import failure means "not available"
            return f"N/A: {mod} not importable ({type(err).__name__}: {err})"
        if self.checksum not in ("default", None):
            from memtree.store.primitives.checksums import available_checksums

            if self.checksum not in available_checksums():
                return f"N/A: checksum {self.checksum!r} not installed (the fast-checksums extra)"
        return None


def reading_store(store: Store) -> Store:
    """The reader of what ``store`` writes (a save is checked by reading it back with it)."""
    reader = {"memtree": "mmap", "tensordict": "mmap", "safetensors": "load_file",
              "torch": "load_mmap", "tensorizer": "eager", "raw": "mmap", "raw-noprealloc": "mmap",
              "raw-files": "mmap"}[store.kind]
    kind = "raw" if store.kind == "raw-noprealloc" else store.kind
    return Store(store.name, kind, reader=reader)


def store_systems(many_files: bool) -> list[Store]:
    """The rows of W1 (``many_files=False``) or W2, producers before their readers.

    W1 also saves with each checksum setting at 2 threads (``memtree t2 no checksum``,
    ``... xxh3``: the fast-checksums extra's default, ``... crc32``: the standard library's):
    what checksums by default cost a save.
    """
    rows: list[Store] = []
    for kind in ("memtree", "tensordict"):
        rows.append(Store(f"{kind} t0", kind, 0, reader="mmap"))
        if kind == "memtree":  # load_memmap(lazy=False): every level validated and mapped at open
            rows.append(Store("memtree eager", kind, saves=False, reader="eager", source="memtree t0"))
        rows.append(Store(f"{kind} t2", kind, 2))
        rows.append(Store(f"{kind} t8", kind, 8))
        if kind == "memtree" and not many_files:
            for checksum, label in ((None, "no checksum"), ("xxh3", "xxh3"), ("crc32", "crc32")):
                rows.append(Store(f"memtree t2 {label}", kind, 2, checksum=checksum))
    rows += [
        Store("safetensors", "safetensors", reader="safe_open"),
        Store(
            "safetensors load_file",
            "safetensors",
            saves=False,
            reader="load_file",
            source="safetensors",
        ),
        Store("torch.save/load", "torch", reader="load"),
        Store(
            "torch.load(mmap)", "torch", saves=False, reader="load_mmap", source="torch.save/load"
        ),
        Store("tensorizer", "tensorizer", reader="eager"),
        Store("tensorizer lazy", "tensorizer", saves=False, reader="lazy", source="tensorizer"),
        Store("raw", "raw", reader="mmap", limit=True),
        Store("raw-noprealloc", "raw-noprealloc", limit=True),
        Store("raw readinto", "raw", saves=False, reader="readinto", source="raw", limit=True),
    ]
    if many_files:
        rows.append(Store("raw-files", "raw-files", reader="mmap", limit=True))
    return rows


# -- data -----------------------------------------------------------------------------------
GiB = 1024**3


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


def nest(layout: Layout, tensors: list[torch.Tensor]) -> dict[str, Any]:
    """Nested dict ``{"a": {"b": t}}`` from keys ``("a", "b")``."""
    root: dict[str, Any] = {}
    for (key, _, _), t in zip(layout, tensors):
        node = root
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = t
    return root


def flat_name(key: Key) -> str:
    """The dotted name of a key (``state_dict`` style)."""
    return ".".join(key)


def make_tensors(layout: Layout, seed: int = 0) -> list[torch.Tensor]:
    """Random tensors of the layout's shapes (uniform, so that nothing compresses)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.empty(shape, dtype=dtype).uniform_(generator=gen) for _, shape, dtype in layout]


def expected(layout: Layout, tensors: list[torch.Tensor]) -> dict[Key, Digest]:
    """The digest of every tensor, by key: what any read of the saved data must give."""
    return {key: digest(t) for (key, _, _), t in zip(layout, tensors)}


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return prod(shape) * dtype.itemsize


_INDEX: dict[int, tuple[list[int], int, dict[Key, int]]] = {}


def _offsets(layout: Layout) -> tuple[list[int], int, dict[Key, int]]:
    """Byte offsets, total size and key -> position of a raw file's tensors.

    The raw limit knows its layout without reading anything: computed once per layout (by
    :func:`prepare_index`, before any measurement), never inside a timed run.
    """
    if id(layout) not in _INDEX:
        offs, at = [], 0
        for _, shape, dtype in layout:
            offs.append(at)
            at += _nbytes(shape, dtype)
        _INDEX[id(layout)] = (offs, at, {k: i for i, (k, _, _) in enumerate(layout)})
    return _INDEX[id(layout)]


def prepare_index(layout: Layout) -> None:
    """Compute the raw limit's index of ``layout`` now (outside the timed runs)."""
    _offsets(layout)


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]


# -- save -----------------------------------------------------------------------------------
def save(store: Store, layout: Layout, tensors: list[torch.Tensor], path: str) -> Any:
    """Write the tensors in the store's format at ``path``; returns whatever the API returns."""
    kind = store.kind
    if kind == "memtree":
        from memtree import TensorTree

        extra = {} if store.checksum == "default" else {"checksum": store.checksum}
        return TensorTree(nest(layout, tensors)).memmap(path, num_threads=store.threads, **extra)
    if kind == "tensordict":
        from tensordict import TensorDict

        return TensorDict(nest(layout, tensors), batch_size=[]).memmap(
            path, num_threads=store.threads
        )
    flat = {flat_name(k): t for (k, _, _), t in zip(layout, tensors)}
    if kind == "safetensors":
        from safetensors.torch import save_file

        return save_file(flat, path)
    if kind == "torch":
        return torch.save(flat, path)
    if kind == "tensorizer":
        from tensorizer import TensorSerializer

        ser = TensorSerializer(path)
        ser.write_state_dict(flat)
        ser.close()
        return None
    if kind in ("raw", "raw-noprealloc"):
        _, total, _ = _offsets(layout)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            if kind == "raw" and total:
                os.posix_fallocate(fd, 0, total)
            for t in tensors:
                _write_all(fd, _bytes(t))
        finally:
            os.close(fd)
        return None
    if kind == "raw-files":  # every directory first, then the files (the faster order on ext4)
        os.mkdir(path)
        for d in dict.fromkeys(os.path.join(path, *key[:-1]) for key, _, _ in layout):
            os.makedirs(d, exist_ok=True)
        for (key, _, _), t in zip(layout, tensors):
            fd = os.open(
                os.path.join(path, *key), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644
            )
            try:
                _write_all(fd, _bytes(t))
            finally:
                os.close(fd)
        return None
    raise ValueError(kind)


# -- read -----------------------------------------------------------------------------------
class Handle:
    """An opened store: ``get(key)`` one tensor, ``all()`` every tensor, ``close()``."""

    def __init__(self, store: Store, layout: Layout, path: str) -> None:
        self.store, self.layout, self.path = store, layout, path
        self.reader = store.reader
        self._closers: list[Any] = []
        r = self.reader
        if store.kind == "memtree":
            from memtree import load_memmap

            self.obj: Any = load_memmap(path, lazy=r != "eager")
        elif store.kind == "tensordict":
            from tensordict import TensorDict

            self.obj = TensorDict.load_memmap(path)
        elif r == "safe_open":
            from safetensors import safe_open

            ctx = safe_open(path, framework="pt")
            self.obj = ctx.__enter__()
            self._closers.append(lambda: ctx.__exit__(None, None, None))
        elif r == "load_file":
            from safetensors.torch import load_file

            self.obj = load_file(path)
        elif r == "load":
            self.obj = torch.load(path, weights_only=True)
        elif r == "load_mmap":
            self.obj = torch.load(path, weights_only=True, mmap=True)
        elif store.kind == "tensorizer":
            from tensorizer import TensorDeserializer

            self.obj = TensorDeserializer(path, device="cpu", lazy_load=r == "lazy")
            self._closers.append(self.obj.close)
        elif store.kind == "raw" and r == "mmap":
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                size = os.fstat(fd).st_size
                self.obj = mmap.mmap(fd, size, access=mmap.ACCESS_COPY) if size else b""
            finally:
                os.close(fd)
            self.offsets, _, self._index = _offsets(layout)
        elif r == "readinto":
            self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            self._closers.append(lambda: os.close(self.fd))
            self.offsets, _, self._index = _offsets(layout)
        elif store.kind == "raw-files":  # open + private mmap + close per file (no fd kept)
            self.obj = {
                key: torch.from_file(
                    os.path.join(path, *key), shared=False, size=prod(shape), dtype=dtype
                ).view(shape)
                for key, shape, dtype in layout
            }
        else:
            raise ValueError(f"{store.name} cannot read ({store.kind}, {r})")

    def get(self, key: Key) -> torch.Tensor:
        """One tensor (as the system hands it out: mapped, loaded, or read now)."""
        kind, r = self.store.kind, self.reader
        if kind in ("memtree", "tensordict"):
            return self.obj[key]
        if kind == "raw-files":
            return self.obj[key]
        if r == "safe_open":
            return self.obj.get_tensor(flat_name(key))
        if kind == "raw":
            i = self._index[key]
            _, shape, dtype = self.layout[i]
            if r == "mmap":
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    return torch.frombuffer(
                        self.obj, dtype=dtype, count=prod(shape), offset=self.offsets[i]
                    ).view(shape)
            out = torch.empty(shape, dtype=dtype)
            _preadv_all(self.fd, _bytes(out), self.offsets[i])
            return out
        return self.obj[flat_name(key)]

    def all(self) -> Iterator[torch.Tensor]:
        """Every tensor, in layout order."""
        if self.store.kind == "raw" and self.reader == "readinto":
            _, total, _ = _offsets(self.layout)
            buf = torch.empty(total, dtype=torch.uint8)
            _preadv_all(self.fd, _bytes(buf), 0)
            for (_, shape, dtype), off in zip(self.layout, self.offsets):
                yield buf[off : off + _nbytes(shape, dtype)].view(dtype).view(shape)
            return
        for key, _, _ in self.layout:
            yield self.get(key)

    def close(self) -> None:
        """Release files and mappings."""
        for c in self._closers:
            c()
        self._closers.clear()
        self.obj = None


def _preadv_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done : done + (64 << 20)]], offset + done)
        if n <= 0:
            raise OSError("short read")
        done += n


def touch_all(handle: Handle) -> float:
    """Read every byte (a float sum over every tensor, the same work for every system)."""
    acc = 0.0
    for t in handle.all():
        acc += float(t.detach().sum())
    return acc


def read_one(handle: Handle, key: Key) -> torch.Tensor:
    """Copy one tensor out (so that its bytes are really read)."""
    return handle.get(key).clone()
