"""Loading any source into a module: :func:`load_into_module` and its :class:`LoadResult`.

A source is a :class:`~memtree.TensorTree`, a memtree directory, a flat ``state_dict``, a
checkpoint file (``torch.save``, ``.safetensors``) or a Hugging Face model directory or shard
index (read lazily through :mod:`memtree.interop`); it is seen as flat dotted names
(:class:`memtree.tree.parts.bind.Source`), optionally renamed by ``prefix=``, matched to the module's
slots and loaded: live tensors are filled in place, meta tensors are bound (see
:mod:`memtree.tree.parts.bind`).

Example:
    >>> import tempfile, torch, memtree
    >>> from torch import nn
    >>> d = tempfile.mkdtemp() + "/m"
    >>> _ = memtree.TensorTree.from_module(nn.Linear(2, 2)).memmap(d)
    >>> memtree.load_into_module(nn.Linear(2, 2), d)
    LoadResult(missing=[], unexpected=[])
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from ..errors import InvalidArgumentError, MemtreeError, MemtreeKeyError, ShapeMismatchError, SourceError, check_keywords
from ..format.names import META_NAME
from ..interop import open_checkpoint
from ..interop.sharded import find_checkpoint
from ..dist.dtensor import is_dtensor
from ..dist.read import ShardSource, fill_dtensors
from ..store.primitives.files import FileRange, gc_paused
from ..store.reading.mapped import MemoryMappedTensor
from ..store.primitives.memory import is_plain_memory
from ..store.reading.options import check_device
from ..store.primitives.fill import FillJob, fill, mapped_range, memory_job
from ..store.reading.read import PendingLevel, fill_tree, open_for_fill, release_leaves
from ..store.reading.storage import local_path
from ..store.foreign.tensordict import is_tensordict_dir
from ..tree.parts.bind import (
    TIED_KEY,
    Group,
    KeyPrefix,
    Plan,
    Source,
    bind,
    is_live,
    module_groups,
    names_list,
    on_ring,
    plain,
    plan,
    prefixes,
    check_shared_memory,
    refuse_fills_from_meta,
    shared_memory,
    source_from_leaves,
    unmatched_prefixes,
)
from ..format.subclass_registry import is_plain
from ..tree.parts.subclasses import fill_dests, layout_problem
from ..tree.tensortree import TensorTree, load_memmap

__all__ = ["LoadResult", "as_source", "load_into_module"]


class _Keys(NamedTuple):
    missing: list[str]
    unexpected: list[str]


class LoadResult(_Keys):
    """What :func:`load_into_module` could not match, as dotted ``state_dict()`` names.

    A 2-tuple ``(missing, unexpected)`` like the result of ``nn.Module.load_state_dict``
    (``missing, unexpected = result`` works, and ``missing_keys``/``unexpected_keys`` are
    ``load_state_dict``'s names of the two lists); ``mismatched`` is an attribute, not a tuple
    item, and is left out of ``==`` (a tuple comparison).

    Attributes:
        missing: the module's tensors that the source does not provide (they keep their
            current value; meta tensors are initialised, see :func:`load_into_module`).
        unexpected: the source's tensors that match no tensor of the module.
        mismatched: the module's tensors skipped by ``ignore_mismatched=True`` because the
            source's shape differs (they keep their current value, like ``missing``).

    Example:
        >>> r = LoadResult(["head.weight"], [], mismatched=["fc.weight"])
        >>> missing, unexpected = r
        >>> missing, r.mismatched, r.missing_keys is r.missing
        (['head.weight'], ['fc.weight'], True)
    """

    mismatched: list[str]

    @property
    def missing_keys(self) -> list[str]:
        """``missing``, by the name ``nn.Module.load_state_dict``'s result gives it."""
        return self.missing

    @property
    def unexpected_keys(self) -> list[str]:
        """``unexpected``, by the name ``nn.Module.load_state_dict``'s result gives it."""
        return self.unexpected

    def __new__(
        cls, missing: list[str], unexpected: list[str], mismatched: list[str] | None = None
    ) -> LoadResult:
        self = super().__new__(cls, missing, unexpected)
        self.mismatched = list(mismatched) if mismatched is not None else []
        return self

    def __repr__(self) -> str:
        extra = f", mismatched={self.mismatched!r}" if self.mismatched else ""
        return f"LoadResult(missing={self.missing!r}, unexpected={self.unexpected!r}{extra})"


