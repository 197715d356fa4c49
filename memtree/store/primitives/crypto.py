"""Encryption at rest: leaves sealed with AES-256-GCM in chunks, every ``meta.json`` authenticated.

Optional extra ``memtree[crypto]`` (the ``cryptography`` package, imported on first use only).
The format is ``docs/format.md``, "Version 2", "Encryption"; the guide is
``docs/guide/encryption.md``. In short, for a tree written with ``encryption=key``:

* the writer draws 32 random bytes, the tree's ``salt``, and derives with HKDF-SHA256 from the
  key and the salt a data key, a MAC key and a 16-byte ``key_check`` (recorded, so that a
  wrong key is reported as such; the key itself is never written);
* each leaf has its own AES-256-GCM key, HKDF-Expand of the data key with the leaf file's path
  in the tree; its bytes are cut into chunks of ``chunk_bytes``, each sealed with the chunk
  index as nonce (no (key, nonce) pair ever repeats: a fresh salt per write, a key per leaf, an
  index per chunk) and an associated data that binds the chunk index, whether it is the last
  chunk, the leaf's total length, dtype and shape; a chunk therefore cannot be reordered,
  dropped, moved to another leaf or tree, or the leaf truncated, without failing
  authentication. The file is the chunks' ciphertexts, each followed by its 16-byte tag;
* every level's ``meta.json`` carries the same ``encryption`` object and a ``mac``
  (HMAC-SHA256 with the MAC key, over the level's ``meta.json`` without ``mac`` and its
  directory path), so that no entry can be removed, renamed, retyped or moved between levels.

Names, shapes, dtypes and non-tensor values stay readable without the key (``memtree info``,
``load_memmap(..., device="meta")``), unless the tree is written with ``encrypt_names=True``:
then files and directories get random names (:func:`hide_names`) and each level's real
``meta.json`` is sealed with AES-256-GCM under a key of its own, inside a stub that only its
``mac`` and ``sealed`` fields fill. Encrypted trees load into memory, not mapped: chunks are
decrypted by a pool of threads (``cryptography`` releases the GIL).

Example:
    >>> import os, tempfile, torch
    >>> from memtree.format.level import Level
    >>> from memtree.store.reading.options import ReadOptions, WriteOptions
    >>> from memtree.store.reading.read import read_tree
    >>> from memtree.store.writing.write import write_tree
    >>> key, d = EncryptionKey.generate(), tempfile.mkdtemp() + "/t"
    >>> _ = write_tree(d, Level((), {"x": torch.arange(3)}), WriteOptions.of(encryption=key))
    >>> read_tree(d, ReadOptions.of(encryption=key)).entries["x"].tolist()
    [0, 1, 2]
"""

from __future__ import annotations

import base64
import errno
import hashlib
import hmac
import os
import struct
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import orjson

from ...errors import DecryptionError, InvalidArgumentError, MissingDependencyError, StorageError
from ...format.dtypes import dtype_name
from ...format.level import fmt_key
from ...format.names import LEAF_SUFFIX
from ...format.schema import (
    ENCRYPTION_ALGORITHM,
    TAG_BYTES,
    TREE_TYPE,
    ChildMeta,
    EncryptionMeta,
    LeafMeta,
    LevelMeta,
    dump_level,
    encrypted_level,
    parse_level,
    sealed_nbytes,
)
from .files import FileRange, new_file, preallocate_fd
from .checksums import new_digest
from .memory import byte_view

if TYPE_CHECKING:  # torch is imported by the functions that handle tensors (memtree info imports none)
    import torch

__all__ = [
    "EncryptionKey",
    "TreeCipher",
    "CHUNK_BYTES",
    "require_backend",
    "open_cipher",
    "hide_names",
    "derive_key",
    "key_fingerprint",
    "key_matches",
]

#: Plaintext bytes per encrypted chunk that writers use (readers take the tree's ``chunk_bytes``):
#: small enough to spread one leaf over the decrypting threads, large enough that the per-chunk
#: cost (a tag, a call) is below 0.1 %.
CHUNK_BYTES = 1024 * 1024
#: Bytes of an :class:`EncryptionKey`.
KEY_BYTES = 32
_SALT_BYTES = 32
_CHECK_BYTES = 16
_NONCE_BYTES = 12
_INFO = b"memtree/v2 " + ENCRYPTION_ALGORITHM.encode()
_LEVEL_AAD = b"memtree/v2 sealed level\0"


