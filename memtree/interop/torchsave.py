"""Lazy, safe reader of ``torch.save`` checkpoints (the role of the zipslicer library).

A ``torch.save`` file (torch >= 1.6, the zip format) is a zip archive whose entries are stored
uncompressed::

    <archive>/data.pkl        the pickled object (a state_dict, a dict of state_dicts, ...)
    <archive>/data/<key>      the raw little-endian bytes of storage <key>, 64-byte aligned
    <archive>/byteorder, version, .format_version, .storage_alignment, .data/serialization_id

In ``data.pkl`` a tensor is a call ``torch._utils._rebuild_tensor_v2(storage, offset, size,
stride, requires_grad, hooks)`` whose ``storage`` is a *persistent id*
``("storage", torch.FloatStorage, "<key>", "cpu", numel)``. This module:

1. reads the zip's central directory (:mod:`zipfile`): no tensor data is read; the local
   header of every storage record (where its data starts) is prefetched at once
   (``POSIX_FADV_WILLNEED``), then read one by one as the pickle names the records;
2. unpickles ``data.pkl`` with :class:`~memtree.interop.unpickler.RestrictedUnpickler`. Its
   ``find_class`` resolves only a closed allowlist (the values ``torch.load(weights_only=True)``
   accepts by default: containers, ``set``, ``bytes``, ``complex``, ``torch.Size``,
   ``torch.device``, dtypes, layouts; storage types; the tensor rebuild functions): any other
   global raises :class:`~memtree.errors.UnsafePickleError` *before* it could be called, so a
   hostile ``__reduce__`` runs nothing. The rebuild functions are replaced by ones that return a
   :class:`TensorRef` (storage key, dtype, offset, size, stride, the ``conj``/``neg`` bits of
   its metadata), and ``persistent_load`` returns a :class:`StorageRef` checked against the zip
   directory, so unpickling reads no data. A tensor memtree cannot read (sparse, quantized,
   nested, meta...) is refused by its key, or left out and listed in
   :attr:`TorchSaveReader.skipped` with ``skip_unsupported=True``.
   How much the pickle may build is bounded too (:mod:`memtree.interop.pickle_guard`): its
   size (a compressed ``data.pkl`` is inflated under that bound), every operation is checked
   and counted before it runs, and the object is flattened in linear time, refusing cycles and
   deep nesting, so a hostile file can neither exhaust memory nor hang the reader;
3. reads one tensor on demand from its storage record: the record's data starts after its
   local file header (30 bytes + name + extra field), and only the bytes the tensor spans are
   read (``pread`` into a new tensor: peak memory is that tensor) or mapped (zero copy, like
   ``torch.load(mmap=True)``); a conjugate or negative view gets its bit, as ``torch.load``
   gives it. Tensors that are views of one storage (tied weights, slices) each
   read their own span; mapped, they share memory;
4. or names, for a contiguous tensor without those bits, the byte range of the file that holds it
   (:meth:`TorchSaveReader.file_range`): a conversion copies that range into the leaf file
   file to file, and the process never holds the tensor.

Every range is checked against its record and the file before it is read, mapped or copied.
The CRC-32 of a record is checked when a ``pread`` reads it whole, when the in-place loader
(:func:`memtree.store.primitives.fill.fill`) reads it whole (by the reader thread, on the bytes it read),
and before a file-to-file copy of a whole record (read through one 64 KiB buffer); mapped views
are not checked (as with ``torch.load``, which checks no CRC-32). The CRC-32 is
:func:`memtree.store.primitives.checksums.crc32`: zlib's, or ISA-L's (about 3.5 times faster) where the
``isal`` package is installed.

``allow_pickle=True`` lets other globals through to :class:`pickle.Unpickler` (trusted files
only); tensors stay lazy either way. Legacy (pre-zip) checkpoints are refused with
:class:`~memtree.errors.LegacyCheckpointError`: reading them needs a full unpickling.

Example:
    >>> import os, tempfile, torch
    >>> from memtree.interop.torchsave import TorchSaveReader
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
    >>> torch.save({"w": torch.arange(6.0).reshape(2, 3), "step": 7}, path)
    >>> with TorchSaveReader(path) as r:
    ...     r.spec("w"), r.read("w")[1].tolist(), r.non_tensors
    ((torch.Size([2, 3]), torch.float32), [3.0, 4.0, 5.0], {'step': 7})
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
import zlib
from typing import Any, Callable

import torch

from ..errors import (
    CheckpointFormatError,
    DtypeError,
    KeyCollisionError,
    LegacyCheckpointError,
    MemtreeError,
    MemtreeKeyError,
    RoutingError,
)
from ..format.dtypes import itemsize
from ..store.primitives.checksums import crc32, file_checksum
from ..store.primitives.files import FileRange, storage_error
from .checkpoint_file import CheckpointFile, Closing
from .pickle_guard import (
    Budget,
    PickleLimits,
    PickleScanner,
    current_limits,
    flatten_pickled,
    limit_error,
)
from .unpickler import RestrictedUnpickler, RoutedStorage, StorageRef, TensorRef, UnreadableTensor

__all__ = [
    "StorageRef",
    "TensorRef",
    "RestrictedUnpickler",
    "TorchSaveReader",
    "is_torch_zip",
    "legacy_message",
    "skipped_error",
]

_READ_CHUNK = 1 << 20  # data.pkl is read (and inflated) and scanned this much at a time
_ZIP_MAGIC = b"PK\x03\x04"
_LOCAL_HEADER = struct.Struct("<4s5H3I2H")  # signature ... name length, extra length


def legacy_message(path: str) -> str:
    """How to turn a legacy (or non-zip) ``torch.save`` file into one memtree can read."""
    return (
        f"{path} is a legacy (pre-zip) torch.save file or a raw pickle; reading it needs a full "
        "unpickling, which can run code. In a trusted environment, load it with torch.load(path, "
        "weights_only=True) (or weights_only=False if you trust it) and re-save it with "
        "torch.save(obj, new_path), which writes the zip format; then convert that file"
    )


def is_torch_zip(head: bytes) -> bool:
    """True if ``head`` (a file's first bytes) starts a zip archive."""
    return head[:4] == _ZIP_MAGIC


def skipped_error(path: str, key: str, what: str) -> MemtreeKeyError:
    """The error for reading ``key``, which ``skip_unsupported=True`` left out (``what`` it is)."""
    return MemtreeKeyError(f"{key!r} of {path} was left out (skip_unsupported=True): it is {what}")


# -- the reader --------------------------------------------------------------------------------
class TorchSaveReader(Closing):
    """A ``torch.save`` zip checkpoint, opened lazily: specs now, data on demand.

    Keys are the dotted paths of the tensors in the pickled object: a state_dict's own keys,
    ``"model.encoder.weight"`` for nested dicts, list items by index. Non-tensor values
    (``"epoch"``, hyper-parameters) are in :attr:`non_tensors`.

    Args:
        path: the checkpoint (``.pt``, ``.pth``, ``.bin``, ...).
        allow_pickle: let the pickle build objects outside the safe allowlist (trusted files).
        limits: bounds on the pickle (default: :func:`~memtree.interop.pickle_limits` in force).
        skip_unsupported: leave out the tensors memtree cannot read (sparse, quantized, nested,
            meta, dtypes it cannot hold, tensors in a set or under keys other than ``str`` and
            ``int``) and list them in :attr:`skipped`, instead of refusing the file.

    Raises:
        LegacyCheckpointError: a pre-zip checkpoint (the message says how to convert it).
        UnsafePickleError: the pickle names something other than tensors and the values
            ``torch.load(weights_only=True)`` accepts by default.
        DtypeError: a tensor memtree cannot read (see ``skip_unsupported``), named by its key.
        CheckpointFormatError: not a torch.save zip, truncated, or damaged; or a pickle beyond
            ``limits``, with a cycle, or nested deeper than they allow (the message says which
            limit, and how to raise it).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        allow_pickle: bool = False,
        limits: PickleLimits | None = None,
        skip_unsupported: bool = False,
    ) -> None:
        self._file = CheckpointFile(path)
        self.path = self._file.path
        self._skip_unsupported = skip_unsupported
        self.skipped: dict[str, str] = {}
        """The tensors left out (``skip_unsupported=True``) by dotted key, with what each is
        (``{"emb": "a sparse_coo tensor (sparse)"}``)."""
        try:
            self._open(allow_pickle, limits)
        except BaseException:
            self.close()
            raise

    def _open(self, allow_pickle: bool, limits: PickleLimits | None) -> None:
        head = self._file.head(512)
        if not is_torch_zip(head):
            if head[:1] == b"\x80" or head[257:262] == b"ustar":  # a pickle, or torch's old tar
                raise LegacyCheckpointError(legacy_message(self.path))
            raise CheckpointFormatError(
                f"{self.path} is not a torch.save checkpoint (it does not start with a zip header)"
            )
        try:
            # zipfile seeks this file object; every other read uses pread on the same descriptor
            self._zip_file = open(self._file.fd, "rb", closefd=False)  # noqa: SIM115
            self._zip = zipfile.ZipFile(self._zip_file)
            infos = {i.filename: i for i in self._zip.infolist()}
        except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, NotImplementedError) as err:
            raise CheckpointFormatError(  # NotImplementedError: an entry of a newer zip version
                f"{self.path} is not a readable zip archive ({err}); the file is truncated or "
                "damaged: download or save it again"
            ) from None
        pickles = [n for n in infos if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            kind = (
                "a TorchScript archive"
                if any(n.endswith("constants.pkl") for n in infos)
                else "not a torch.save checkpoint"
            )
            raise CheckpointFormatError(
                f"{self.path} is {kind} (found {len(pickles)} data.pkl records); memtree reads "
                "files written by torch.save(obj, path)"
            )
        self._infos = infos
        self._prefix = pickles[0][: -len("data.pkl")]
        records = self._prefix + "data/"
        headers = sorted(i.header_offset for n, i in infos.items() if n.startswith(records))
        _prefetch(self._file.fd, headers)
        order = infos.get(self._prefix + "byteorder")
        if order is not None and self._read_entry(order, 16) != b"little":
            raise CheckpointFormatError(
                f"{self.path} was saved on a big-endian machine; re-save it on a little-endian one"
            )
        limits = current_limits() if limits is None else limits
        where = f"{self.path} (data.pkl)"
        scan = PickleScanner(limits, where)
        data = self._read_entry(infos[pickles[0]], limits.max_bytes, scan)
        self._storages: dict[str, StorageRef] = {}
        budget = Budget(limits, where, scan.objects, len(data))
        unpickler = RestrictedUnpickler(
            io.BufferedReader(_Buffer(data), _READ_CHUNK),
            self._storage,
            where,
            allow_pickle=allow_pickle,
            budget=budget,
        )
        del data
        try:
            obj = unpickler.load()
        except CheckpointFormatError as err:  # from a check of the calls' arguments: say where
            if self.path in str(err):
                raise
            raise CheckpointFormatError(f"{where}: {err}") from None
        except MemtreeError:
            raise
        except Exception as err:  # any malformed pickle: a clear error, never a traceback
            raise CheckpointFormatError(
                f"{where} is malformed: {type(err).__name__}: {err}"[:400]
            ) from None
        finally:
            unpickler.release()
        self._refs: dict[str, TensorRef] = {}
        self._paths: dict[str, tuple[str, ...]] = {}
        self.non_tensors: dict[str, Any] = {}
        """Non-tensor values of the checkpoint by dotted key (``{"epoch": 3}``)."""
        self.containers: dict[str, str] = {}
        """How containers other than str-keyed dicts became dotted keys, by dotted path (``""``:
        the top level): ``"list"`` or ``"tuple"`` (items by index) or ``"int keys"`` (a dict's
        int keys became ``str``), e.g. ``{"optimizer.state": "int keys"}``."""
        if not isinstance(obj, dict):
            if isinstance(obj, (TensorRef, UnreadableTensor)):
                raise CheckpointFormatError(
                    f"{self.path} holds a single tensor, not a dict of tensors; save "
                    "{'tensor': t} instead"
                )
            raise CheckpointFormatError(
                f"{self.path} holds a {type(obj).__name__}, not a dict of tensors (a state_dict)"
            )
        flat = flatten_pickled(obj, (TensorRef, UnreadableTensor), limits, where, budget.objects)
        for path, value, is_tensor in flat.entries:
            if isinstance(value, UnreadableTensor):
                self._unreadable(path, value.what, value.damaged)
            elif path in flat.buried:
                where = "under keys other than str and int" if isinstance(value, dict) else "inside"
                self._unreadable(path, f"a {type(value).__name__} with tensors {where}", False)
            else:
                self._add(path, value, self._refs if is_tensor else self.non_tensors)
        self.containers.update((".".join(p), kind) for p, kind in flat.containers.items())

    def _read_entry(
        self, info: zipfile.ZipInfo, max_bytes: int, scan: PickleScanner | None = None
    ) -> bytearray:
        """A zip entry's bytes, read (and inflated) at most ``max_bytes``; fed to ``scan``.

        The sizes the zip declares are checked, but the bound holds whatever they say: reading
        stops past ``max_bytes`` inflated bytes, and ``scan`` refuses a hostile pickle as soon
        as the part read so far is beyond its limits.
        """
        what = f"{self.path}: {info.filename}"
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise CheckpointFormatError(
                f"{what} uses compression method {info.compress_type}; torch.save stores its "
                "entries uncompressed (memtree also reads deflated ones)"
            )
        if info.file_size > max_bytes:
            raise self._too_big(what, f"declares {info.file_size:,} bytes", max_bytes, scan)
        buf = bytearray()
        try:
            with self._zip.open(info) as f:
                while chunk := f.read(_READ_CHUNK):
                    buf += chunk
                    if len(buf) > max_bytes:
                        raise self._too_big(what, f"inflates to more than {max_bytes:,} bytes", max_bytes, scan)
                    if scan is not None:
                        scan.feed(buf)
        except MemtreeError:
            raise
        # zipfile raises NotImplementedError for an entry of a newer zip version or an unknown
        # compression, RuntimeError for an encrypted one: all damage (or not torch.save's)
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, zlib.error, NotImplementedError, RuntimeError) as err:
            raise CheckpointFormatError(
                f"{what} cannot be read ({err}); the file is damaged"
            ) from None
        if len(buf) != info.file_size:
            raise CheckpointFormatError(
                f"{what} holds {len(buf):,} bytes but declares {info.file_size:,}; the file is "
                "damaged"
            )
        if scan is not None:
            scan.feed(buf, final=True)
        return buf

    @staticmethod
    def _too_big(
        what: str, how: str, max_bytes: int, scan: PickleScanner | None
    ) -> CheckpointFormatError:
        if scan is None:
            return CheckpointFormatError(f"{what} {how} (at most {max_bytes:,} expected)")
        return limit_error(what, how, "max_bytes", max_bytes)

    def _storage(self, key: str, dtype: torch.dtype, numel: int) -> StorageRef:
        known = self._storages.get(key)
        if known is not None:
            if known.dtype != dtype or known.numel != numel:
                raise CheckpointFormatError(
                    f"{self.path}: storage {key!r} is described two different ways"
                )
            return known
        name = f"{self._prefix}data/{key}"
        info = self._infos.get(name)
        nbytes = numel * itemsize(dtype)
        if info is None:
            raise CheckpointFormatError(
                f"{self.path}: the record {name} of a tensor is missing; the file is damaged"
            )
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != nbytes:
            raise CheckpointFormatError(
                f"{self.path}: record {name} is {info.file_size:,} bytes (compression "
                f"{info.compress_type}), expected {nbytes:,} stored bytes; the file is damaged"
            )
        header = self._file.read_bytes(
            info.header_offset, _LOCAL_HEADER.size, f"the header of {name}"
        )
        fields = _LOCAL_HEADER.unpack(header)
        if fields[0] != _ZIP_MAGIC:
            raise CheckpointFormatError(
                f"{self.path}: record {name} has no local header; the file is damaged"
            )
        data_offset = info.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1]
        self._file.check_range(data_offset, nbytes, f"record {name}")
        ref = StorageRef(key, dtype, numel, data_offset, info.CRC)
        self._storages[key] = ref
        return ref

    def _unreadable(self, path: tuple[str, ...], what: str, damaged: bool) -> None:
        """A value memtree does not read: refused (naming its key), or skipped when asked."""
        key = ".".join(path)
        if damaged:
            raise CheckpointFormatError(
                f"{self.path}: {key!r} is {what}; the file is damaged (torch.load cannot read it "
                "either)"
            )
        if not self._skip_unsupported:
            raise DtypeError(
                f"{self.path}: {key!r} is {what}, which memtree cannot read. Pass "
                "skip_unsupported=True to open_checkpoint or convert to leave it out (listed in "
                "their `skipped`; load_into_module(module, open_checkpoint(path, "
                "skip_unsupported=True)) loads the rest), or load the file with "
                "torch.load(weights_only=True) and save that value as a dense tensor of a "
                "supported dtype"
            )
        self.skipped[key] = what

    def _add(self, path: tuple[str, ...], value: Any, into: dict[str, Any]) -> None:
        key = ".".join(path)
        if key in self._refs or key in self.non_tensors:
            raise KeyCollisionError(
                f"{self.path}: two entries flatten to the key {key!r}; memtree cannot tell "
                "them apart"
            )
        into[key] = value
        self._paths[key] = path

    # -- public API ---------------------------------------------------------------------------
    def keys(self) -> list[str]:
        """The tensors' dotted keys, in the checkpoint's order."""
        return list(self._refs)

    def path_of(self, key: str) -> tuple[str, ...]:
        """The nesting of ``key`` in the pickled object (dict keys and list indices)."""
        return self._paths[key]

    def ref(self, key: str) -> TensorRef:
        """The :class:`TensorRef` of ``key``."""
        try:
            return self._refs[key]
        except KeyError:
            if key in self.skipped:
                raise skipped_error(self.path, key, self.skipped[key]) from None
            raise MemtreeKeyError(
                f"{key!r} is not a tensor of {self.path} (tensors: {list(self._refs)[:10]})"
            ) from None

    def spec(self, key: str) -> tuple[torch.Size, torch.dtype]:
        """``(shape, dtype)`` of ``key`` without reading data."""
        ref = self.ref(key)
        return ref.shape, ref.dtype

    def _byte_range(self, key: str) -> tuple[TensorRef, int, int]:
        """``(ref, start, nbytes)``: the bytes of the file that ``key``'s tensor spans, checked
        against the file (the record was checked when the pickle was read)."""
        ref = self.ref(key)
        storage = ref.storage
        if isinstance(storage, RoutedStorage):
            raise RoutingError(
                f"{self.path} was written by torch.save under memtree.saving(): the data of "
                f"{key!r} is leaf {storage.key!r} of the tree {os.path.basename(self.path)}.memtree/"
                f"{storage.entry}/ beside it. Load the file with `with memtree.loading(): "
                "torch.load(path)`, which maps it from there"
            )
        first, count = ref.span()
        size = itemsize(ref.dtype)
        start, nbytes = storage.data_offset + first * size, count * size
        self._file.check_range(start, nbytes, f"tensor {key!r}")
        return ref, start, nbytes

    def read(self, key: str, *, mmap: bool = True) -> torch.Tensor:
        """Read one tensor, with the values ``torch.load`` gives it (a tensor saved as a
        conjugate or negative view comes back as one: see :meth:`TensorRef.apply_bits`).

        Args:
            key: a key of :meth:`keys`.
            mmap: True: a zero-copy view of a read-only (copy-on-write) mapping of the file;
                False: a new tensor filled with ``pread`` (the CRC-32 of the record is checked
                when the tensor spans it whole).
        """
        ref, start, nbytes = self._byte_range(key)
        if mmap and start % itemsize(ref.dtype) == 0:
            flat = self._file.mapped()[start : start + nbytes].view(ref.dtype)
            return ref.apply_bits(torch.as_strided(flat, ref.size, ref.stride, flat.storage_offset()))
        buf = torch.empty(nbytes // itemsize(ref.dtype), dtype=ref.dtype)
        self._file.read_into(buf, start, f"tensor {key!r}")
        if self._whole_record(ref, nbytes):
            self._check_crc(key, ref, crc32(buf.view(torch.uint8).numpy()))
        return ref.apply_bits(torch.as_strided(buf, ref.size, ref.stride, 0))

    @staticmethod
    def _whole_record(ref: TensorRef, nbytes: int) -> bool:
        storage = ref.storage
        return isinstance(storage, StorageRef) and nbytes == storage.nbytes and nbytes > 0 and bool(storage.crc)

    def _check_crc(self, key: str, ref: TensorRef, crc: int) -> None:
        if crc != getattr(ref.storage, "crc", None):  # (a routed storage is never read here)
            raise CheckpointFormatError(
                f"{self.path}: tensor {key!r} fails its CRC-32 check (record "
                f"data/{ref.storage.key}); the file is damaged: download or save it again"
            )

    def file_range(self, key: str) -> FileRange | None:
        """The bytes of the file that hold ``key``'s tensor as it is, if they are its values.

        ``None`` for a strided view (transposed, sliced with a step, expanded) and for a
        conjugate or negative view (its values are not the bytes): :meth:`read` it. The range is valid while the reader is open. A range that is a whole record is
        checked against the record's CRC-32 first (``CheckpointFormatError``).

        Example:
            >>> import os, tempfile, torch
            >>> path = os.path.join(tempfile.mkdtemp(), "c.pt")
            >>> torch.save({"w": torch.arange(6.0).reshape(2, 3)}, path)
            >>> with TorchSaveReader(path) as r:
            ...     span = r.file_range("w")
            ...     torch.frombuffer(os.pread(span.fd, span.nbytes, span.offset), dtype=torch.float32)
            tensor([0., 1., 2., 3., 4., 5.])
        """
        ref, start, nbytes = self._byte_range(key)
        if not ref.stored_as_is():
            return None
        if self._whole_record(ref, nbytes):  # read through one small buffer, never held whole
            try:
                digest = file_checksum(self._file.fd, nbytes, "crc32", start, _CRC_BUFFER)
            except OSError as err:
                raise storage_error(err, f"reading tensor {key!r} of {self.path}") from err
            self._check_crc(key, ref, int(digest.partition(":")[2], 16))
        return FileRange(self._file.fd, start, nbytes, f"tensor {key!r} of {self.path}")

    def fill_range(self, key: str) -> tuple[FileRange, tuple[str, Callable[[str], None]] | None] | None:
        """Where ``key``'s bytes lie, for :func:`memtree.store.primitives.fill.fill`, and the check of the
        record's CRC-32 on the bytes read (when the tensor spans its record whole).

        ``None`` for a strided, conjugate or negative view (see :meth:`file_range`). Unlike :meth:`file_range`, the file
        is not read here: the CRC-32 is checked on the bytes as they are filled.
        """
        ref, start, nbytes = self._byte_range(key)
        if not ref.stored_as_is():
            return None
        span = FileRange(self._file.fd, start, nbytes, f"tensor {key!r} of {self.path}")
        if not self._whole_record(ref, nbytes):
            return span, None

        def check(found: str) -> None:
            self._check_crc(key, ref, int(found.partition(":")[2], 16))

        return span, ("crc32", check)

    def close(self) -> None:
        """Close the file (tensors already read or mapped stay valid)."""
        for f in (getattr(self, "_zip", None), getattr(self, "_zip_file", None)):
            if f is not None:
                f.close()
        self._file.close()


def _prefetch(fd: int, offsets: list[int]) -> None:
    """Ask the kernel to read the pages at ``offsets`` in the background (``WILLNEED``).

    Unpickling reads each storage record's local zip header, scattered through the file (one
    before each record's data): asked for all at once, a file not in the page cache serves them
    in one pass of the disk instead of one round trip each.
    """
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    for offset in offsets:
        try:
            advise(fd, offset, _LOCAL_HEADER.size + 256, os.POSIX_FADV_WILLNEED)
        except OSError:  # advice only: a filesystem that refuses it reads on demand
            return


class _Buffer(io.RawIOBase):
    """A bytearray read as a file, without copying it (``io.BytesIO`` would)."""

    def __init__(self, data: bytearray) -> None:
        super().__init__()
        self._data = data
        self._pos = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = min(len(view), len(self._data) - self._pos)
        view[:n] = memoryview(self._data)[self._pos : self._pos + n]
        self._pos += n
        return n


#: The buffer through which a record copied file to file is read for its CRC-32: the only
#: memory a conversion's copy holds (at ~2.7 GB/s of CRC-32, 64 KiB reads cost little more).
_CRC_BUFFER = 64 * 1024
