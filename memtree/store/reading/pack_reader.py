"""How an opened tree reads its packed leaves (format version 3, :mod:`memtree.format.packs`).

A tree whose root lists packs gets one :class:`PackReader` (held by its
:class:`~memtree.store.reading.leaf_reader.LeafReader`). For each pack it opens the file once, relative to
the tree's held root directory, without following links, and checks that it is a regular file of
exactly the size the root ``meta.json`` records; each loaded level's packed leaves are then checked
to lie inside their pack without sharing a byte with any other packed leaf of the tree
(:class:`~memtree.format.packs.PackRanges`). A mapped load maps each pack once (read-only
copy-on-write for ``mode="r"``; read-write for ``mode="r+"``, after giving a pack that another
tree shares by a hard link its own copy, :mod:`memtree.store.reading.unshare`), and every packed leaf is
a view of that one mapping: a :class:`~memtree.MemoryMappedTensor` whose row writes go to its
bytes of the pack. Reads into memory (``mmap=False``, devices) and :func:`~memtree.store.reading.read.fill_tree`
read ranges of the pack's descriptor.

Example:
    >>> import tempfile, torch
    >>> from memtree.format.level import Level
    >>> from memtree.store.reading.options import WriteOptions
    >>> from memtree.store.writing.write import write_tree
    >>> d = tempfile.mkdtemp() + "/t"
    >>> root = write_tree(d, Level((), {"a": torch.ones(2), "b": torch.arange(3)}), WriteOptions.of(pack_below=1024))
    >>> a, b = root.load()["a"], root.load()["b"]
    >>> a.filename == b.filename, a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr(), b.tolist()
    (True, True, [0, 1, 2])
"""

from __future__ import annotations

import os
from math import prod

import torch

from ...format.packs import PackMeta, PackRanges
from ...format.schema import LeafMeta, LevelMeta
from ..primitives.files import map_fd, open_leaf
from .mapped import MemoryMappedTensor, check_sole, map_view
from .mapped_files import MappedFile

__all__ = ["PackReader"]


class PackReader:
    """The packs of one opened tree: checked descriptors, mappings, and the ranges accepted.

    Args:
        root: the tree's root directory (for paths in messages, and its writer lock).
        root_fd: its held descriptor (owned by the caller, open while this reader is used).
        packs: the root ``meta.json``'s packs.
    """

    def __init__(self, root: str, root_fd: int, packs: tuple[PackMeta, ...]) -> None:
        self.root = root
        self.root_fd = root_fd
        self.sizes = {p.file: p.nbytes for p in packs}
        self.ranges = PackRanges(self.sizes)
        self.accepted: set[tuple[str, ...]] = set()  # levels (by directories) whose ranges are checked
        self.fds: dict[tuple[str, bool], int] = {}  # (pack, writable) -> descriptor
        self.mappings: dict[tuple[str, bool], tuple[torch.Tensor, MappedFile, dict[torch.dtype, torch.Tensor]]] = {}

    def path(self, name: str) -> str:
        """The pack's path, for messages and mappings."""
        return os.path.join(self.root, name)

    def accept(self, meta: LevelMeta, dirs: tuple[str, ...], where: str) -> None:
        """Check the packed leaves of a level before any of them is handed out (once per level).

        Raises:
            MetaFormatError: a leaf outside its pack, in a pack the root does not list, or
                sharing bytes with another packed leaf of the tree.
        """
        if dirs not in self.accepted:
            self.ranges.add_level(meta, where)
            self.accepted.add(dirs)

    def fd(self, name: str, *, writable: bool = False) -> int:
        """The pack's checked descriptor (read-write for a writable mapping: a pack that another
        tree shares by a hard link is first given its own copy, so writes never reach that tree);
        owned by this reader: ``os.dup`` it to hand it on.

        Raises:
            MissingLeafError, UnsafePathError, LeafSizeError: the pack is missing, not a regular
                file, or not of the size the root records.
        """
        fd = self.fds.get((name, writable))
        if fd is not None:
            return fd
        path = self.path(name)
        fd, st = open_leaf(name, self.sizes[name], path, dir_fd=self.root_fd, writable=writable)
        if writable and st.st_nlink > 1 and st.st_size:
            from .unshare import own_file

            fd, st = own_file(fd, st, name, path, root=self.root, dir_fd=self.root_fd, dirs=())
        self.fds[(name, writable)] = fd
        return fd

    def view(self, entry: LeafMeta, *, readonly: bool) -> MemoryMappedTensor:
        """The packed leaf as a view of its pack's one mapping (mapped on first use)."""
        assert entry.pack is not None and entry.offset is not None
        key = (entry.pack, readonly)
        mapping = self.mappings.get(key)
        if mapping is None:
            fd = self.fd(entry.pack, writable=not readonly)
            path = self.path(entry.pack)
            flat = map_fd(fd, path, self.sizes[entry.pack], writable=not readonly)
            st = os.fstat(fd)  # after mapping (see memtree.store.reading.mapped.map_leaf)
            check_sole(path, st, readonly, self.sizes[entry.pack])
            mapping = self.mappings[key] = (flat, MappedFile(path, (st.st_dev, st.st_ino)), {})
        flat, file, typed = mapping
        dtype = entry.dtype
        base = typed.get(dtype)
        if base is None:
            base = typed[dtype] = flat.view(dtype)  # a pack's size is a multiple of any item size
        shape = entry.shape
        strides = []
        step = 1
        for n in reversed(shape):
            strides.append(step)
            step *= n
        start = entry.offset // base.element_size()
        if not prod(shape):  # no element: a view of nothing (never past the mapping's end)
            start = 0
        view = base.as_strided(shape, tuple(reversed(strides)), start)
        return map_view(view, file, readonly)

    def close(self) -> None:
        """Close the descriptors (the mappings live on with their views)."""
        fds, self.fds = self.fds, {}
        for fd in fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