class EncryptionKey:
    """A 256-bit key for ``memmap(..., encryption=key)`` and ``load_memmap(..., encryption=key)``.

    memtree never writes it: keep it yourself (a secrets manager, an environment variable as
    hex: ``EncryptionKey(bytes.fromhex(os.environ["MEMTREE_KEY"]))``). Its ``repr`` hides it.

    Example:
        >>> key = EncryptionKey.generate()
        >>> EncryptionKey(key.to_bytes()) == key, repr(key)
        (True, 'EncryptionKey(<hidden>)')
    """

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        """Wrap 32 bytes of key material (e.g. ``os.urandom(32)`` kept from an earlier run).

        Raises:
            InvalidArgumentError: not exactly 32 bytes.
        """
        if not isinstance(key, (bytes, bytearray, memoryview)) or len(key) != KEY_BYTES:
            size = f"{len(key)} bytes" if isinstance(key, (bytes, bytearray, memoryview)) else type(key).__name__
            raise InvalidArgumentError(
                f"an EncryptionKey is {KEY_BYTES} bytes (AES-256), got {size}; make one with "
                "EncryptionKey.generate() and keep key.to_bytes()"
            )
        self._key = bytes(key)

    @classmethod
    def generate(cls) -> EncryptionKey:
        """A new random key from the operating system's CSPRNG.

        Example:
            >>> len(EncryptionKey.generate().to_bytes())
            32
        """
        return cls(os.urandom(KEY_BYTES))

    def to_bytes(self) -> bytes:
        """The key's 32 bytes, to store somewhere safe.

        Example:
            >>> EncryptionKey(bytes(32)).to_bytes() == bytes(32)
            True
        """
        return self._key

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EncryptionKey) and hmac.compare_digest(self._key, other._key)

    __hash__ = None  # type: ignore[assignment]  # a key is compared, not put in sets

    def __repr__(self) -> str:
        return "EncryptionKey(<hidden>)"


def require_backend() -> Any:
    """``cryptography``'s ``AESGCM`` class, or a clear error when the extra is not installed.

    Raises:
        MissingDependencyError: ``cryptography`` is missing (``pip install 'memtree[crypto]'``).
    """
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError as err:
        raise MissingDependencyError(
            "encrypted trees need the 'cryptography' package: pip install 'memtree[crypto]'"
        ) from err
    return AESGCM


def _hkdf(key: bytes, salt: bytes, info: bytes, length: int) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=_INFO + info).derive(key)


def derive_key(key: EncryptionKey, salt: bytes, label: str) -> EncryptionKey:
    """A key of its own for one use of ``key``: HKDF-SHA256 of ``key`` with ``salt`` and an info
    naming ``label`` (``docs/format.md``, "Checkpoint roots"). Keys derived with another salt or
    label are unrelated, and none reveals ``key``.

    Example:
        >>> key = EncryptionKey(bytes(32))
        >>> derive_key(key, b"root", "step 1") == derive_key(key, b"root", "step 2")
        False
    """
    require_backend()
    return EncryptionKey(_hkdf(key.to_bytes(), salt, b" derive\0" + label.encode(), KEY_BYTES))


def key_fingerprint(key: EncryptionKey, salt: bytes) -> str:
    """A 16-byte check of ``key`` (hex), as a tree's ``key_check``: a wrong key is told without
    writing or revealing the key.

    Example:
        >>> len(key_fingerprint(EncryptionKey(bytes(32)), b"salt"))
        32
    """
    require_backend()
    return _hkdf(key.to_bytes(), salt, b" key check", _CHECK_BYTES).hex()


def key_matches(key: EncryptionKey, meta: EncryptionMeta) -> bool:
    """Whether ``key`` is the key of the tree whose root ``encryption`` is ``meta`` (its
    ``key_check``; constant-time comparison).

    Example:
        >>> key = EncryptionKey.generate()
        >>> cipher = TreeCipher.new(key)
        >>> key_matches(key, cipher.meta), key_matches(EncryptionKey.generate(), cipher.meta)
        (True, False)
    """
    return hmac.compare_digest(key_fingerprint(key, bytes.fromhex(meta.salt)), meta.key_check)