def _tree_leaves(tree: TensorTree) -> list[tuple[tuple[str, ...], Any]]:
    """``tree``'s leaves as ``(key path, value)``."""
    return [((k,) if isinstance(k, str) else k, v) for k, v in tree.items(include_nested=True, leaves_only=True)]


def _tree_source(tree: TensorTree) -> Source:
    return source_from_leaves(_tree_leaves(tree))


def _source_from_mapping(source: Mapping[Any, Any]) -> Source:
    if any(isinstance(v, Mapping) and k != TIED_KEY for k, v in source.items()):
        return _tree_source(TensorTree(source))
    leaves: list[tuple[tuple[str, ...], Any]] = []
    for key, value in source.items():
        name = ".".join(key) if isinstance(key, tuple) else key
        if not isinstance(name, str):
            raise SourceError(f"state_dict keys must be str, got {key!r}")
        leaves.append(((name,), value))
    return source_from_leaves(leaves, "state_dict")


def _source_from_file(path: str) -> Source:
    mapping = open_checkpoint(path)
    return Source({k: k for k in mapping.keys() if k != TIED_KEY}, {}, lazy=mapping)


def as_source(source: Any, *, mode: str = "r") -> Source:
    """Any source :func:`load_into_module` takes, as a :class:`~memtree.tree.parts.bind.Source`."""
    if isinstance(source, Source):
        return source
    if isinstance(source, TensorTree):
        return _tree_source(source)
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isfile(path):
            return _source_from_file(path)
        if os.path.isdir(path) and not os.path.isfile(os.path.join(path, META_NAME)) and find_checkpoint(path):
            return _source_from_file(path)  # a Hugging Face model directory
        if os.path.exists(path) and not os.path.isdir(path):  # a FIFO, a socket, a device
            raise SourceError(
                f"{path} is neither a regular file nor a directory (it resolves to "
                f"{os.path.realpath(path)}); a source is a checkpoint file, a memtree directory or "
                "a Hugging Face model directory"
            )
        return _tree_source(load_memmap(path, mode=mode))
    if isinstance(source, Mapping):
        if callable(getattr(source, "tensor_spec", None)):
            return Source({k: k for k in source.keys() if k != TIED_KEY}, {}, lazy=source)
        return _source_from_mapping(source)
    raise SourceError(
        f"cannot load from a {type(source).__name__}: pass a TensorTree, a memtree directory, "
        "a checkpoint file or Hugging Face model directory, or a state_dict (a mapping of "
        "dotted names to tensors)"
    )


# -- prefix= -----------------------------------------------------------------------------------
def _normal_prefix(prefix: Any) -> str:
    if not isinstance(prefix, str) or not prefix.strip("."):
        raise InvalidArgumentError(
            f"prefix= is a dotted name prefix such as 'model.' or 'transformer', got {prefix!r}"
        )
    return prefix.rstrip(".") + "."


def _apply_prefix(src: Source, module_names: Iterable[str], prefix: str) -> Source:
    """``src`` renamed by the ``prefix=`` rule of :func:`load_into_module`.

    Raises:
        MemtreeKeyError: neither side has a name under ``prefix``.
        SourceError: stripping it makes two source names equal.
    """
    p = _normal_prefix(prefix)
    in_src = any(n.startswith(p) for n in src.names())
    in_module = any(n.startswith(p) for n in module_names)
    if in_src and not in_module:
        return src.renamed(lambda n: n[len(p):] if n.startswith(p) else n)
    if in_module and not in_src:
        return src.renamed(lambda n: p + n)
    if in_src:
        return src  # both sides have it: the names already agree on it
    raise MemtreeKeyError(
        f"load_into_module: prefix={prefix!r} starts no name of the source and no name of the "
        "module; nothing was loaded. prefix= is the dotted prefix that one side's names have "
        "and the other's lack (e.g. 'model.' or 'transformer.')"
    )


