"""A tree on disk and in modules: ``memmap``/``memmap_like``/``load_memmap``, growth, module binding.

A mixin of :class:`~memtree.TensorTree`. What a write does is :func:`memtree.store.writing.write.write_tree`;
what a load checks is :mod:`memtree.store.reading.read` (chosen by :func:`memtree.store.open.open_prefix`);
growth is :mod:`memtree.store.writing.grow`; binding into modules is :mod:`memtree.tree.parts.bind`.

Example:
    >>> import torch, memtree
    >>> import tempfile, torch, memtree
    >>> d = tempfile.mkdtemp() + "/t"
    >>> _ = memtree.TensorTree({"x": torch.arange(3)}).memmap(d)
    >>> memtree.TensorTree.load_memmap(d)["x"].tolist()
    [0, 1, 2]
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

from typing_extensions import Self

import torch

from ...format.level import Level
from ...errors import InvalidArgumentError, check_keywords
from ...store.reading.mapped import MemoryMappedTensor
from ...store.open import open_prefix
from ...store.reading.options import KeySelection, ReadOptions, WriteOptions, check_remote_keywords
from ...store.reading.read import PendingLevel
from ...dist.dtensor import has_dtensor, is_dtensor
from . import bind
from .core import TreeCore
from .shape_ops import ShapeOps

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ...store.primitives.crypto import EncryptionKey
    from ...store.reading.options import RemoteKeywords

# Imported on first use, so that a process that only loads never imports them:
# ...store.writing.write (writing), .growth (append_, extend_, resize_).

__all__ = ["Persistence"]


class Persistence(ShapeOps):
    """Writing, loading, growing and module binding (mixed into :class:`~memtree.TensorTree`)."""

    _bound_into: tuple[Any, bool] | None = None  # a swap of to_module: (module, inplace), bound back on exit

    def is_memmap(self) -> bool:
        """True if every tensor leaf is a :class:`MemoryMappedTensor`."""
        return all(
            isinstance(v, MemoryMappedTensor)
            for v in self.values(include_nested=True, leaves_only=True)
            if isinstance(v, torch.Tensor)
        )

    @check_keywords
    def memmap_(
        self,
        prefix: str | os.PathLike[str] | None = None,
        *,
        copy_existing: bool = False,
        num_threads: int = 0,
        existsok: bool = True,
        fsync: bool = False,
        allow_pickle: bool = False,
        checksum: str | None = "auto",
        progress: bool | None = None,
        pack_below: int | None = None,
        link_from: str | os.PathLike[str] | None = None,
    ) -> Self:
        """Write the tree under ``prefix`` and replace its leaves by the mapped files; returns ``self``.

        The write is atomic: until it commits, ``prefix`` keeps its old content (if any).

        Args:
            prefix: destination directory; ``None`` moves leaves to anonymous shared memory.
            copy_existing: copy leaves already memory-mapped from another prefix (else raise).
            num_threads: write leaves with this many threads (0: in the calling thread).
            existsok: allow replacing an existing memtree directory at ``prefix``.
            fsync: also make the commit durable across power loss.
            allow_pickle: pickle non-tensor values that JSON cannot hold exactly.
            checksum: each leaf's checksum, recorded in ``meta.json`` with the root's
                ``tree_hash`` and computed in the same pass as the write; checked by
                ``load_memmap(..., verify=True)`` and ``memtree verify``. ``"auto"`` (default): the
                fastest installed of ``"xxh3"``, ``"crc32c"`` (``memtree[fast-checksums]``) and
                ``"crc32"``; ``"sha256"`` also detects deliberate changes, given a trusted
                ``meta.json``; ``None``: no checksum.
            progress: a progress bar of the bytes written: ``None`` (default) only on a
                terminal outside CI, ``True``/``False`` forced (tqdm optional).
            pack_below: tensor leaves smaller than this many bytes share pack files at the
                root instead of a file each (``docs/format.md``, "Packs of small leaves"): one
                file and one write per 64 MiB of them. ``None`` (default): leaves under 64 KiB,
                when the tree has at least 64 of them; ``0``: never (every leaf its own file).
            link_from: an incremental save: a committed tree (the previous checkpoint) whose
                leaf files are hard-linked instead of written wherever a leaf at the same key
                has the same dtype, shape and bytes (compared, not only checksummed; see
                :mod:`memtree.store.writing.linking`). Nothing is linked where no process can
                be proved not to write the old files (a tree loaded with ``mode="r+"`` maps
                them read-write) or across filesystems: those leaves are written. The leaves
                are then mapped read-only (``mode="r"``): a write through this tree must never
                change the tree it shares files with (``load_memmap(prefix)`` maps them
                read-write, each linked file getting its own copy when first used).

        Raises:
            NotAMemtreeError, NotCommittedError: ``link_from`` is not a committed tree
                (nothing written).

        Example:
            >>> import tempfile, torch, memtree
            >>> t = memtree.TensorTree({"w": torch.ones(3)}).memmap_(tempfile.mkdtemp() + "/m")
            >>> t.is_memmap()
            True
        """
        self._adopt(
            self._write(prefix, WriteOptions.of(
                copy_existing=copy_existing, num_threads=num_threads, existsok=existsok, fsync=fsync,
                allow_pickle=allow_pickle, checksum=self._checksum_for(checksum), progress=progress,
                pack_below=pack_below,
                link_from=link_from,
            ))
        )
        return self

    @check_keywords
    def memmap(
        self,
        prefix: str | os.PathLike[str] | None = None,
        *,
        copy_existing: bool = False,
        num_threads: int = 0,
        existsok: bool = True,
        fsync: bool = False,
        allow_pickle: bool = False,
        checksum: str | None = "auto",
        progress: bool | None = None,
        encryption: EncryptionKey | None = None,
        encrypt_names: bool = False,
        pack_below: int | None = None,
        link_from: str | os.PathLike[str] | None = None,
    ) -> Self:
        """Like :meth:`memmap_`, but return a new memory-mapped tree and leave ``self`` as it is.

        ``encryption=key`` (a :class:`memtree.EncryptionKey`, extra ``memtree[crypto]``) encrypts
        every leaf with AES-256-GCM and authenticates every ``meta.json``; the tree returned is
        then in memory, not mapped: each level is decrypted from the files when first used
        (``docs/guide/encryption.md``). Keys, shapes, dtypes and non-tensor values stay
        readable without the key, unless ``encrypt_names=True``: then each level's entries are
        sealed too and files get random names. An encrypted tree packs no leaf (``pack_below``
        must be left out).

        ``link_from=previous`` saves incrementally: each leaf whose bytes equal those of the same
        key in the committed tree ``previous`` is a hard link to its file, and the tree returned
        is mapped read-only (see :meth:`memmap_`).

        Example:
            >>> import tempfile, torch, memtree
            >>> t = memtree.TensorTree({"w": torch.ones(3)})
            >>> m = t.memmap(tempfile.mkdtemp() + "/m", num_threads=2)
            >>> m.is_memmap(), t.is_memmap()
            (True, False)
            >>> key = memtree.EncryptionKey.generate()
            >>> e = t.memmap(tempfile.mkdtemp() + "/e", encryption=key)
            >>> e.is_memmap(), e["w"].tolist()
            (False, [1.0, 1.0, 1.0])
            >>> import os
            >>> d = tempfile.mkdtemp()
            >>> _ = t.memmap(d + "/step1")
            >>> n = t.memmap(d + "/step2", link_from=d + "/step1")      # unchanged: linked
            >>> os.stat(n["w"].filename).st_nlink
            2
        """
        if encryption is not None and prefix is None:
            raise InvalidArgumentError("encryption= needs a prefix: shared memory (prefix=None) is never encrypted")
        level = self._write(prefix, WriteOptions.of(
            copy_existing=copy_existing, num_threads=num_threads, existsok=existsok, fsync=fsync,
            allow_pickle=allow_pickle, checksum=self._checksum_for(checksum), progress=progress,
            encryption=encryption, encrypt_names=encrypt_names, pack_below=pack_below, link_from=link_from,
        ))
        return type(self)._from_level(level, self._device)

    @check_keywords
    def memmap_like(
        self,
        prefix: str | os.PathLike[str] | None = None,
        *,
        num_threads: int = 0,
        existsok: bool = True,
        reserve: bool = False,
        progress: bool | None = None,
        pack_below: int | None = None,
    ) -> Self:
        """A new memory-mapped tree of zeros with this tree's keys, shapes and dtypes.

        No data is read or written: files are sparse (``reserve=True`` allocates their blocks),
        so ``datum.expand(1_000_000).memmap_like(d)`` takes milliseconds. The free space is
        checked first. Non-tensor leaves are kept. ``pack_below`` packs small leaves as
        :meth:`memmap_` does (they are still written in place by index; growing the tree moves
        them into files of their own).

        Example:
            >>> import tempfile, torch, memtree
            >>> datum = memtree.TensorTree({"img": torch.zeros(3, 64, 64, dtype=torch.uint8)})
            >>> data = datum.expand(1000).memmap_like(tempfile.mkdtemp() + "/ds")
            >>> data.batch_size, data["img"].shape
            (torch.Size([1000]), torch.Size([1000, 3, 64, 64]))
        """
        level = self._write(prefix, WriteOptions.of(
            like=True, num_threads=num_threads, existsok=existsok, reserve=reserve, progress=progress,
            pack_below=pack_below,
        ))
        return type(self)._from_level(level, self._device)

    def _holds_dtensor(self) -> bool:
        return any(is_dtensor(v) for v in self.values(include_nested=True, leaves_only=True))

    def _checksum_for(self, checksum: str | None) -> str | None:
        """``checksum=`` of a write: a tree of ``DTensor`` s is written by every rank at once, and
        ``"auto"`` then means a checksum whose pieces combine (:mod:`memtree.dist.write`)."""
        if checksum != "auto" or not self._holds_dtensor():
            return checksum
        from ...dist.write import collective_checksum

        return collective_checksum(checksum)

    def _write(self, prefix: str | os.PathLike[str] | None, options: WriteOptions) -> Level | PendingLevel:
        """Write through :func:`memtree.store.writing.write.write_tree` (or share memory when no prefix);
        a tree of ``DTensor`` s through :func:`memtree.dist.write.write_collective`, on every rank."""
        from ...store.writing.write import share_tree, write_tree

        level = self._to_level(keep_dtensors=True)
        if has_dtensor(level):
            if prefix is None:
                raise InvalidArgumentError(
                    "memmap(prefix=None) keeps leaves in this process's shared memory; a tree of "
                    "DTensors is written to a directory every rank shares: pass a prefix"
                )
            from ...dist.read import load_sharded, targets_like
            from ...dist.write import write_collective

            dest = write_collective(prefix, level, options)
            return load_sharded(dest, targets_like(level))
        if prefix is None:
            if options.link_from is not None:
                raise InvalidArgumentError("link_from= needs a prefix: shared memory (prefix=None) has no files to link")
            return share_tree(level, like=options.like)
        if options.link_from is not None:
            from ...store.writing.linking import check_link_source

            check_link_source(options.link_from)
            # mapped read-write, a linked file would get its own copy as soon as it is used
            # (a write into this tree must never change the other): the tree comes back read-only
            return write_tree(prefix, level, options, mode="r")
        return write_tree(prefix, level, options)

    @classmethod
    @check_keywords
    def load_memmap(
        cls,
        prefix: str | os.PathLike[str],
        *,
        device: torch.device | str | None = None,
        keys: Iterable[KeySelection] | None = None,
        mode: str = "r+",
        mmap: bool = True,
        allow_pickle: bool = False,
        verify: bool = False,
        unknown_classes: str = "error",
        lazy: bool = True,
        encryption: EncryptionKey | None = None,
        mesh: Any = None,
        placements: Any = None,
        **remote: Unpack[RemoteKeywords],
    ) -> Self:
        """Load a tree written by :meth:`memmap`: O(metadata) now, each level when first used.

        Returns after validating the root ``meta.json`` only. A level (a sub-tree) is loaded
        the first time its entries are used (``tree["a"]``, ``keys()``, ``to_module``...): its
        leaf files are checked (regular file of exactly the right size, no symbolic link) and
        mapped, and its sub-levels' ``meta.json`` files validated. No leaf data is read. Files
        are opened relative to the tree's directory as it was when loaded: re-saving the prefix
        meanwhile never mixes two versions (the old levels raise instead, if deleted).

        Args:
            prefix: the tree's directory, or an fsspec URL (``"s3://bucket/tree"``,
                ``"https://host/tree"``; not ``file://``) to load with :func:`memtree.remote.load`.
            device: ``None``/``"cpu"``: leaves are mapped files; ``"meta"``: structure only (no
                leaf file opened); another device: leaves are copied there.
            keys: load only these keys (str or tuples); only the ``meta.json`` files on their
                paths are opened.
            mode: ``"r+"`` writes reach the files; ``"r"`` read-only (writes raise).
            mmap: ``False`` reads leaves into ordinary memory with large reads (network
                filesystems).
            allow_pickle: unpickle non-tensor leaves that were saved with ``allow_pickle=True``
                (trusted files only).
            verify: hash every loaded leaf that records a checksum (``memmap(...,
                checksum=...)``) and raise :class:`~memtree.IntegrityError` on a mismatch; reads
                those files once. Leaves without a checksum are size-checked only, as always.
            unknown_classes: a level stored as a ``@tensorclass`` comes back as that class when
                it is registered (its module imported); otherwise ``"error"`` raises
                :class:`~memtree.UnknownClassError` and ``"tree"`` loads it as a plain tree.
            lazy: ``False`` loads every level before returning, so that a damaged or missing
                file raises here rather than on first use. ``verify=True``, ``mmap=False``,
                ``device`` other than CPU/meta, and remote URLs always load everything at once.
            encryption: the :class:`memtree.EncryptionKey` of a tree written with
                ``memmap(..., encryption=key)``. Its leaves are then decrypted into memory (never
                mapped; ``mode`` and ``mmap`` do not apply), every level at once, by several
                threads; every ``meta.json`` and chunk is authenticated, and a wrong key, a
                missing key (except for ``device="meta"``), or a changed, swapped or truncated
                file raises :class:`~memtree.DecryptionError`. A key for a tree that is not
                encrypted raises too.
            mesh: a ``DeviceMesh``: every leaf saved from a ``DTensor`` (whose placements the tree
                records) comes back as a ``DTensor`` on ``mesh`` with those placements, and this rank
                reads only its own shard (``docs/guide/distributed.md``); every rank of the mesh
                calls it. A shard that is one range of its file is mapped (zero-copy), a strided one
                (``Shard(1)``) read into memory; ``verify=True`` reads and checks the chunks its
                ranges touch. The mesh's size need not be the saver's; its number of dims must be
                (else give ``placements``). From a URL, each rank's ranges are ranged requests
                (other leaves are downloaded whole); ``storage_options`` is the one remote option.
            placements: with ``mesh``, the placements of some leaves (a mapping from keys, ``"w"``
                or ``("a", "w")``, to a list of placements, one per mesh dim), or a function of
                ``(key path, shape)`` returning one (or ``None``: the recorded placements, or
                the full tensor): any tree, also one written by a single process, is split so.
            **remote: URLs only: ``storage_options``, ``cache_dir``, ``num_threads``,
                ``chunk_bytes``, ``retries``, ``timeout``, ``allow_redirects``, ``fsync``, ``progress`` (see
                :func:`memtree.remote.load`).

        Example:
            >>> import tempfile, torch, memtree
            >>> d = tempfile.mkdtemp() + "/m"
            >>> _ = memtree.TensorTree({"a": torch.ones(2), "b": {"c": torch.zeros(1)}}).memmap(d)
            >>> memtree.TensorTree.load_memmap(d, keys=[("b", "c")]).keys(include_nested=True)
            ['b', ('b', 'c')]
        """
        if remote:
            check_remote_keywords(cls.load_memmap, remote)
        if mesh is not None or placements is not None:
            from ...dist.read import load_sharded, load_sharded_remote, targets_for
            from ...store.reading.storage import is_url, local_path

            where = local_path(prefix)
            if device is not None or encryption is not None or allow_pickle or set(remote) - {"storage_options"}:
                raise InvalidArgumentError(
                    "mesh=/placements= load memtree directories and URLs (storage_options= for "
                    "those): device=, encryption=, allow_pickle= and other remote options are not "
                    "supported with them"
                )
            target = targets_for(mesh, placements)
            if is_url(where):
                level = load_sharded_remote(
                    str(where), target, verify=verify, keys=keys, storage_options=remote.get("storage_options")
                )
            else:
                level = load_sharded(where, target, mode=mode, mmap=mmap, verify=verify, keys=keys)
            return cls._from_level(level, None, unknown_classes)
        options = ReadOptions.of(
            keys=keys, mode=mode, mmap=mmap, device=device, allow_pickle=allow_pickle, verify=verify,
            encryption=encryption,
        )
        dev = options.device
        root = open_prefix(prefix, options, **remote)
        if isinstance(root, Level):  # a remote tree or tensordict's layout: loaded whole
            return cls._from_level(root, dev, unknown_classes)
        lazy = lazy and not verify and mmap and encryption is None and (dev is None or dev.type in ("cpu", "meta"))
        if not lazy:
            return cls._from_level(root.load_all(), dev, unknown_classes)
        tree = cls._lazy(root, dev, unknown_classes)
        tree._load_selected(options.selection)
        return tree

    @classmethod
    @check_keywords
    def from_module(cls, module: Any, *, use_state_dict: bool = False) -> Self:
        """A tree of ``module``'s parameters and persistent buffers, nested by module path.

        The leaves are the module's own tensors (parameters stay ``nn.Parameter``): nothing is
        copied until the tree is written with ``memmap``. Tied tensors are stored once; the other
        names are recorded in ``tree["__tied__"]`` (see :mod:`memtree.tree.parts.bind`). A module on
        the meta device gives a tree of meta tensors, which ``memmap_like`` can allocate on disk.

        Args:
            module: any ``nn.Module``.
            use_state_dict: the tree is exactly what ``module.state_dict()`` returns, instead
                of the module's attributes: every ``state_dict`` hook runs (also one that
                rebinds ``p.data`` after the values are taken) and extra states
                (``get_extra_state``) are included; the tensors are ``state_dict()``'s detached
                ones, sharing the module's memory (no copy), and names whose tensors are one
                memory are stored once (the ``"__tied__"`` record).

        Example:
            >>> import torch, memtree
            >>> from torch import nn
            >>> memtree.TensorTree.from_module(nn.Linear(2, 3))["weight"].shape
            torch.Size([3, 2])
        """
        base = cls._base()
        tree = base._nest(*bind.module_flat(module, use_state_dict=use_state_dict))
        return cast(Self, tree) if cls is base else cls(tree)

    @check_keywords
    def to_module(self, module: Any, *, return_swap: bool = True, inplace: bool = False) -> TreeCore | None:
        """Bind this tree's tensors as ``module``'s parameters and buffers, zero-copy.

        tensordict's ``to_module``: afterwards each parameter and buffer of the module *is*
        the leaf of the same path (its memory: a mapped leaf of ``load_memmap`` stays the
        mapping, a meta leaf makes a meta parameter), whatever the module held before.
        Parameters stay ``nn.Parameter``: a leaf that is one is bound as it is, any other leaf
        is wrapped in a new one sharing its memory, with the module's ``requires_grad``; a leaf
        that tracks gradients (``requires_grad``, or a ``torch.vmap`` slice) is put in the
        parameter slot as it is, as ``torch.func.functional_call`` does, so that gradients of a
        forward pass reach the tree's tensors. Two names of one module tensor (a tie) that the
        tree gives different tensors each get their own; the tie record (``"__tied__"``) ties
        names again. See :mod:`memtree.tree.parts.bind`.

        Every leaf must match a parameter, buffer or extra state of the module by its path
        (shapes and dtypes must agree), and every parameter and persistent buffer of the module
        must have its leaf (non-persistent buffers and extra states are bound when given): a
        tree that lacks some raises (a module left half on the meta device would fail later, far
        from the cause). Everything
        is checked before anything changes, and an error leaves the module as it was.

        Binding replaces the module's parameter objects, so an optimizer built before holds
        the old ones: to resume training into a live model (optimizer built first), use
        :func:`memtree.load_into_module` (or ``Checkpointer.restore``), which fills in place;
        ``inplace=True`` does the same here: live tensors are filled
        (``with torch.no_grad(): p.copy_(leaf)``, same objects, device and dtype kept) and
        tensors on the meta device, which hold nothing to fill, are bound.

        Args:
            module: the module to bind into.
            return_swap: return what the module held, as a tree: binding it back,
                ``swap.to_module(module)``, restores the module, every slot holding the same
                object as before. The swap is also a context manager that does so on exit:
                ``with params.to_module(m): y = m(x)``. With ``inplace=True`` the swap holds
                *copies* of the filled tensors' old values, taken before the fill (never views
                the fill overwrites; one copy of those tensors), and restores them in place.
                Pass ``return_swap=False`` to skip it.
            inplace: fill live tensors in place instead of binding.

        Returns:
            The swapped-out tensors as a tree, or ``None``.

        Raises:
            MemtreeKeyError: a tree leaf matches nothing in the module, or a tensor of the module
                has no leaf (use :func:`memtree.load_into_module` with ``strict=False`` to load
                part of a module).
            ShapeMismatchError: a leaf's shape or dtype differs from the module's tensor.
            SourceError: the tree gives two names of one attribute (a sub-module used twice)
                different tensors, or with ``inplace=True``, two names of one tensor, or meta
                leaves to fill live tensors with.

        Example:
            >>> import torch, memtree
            >>> from torch import nn
            >>> a, b = nn.Linear(2, 3), nn.Linear(2, 3)
            >>> w = b.weight
            >>> swap = memtree.TensorTree.from_module(a).to_module(b)
            >>> b.weight is a.weight                                 # bound: a's parameter
            True
            >>> _ = swap.to_module(b, return_swap=False)             # bound back: b's own
            >>> b.weight is w
            True
            >>> _ = memtree.TensorTree.from_module(a).to_module(b, inplace=True)
            >>> b.weight is w and torch.equal(b.weight, a.weight)     # filled in place
            True
            >>> with memtree.TensorTree.from_module(a).apply(torch.zeros_like).to_module(b):
            ...     b(torch.ones(1, 2)).abs().sum().item()            # zero weights, for now
            0.0
            >>> b.weight is w
            True
        """
        leaves = self.items(include_nested=True, leaves_only=True)
        src = bind.source_from_leaves(((k,) if isinstance(k, str) else k, v) for k, v in leaves)
        flat, aliases = bind.to_module(src, module, inplace=inplace, return_swap=return_swap)
        if not return_swap:
            return None
        swap = cast(Persistence, self._base()._nest(flat, aliases))
        swap._bound_into = (module, inplace)
        return swap

    def __enter__(self) -> Self:
        """A swap returned by :meth:`to_module`, as a context: binds it back on exit."""
        if getattr(self, "_bound_into", None) is None:
            raise InvalidArgumentError(
                "only the swap returned by tree.to_module(module) is a context manager (it binds "
                "the module's previous tensors back on exit): with params.to_module(module): ..."
            )
        return self

    def __getstate__(self) -> dict[str, Any]:  # a pickled or copied swap is a plain tree
        state = dict(super().__getstate__())
        state.pop("_bound_into", None)
        return state

    def __exit__(self, *exc: object) -> None:
        assert self._bound_into is not None  # set by to_module, checked by __enter__
        module, inplace = self._bound_into
        self._bound_into = None
        self.to_module(module, inplace=inplace, return_swap=False)

    def append_(self, item: Any, *, fsync: bool = False) -> Self:
        """Append one item along the first batch dim, on disk and in this tree; returns ``self``.

        The tree must be mapped from a prefix (``memmap(prefix)``, ``memmap_like(prefix)`` or
        ``load_memmap``). Files grow in place, their capacity at least doubling (amortised O(1)
        per item), existing rows are never rewritten, and the new length is committed like a
        write; see :mod:`memtree.store.writing.grow`.

        Args:
            item: a tree (or nested mapping) of batch size ``batch_size[1:]``.
            fsync: also make the growth durable across power loss.

        Example:
            >>> import tempfile, torch, memtree
            >>> buf = memtree.TensorTree({"x": torch.zeros(0, 2)}, batch_size=[0]).memmap(tempfile.mkdtemp() + "/b")
            >>> buf.append_({"x": torch.ones(2)}).batch_size
            torch.Size([1])
        """
        from . import growth

        self._adopt_grown(growth.extend(self, item, single=True, fsync=fsync, base=self._base()))
        return self

    def extend_(self, rows: Any, *, fsync: bool = False) -> Self:
        """Append rows (a tree or mapping of batch size ``[k] + batch_size[1:]``); returns ``self``.

        Like :meth:`append_` for ``k`` items at once (one commit).

        Example:
            >>> import tempfile, torch, memtree
            >>> buf = memtree.TensorTree({"x": torch.zeros(1)}, batch_size=[1]).memmap(tempfile.mkdtemp() + "/b")
            >>> buf.extend_({"x": torch.arange(3.0)})["x"].tolist()
            [0.0, 0.0, 1.0, 2.0]
        """
        from . import growth

        self._adopt_grown(growth.extend(self, rows, single=False, fsync=fsync, base=self._base()))
        return self

    def resize_(self, length: int, *, fsync: bool = False) -> Self:
        """Set the first batch dim to ``length`` on disk and in this tree; returns ``self``.

        New rows are zeros (sparse: no data written past the old capacity). A smaller length
        writes a new generation of each leaf file holding the rows kept (a copy of them): a
        tree loaded before, in any process, keeps seeing its rows unchanged, and files are never
        truncated (see :mod:`memtree.store.writing.grow`).

        Example:
            >>> import tempfile, torch, memtree
            >>> data = memtree.TensorTree({"x": torch.ones(2)}, batch_size=[2]).memmap(tempfile.mkdtemp() + "/d")
            >>> data.resize_(4)["x"].tolist()
            [1.0, 1.0, 0.0, 0.0]
        """
        from . import growth

        self._adopt_grown(growth.resize(self, length, fsync=fsync))
        return self

    def _adopt_grown(self, level: Level) -> None:
        self._batch_size = torch.Size(level.batch_size)
        for k, v in level.entries.items():
            if isinstance(v, Level):
                self._data[k]._adopt_grown(v)
            else:
                self._data[k] = v

    def __getitems__(self, indices: list[int]) -> Self:
        """A batch for ``torch.utils.data.DataLoader``: ``self[indices]``, one gather per leaf.

        The DataLoader passes this batch to its ``collate_fn``; the default one returns it as
        it is (importing memtree registers trees with torch's default collation, and
        :func:`memtree.collate`, as an explicit ``collate_fn``, does the same; see
        :mod:`memtree.tree.dataset`).

        Example:
            >>> import torch, memtree
            >>> memtree.TensorTree({"x": torch.arange(5)}, batch_size=[5]).__getitems__([4, 0])["x"].tolist()
            [4, 0]
        """
        batch: Self = self[torch.as_tensor(indices, dtype=torch.long)]
        return batch

    def pin_memory(self) -> Self:
        """A copy in page-locked memory, for fast copies to the GPU (``DataLoader(pin_memory=True)``).

        Example:
            >>> import torch, memtree
            >>> t = memtree.TensorTree({"x": torch.zeros(2)})
            >>> t.pin_memory()["x"].is_pinned() if torch.cuda.is_available() else True
            True
        """
        return self.apply(lambda t: t.pin_memory())