@dataclass(frozen=True, eq=False)
class TreeCipher:
    """The keys of one encrypted tree (derived from an :class:`EncryptionKey` and its salt)."""

    meta: EncryptionMeta
    data_key: bytes
    mac_key: bytes

    def __repr__(self) -> str:
        return f"TreeCipher({self.meta.algorithm}, chunk_bytes={self.meta.chunk_bytes})"

    @classmethod
    def new(cls, key: EncryptionKey, chunk_bytes: int | None = None, *, names: bool = False) -> TreeCipher:
        """Keys for a new tree: a fresh random salt; chunks of ``chunk_bytes`` (default
        :data:`CHUNK_BYTES`); ``names``: seal every level's entries too.

        Example:
            >>> TreeCipher.new(EncryptionKey.generate()).meta.chunk_bytes == CHUNK_BYTES
            True
        """
        salt = os.urandom(_SALT_BYTES)
        check = key_fingerprint(key, salt)
        chunk = chunk_bytes if chunk_bytes is not None else CHUNK_BYTES
        return cls._derive(key, EncryptionMeta(ENCRYPTION_ALGORITHM, chunk, salt.hex(), check, names))

    @classmethod
    def open(cls, key: EncryptionKey, meta: EncryptionMeta, where: str) -> TreeCipher:
        """Keys for an existing tree, after checking that ``key`` is its key.

        Raises:
            DecryptionError: ``key`` is not the key the tree was written with.
        """
        if not key_matches(key, meta):
            raise DecryptionError(
                f"{where} was encrypted with another key: the key given does not match its "
                "key_check (or the salt or key_check in its meta.json were changed); pass the "
                "key it was written with"
            )
        return cls._derive(key, meta)

    @classmethod
    def _derive(cls, key: EncryptionKey, meta: EncryptionMeta) -> TreeCipher:
        salt = bytes.fromhex(meta.salt)
        raw = key.to_bytes()
        return cls(meta, _hkdf(raw, salt, b" data", 32), _hkdf(raw, salt, b" meta mac", 32))

    # -- meta.json ------------------------------------------------------------------------------
    def _expand(self, label: bytes, rel: str) -> bytes:
        """HKDF-Expand (RFC 5869) of the data key to one 32-byte block: HMAC(PRK, info || 0x01)."""
        info = _INFO + label + b"\0" + rel.encode() + b"\x01"
        return hmac.new(self.data_key, info, hashlib.sha256).digest()

    def _level_aead(self, rel: str) -> Any:
        return require_backend()(self._expand(b" level", rel))

    def _mac(self, meta: LevelMeta, rel: str) -> str:
        body = dump_level(replace(meta, mac=None))
        msg = b"memtree/v2 level\0" + rel.encode() + b"\0" + body
        return hmac.new(self.mac_key, msg, hashlib.sha256).hexdigest()

    def seal_level(self, meta: LevelMeta, rel: str) -> LevelMeta:
        """``meta`` as an encrypted level at directory ``rel`` (``""``: the root): its leaves
        encrypted in this tree's chunks, the ``encryption`` object and the ``mac``."""
        encrypted = encrypted_level(meta, self.meta, None, rel)
        if self.meta.names:  # the level's real meta.json, encrypted: a key per level, used once
            inner = dump_level(replace(meta, save_id=None))
            blob = self._level_aead(rel).encrypt(bytes(_NONCE_BYTES), inner, _LEVEL_AAD + rel.encode())
            encrypted = LevelMeta(
                (), (), TREE_TYPE, save_id=meta.save_id, encryption=self.meta, sealed=base64.b64encode(blob).decode()
            )
        return replace(encrypted, mac=self._mac(encrypted, rel))

    def reveal(self, meta: LevelMeta, rel: str, where: str) -> LevelMeta:
        """A level of this tree as read from ``where``, authenticated (and decrypted, when its
        names are encrypted): refuses a ``meta.json`` that was changed, moved or not sealed.

        Raises:
            DecryptionError: no ``mac``, another tree's ``encryption``, a ``mac`` mismatch.
            MetaFormatError: the decrypted level breaks the schema (only a writer with the key
                could make one).
        """
        if meta.encryption != self.meta or meta.mac is None:
            raise DecryptionError(
                f"{where}/meta.json is not sealed with this tree's encryption (the root's "
                "salt and chunk size): a level was replaced or moved from another tree"
            )
        if not hmac.compare_digest(self._mac(meta, rel), meta.mac):
            raise DecryptionError(
                f"{where}/meta.json fails authentication: it was changed after it was written, "
                "or moved from elsewhere in the tree (its mac covers every field and its place)"
            )
        if meta.sealed is None:
            return meta
        try:
            inner = self._level_aead(rel).decrypt(
                bytes(_NONCE_BYTES), base64.b64decode(meta.sealed), _LEVEL_AAD + rel.encode()
            )
        except Exception as err:  # cryptography's InvalidTag (the mac matched: only with the key)
            if type(err).__name__ != "InvalidTag":
                raise
            raise DecryptionError(f"{where}/meta.json: its sealed entries fail authentication") from None
        level = parse_level(inner, f"{where}/meta.json (decrypted)", depth=rel.count("/") + 1 if rel else 0)
        return encrypted_level(replace(level, save_id=meta.save_id), self.meta, meta.mac, where)

    # -- leaves ---------------------------------------------------------------------------------
    def _leaf(self, rel: str, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int) -> _LeafSeal:
        aead = require_backend()(self._expand(b" leaf", rel))
        head = b"memtree/v2 chunk\0" + orjson.dumps([rel, dtype_name(dtype), list(shape)]) + b"\0"
        chunks = max(1, -(-nbytes // self.meta.chunk_bytes))
        return _LeafSeal(aead, head, nbytes, self.meta.chunk_bytes, chunks)

    def write_leaf(
        self,
        path: str,
        rel: str,
        data: torch.Tensor | FileRange,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        *,
        fsync: bool = False,
        checksum: str | None = None,
    ) -> str | None:
        """Create the encrypted file of one leaf (never an existing file).

        Args:
            path: the new file.
            rel: the leaf file's path in the tree (``"a/w.memmap"``), bound into its key.
            data: the plaintext: a contiguous CPU tensor, or a :class:`FileRange` to read.
            dtype, shape: the leaf's, bound into each chunk's associated data.
            checksum: hash the written file (the ciphertext) with this algorithm.

        Returns:
            ``"<algorithm>:<hex>"`` of the file when ``checksum`` is set, else None.
        """
        leaf = self._leaf(rel, dtype, shape, data.nbytes)
        plain = _plaintext(data)
        digest = new_digest(checksum) if checksum is not None else None
        fd = new_file(path)
        try:
            preallocate_fd(fd, sealed_nbytes(leaf.nbytes, leaf.chunk))

            def seal(i: int) -> bytes:
                lo = i * leaf.chunk
                part = plain(lo, min(leaf.chunk, leaf.nbytes - lo))
                sealed: bytes = leaf.aead.encrypt(leaf.nonce(i), part, leaf.aad(i))
                _pwrite_all(fd, sealed, i * (leaf.chunk + TAG_BYTES))
                return sealed

            _each_chunk(seal, leaf.chunks, digest.update if digest is not None else None)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return f"{checksum}:{digest.hexdigest()}" if digest is not None else None

    def read_leaf(self, fd: int, rel: str, entry: LeafMeta, where: str, key: tuple[str, ...]) -> torch.Tensor:
        """Decrypt one leaf's checked file (exactly ``entry.file_nbytes`` bytes) into memory.

        Raises:
            DecryptionError: a chunk fails authentication (nothing of the leaf is returned).
        """
        leaf = self._leaf(rel, entry.dtype, entry.shape, entry.nbytes)
        import torch

        out = torch.empty(entry.shape, dtype=entry.dtype)
        view = byte_view(out)

        def open_chunk(i: int) -> None:
            lo = i * leaf.chunk
            size = min(leaf.chunk, leaf.nbytes - lo) + TAG_BYTES
            sealed = os.pread(fd, size, i * (leaf.chunk + TAG_BYTES))
            if len(sealed) != size:
                raise StorageError(errno.EIO, f"{where}: the file ended inside chunk {i}; it changed while read")
            try:
                data = leaf.aead.decrypt(leaf.nonce(i), sealed, leaf.aad(i))
            except Exception as err:  # cryptography's InvalidTag
                if type(err).__name__ != "InvalidTag":
                    raise
                raise DecryptionError(
                    f"leaf {fmt_key(key)} at {where} fails authentication (chunk {i} of "
                    f"{leaf.chunks}): the file was changed, truncated, or moved from another leaf "
                    "or tree, or its dtype/shape in meta.json were edited; restore it or re-save the tree"
                ) from None
            if data:
                view[lo : lo + len(data)] = data

        _each_chunk(open_chunk, leaf.chunks)
        return out


@dataclass(frozen=True)
class _LeafSeal:
    """One leaf's AEAD and the fixed part of its chunks' associated data."""

    aead: Any
    head: bytes
    nbytes: int
    chunk: int
    chunks: int

    @staticmethod
    def nonce(i: int) -> bytes:
        return i.to_bytes(_NONCE_BYTES, "big")

    def aad(self, i: int) -> bytes:
        return self.head + struct.pack("<QQB", i, self.nbytes, i == self.chunks - 1)


def _plaintext(data: torch.Tensor | FileRange) -> Callable[[int, int], Any]:
    """``read(offset, n)``: ``n`` bytes of a leaf's plaintext (a view of a tensor's memory, or
    read from the file a :class:`FileRange` names)."""
    if not isinstance(data, FileRange):
        view = byte_view(data)
        return lambda lo, n: view[lo : lo + n]

    def read(lo: int, n: int) -> bytes:
        part = os.pread(data.fd, n, data.offset + lo)
        if len(part) != n:
            raise StorageError(
                errno.EIO, f"{data.what} ends before its {data.nbytes:,} bytes: the file was truncated "
                "or replaced while it was read; check it and try again"
            )
        return part

    return read


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def open_cipher(
    meta: LevelMeta, key: EncryptionKey | None, where: str, *, structure_only: bool
) -> tuple[TreeCipher | None, LevelMeta]:
    """The cipher of a tree from its root ``meta.json`` and the caller's key, and the root level
    (authenticated; decrypted when its names are encrypted).

    ``structure_only`` (``device="meta"``): no leaf is read, so no key is needed, unless the
    names are encrypted.

    Raises:
        DecryptionError: an encrypted tree without a key, a key for a plain tree, a wrong key,
            or a root ``meta.json`` failing authentication.
        MissingDependencyError: ``cryptography`` is not installed.
    """
    if meta.encryption is None:
        if key is not None:
            raise DecryptionError(
                f"{where} is not encrypted, but a key was given: its data is not authenticated "
                "by that key. Load it without encryption= if you expect a plain tree"
            )
        return None, meta
    if key is None:
        if meta.encryption.names:
            raise DecryptionError(
                f"{where} is encrypted, names included ({meta.encryption.algorithm}); pass its key: "
                "load_memmap(path, encryption=key)"
            )
        if structure_only:
            return None, meta
        raise DecryptionError(
            f"{where} is encrypted ({meta.encryption.algorithm}); pass its key: "
            "load_memmap(path, encryption=key). Names, shapes and dtypes are readable without it "
            "(device='meta', `memtree info`)"
        )
    cipher = TreeCipher.open(key, meta.encryption, where)
    return cipher, cipher.reveal(meta, "", where)


def hide_names(plan: Any) -> None:
    """Give every file and directory of a write plan a random name (``encrypt_names=True``).

    ``plan`` is a :class:`memtree.store.writing.write.WritePlan`: its levels' directories, their
    entries' ``file``/``dir`` names and its leaves' paths are renamed consistently, in place.
    The real names (keys) then exist only inside the sealed ``meta.json`` files.
    """
    renamed: dict[str, str] = {"": ""}  # directory path in the plan -> random path
    files: dict[str, str] = {}
    for lp in sorted(plan.levels, key=lambda lp: lp.depth):  # parents first
        new_rel = renamed[lp.rel]
        used: set[str] = set()
        entries = []
        for e in lp.meta.entries:
            if isinstance(e, (LeafMeta, ChildMeta)):
                name = _random_name(used) + (LEAF_SUFFIX if isinstance(e, LeafMeta) else "")
                old = e.file if isinstance(e, LeafMeta) else e.dir
                full = f"{new_rel}/{name}" if new_rel else name
                (files if isinstance(e, LeafMeta) else renamed)[f"{lp.rel}/{old}" if lp.rel else old] = full
                e = replace(e, file=name) if isinstance(e, LeafMeta) else replace(e, dir=name)
            entries.append(e)
        lp.rel, lp.meta = new_rel, replace(lp.meta, entries=tuple(entries))
    for job in plan.leaves:
        job.rel = files[job.rel]


def _random_name(used: set[str]) -> str:
    while True:
        name = os.urandom(8).hex()
        if name not in used:
            used.add(name)
            return name


# -- the decrypting and encrypting threads -----------------------------------------------------
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(_workers(), thread_name_prefix="memtree-crypto")
        return _POOL


def _forget_pool() -> None:  # the pool's threads do not exist in a forked child
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def _each_chunk(work: Callable[[int], Any], count: int, consume: Callable[[Any], None] | None = None) -> None:
    """``work(i)`` for every chunk ``i < count``, by the shared pool of threads, with at most two
    chunks per thread in flight (bounded memory); ``consume`` gets the results in chunk order.

    On a failure, every chunk still in flight finishes (or is cancelled) before the error is
    raised, so no thread touches a file or buffer the caller then frees.
    """
    if count == 1 or _workers() == 1:
        for i in range(count):
            result = work(i)
            if consume is not None:
                consume(result)
        return
    pool, window = _pool(), 2 * _workers()
    pending: dict[int, Future[Any]] = {}
    try:
        for i in range(count):
            for j in range(i + len(pending), min(count, i + window)):
                pending[j] = pool.submit(work, j)
            result = pending.pop(i).result()
            if consume is not None:
                consume(result)
    finally:
        for f in pending.values():
            f.cancel()
        wait_futures(list(pending.values()))