def _suggest_prefix(src: Source, module_names: set[str], found: Plan) -> tuple[str, int] | None:
    """The prefix (and how many more names it matches) that would fix a mismatch of names."""
    missing, unexpected = set(found.missing_names), set(found.unexpected)
    counts: Counter[str] = Counter()
    for names, others in ((unexpected, missing), (missing, unexpected)):
        for name in names:
            for i, c in enumerate(name):
                if c == "." and name[i + 1 :] in others:
                    counts[name[: i + 1]] += 1
    matched = len(set(src.names()) & module_names)
    best: tuple[str, int] | None = None
    for candidate, _ in counts.most_common(3):
        try:
            renamed = _apply_prefix(src, module_names, candidate)
        except MemtreeError:
            continue
        gain = len(set(renamed.names()) & module_names) - matched
        if gain > 0 and (best is None or gain > best[1]):
            best = (candidate, gain)
    return best


def _strict_error(module: nn.Module, src: Source, module_names: set[str], found: Plan) -> MemtreeKeyError:
    parts = []
    if found.missing_names:
        parts.append(f"missing from the source: {names_list(found.missing_names)}")
    if found.unexpected:
        parts.append(f"unexpected in the source: {names_list(found.unexpected)}")
    suggestion = _suggest_prefix(src, module_names, found)
    if suggestion is not None:
        advice = (
            f"the names differ by a prefix: pass prefix={suggestion[0]!r} ({suggestion[1]} more "
            "names then match)"
        )
    elif not found.pairs and not found.mismatched:
        advice = (
            "no name of the source matches a name of the module, so strict=False would load "
            "nothing: check that the checkpoint is for this model, or map the names with prefix="
        )
    else:
        advice = (
            f"pass strict=False to load the {len(found.pairs)} tensors that match, or keys= to "
            "load only a sub-tree"
        )
    return MemtreeKeyError(
        f"load_into_module(strict=True) into {type(module).__name__}: "
        + "; ".join(parts)
        + f". Nothing was changed: {advice}"
    )


def _locator(source: Any, src: Source) -> Callable[[str], Any] | None:
    """How to find the file bytes of a source name: ``(FileRange, checksum check) | None``.

    For checkpoint files (their readers know each tensor's range), and for the leaves of a
    memtree tree that are file mappings holding exactly their file's bytes: every leaf of a
    directory given by path (just mapped here, read-only), and the shared (``mode="r+"``)
    mappings of a tree or ``state_dict`` given in memory (a read-only mapping may hold private
    changes that its file lacks: it is copied from memory). ``None`` for other in-memory
    sources.
    """
    lazy = src.lazy
    fill_range = getattr(lazy, "fill_range", None)
    if callable(fill_range):
        return lambda name: fill_range(src.entries[name])
    if lazy is not None:
        return None
    fresh = isinstance(source, (str, os.PathLike))

    def leaf(name: str) -> Any:
        value = src.entries[name]
        if not isinstance(value, MemoryMappedTensor) or (value.readonly and not fresh):
            return None
        span = mapped_range(value)
        return None if span is None else (span, None)

    return leaf


def _dest(group: Group) -> torch.Tensor:
    """The live tensor of ``group`` as a plain tensor over its memory, to fill."""
    dest = group.tensor.detach()
    return dest if type(dest) is torch.Tensor else dest.as_subclass(torch.Tensor)


