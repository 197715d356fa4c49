"""The identity and the key of an encrypted checkpoint root, checked before a ``Checkpointer``
writes anything; and the key of each of its steps.

A plain root has no record. The first :class:`~memtree.Checkpointer` that opens an empty root
with ``encryption=key`` writes the root's record, ``root/.memtree-root.json``
(``docs/format.md``, "Checkpoint roots"):

.. code-block:: json

    {"format": "memtree-checkpoints", "version": 1, "root_id": "<32 hex>",
     "encryption": {"algorithm": "aes-256-gcm", "key_check": "<32 hex>"}}

* ``root_id``: 16 random bytes, the root's identity. It is a file in the root, so it moves with
  the root (``mv``, ``cp -r``, a backup restored elsewhere): "the same root" means the same
  record, wherever the directory is;
* ``key_check``: :func:`~memtree.store.primitives.crypto.key_fingerprint` of the key with the root id, so
  that a checkpointer with another key is refused before it writes (the key is never written);
* step ``N`` is encrypted with its own key, :func:`~memtree.store.primitives.crypto.derive_key` of the key
  with the root id and the label ``"checkpoint step N"``. Its ``key_check`` (in its root
  ``meta.json``, authenticated like every byte of an encrypted tree) therefore binds the step's
  number and its root: a step copied or renamed to another number, or into another root of the
  same key, fails its key check on restore, and an older step can never pass for a newer one.

Opening a root with a key that already holds plain steps, without a key when it has a record,
or with a key and encrypted steps but no record (written before steps were authenticated, or
its record deleted) is refused: a root holds steps of one kind and one key.

Example:
    >>> import tempfile
    >>> from memtree.store.primitives.crypto import EncryptionKey
    >>> from memtree.store.reading.steps import list_steps
    >>> root, key = tempfile.mkdtemp(), EncryptionKey.generate()
    >>> record = open_root(root, key, list_steps(root), fsync=False)
    >>> open_root(root, key, list_steps(root), fsync=False) == record
    True
    >>> record.step_key(key, 1) == record.step_key(key, 2)
    False
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import orjson

from ..errors import DecryptionError, MetaFormatError, UnsupportedVersionError
from ..format.names import ROOT_RECORD
from ..format.schema import ENCRYPTION_ALGORITHM
from ..store.primitives.commit import fsync_dir, write_small_file
from ..store.primitives.crypto import EncryptionKey, derive_key, key_fingerprint
from ..store.reading.steps import StepListing
from ..store.reading.storage import read_small_file
from ..store.writing.staged import staged_file

__all__ = ["RootRecord", "open_root", "read_record", "check_unchanged"]

#: The ``format`` of a root record, and the version this memtree writes and reads.
RECORD_FORMAT = "memtree-checkpoints"
RECORD_VERSION = 1
#: A record is about 150 bytes; anything much larger was not written by memtree.
MAX_RECORD_BYTES = 4096
_HEX32 = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class RootRecord:
    """An encrypted root's record: its identity and the check of its key."""

    root_id: str
    key_check: str

    def step_key(self, key: EncryptionKey, step: int) -> EncryptionKey:
        """The key step ``step`` of this root is encrypted with (see the module docstring)."""
        return derive_key(key, bytes.fromhex(self.root_id), f"checkpoint step {step}")

    def check_key(self, key: EncryptionKey, path: str) -> None:
        """Refuse ``key`` unless it is this root's key.

        Raises:
            DecryptionError: another key (nothing was written).
        """
        if key_fingerprint(key, bytes.fromhex(self.root_id)) != self.key_check:
            raise DecryptionError(
                f"{path} is encrypted with another key: the key given does not match its "
                f"key_check (in {os.path.join(path, ROOT_RECORD)}); nothing was written. Pass the "
                "key its steps were saved with, or use another root"
            )


def _damaged(path: str, what: str) -> MetaFormatError:
    return MetaFormatError(
        f"{path} is not a memtree checkpoint root record ({what}). It records the identity and "
        "key check of an encrypted checkpoint root, without which its steps cannot be "
        "authenticated: restore it from a copy of the root, or move the file away to start a "
        "new root elsewhere"
    )


