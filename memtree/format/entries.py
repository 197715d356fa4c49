"""The classes of a parsed ``meta.json``: :class:`LevelMeta` and its entries.

:mod:`memtree.format.schema` parses and dumps them (and re-exports every name here). They are
immutable value objects (:class:`~memtree.format.record.Record`): dataclasses whose equality,
hash, ``repr`` and immutability are those of ``@dataclass(frozen=True)``, at a sixth of its
cost at import.

Example:
    >>> import dataclasses
    >>> leaf = LeafMeta("w", "w.memmap", "float32", (2, 3))
    >>> leaf == LeafMeta("w", "w.memmap", "float32", (2, 3)), leaf.nbytes
    (True, 24)
    >>> dataclasses.replace(leaf, checksum="crc32:00000000").checksum
    'crc32:00000000'
    >>> leaf.key = "v"
    Traceback (most recent call last):
    dataclasses.FrozenInstanceError: cannot assign to field 'key'
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING, Any, Union

from ..errors import DtypeError
from .chunks import ChunkSums, leaf_sums
from .record import Record
from .dtypes import DTYPE_ITEMSIZES, dtype_from_name
from .dtypes import dtype_name as name_of_dtype

if TYPE_CHECKING:
    import torch

__all__ = [
    "TREE_TYPE",
    "TAG_BYTES",
    "sealed_nbytes",
    "TuplePath",
    "LeafMeta",
    "ChildMeta",
    "JsonMeta",
    "PickleMeta",
    "Subclass",
    "SubclassMeta",
    "Placement",
    "DTensorLayout",
    "Entry",
    "EncryptionMeta",
    "PackMeta",
    "LevelMeta",
]

#: The ``type`` of a plain tree's levels.
TREE_TYPE = "TensorTree"
#: Bytes of the authentication tag after each encrypted chunk.
TAG_BYTES = 16


def sealed_nbytes(nbytes: int, chunk_bytes: int) -> int:
    """Size of an encrypted leaf file: the data plus one tag per chunk (an empty leaf has one
    chunk, so its file holds a tag: never empty).

    Example:
        >>> sealed_nbytes(0, 4096), sealed_nbytes(4096, 4096), sealed_nbytes(4097, 4096)
        (16, 4112, 4129)
    """
    return nbytes + TAG_BYTES * max(1, -(-nbytes // chunk_bytes))


TuplePath = tuple[Union[int, str], ...]
"""Where a tuple sits in a JSON value: array indices and object keys from the value down."""

_set = object.__setattr__


@dataclass(init=False, repr=False, eq=False)
class Placement(Record):
    """One mesh dim of a DTensor: ``"replicate"``, ``"shard"`` along ``dim``, or
    ``"strided_shard"`` along ``dim`` with ``split_factor`` (torch's ``_StridedShard``)."""

    kind: str
    dim: int | None = None
    split_factor: int | None = None

    def __init__(self, kind: str, dim: int | None = None, split_factor: int | None = None) -> None:
        _set(self, "kind", kind)
        _set(self, "dim", dim)
        _set(self, "split_factor", split_factor)


@dataclass(init=False, repr=False, eq=False)
class DTensorLayout(Record):
    """How a DTensor stored as its full tensor was laid out: mesh shape, dim names, placements."""

    mesh: tuple[int, ...]
    placements: tuple[Placement, ...]
    dim_names: tuple[str, ...] | None = None

    def __init__(
        self, mesh: tuple[int, ...], placements: tuple[Placement, ...], dim_names: tuple[str, ...] | None = None
    ) -> None:
        _set(self, "mesh", mesh)
        _set(self, "placements", placements)
        _set(self, "dim_names", dim_names)


@dataclass(init=False, repr=False, eq=False)
class Subclass(Record):
    """What a subclass group records besides its inner tensors.

    Attributes:
        type: the registered name of the class (``"torchao.Int8Tensor"``), never an import path.
        dtype_name: the outer tensor's dtype (a leaf dtype, or a quantized one).
        shape: the outer tensor's shape; its leading dims are the level's batch dims.
        stride: the outer tensor's stride (what ``__tensor_unflatten__`` is given).
        context: the flatten context as tagged JSON (:func:`check_context`).
    """

    type: str
    dtype_name: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    context: Any

    def __init__(self, type: str, dtype_name: str, shape: tuple[int, ...], stride: tuple[int, ...], context: Any) -> None:
        _set(self, "type", type)
        _set(self, "dtype_name", dtype_name)
        _set(self, "shape", shape)
        _set(self, "stride", stride)
        _set(self, "context", context)


@dataclass(init=False, repr=False, eq=False)
class LeafMeta(Record):
    """A tensor leaf: its key, file name, dtype, shape, optional checksum(s) and capacity.

    The dtype is kept as its format name (``dtype_name``; a ``torch.dtype`` given to the
    constructor is turned into its name), so that metadata is parsed without torch; the
    ``dtype`` property gives the torch dtype. ``capacity`` (growable leaves only) is the number
    of rows along dim 0 that the file holds; the tensor is the first ``shape[0]`` of them.
    """

    key: str
    file: str
    dtype_name: str
    shape: tuple[int, ...]
    checksum: str | None = None
    capacity: int | None = None
    #: Plaintext bytes per chunk when the leaf is encrypted (its level's ``encryption``), else None.
    chunk_bytes: int | None = None
    int_key: bool = False
    #: How the DTensor this leaf holds the full tensor of was laid out (format version 3,
    #: :mod:`memtree.format.subclass`), else None.
    layout: DTensorLayout | None = None
    #: The checksum of each chunk of a leaf larger than one chunk (format version 3, instead of
    #: ``checksum``; :mod:`memtree.format.chunks`), else None.
    chunks: ChunkSums | None = None
    #: The pack file (at the tree's root) that holds the leaf's bytes from ``offset`` (format
    #: version 3, :mod:`memtree.format.packs`); ``None`` for a leaf in its own ``file`` (then "").
    pack: str | None = None
    offset: int | None = None

    def __init__(
        self,
        key: str,
        file: str,
        dtype_name: str | torch.dtype,
        shape: tuple[int, ...],
        checksum: str | None = None,
        capacity: int | None = None,
        chunk_bytes: int | None = None,
        int_key: bool = False,
        layout: DTensorLayout | None = None,
        chunks: ChunkSums | None = None,
        pack: str | None = None,
        offset: int | None = None,
    ) -> None:
        _set(self, "key", key)
        _set(self, "file", file)
        _set(self, "dtype_name", dtype_name if isinstance(dtype_name, str) else name_of_dtype(dtype_name))
        _set(self, "shape", shape)
        _set(self, "checksum", checksum)
        _set(self, "capacity", capacity)
        _set(self, "chunk_bytes", chunk_bytes)
        _set(self, "int_key", int_key)
        _set(self, "layout", layout)
        _set(self, "chunks", chunks)
        _set(self, "pack", pack)
        _set(self, "offset", offset)

    @property
    def dtype(self) -> torch.dtype:
        """The leaf's torch dtype (imports torch on first use).

        Raises:
            DtypeError: this torch build lacks the dtype (float8 types need a recent torch).
        """
        dt = dtype_from_name(self.dtype_name)
        if dt is None:
            raise DtypeError(
                f"leaf {self.key!r} ({self.file or self.pack}) holds {self.dtype_name}, which this torch build "
                "does not have; upgrade torch to load it"
            )
        return dt

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes (``numel × itemsize``)."""
        return prod(self.shape) * DTYPE_ITEMSIZES[self.dtype_name]

    @property
    def file_nbytes(self) -> int:
        """Exact size of the leaf's file in bytes: ``nbytes``, or ``capacity`` rows of it, or
        for an encrypted leaf ``nbytes`` plus its tags (:func:`sealed_nbytes`)."""
        if self.chunk_bytes is not None:
            return sealed_nbytes(self.nbytes, self.chunk_bytes)
        if self.capacity is None:
            return self.nbytes
        return self.capacity * prod(self.shape[1:]) * DTYPE_ITEMSIZES[self.dtype_name]

    @property
    def checksum_nbytes(self) -> int:
        """Bytes from the file's start that ``checksum`` covers: the tensor's bytes, or the whole
        file of an encrypted leaf (its ciphertext, which can be checked without the key)."""
        return self.file_nbytes if self.chunk_bytes is not None else self.nbytes

    @property
    def sums(self) -> ChunkSums | None:
        """The leaf's checksums as chunks, whichever way it records them (its one ``checksum``
        is one chunk of ``checksum_nbytes``): :func:`~memtree.format.chunks.leaf_sums`; ``None``
        when it records none."""
        if self.chunks is not None:
            return self.chunks
        return leaf_sums(self.checksum, None, self.checksum_nbytes) if self.checksum is not None else None

    def with_sums(self, sums: str | ChunkSums | None) -> LeafMeta:
        """This leaf recording ``sums`` instead of what it records: a ``"<algorithm>:<hex>"``
        ``checksum``, or the checksums of its chunks (:class:`~memtree.format.chunks.ChunkSums`;
        one chunk is recorded as its ``checksum``), or none.

        Example:
            >>> leaf = LeafMeta("w", "w.memmap", "uint8", (3,))
            >>> leaf.with_sums(ChunkSums("crc32", 3, "0854897f")).checksum
            'crc32:0854897f'
        """
        chunks = sums if isinstance(sums, ChunkSums) else None
        if chunks is not None and chunks.count == 1:
            sums, chunks = chunks.digest(0), None
        checksum = sums if isinstance(sums, str) else None
        summed: LeafMeta = self.evolve(checksum=checksum, chunks=chunks)  # (a packed leaf's pack too)
        return summed


@dataclass(init=False, repr=False, eq=False)
class ChildMeta(Record):
    """A sub-tree stored in the sub-directory ``dir``."""

    key: str
    dir: str
    int_key: bool = False

    def __init__(self, key: str, dir: str, int_key: bool = False) -> None:
        _set(self, "key", key)
        _set(self, "dir", dir)
        _set(self, "int_key", int_key)


@dataclass(init=False, repr=False, eq=False)
class SubclassMeta(ChildMeta):
    """A subclass leaf: its group's directory ``dir`` (walked like a sub-tree's) and ``subclass``."""

    subclass: Subclass = None  # type: ignore[assignment]  # always given: after ChildMeta's defaults

    def __init__(self, key: str, dir: str, subclass: Subclass, int_key: bool = False) -> None:
        super().__init__(key, dir, int_key)
        _set(self, "subclass", subclass)


@dataclass(init=False, repr=False, eq=False)
class JsonMeta(Record):
    """A non-tensor leaf stored inline as a JSON value; ``tuples``: the paths (in ``value``) of the
    arrays that are Python tuples (:func:`memtree.format.values.tuples_to_lists`)."""

    key: str
    value: Any
    int_key: bool = False
    tuples: tuple[TuplePath, ...] | None = None

    def __init__(
        self, key: str, value: Any, int_key: bool = False, tuples: tuple[TuplePath, ...] | None = None
    ) -> None:
        _set(self, "key", key)
        _set(self, "value", value)
        _set(self, "int_key", int_key)
        _set(self, "tuples", tuples)


@dataclass(init=False, repr=False, eq=False)
class PickleMeta(Record):
    """A non-tensor leaf pickled into ``file`` (only with ``allow_pickle=True``)."""

    key: str
    file: str
    int_key: bool = False

    def __init__(self, key: str, file: str, int_key: bool = False) -> None:
        _set(self, "key", key)
        _set(self, "file", file)
        _set(self, "int_key", int_key)


Entry = Union[LeafMeta, ChildMeta, JsonMeta, PickleMeta]


@dataclass(init=False, repr=False, eq=False)
class EncryptionMeta(Record):
    """How a tree's leaves are encrypted (the same object at every level of the tree).

    ``salt`` (32 random bytes, hex) is the per-tree nonce material the keys are derived from;
    ``key_check`` (16 bytes, hex) is derived from the key and the salt, so a wrong key is told
    apart from damaged data. The key itself is never written. ``names``: the levels' entries
    (keys, names, shapes, values) are sealed too, and file names are random.
    """

    algorithm: str
    chunk_bytes: int
    salt: str
    key_check: str
    names: bool = False

    def __init__(self, algorithm: str, chunk_bytes: int, salt: str, key_check: str, names: bool = False) -> None:
        _set(self, "algorithm", algorithm)
        _set(self, "chunk_bytes", chunk_bytes)
        _set(self, "salt", salt)
        _set(self, "key_check", key_check)
        _set(self, "names", names)


@dataclass(init=False, repr=False, eq=False)
class PackMeta(Record):
    """A pack file of small leaves (format version 3, :mod:`memtree.format.packs`): its name at
    the tree's root and its exact size in bytes."""

    file: str
    nbytes: int

    def __init__(self, file: str, nbytes: int) -> None:
        _set(self, "file", file)
        _set(self, "nbytes", nbytes)