def _read_into_place(
    found: Plan,
    src: Source,
    locate: Callable[[str], Any] | None,
    dev: torch.device | None,
    dtype: torch.dtype | None,
    assign: bool,
) -> tuple[Plan, dict[tuple[str, Any], torch.Tensor]]:
    """Fill, with one :func:`~memtree.store.primitives.fill.fill`, what is read rather than copied:

    * live tensors (unless ``assign``) whose source has file bytes (``locate``): filled in
      place by threaded ``preadv`` (CUDA ones through the pinned ring);
    * the tensors to bind onto a CUDA ``dev``: new tensors allocated there (cast to ``dtype``),
      filled through the pinned ring from the file bytes, or from the source tensor's host
      memory: never a ``.to()`` copy of a file mapping.

    Returns the plan of what is left to :func:`bind` (the live tensors filled taken out), and
    the new device tensors by ``(kind, Source.key)``, which ``convert`` gives :func:`bind`.
    """
    jobs: list[FillJob] = []
    rest: list[tuple[Group, str]] = []
    staged: dict[tuple[str, Any], torch.Tensor] = {}
    owned: list[int] = []  # descriptors opened for mapped leaves
    try:
        for group, name in found.pairs:
            live = not assign and is_live(group)
            key = (group.kind, src.key(name))
            if not live:
                rest.append((group, name))
                if group.kind == "extra" or not on_ring(dev) or key in staged or not src.is_tensor(name):
                    continue  # bound by bind(); a tensor under several names is bound once
            # a tensor subclass or a DTensor: filled by bind(), inner tensor by inner tensor
            where = locate(name) if locate is not None and is_plain(group.tensor) else None
            if where is None:
                if live:  # bind() copies it (from host memory into CUDA: through the ring too)
                    rest.append((group, name))
                    continue
                host = plain(src.get(name)).detach()
                if not is_plain_memory(host):
                    continue  # a device tensor, or a subclass: convert() copies it
            shape, stored = src.spec(name)
            if live:
                dest = _dest(group)
            else:
                cast = dtype if dtype is not None and stored.is_floating_point else stored
                dest = staged[key] = torch.empty(shape, dtype=cast, device=dev)
            if where is None:
                job = memory_job(dest, host, name)
                assert job is not None  # a new tensor of the source's shape, from plain memory
                jobs.append(job)
                continue
            span, checksum = where
            if src.lazy is None:
                owned.append(span.fd)
            jobs.append(FillJob(dest, span, stored if stored != dest.dtype else None, checksum))
        fill(jobs)
    finally:
        for fd in owned:
            os.close(fd)
    return dataclasses.replace(found, pairs=rest), staged


def _structure(source: Any) -> PendingLevel | None:
    """``source`` opened as a plain memtree directory by
    :func:`~memtree.store.reading.read.open_for_fill` (its structure, each leaf opened once as its level
    loads, none mapped); ``None`` for any other source."""
    if not isinstance(source, (str, os.PathLike)):
        return None
    path = os.fspath(source)
    if not os.path.isfile(os.path.join(path, META_NAME)) or is_tensordict_dir(path):
        return None
    root = open_for_fill(path)
    return root if root.meta.encryption is None else None


def _leaf_targets(
    found: Plan, src: Source, leaves: list[tuple[tuple[str, ...], Any]]
) -> dict[tuple[str, ...], list[tuple[torch.Tensor, torch.dtype]]] | None:
    """What :func:`~memtree.store.reading.read.fill_tree` reads into the live tensors of ``found``, by
    key path of the tree whose ``leaves`` (on the meta device) ``src`` was made from; ``None``
    if a pair has no key path, or if the tree holds several names of one tied tensor (whose
    values are compared on the data)."""
    paths = {id(v): path for path, v in leaves if isinstance(v, torch.Tensor)}
    targets: dict[tuple[str, ...], list[tuple[torch.Tensor, torch.dtype]]] = {}
    for group, name in found.pairs:
        path = paths.get(id(src.entries.get(name)))
        if path is None or not is_live(group) or not all(isinstance(k, str) for k in path):
            return None
        if sum(n in src.entries for n in group.names) > 1:
            return None  # several names of one tied tensor: plan() compares their data
        problem = layout_problem(src.entries[name], group.tensor)
        if problem is not None:
            raise ShapeMismatchError(f"load_into_module: {group.names[0]!r}: {problem}. Nothing was changed")
        dests = fill_dests(group.tensor)
        if dests is None:  # a DTensor holding part of its tensor: its part is sliced out by bind()
            return None
        stored = src.spec(name)[1]
        for inner, dest in dests:  # a subclass: each inner tensor from its own leaf, as it is
            targets.setdefault(path + inner, []).append((dest, dest.dtype if inner else stored))
    return targets


