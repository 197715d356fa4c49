"""Loading a tree from a prefix: validate every ``meta.json``, check every leaf, then map it.

What ``load_memmap`` does, level by level from the root:

1. open the level's directory (sub-directories relative to their parent's descriptor, never
   following symbolic links) and its ``meta.json`` (regular file, at most 16 MiB, checked with
   ``fstat`` before reading), and validate it with :func:`memtree.format.parse_level`;
2. with ``keys=``, keep only the entries on the path to the requested keys (other sub-trees'
   ``meta.json`` files and leaves are never opened);
3. for each leaf: open it without following links, check it is a regular file of exactly
   ``numel × itemsize`` bytes, and only then map it (or read it, with ``mmap=False``; or skip
   the file entirely, with ``device="meta"``). With ``verify=True``, a leaf whose ``meta.json``
   entry records a checksum is hashed first and refused on a mismatch (``IntegrityError``).

Reading never writes: a damaged tree raises a :class:`~memtree.errors.MemtreeError` naming the
file and leaves every file as it was.

Example:
    >>> import tempfile, torch
    >>> from memtree.level import Level
    >>> from memtree.write import write_tree
    >>> from memtree.read import read_tree
    >>> d = tempfile.mkdtemp() + "/t"
    >>> _ = write_tree(d, Level((), {"x": torch.arange(3)}))
    >>> read_tree(d).entries["x"].tolist()
    [0, 1, 2]
"""

from __future__ import annotations

import dataclasses
import errno
import os
import pickle
import stat
from collections.abc import Iterable
from typing import Any, Union

import torch

from .errors import (
    IntegrityError,
    LimitError,
    MemtreeError,
    MemtreeKeyError,
    MetaFormatError,
    MissingLeafError,
    NotAMemtreeError,
    NotCommittedError,
    PickleNotAllowedError,
    UnsafePathError,
)
from .fileio import file_checksum, open_checked, read_fd, storage_error, tensor_checksum
from .format import MAX_META_BYTES, ChildMeta, JsonMeta, LeafMeta, LevelMeta, PickleMeta, parse_level
from .keys import META_NAME
from .level import Level
from .mmap_tensor import map_leaf
from .nontensor import NonTensor, UnloadedPickle
from .recover import is_uncommitted_name

__all__ = ["read_tree", "read_meta", "read_meta_bytes", "select_entries", "open_dir", "META_FLAGS", "KeySelection", "normalize_keys"]

KeySelection = Union[str, tuple[str, ...]]
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
META_FLAGS = os.O_RDONLY | os.O_CLOEXEC | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0)

_Trie = dict[str, Any]  # key -> sub-trie, or None for "everything below"


def normalize_keys(keys: Iterable[KeySelection]) -> _Trie:
    """Turn ``["a", ("b", "c")]`` into a selection trie ``{"a": None, "b": {"c": None}}``."""
    if isinstance(keys, (str, tuple)):
        keys = [keys]
    trie: _Trie = {}
    for key in keys:
        parts = (key,) if isinstance(key, str) else tuple(key)
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