@dataclass(init=False, repr=False, eq=False)
class LevelMeta(Record):
    """One level of a tree: its batch size and its entries in key order.

    An encrypted tree's levels carry ``encryption`` and ``mac`` (HMAC-SHA256 of the level's
    ``meta.json`` without the ``mac`` field, bound to the level's place in the tree). With
    encrypted names, a level on disk holds no entry: ``sealed`` is the base64 ciphertext of its
    real ``meta.json`` (which :mod:`memtree.store.primitives.crypto` decrypts and parses).
    """

    batch_size: tuple[int, ...]
    entries: tuple[Entry, ...]
    type: str = TREE_TYPE
    save_id: str | None = None
    #: The root's whole-tree hash (``"<algorithm>:<hex>"``, ``docs/format.md``), else None.
    tree_hash: str | None = None
    encryption: EncryptionMeta | None = None
    mac: str | None = None
    sealed: str | None = None
    #: The root's pack files (format version 3, :mod:`memtree.format.packs`); empty elsewhere.
    packs: tuple[PackMeta, ...] = ()

    def __init__(
        self,
        batch_size: tuple[int, ...],
        entries: tuple[Entry, ...],
        type: str = TREE_TYPE,
        save_id: str | None = None,
        tree_hash: str | None = None,
        encryption: EncryptionMeta | None = None,
        mac: str | None = None,
        sealed: str | None = None,
        packs: tuple[PackMeta, ...] = (),
    ) -> None:
        _set(self, "batch_size", batch_size)
        _set(self, "entries", entries)
        _set(self, "type", type)
        _set(self, "save_id", save_id)
        _set(self, "tree_hash", tree_hash)
        _set(self, "encryption", encryption)
        _set(self, "mac", mac)
        _set(self, "sealed", sealed)
        _set(self, "packs", packs)