def _split_dtensors(found: Plan, assign: bool) -> tuple[list[tuple[Group, str]], Plan]:
    """The planned pairs whose module tensor is a ``DTensor`` (filled shard by shard, each rank
    its own: :mod:`memtree.dist.read`), and the plan of the others.

    Raises:
        InvalidArgumentError: ``assign=True``, or a ``DTensor`` on the meta device: a sharded
            parameter is only ever filled in place.
    """
    dist_pairs = [(g, n) for g, n in found.pairs if g.kind != "extra" and is_dtensor(g.tensor)]
    if not dist_pairs:
        return [], found
    meta = [g.names[0] for g, _ in dist_pairs if not is_live(g)]
    if assign or meta:
        raise InvalidArgumentError(
            f"load_into_module: the module's tensors {names_list([g.names[0] for g, _ in dist_pairs])} are "
            "DTensors, whose shards are filled in place (each rank reads its own); "
            + ("assign=True would replace them: drop it" if assign else
               f"{names_list(meta)} are on the meta device: materialise the module first "
               "(module.to_empty(device=...)), then load")
            + ". Nothing was changed"
        )
    chosen = {id(g) for g, _ in dist_pairs}
    return dist_pairs, dataclasses.replace(found, pairs=[(g, n) for g, n in found.pairs if id(g) not in chosen])


def _shard_sources(
    pairs: list[tuple[Group, str]],
    src: Source,
    source: Any,
    root: PendingLevel | None,
    leaves: list[tuple[tuple[str, ...], Any]],
    owned: list[int],
) -> list[ShardSource]:
    """Where each ``DTensor`` of ``pairs`` is filled from: a kept leaf of a memtree directory, a
    checkpoint file's range, a mapped leaf's file (its descriptor added to ``owned``), a
    ``DTensor`` of the source (redistributed to the module's placements on the same mesh, else
    gathered), or a tensor in memory."""
    kept = root.source.reader.kept if root is not None else None
    paths = {id(v): path for path, v in leaves if isinstance(v, torch.Tensor)} if kept is not None else {}
    locate = _locator(source, src) if kept is None else None
    out: list[ShardSource] = []
    for group, name in pairs:
        stored = src.spec(name)[1]
        path = paths.get(id(src.entries.get(name)))
        if kept is not None and path in kept:
            fd, entry, where = kept[path]
            out.append(ShardSource(group.tensor, name, entry.dtype, span=FileRange(fd, entry.offset or 0, entry.nbytes, f"leaf {where}")))
            continue
        found = locate(name) if locate is not None else None
        if found is not None:
            if src.lazy is None:
                owned.append(found[0].fd)
            out.append(ShardSource(group.tensor, name, stored, span=found[0]))
            continue
        value = src.get(name)
        if value.device.type == "meta":
            raise SourceError(
                f"load_into_module: the source's {name!r} is on the meta device (no data) and the "
                "module's is a DTensor to fill; nothing was changed"
            )
        span = mapped_range(value) if isinstance(value, MemoryMappedTensor) else None
        if span is not None:  # a mapped leaf: read this rank's ranges of its file
            owned.append(span.fd)
            out.append(ShardSource(group.tensor, name, stored, span=span))
        elif is_dtensor(value):  # every rank takes this step in the same order
            target = group.tensor
            if value.device_mesh == target.device_mesh:
                shard = value.redistribute(target.device_mesh, target.placements).to_local()
                out.append(ShardSource(group.tensor, name, stored, local=shard))
            else:
                out.append(ShardSource(group.tensor, name, stored, tensor=value.full_tensor()))
        else:
            out.append(ShardSource(group.tensor, name, stored, tensor=value))
    return out