def select_entries(
    meta: LevelMeta, selection: _Trie | None, path: tuple[str, ...], where: str
) -> LevelMeta:
    """The level with only the entries a ``keys=`` selection asks for, in selection order.

    Raises:
        MemtreeKeyError: a selected key is not at this level (names the key and the keys there).
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
    return dataclasses.replace(meta, entries=tuple(by_key[k] for k in selection))


def open_dir(name: str, where: str, dir_fd: int | None) -> int:
    """Open a tree's root (``dir_fd=None``) or a sub-tree directory without following links.

    Raises:
        NotAMemtreeError, MissingLeafError, UnsafePathError, StorageError.
    """
    try:
        return os.open(name, _DIR_FLAGS | (_NOFOLLOW if dir_fd is not None else 0), dir_fd=dir_fd)
    except FileNotFoundError:
        if dir_fd is None:
            raise NotAMemtreeError(f"{where} does not exist; check the path") from None
        raise MissingLeafError(f"sub-tree directory {where} is missing; the tree is damaged") from None
    except NotADirectoryError:
        if dir_fd is None:
            raise NotAMemtreeError(f"{where} is not a directory; a memtree is a directory") from None
        raise UnsafePathError(f"{where} is not a directory (or is a symbolic link)") from None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UnsafePathError(
                f"{where} is a symbolic link; memtree does not follow links inside a tree"
            ) from None
        raise storage_error(err, f"opening {where}") from err


def read_meta_bytes(dir_fd: int, where: str, *, root: bool) -> tuple[bytes, str]:
    """The bytes of the ``meta.json`` in an open directory, and its path.

    Opened without following links, refused unless it is a regular file of at most
    :data:`~memtree.format.MAX_META_BYTES` (checked with ``fstat`` before reading).
    """
    path = os.path.join(where, META_NAME)
    try:
        fd = os.open(META_NAME, META_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        if root:
            raise NotAMemtreeError(
                f"{where} has no {META_NAME}: it is not a memtree directory (or its write never "
                "finished)"
            ) from None
        raise MissingLeafError(f"{path} is missing; the tree is damaged") from None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UnsafePathError(f"{path} is a symbolic link; refusing to follow it") from None
        raise storage_error(err, f"opening {path}") from err
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{path} is not a regular file")
        if st.st_size > MAX_META_BYTES:
            raise LimitError(
                f"{path} has {st.st_size:,} bytes, more than the {MAX_META_BYTES:,} allowed for "
                "a meta.json; it was not written by memtree (or tensordict)"
            )
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_META_BYTES + 1)
    finally:
        os.close(fd)
    return data, path


def read_meta(dir_fd: int, where: str, *, depth: int, root: bool) -> LevelMeta:
    """Read and validate the ``meta.json`` in an open directory."""
    data, path = read_meta_bytes(dir_fd, where, root=root)
    return parse_level(data, path, depth=depth)


def read_tree(
    prefix: str | os.PathLike[str],
    *,
    keys: Iterable[KeySelection] | None = None,
    mode: str = "r+",
    mmap: bool = True,
    device: torch.device | str | None = None,
    allow_pickle: bool = False,
    verify: bool = False,
) -> Level:
    """Load a tree's structure and leaves (see the module docstring for the steps).

    Raises:
        IntegrityError: ``verify=True`` and a leaf's bytes do not match its recorded checksum.
        MemtreeError: the directory is missing, damaged, hostile, or lacks a requested key.
    """
    if mode not in ("r", "r+"):
        raise ValueError(f"mode must be 'r' or 'r+', got {mode!r}")
    root = os.path.realpath(os.fspath(prefix))
    if is_uncommitted_name(os.path.basename(root)):
        raise NotCommittedError(
            f"{root} is the staging directory (or old copy) of a write that never finished; it "
            "is not a committed tree. memtree.recover() on its parent directory restores or "
            "deletes it"
        )
    dev = torch.device(device) if device is not None else torch.device("cpu")
    selection = normalize_keys(keys) if keys is not None else None
    reader = _Reader(mode, mmap, dev, allow_pickle, verify)
    fd = open_dir(root, root, None)
    try:
        return reader.level(fd, root, selection, (), 0)
    finally:
        os.close(fd)


class _Reader:
    def __init__(self, mode: str, mmap: bool, device: torch.device, allow_pickle: bool, verify: bool) -> None:
        self.readonly = mode == "r"
        self.mmap = mmap
        self.device = device
        self.allow_pickle = allow_pickle
        self.verify = verify

    def level(
        self,
        dir_fd: int,
        where: str,
        selection: _Trie | None,
        path: tuple[str, ...],
        depth: int,
        parent_batch: tuple[int, ...] = (),
    ) -> Level:
        meta = read_meta(dir_fd, where, depth=depth, root=depth == 0)
        if meta.batch_size[: len(parent_batch)] != parent_batch:
            raise MetaFormatError(
                f"{os.path.join(where, META_NAME)}: batch_size {list(meta.batch_size)} does not "
                f"start with the parent's {list(parent_batch)}; the tree is damaged"
            )
        entries = select_entries(meta, selection, path, where).entries
        out = Level(meta.batch_size, {}, meta.type)
        for entry in entries:
            sub = selection.get(entry.key) if selection is not None else None
            if isinstance(entry, LeafMeta):
                if sub is not None:
                    raise MemtreeKeyError(
                        f"key {path + (entry.key,)!r} is a tensor leaf at {where}; it has no "
                        f"sub-key {next(iter(sub))!r}"
                    )
                out.entries[entry.key] = self.leaf(dir_fd, where, entry, path)
            elif isinstance(entry, ChildMeta):
                child_where = os.path.join(where, entry.dir)
                child_fd = open_dir(entry.dir, child_where, dir_fd)
                try:
                    out.entries[entry.key] = self.level(
                        child_fd, child_where, sub, path + (entry.key,), depth + 1, meta.batch_size
                    )
                finally:
                    os.close(child_fd)
            elif isinstance(entry, JsonMeta):
                out.entries[entry.key] = NonTensor(entry.value)
            else:
                out.entries[entry.key] = NonTensor(self.pickled(dir_fd, where, entry))
        return out

    def leaf(self, dir_fd: int, where: str, entry: LeafMeta, parents: tuple[str, ...]) -> torch.Tensor:
        if self.device.type == "meta":
            return torch.empty(entry.shape, dtype=entry.dtype, device="meta")
        path = os.path.join(where, entry.file)
        fd = open_checked(entry.file, entry.file_nbytes, path, dir_fd=dir_fd)  # maps only nbytes
        check = self.verify and entry.checksum is not None
        try:
            if self.mmap:
                if check:
                    self.check(file_checksum(fd, entry.nbytes, _algorithm(entry)), entry, path, parents)
                tensor: torch.Tensor = map_leaf(fd, path, entry.dtype, entry.shape, readonly=self.readonly)
            else:
                tensor = torch.empty(entry.shape, dtype=entry.dtype)
                read_fd(fd, tensor)
                if check:  # hash the bytes just read: one pass over the file
                    self.check(tensor_checksum(tensor, _algorithm(entry)), entry, path, parents)
        except OSError as err:
            if isinstance(err, MemtreeError):
                raise
            raise storage_error(err, f"reading leaf {path}") from err
        finally:
            os.close(fd)
        if self.device.type != "cpu":
            tensor = tensor.to(self.device)
        return tensor

    @staticmethod
    def check(found: str, entry: LeafMeta, path: str, parents: tuple[str, ...]) -> None:
        if found != entry.checksum:
            key = parents + (entry.key,)
            raise IntegrityError(
                f"leaf {key if len(key) > 1 else key[0]!r} at {path} is damaged: its meta.json "
                f"records checksum {entry.checksum}, the file has {found}. The file changed "
                "after it was written; restore it or re-save the tree (`memtree verify DIR` "
                "lists every damaged leaf)"
            )

    def pickled(self, dir_fd: int, where: str, entry: PickleMeta) -> Any:
        path = os.path.join(where, entry.file)
        if self.device.type == "meta":  # structure only: never open (let alone unpickle) it
            return UnloadedPickle(path)
        if not self.allow_pickle:
            raise PickleNotAllowedError(
                f"non-tensor leaf {entry.key!r} is pickled in {path}; unpickling can run arbitrary "
                "code, so it is loaded only with allow_pickle=True (trusted files only)"
            )
        try:
            fd = os.open(entry.file, META_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            raise MissingLeafError(f"pickled leaf file {path} is missing; the tree is damaged") from None
        except OSError as err:
            raise UnsafePathError(f"cannot open {path} safely: {err}") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UnsafePathError(f"{path} is not a regular file")
            with os.fdopen(os.dup(fd), "rb") as f:
                return pickle.load(f)
        finally:
            os.close(fd)


def _algorithm(entry: LeafMeta) -> str:
    assert entry.checksum is not None
    return entry.checksum.partition(":")[0]