def _parse(data: bytes, path: str) -> RootRecord:
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise _damaged(path, "not JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != RECORD_FORMAT:
        raise _damaged(path, f"no \"format\": \"{RECORD_FORMAT}\"")
    version = doc.get("version")
    if type(version) is not int:
        raise _damaged(path, "no int \"version\"")
    if version != RECORD_VERSION:
        raise UnsupportedVersionError(
            f"{path} is a checkpoint root record of version {version}; this memtree reads "
            f"version {RECORD_VERSION}: upgrade memtree to open this root"
        )
    encryption = doc.get("encryption")
    if set(doc) != {"format", "version", "root_id", "encryption"} or not isinstance(encryption, dict):
        raise _damaged(path, f"fields {sorted(doc)}, expected format, version, root_id, encryption")
    if set(encryption) != {"algorithm", "key_check"} or encryption["algorithm"] != ENCRYPTION_ALGORITHM:
        raise _damaged(path, f"encryption {sorted(encryption)}, expected algorithm {ENCRYPTION_ALGORITHM!r}, key_check")
    root_id, check = doc["root_id"], encryption["key_check"]
    if not (isinstance(root_id, str) and _HEX32.fullmatch(root_id) and isinstance(check, str) and _HEX32.fullmatch(check)):
        raise _damaged(path, "root_id and key_check must be 32 lowercase hex digits")
    return RootRecord(root_id, check)


def read_record(root: str) -> RootRecord | None:
    """The record of the checkpoint root ``root``, or ``None`` when it has none.

    Opened without following a link, refused unless a regular file of at most
    :data:`MAX_RECORD_BYTES` bytes of the documented form.

    Raises:
        UnsafePathError: the record is a link, a FIFO, a directory...
        MetaFormatError: it is damaged or foreign (``LimitError``: too large;
            ``UnsupportedVersionError``: a newer version).
    """
    path = os.path.join(root, ROOT_RECORD)
    data = read_small_file(path, path, MAX_RECORD_BYTES, "a checkpoint root record (about 150 bytes)")
    if data is None:
        return None
    return _parse(data, path)


def _create(root: str, key: EncryptionKey, fsync: bool) -> RootRecord:
    """Write a new record for ``root`` (never over one: a concurrent creator's record wins),
    under its writer lock with the temporary name journaled: after a kill, the next creator or
    :func:`memtree.recover` removes the temporary file."""
    root_id = os.urandom(16).hex()
    record = RootRecord(root_id, key_fingerprint(key, bytes.fromhex(root_id)))
    doc = {"format": RECORD_FORMAT, "version": RECORD_VERSION, "root_id": root_id,
           "encryption": {"algorithm": ENCRYPTION_ALGORITHM, "key_check": record.key_check}}
    with staged_file(os.path.join(root, ROOT_RECORD), existsok=False) as tmp:
        write_small_file(tmp, orjson.dumps(doc) + b"\n", fsync=fsync)
    if fsync:
        fsync_dir(root)
    return record


def open_root(root: str, key: EncryptionKey | None, listing: StepListing, *, fsync: bool) -> RootRecord | None:
    """Check that a checkpointer with ``key`` (``None``: plain) may write into ``root``, whose
    steps are ``listing``; returns the root's record (``None`` for a plain root), written now
    for an encrypted root that has none and no step yet.

    Raises:
        DecryptionError: no key for an encrypted root, another key, a key for a root holding plain
            steps, or a key for encrypted steps without a record; the message says which.
        MetaFormatError, UnsafePathError: the record is damaged or not a regular file.
    """
    record = read_record(root)
    if record is not None:
        if key is None:
            raise DecryptionError(
                f"{root} is an encrypted checkpoint root (it has {ROOT_RECORD}); a Checkpointer "
                "without its key would write plain steps into it. Pass the key: "
                "Checkpointer(root, encryption=key)"
            )
        record.check_key(key, root)
        return record
    encrypted = [s for s, meta in listing.steps.items() if meta.encryption is not None]
    plain = [s for s, meta in listing.steps.items() if meta.encryption is None]
    if encrypted:
        raise DecryptionError(
            f"{root} holds encrypted steps {encrypted[:10]} but no {ROOT_RECORD}: they were saved "
            "by a memtree that did not bind steps to their root and number, or the record was "
            "deleted, so they cannot be authenticated as this root's steps. Read each with "
            "memtree.load_memmap(step_dir, encryption=key, mmap=False) if you trust it, and save "
            "what you keep into a new root"
        )
    if key is None:
        return None
    if plain:
        raise DecryptionError(
            f"{root} holds plain (unencrypted) steps {plain[:10]}; encryption= would mix plain and "
            "encrypted steps in one root, and a plain step would then restore unauthenticated. "
            "Save encrypted steps into a new root, or open this one without encryption="
        )
    try:
        return _create(root, key, fsync)
    except FileExistsError:  # another checkpointer made it meanwhile: its key must be ours
        raced = read_record(root)
        if raced is None:
            raise
        raced.check_key(key, root)
        return raced


def check_unchanged(root: str, record: RootRecord | None) -> None:
    """Before a write: the root's record is still the one the checkpointer opened (another
    checkpointer may have made an empty plain root encrypted meanwhile, or a record been replaced).

    Raises:
        DecryptionError: the record appeared, vanished or changed; nothing was written.
    """
    now = read_record(root)
    if now != record:
        change = "has become encrypted" if record is None else "has another record than when it was opened" if now else "lost its record"
        raise DecryptionError(
            f"{root} {change} ({ROOT_RECORD}); nothing was written. Open a new Checkpointer on it "
            "(it checks the root's encryption and key again)"
        )