def _same_device(have: torch.device, want: torch.device) -> bool:
    return have.type == want.type and (want.index is None or have.index == want.index)


@check_keywords
def load_into_module(
    module: nn.Module,
    source: Any,
    *,
    strict: bool = True,
    keys: Iterable[KeyPrefix] | KeyPrefix | None = None,
    device: torch.device | str | None = None,
    prefix: str | None = None,
    dtype: torch.dtype | None = None,
    ignore_mismatched: bool = False,
    assign: bool = False,
) -> LoadResult:
    """Load ``source`` into ``module``'s parameters and buffers, by dotted ``state_dict()`` names.

    How each tensor is loaded depends on the module's tensor:

    * **live** (it holds data: a module built the usual way): it is *filled in place*. The
      module keeps its ``nn.Parameter`` objects, their storage, device and ``requires_grad``,
      so an optimizer built before the load (the usual resume order: model, optimizer, then
      load), hooks and ties keep working. From a file (memtree directory, safetensors,
      ``torch.save``, shards) the bytes are read with threaded ``preadv`` straight into the
      tensors' memory (no mapping, no second copy; :mod:`memtree.store.primitives.fill`), CUDA tensors
      through a ring of pinned buffers; from tensors in memory, ``p.copy_(source)`` (into
      CUDA tensors through the same ring; the shared ``mode="r+"`` mappings of a tree are
      read from their files);
    * **meta** (a module built under :func:`empty_init`): there is nothing to fill, so the
      source tensor is *bound*, zero-copy: with a memtree directory the weights become
      read-only copy-on-write mappings of the files (no data is read until used, and the files
      never change); build the optimizer after loading. With ``device="cuda"`` each tensor is
      allocated on the device, filled through the pinned ring (from the file, or the source's
      memory; never copied from a mapping), then bound;
    * ``assign=True`` binds every tensor, live or not (like
      ``nn.Module.load_state_dict(assign=True)``): parameters are then new objects, which an
      optimizer built before the load does not hold (onto CUDA: read through the ring too).

    Module tensors the source does not provide are reported in ``missing`` and keep their
    current value. In a module built under :func:`empty_init` they stay on the meta device, so
    that a checkpoint in several parts can be loaded by several calls without allocating the
    parts still to come; call :func:`init_missing` once every part is loaded to allocate and
    initialise what no source provided (a new head, for example).

    Python's cyclic garbage collector is paused during the call (enabled again at its end,
    unless the caller had disabled it): the walk of a large tree allocates many objects, none of
    them garbage, and a full collection would cost more than reading a warm model.

    Args:
        module: the module to load into.
        source: a :class:`~memtree.TensorTree`, a memtree directory, a flat ``state_dict``
            (``{"encoder.0.weight": tensor, ...}``), a checkpoint file (``torch.save``,
            ``.safetensors``), or a Hugging Face model directory or shard index
            (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``); files are read
            through ``memtree.interop``, lazily: only the tensors that are loaded are read.
        strict: raise :class:`~memtree.MemtreeKeyError` if anything is missing or unexpected,
            before changing anything. The message suggests the ``prefix=`` that would make the
            names match, when one would.
        keys: load only names under these dotted prefixes or tuples (``"encoder"``,
            ``("encoder", "0")``) of the module's names; ``missing``/``unexpected`` are then
            computed within them.
        device: where bound tensors go (a copy, unless they are there already; onto CUDA,
            new tensors read through the pinned ring); ``None`` binds them where the source
            has them. Tensors filled in place stay on their own
            device: a live tensor elsewhere than ``device`` raises (move the module first).
        prefix: a dotted prefix (``"model."``, ``"transformer"``; the final dot is optional)
            that the names of one side have and the other's lack, as between a task model
            (``GPT2LMHeadModel``: ``transformer.h.0...``) and its base model (``GPT2Model``:
            ``h.0...``). The rule: if some source names start with it and no module name does,
            it is stripped from the source names that start with it (the others are matched as
            they are, usually ``unexpected``: a task head); if some module names start with it
            and no source name does, it is added in front of every source name; if both sides
            have names under it, names are matched as they are; if neither does, it raises.
        dtype: cast floating-point source tensors to this dtype as they are loaded, one
            tensor at a time (never a copy of the whole checkpoint): a ``bfloat16``
            checkpoint into a ``float32`` model. Integer and bool tensors keep their dtype.
            The cast dtype must then be the module tensor's dtype, as without ``dtype``.
        ignore_mismatched: skip source tensors whose shape differs from the module's (a new
            classification head) instead of raising, and report their module names in
            :attr:`LoadResult.mismatched`; they keep their current value (meta ones stay meta,
            for :func:`init_missing`). They do not fail ``strict=True``. A dtype difference
            still raises.
        assign: bind the source tensors even into live tensors, instead of filling them.

    Returns:
        :class:`LoadResult` ``(missing, unexpected)``, lists of dotted names, with
        ``.mismatched``.

    Raises:
        ShapeMismatchError: a source tensor's shape or dtype differs from the module's (named
            with both sides); raised before anything changes, even with ``strict=False``.
        MemtreeKeyError: ``strict=True`` and names are missing or unexpected; a ``keys=`` entry
            names no tensor or sub-module of the module and nothing in the source; or
            ``prefix`` starts no name of either side.
        InvalidArgumentError: ``dtype`` is not a floating-point dtype, ``prefix`` is not a
            dotted name, ``device`` is not a device this process has (CUDA without CUDA) or
            differs from a live tensor's device, or a live tensor's elements share memory (an
            expanded view: it cannot be filled in place).
        SourceError: the source is of an unknown kind or cannot be read, or gives two names
            of one tied tensor of the module, or tensors on the meta device (no data) to fill
            live tensors with, or two live tensors that share memory, values
            that disagree.

    Example:
        >>> import tempfile
        >>> from torch import nn
        >>> from memtree import TensorTree, empty_init, init_missing
        >>> d = tempfile.mkdtemp() + "/m"
        >>> _ = TensorTree.from_module(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))).memmap(d)
        >>> with empty_init():
        ...     new = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))   # a new head
        >>> load_into_module(new, d, ignore_mismatched=True)
        LoadResult(missing=[], unexpected=[], mismatched=['1.weight', '1.bias'])
        >>> init_missing(new)                         # allocate and initialise the new head
        ['1.weight', '1.bias']
        >>> new(torch.ones(1, 4)).shape
        torch.Size([1, 3])
    """
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise InvalidArgumentError(
            f"load_into_module: dtype= is the floating-point dtype to cast to (torch.float32, "
            f"torch.bfloat16...), got {dtype!r}"
        )
    dev = check_device(device)
    if isinstance(source, str):
        source = local_path(source)  # file:///path is the local path; other URLs: load_memmap's
    with gc_paused():  # the walk and the plan allocate many objects, none of them garbage
        return _load(module, source, strict, keys, dev, prefix, dtype, ignore_mismatched, assign)


