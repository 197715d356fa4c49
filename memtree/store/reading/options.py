"""How the store reads and writes a tree: :class:`ReadOptions` and :class:`WriteOptions`, checked once.

The public entry points (:meth:`memtree.TensorTree.load_memmap`, :meth:`~memtree.TensorTree.memmap`,
:func:`memtree.remote.load`...) keep the keyword arguments the SPEC names; each builds one options
object, checked here, and every reader and writer below takes that object instead of declaring
the keywords again. ``keys=`` becomes a *selection*: a trie of the requested keys
(:func:`normalize_keys`), applied to each level by :func:`select_entries`.

Example:
    >>> opts = ReadOptions.of(keys=["a", ("b", "c")], mode="r")
    >>> opts.selection, opts.readonly
    ({'a': None, 'b': {'c': None}}, True)
    >>> ReadOptions.of(mode="w")
    Traceback (most recent call last):
    ...
    memtree.errors.InvalidArgumentError: mode must be 'r' (read-only) or 'r+' (writes reach the files), got 'w'
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict, Union

from ...errors import InvalidArgumentError, KeyTypeError, MemtreeKeyError, UnknownKeywordError, keyword_names
from ...format.record import Record
from ...format.schema import ChildMeta, LevelMeta, SubclassMeta
from ..primitives.checksums import check_checksum_option, default_checksum

if TYPE_CHECKING:  # imported where a device is made: walking levels needs no torch
    import torch

    from ..primitives.crypto import EncryptionKey  # imported where a key is given: plain loads need no crypto

__all__ = [
    "MODES",
    "KeySelection",
    "Selection",
    "check_mode",
    "check_device",
    "normalize_keys",
    "select_entries",
    "ReadOptions",
    "WriteOptions",
    "RemoteKeywords",
    "check_remote_keywords",
]

#: How a loaded tree's files are mapped: ``"r"`` read-only, ``"r+"`` writes reach the files.
MODES = ("r", "r+")

KeySelection = Union[str, tuple[str, ...]]
"""A ``keys=`` entry: a top-level key, or a tuple path to a nested one."""

Selection = dict[str, Any]
"""A trie of selected keys: key -> the selection below it, or ``None`` for everything below."""


def check_mode(mode: object) -> str:
    """``mode`` if it is one of :data:`MODES`, else :class:`~memtree.errors.InvalidArgumentError`."""
    if mode not in MODES:
        raise InvalidArgumentError(
            f"mode must be 'r' (read-only) or 'r+' (writes reach the files), got {mode!r:.40}"
        )
    return str(mode)


def check_device(device: object) -> torch.device | None:
    """``device`` as a ``torch.device`` that this process can put tensors on (``None`` stays).

    Checked before anything is read: a device torch was built without or cannot see would
    otherwise fail deep in a copy (a bare ``AssertionError`` for CUDA without CUDA).

    Raises:
        InvalidArgumentError: ``device`` names no device, or one this process does not have.

    Example:
        >>> check_device("cpu"), check_device(None)
        (device(type='cpu'), None)
    """
    import torch

    if device is None:
        return None
    try:
        dev: torch.device = torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError) as err:
        raise InvalidArgumentError(f"device must name a torch device, got {device!r:.40} ({err})") from None
    if dev.type in ("cpu", "meta"):
        return dev
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count and (dev.index is None or dev.index < count):
            return dev
        if not torch.backends.cuda.is_built():
            have = f"this torch ({torch.__version__}) is built without CUDA"
        elif not count:
            have = "torch sees no CUDA device (no GPU, no driver, or CUDA_VISIBLE_DEVICES hides it)"
        else:
            have = f"this process has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
        raise InvalidArgumentError(
            f"device={str(dev)!r}, but {have}. Nothing was loaded: pass a device this "
            "machine has (None or 'cpu' maps the files), or run where the GPU is visible with a "
            "CUDA build of torch"
        )
    try:
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError, ValueError) as err:  # NotImplementedError is a RuntimeError
        raise InvalidArgumentError(
            f"device={str(dev)!r} cannot hold tensors in this process ({str(err).splitlines()[0]:.200}). "
            "Nothing was loaded: pass a device this machine has (None or 'cpu' maps the files)"
        ) from None
    return dev


def normalize_keys(keys: Iterable[KeySelection] | KeySelection) -> Selection:
    """Turn ``["a", ("b", "c")]`` into a selection trie ``{"a": None, "b": {"c": None}}``.

    Raises:
        KeyTypeError: ``keys`` is not a list of str or tuples of str.
        MemtreeKeyError: an empty key.
    """
    if isinstance(keys, (str, tuple)):
        keys = [keys]
    if not isinstance(keys, Iterable):
        raise KeyTypeError(f"keys= takes a list of keys (str, or tuples of str), got {type(keys).__name__} {keys!r:.60}")
    trie: Selection = {}
    for key in keys:
        if not isinstance(key, (str, tuple)) or not all(isinstance(p, str) for p in (key if isinstance(key, tuple) else ())):
            raise KeyTypeError(f"keys= entries must be str or tuples of str, got {type(key).__name__} {key!r:.60}")
        parts = (key,) if isinstance(key, str) else key
        if not parts or not all(isinstance(p, str) and p for p in parts):
            raise MemtreeKeyError(f"keys= entries must be non-empty str or tuples of str, got {key!r}")
        node = trie
        for part in parts[:-1]:
            sub = node.setdefault(part, {})
            if sub is None:  # a parent is already fully selected
                break
            node = sub
        else:
            node[parts[-1]] = None
    return trie


def select_entries(meta: LevelMeta, selection: Selection | None, path: tuple[str, ...], where: str) -> LevelMeta:
    """The level with only the entries a selection asks for, in selection order.

    Raises:
        MemtreeKeyError: a selected key is not at this level (names the key and the keys there),
            or the selection asks for keys inside a leaf.
    """
    if selection is None:
        return meta
    by_key = {e.key: e for e in meta.entries}
    missing = [k for k in selection if k not in by_key]
    if missing:
        full = path + (missing[0],)
        raise MemtreeKeyError(
            f"key {full if len(full) > 1 else full[0]!r} is not in the tree at {where} "
            f"(keys there: {sorted(by_key)[:20]})"
        )
    for k, sub in selection.items():
        if sub is not None and (not isinstance(by_key[k], ChildMeta) or isinstance(by_key[k], SubclassMeta)):
            full = path + (k,)
            what = "a tensor subclass leaf" if isinstance(by_key[k], SubclassMeta) else "a leaf"
            raise MemtreeKeyError(
                f"keys= asks for keys inside {full if len(full) > 1 else full[0]!r} at {where}, but it is "
                f"{what}, not a sub-tree; select {full if len(full) > 1 else full[0]!r} itself"
            )
    return dataclasses.replace(meta, entries=tuple(by_key[k] for k in selection))


class RemoteKeywords(TypedDict, total=False):
    """The keywords of a remote load besides the reading options (:func:`memtree.remote.load`,
    and ``load_memmap(url, ...)`` through :func:`~memtree.store.open.open_prefix`): the one list
    of them. Each is described in :func:`memtree.remote.load`; a keyword left out takes the
    default of the function it is for (:class:`~memtree.store.urls.fsspec_storage.FsspecStorage`
    for the first four, :func:`~memtree.store.urls.remote.fetch_tree` for the others).

    Example:
        >>> sorted(RemoteKeywords.__annotations__)[:3]
        ['allow_redirects', 'cache_dir', 'chunk_bytes']
    """

    storage_options: Mapping[str, Any] | None
    retries: int
    timeout: float | None
    allow_redirects: str
    cache_dir: str | os.PathLike[str] | None
    num_threads: int
    chunk_bytes: int
    fsync: bool
    progress: bool | None


def check_remote_keywords(function: Callable[..., object], remote: Mapping[str, object]) -> None:
    """Refuse the keywords of ``remote`` (the ``**remote`` of ``function``) that are not
    :class:`RemoteKeywords`: a typo of any keyword ``function`` takes is answered with the
    closest one.

    Raises:
        UnknownKeywordError: a keyword neither ``function`` nor a remote load takes.

    Example:
        >>> def load(url, *, mode="r+", **remote): ...
        >>> check_remote_keywords(load, {"timeout": 5})
        >>> check_remote_keywords(load, {"mdoe": "r"})
        Traceback (most recent call last):
        ...
        memtree.errors.UnknownKeywordError: load() got an unexpected keyword argument 'mdoe': did you mean 'mode'? It takes: url, mode, storage_options, retries, timeout, allow_redirects, cache_dir, num_threads, chunk_bytes, fsync, progress
    """
    unknown = [k for k in remote if k not in RemoteKeywords.__annotations__]
    if unknown:
        accepted = keyword_names(function) + list(RemoteKeywords.__annotations__)
        raise UnknownKeywordError.of(getattr(function, "__name__", "load"), unknown, accepted)


def _flag(name: str, value: object) -> bool:
    if type(value) is not bool:
        raise InvalidArgumentError(f"{name} must be True or False, got {value!r:.40}")
    return value


def _check_pack_below(pack_below: object, *, encrypted: bool) -> None:
    """``pack_below`` is ``None`` or an int in ``[0, PACK_MAX_BYTES]``; a positive one is refused
    with encryption (an encrypted leaf is sealed in its own file: packs are never encrypted)."""
    if pack_below is None:
        return
    from ...format.packs import PACK_MAX_BYTES

    if type(pack_below) is not int or not 0 <= pack_below <= PACK_MAX_BYTES:
        raise InvalidArgumentError(
            f"pack_below must be None (the default), 0 (never pack) or a size in bytes up to "
            f"{PACK_MAX_BYTES} (a pack's most), got {pack_below!r:.40}"
        )
    if pack_below and encrypted:
        raise InvalidArgumentError(
            "pack_below cannot be combined with encryption: each encrypted leaf is sealed in a "
            "file of its own, and packs are never encrypted; leave pack_below out (an encrypted "
            "tree packs nothing)"
        )


def _key(key: object) -> EncryptionKey | None:
    if key is None:
        return None
    from ..primitives.crypto import EncryptionKey, require_backend

    if not isinstance(key, EncryptionKey):
        raise InvalidArgumentError(
            f"encryption= takes a memtree.EncryptionKey (EncryptionKey.generate(), or "
            f"EncryptionKey(32 bytes)), got {type(key).__name__}"
        )
    require_backend()
    return key


_set = object.__setattr__
#: ``WriteOptions(checksum=...)`` not given: :func:`~memtree.store.primitives.checksums.default_checksum`.
_DEFAULT_CHECKSUM: Any = object()


@dataclass(init=False, repr=False, eq=False)  # frozen: a Record (cheaper to define at import)
class ReadOptions(Record):
    """What to read and how: the selection, the mapping mode, where leaves go, which checks.

    Build it with :meth:`of` (which checks every value); the fields are then trusted.

    Attributes:
        selection: the ``keys=`` trie (:func:`normalize_keys`), or ``None`` for every key.
        mode: ``"r+"`` (writes reach the files) or ``"r"`` (read-only mappings).
        mmap: map leaves (``True``) or read them into memory.
        device: ``None`` (leaves where they are read: the CPU), ``meta`` (structure only, no leaf
            file opened) or another device (leaves copied there).
        allow_pickle: unpickle non-tensor leaves saved with ``allow_pickle=True``.
        verify: hash each leaf that records a checksum, refusing a mismatch.
        encryption: the key of an encrypted tree (its leaves are then decrypted into memory).
    """

    selection: Selection | None = None
    mode: str = "r+"
    mmap: bool = True
    device: torch.device | None = None
    allow_pickle: bool = False
    verify: bool = False
    encryption: EncryptionKey | None = None

    def __init__(
        self,
        selection: Selection | None = None,
        mode: str = "r+",
        mmap: bool = True,
        device: torch.device | None = None,
        allow_pickle: bool = False,
        verify: bool = False,
        encryption: EncryptionKey | None = None,
    ) -> None:
        _set(self, "selection", selection)
        _set(self, "mode", mode)
        _set(self, "mmap", mmap)
        _set(self, "device", device)
        _set(self, "allow_pickle", allow_pickle)
        _set(self, "verify", verify)
        _set(self, "encryption", encryption)

    @classmethod
    def of(
        cls,
        *,
        keys: Iterable[KeySelection] | KeySelection | None = None,
        mode: str = "r+",
        mmap: bool = True,
        device: torch.device | str | None = None,
        allow_pickle: bool = False,
        verify: bool = False,
        encryption: EncryptionKey | None = None,
    ) -> ReadOptions:
        """Check and normalise the public keyword arguments of a load.

        Raises:
            InvalidArgumentError: a bad ``mode``, flag, device or ``encryption``.
            KeyTypeError, MemtreeKeyError: a bad ``keys=`` entry.
        """
        return cls(
            normalize_keys(keys) if keys is not None else None,
            check_mode(mode),
            _flag("mmap", mmap),
            check_device(device),
            _flag("allow_pickle", allow_pickle),
            _flag("verify", verify),
            _key(encryption),
        )

    @property
    def readonly(self) -> bool:
        """True for ``mode="r"``."""
        return self.mode == "r"

    @property
    def target(self) -> torch.device:
        """Where leaves end up: ``device``, or the CPU."""
        import torch

        return self.device if self.device is not None else torch.device("cpu")


@dataclass(init=False, repr=False, eq=False)  # frozen: a Record (cheaper to define at import)
class WriteOptions(Record):
    """How a tree is written (:func:`memtree.store.writing.write.write_tree`), checked by :meth:`of`.

    Attributes:
        like: create zero-filled (sparse) files instead of copying data (``memmap_like``).
        num_threads: write files with up to this many threads (0: the calling thread).
        existsok: allow replacing an existing memtree directory (atomically).
        fsync: fsync files and directories so the commit survives power loss.
        reserve: with ``like``, allocate disk blocks instead of leaving files sparse.
        allow_pickle: pickle non-tensor values JSON cannot hold.
        copy_existing: copy leaves already memory-mapped from another prefix.
        checksum: the algorithm of the checksum recorded for each leaf (and of the root's
            ``tree_hash``): one of :data:`~memtree.store.primitives.checksums.CHECKSUMS`, ``"auto"`` (the default:
            the fastest installed, :func:`~memtree.store.primitives.checksums.default_checksum`) or ``None``
            (none). ``like`` records none.
        progress: a progress bar of the bytes written: ``None`` on a terminal only.
        encryption: encrypt the leaves with this key (``docs/guide/encryption.md``).
        encrypt_names: with ``encryption``, also seal every level's entries (keys, shapes,
            values) and give files random names.
        link_from: a committed tree (e.g. the previous checkpoint): each tensor leaf whose key
            path there has the same dtype and shape, no capacity, a recorded checksum equal to
            the new bytes' checksum (same algorithm), and exactly the new bytes becomes a hard
            link to that file instead of a copy (see :func:`memtree.store.writing.write.write_tree`).
        link_verify: with ``link_from``, compare the old file's bytes with the new ones before
            linking it (default): a leaf damaged since its checksum was recorded, or different
            bytes with the same checksum, is written, never linked. ``False`` trusts a recorded
            ``sha256`` checksum of an old file that has the expected size and was not modified
            after its ``meta.json`` was written; other checksums can be matched on purpose, so
            their bytes are compared anyway.
        pack_below: tensor leaves smaller than this many bytes share pack files at the root
            instead of a file each (format version 3, ``docs/format.md``, "Packs of small
            leaves"); ``0`` never packs; ``None`` (the default) packs the leaves under
            :data:`~memtree.format.packs.PACK_BELOW` (64 KiB) when the tree has at least
            :data:`~memtree.format.packs.PACK_MIN_LEAVES` of them. An encrypted tree packs no leaf.
    """

    like: bool = False
    num_threads: int = 0
    existsok: bool = True
    fsync: bool = False
    reserve: bool = False
    allow_pickle: bool = False
    copy_existing: bool = False
    checksum: str | None = dataclasses.field(default_factory=default_checksum)
    progress: bool | None = None
    encryption: EncryptionKey | None = None
    encrypt_names: bool = False
    link_from: str | None = None
    link_verify: bool = True
    pack_below: int | None = None

    def __init__(
        self,
        like: bool = False,
        num_threads: int = 0,
        existsok: bool = True,
        fsync: bool = False,
        reserve: bool = False,
        allow_pickle: bool = False,
        copy_existing: bool = False,
        checksum: str | None = _DEFAULT_CHECKSUM,
        progress: bool | None = None,
        encryption: EncryptionKey | None = None,
        encrypt_names: bool = False,
        link_from: str | None = None,
        link_verify: bool = True,
        pack_below: int | None = None,
    ) -> None:
        _set(self, "like", like)
        _set(self, "num_threads", num_threads)
        _set(self, "existsok", existsok)
        _set(self, "fsync", fsync)
        _set(self, "reserve", reserve)
        _set(self, "allow_pickle", allow_pickle)
        _set(self, "copy_existing", copy_existing)
        _set(self, "checksum", default_checksum() if checksum is _DEFAULT_CHECKSUM else checksum)
        _set(self, "progress", progress)
        _set(self, "encryption", encryption)
        _set(self, "encrypt_names", encrypt_names)
        _set(self, "link_from", link_from)
        _set(self, "link_verify", link_verify)
        _set(self, "pack_below", pack_below)

    @classmethod
    def of(cls, **kwargs: Any) -> WriteOptions:
        """Check the keyword arguments of a write (the fields of this class).

        Raises:
            InvalidArgumentError: an unknown option, a bad flag, thread count or checksum name.
        """
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            raise UnknownKeywordError.of("WriteOptions.of", unknown, names)
        checksum = kwargs.get("checksum", "auto")
        if checksum == "auto":
            kwargs["checksum"] = None if kwargs.get("like") else default_checksum()
        link_from = kwargs.get("link_from")
        if link_from is not None:
            if not isinstance(link_from, (str, os.PathLike)):
                raise InvalidArgumentError(f"link_from must be a path or None, got {type(link_from).__name__}")
            kwargs["link_from"] = os.path.realpath(os.fspath(link_from))
        options = cls(**kwargs)
        flags = ("like", "existsok", "fsync", "reserve", "allow_pickle", "copy_existing", "encrypt_names", "link_verify")
        for name in flags:
            _flag(name, getattr(options, name))
        if type(options.num_threads) is not int or options.num_threads < 0:
            raise InvalidArgumentError(f"num_threads must be an int >= 0, got {options.num_threads!r:.40}")
        check_checksum_option(options.checksum)
        if options.like and options.checksum is not None:
            raise InvalidArgumentError("memmap_like writes no data, so it records no checksum; pass checksum=None")
        if options.link_from is not None and (options.like or options.checksum is None):
            raise InvalidArgumentError(
                "link_from decides by checksum which leaves are unchanged: it needs data and a "
                "checksum (not memmap_like, not checksum=None)"
            )
        if options.progress is not None:
            _flag("progress", options.progress)
        _check_pack_below(options.pack_below, encrypted=_key(options.encryption) is not None)
        if options.encrypt_names and options.encryption is None:
            raise InvalidArgumentError("encrypt_names=True needs encryption=key")
        if _key(options.encryption) is not None:
            if options.like:
                raise InvalidArgumentError(
                    "memmap_like cannot encrypt: it leaves files to be written in place, and an "
                    "encrypted leaf is only ever written whole; build the tree, then memmap(prefix, encryption=key)"
                )
            if options.allow_pickle:
                raise InvalidArgumentError(
                    "allow_pickle=True cannot be combined with encryption: pickled values would be "
                    "stored unencrypted and unauthenticated; keep non-tensor values JSON"
                )
            if options.link_from is not None:
                raise InvalidArgumentError(
                    "link_from cannot be combined with encryption: a hard link would share one "
                    "leaf's ciphertext between trees whose keys and nonces differ; write the tree whole"
                )
        return options