def _load(
    module: nn.Module,
    source: Any,
    strict: bool,
    keys: Iterable[KeyPrefix] | KeyPrefix | None,
    dev: torch.device | None,
    prefix: str | None,
    dtype: torch.dtype | None,
    ignore_mismatched: bool,
    assign: bool,
) -> LoadResult:
    groups = module_groups(module)
    owned: list[int] = []  # descriptors of mapped leaves that DTensors are filled from
    # Into a module whose tensors are all live, from a memtree directory: plan on the tree's
    # structure (each leaf opened and checked once as it is walked, none mapped), then read the
    # leaves into their tensors.
    root = _structure(source) if not assign and all(is_live(g) for g in groups) else None
    try:
        if root is not None:
            leaves = _tree_leaves(TensorTree._from_level(root.load_all(), torch.device("meta")))
            src = source_from_leaves(leaves)
        else:
            src = as_source(source, mode="r")
        module_names = {n for g in groups for n in g.names}
        if prefix is not None:
            src = _apply_prefix(src, module_names, prefix)
        selected = prefixes(keys)
        unmatched = unmatched_prefixes(selected, module, src) if selected is not None else []
        if unmatched:
            raise MemtreeKeyError(
                f"load_into_module: keys= entries {unmatched[:10]} name no tensor or sub-module of "
                f"{type(module).__name__} and no tensor of the source; nothing was loaded. keys= takes "
                "dotted prefixes of state_dict() names, such as 'encoder' or 'encoder.0'"
            )
        found = plan(groups, src, selected, cast=dtype, ignore_mismatched=ignore_mismatched)
        if strict and (found.missing_names or found.unexpected):
            raise _strict_error(module, src, module_names, found)
        if dev is not None and not assign:
            elsewhere = [
                f"{g.names[0]} ({g.tensor.device})"
                for g, _ in found.pairs
                if is_live(g) and not _same_device(g.tensor.device, dev)
            ]
            if elsewhere:
                raise InvalidArgumentError(
                    f"load_into_module(device={str(dev)!r}): the module's tensors {names_list(elsewhere)} "
                    "hold data on another device, and live tensors are filled in place where they "
                    f"are. Nothing was changed: move the module first (module.to({str(dev)!r})), build "
                    "it under memtree.empty_init(), or pass assign=True to bind new tensors"
                )

        staged: dict[tuple[str, Any], torch.Tensor] = {}  # tensors bound onto CUDA, already filled

        def convert(kind: str, name: str, value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            filled = staged.get((kind, src.key(name)))
            if filled is not None:
                return filled
            cast = dtype if dtype is not None and value.is_floating_point() else value.dtype
            target = dev if dev is not None else value.device
            if cast != value.dtype or target != value.device:
                return value.to(device=target, dtype=cast)
            return value

        dist_pairs, found = _split_dtensors(found, assign)  # DTensors: each rank reads its shards
        kept = root is not None and root.source.reader.kept is not None
        shared = root is not None and bool(shared_memory(found))  # checked below, on the data
        targets = _leaf_targets(found, src, leaves) if root is not None and not shared else None
        if root is not None and targets is not None and kept:
            shards = _shard_sources(dist_pairs, src, source, root, leaves, owned)
            fill_tree(root, targets)
            found = dataclasses.replace(found, pairs=[])
        else:
            if root is not None:  # a key path the reader cannot name, or too many leaves to keep open
                src = as_source(source, mode="r")
                if prefix is not None:
                    src = _apply_prefix(src, module_names, prefix)
                found = plan(groups, src, selected, cast=dtype, ignore_mismatched=ignore_mismatched)
                dist_pairs, found = _split_dtensors(found, assign)
            if not assign:
                refuse_fills_from_meta(found, src, "load_into_module")
                check_shared_memory(found, src, "load_into_module")
            shards = _shard_sources(dist_pairs, src, source, None, [], owned)
            found, staged = _read_into_place(found, src, _locator(source, src), dev, dtype, assign)
        fill_dtensors(shards)
        bind(found, src, convert, assign=assign, keep_old=False)
        return LoadResult(found.missing_names, found.unexpected, found.mismatched)
    finally:
        for fd in owned:
            os.close(fd)
        if root is not None:
            release_leaves(root)
