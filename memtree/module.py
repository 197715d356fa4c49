"""Modules: trees of parameters and buffers, zero-copy binding, partial loading, empty init.

* :func:`from_module` builds a :class:`~memtree.TensorTree` of a module's parameters and
  persistent buffers, nested by module path (``layers.0.attn.weight`` ->
  ``tree["layers", "0", "attn", "weight"]``). The leaves *are* the module's tensors (no copy).
* :func:`to_module` binds a tree's tensors as a module's parameters and buffers without copying:
  with a tree from ``load_memmap``, the module's weights are the mapped files.
* :func:`load_into_module` loads any source (a tree, a memtree directory, a flat
  ``state_dict``, a checkpoint file) into a module, partially if asked, and reports what was
  ``missing`` and ``unexpected``.
* :func:`empty_init` builds modules whose weights take no memory (meta device).

**Tied (shared) tensors.** A tensor reachable under several names (a language model's embedding
and output projection, a sub-module used twice) is stored once, under its first name in
``named_parameters(remove_duplicate=False)`` order. Every other name is recorded in a JSON
non-tensor leaf at the root of the tree, ``tree["__tied__"] = {"decoder.weight":
"embedding.weight"}`` (alias -> stored name), so the record survives ``memmap`` and
``load_memmap``. On binding, ties are restored two ways: names that share one tensor in the
*target* module (because its constructor tied them) all get the same bound parameter, and a
name that the source lacks but lists in ``"__tied__"`` is bound to the stored tensor (the
same ``nn.Parameter`` object as its canonical name, so the result is tied again even when the
target module did not tie them itself).

**What binding means.** A parameter becomes a new ``nn.Parameter`` that shares the source
tensor's memory (``requires_grad`` is kept from the module's current parameter); a source
that already is an ``nn.Parameter`` is bound as it is (the same object). A buffer becomes a
plain tensor sharing the source's memory. ``MemoryMappedTensor`` leaves are bound as plain
tensors over the same mapping, so that torch's fast paths (which skip tensor subclasses) run
exactly as for an in-memory model. In-place updates of bound tensors (optimizer steps,
BatchNorm running statistics in training mode) therefore write to the mapping: through to the
files with ``load_memmap(..., mode="r+")`` (the default), or into private copy-on-write pages
with ``mode="r"``, which :func:`load_into_module` uses for directory sources, so loading a
checkpoint into a model never lets training change the checkpoint.

Example:
    >>> import tempfile, torch, memtree
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> d = tempfile.mkdtemp() + "/model"
    >>> _ = memtree.TensorTree.from_module(model).memmap(d)
    >>> with memtree.empty_init():
    ...     fresh = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    >>> fresh[0].weight.device.type
    'meta'
    >>> _ = memtree.load_memmap(d).to_module(fresh)
    >>> x = torch.randn(3, 4)
    >>> torch.equal(fresh(x), model(x))
    True
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Union

import torch
from torch import nn

from .errors import MemtreeKeyError, ShapeMismatchError, SourceError
from .mmap_tensor import MemoryMappedTensor
from .nontensor import NonTensor
from .tree import TensorTree, load_memmap

__all__ = [
    "TIED_KEY",
    "LoadResult",
    "KeyPrefix",
    "from_module",
    "to_module",
    "load_into_module",
    "empty_init",
    "init_missing",
]

#: Root key of the JSON leaf that records tied tensors: ``{alias: stored name}``.
TIED_KEY = "__tied__"
_EXTRA_STATE = "_extra_state"
_LIST_MAX = 10

KeyPrefix = Union[str, tuple[str, ...]]
"""A ``keys=`` entry: a dotted prefix (``"encoder.0"``) or a tuple (``("encoder", "0")``)."""


class LoadResult(NamedTuple):
    """What :func:`load_into_module` could not match, as dotted ``state_dict()`` names.

    Attributes:
        missing: the module's tensors that the source does not provide (they keep their
            current value; meta tensors are initialised, see :func:`load_into_module`).
        unexpected: the source's tensors that match no tensor of the module.
    """

    missing: list[str]
    unexpected: list[str]


# ---------------------------------------------------------------------------------------------
# the module side: slots grouped by tensor identity


@dataclass
class _Slot:
    owner: nn.Module
    attr: str


@dataclass
class _Group:
    """Every name under which one tensor (or one extra state) is reachable in a module."""

    kind: str  # "param", "buffer" or "extra"
    names: list[str]
    slots: list[_Slot]
    tensor: Any  # the current tensor (None for "extra")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _has_extra_state(m: nn.Module) -> bool:
    return type(m).get_extra_state is not nn.Module.get_extra_state


def _module_groups(module: nn.Module, *, extra_state: bool = True) -> list[_Group]:
    """The module's parameters, persistent buffers (and extra states), grouped by identity."""
    by_id: dict[int, _Group] = {}
    groups: list[_Group] = []
    for path, m in module.named_modules(remove_duplicate=False):
        for kind, store in (("param", m._parameters), ("buffer", m._buffers)):
            for attr, t in store.items():
                if t is None or (kind == "buffer" and attr in m._non_persistent_buffers_set):
                    continue
                name = _join(path, attr)
                group = by_id.get(id(t))
                if group is None:
                    group = by_id[id(t)] = _Group(kind, [], [], t)
                    groups.append(group)
                if name not in group.names:
                    group.names.append(name)
                group.slots.append(_Slot(m, attr))
        if extra_state and _has_extra_state(m):
            groups.append(_Group("extra", [_join(path, _EXTRA_STATE)], [_Slot(m, _EXTRA_STATE)], None))
    return groups


# ---------------------------------------------------------------------------------------------
# building trees from modules


def _nest(flat: Iterable[tuple[str, Any]], aliases: Mapping[str, str]) -> TensorTree:
    tree = TensorTree()
    for name, value in flat:
        if not isinstance(value, torch.Tensor):
            value = NonTensor(value)
        tree[tuple(name.split("."))] = value
    if aliases:
        if TIED_KEY in tree:
            raise SourceError(
                f"the module has a tensor or sub-module named {TIED_KEY!r}, the key memtree "
                "reserves for the record of tied tensors; rename it"
            )
        tree[TIED_KEY] = NonTensor(dict(aliases))
    return tree


def from_module(module: nn.Module, *, use_state_dict: bool = False) -> TensorTree:
    """A tree of ``module``'s parameters and persistent buffers, nested by module path.

    The leaves are the module's own tensors (parameters stay ``nn.Parameter``): nothing is
    copied until the tree is written with ``memmap``. Tied tensors are stored once; the other
    names are recorded in ``tree["__tied__"]`` (see the module docstring). A module on the
    meta device gives a tree of meta tensors, which ``memmap_like`` can allocate on disk.

    Args:
        module: any ``nn.Module``.
        use_state_dict: build the tree from ``module.state_dict(keep_vars=True)`` instead of
            the module's attributes, so that custom ``state_dict`` hooks and extra states
            (``get_extra_state``) are honoured.

    Returns:
        A :class:`~memtree.TensorTree` with ``batch_size=()``.

    Example:
        >>> from torch import nn
        >>> tree = from_module(nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3)))
        >>> sorted(k for k in tree.keys(include_nested=True, leaves_only=True))
        [('0', 'bias'), ('0', 'weight'), ('1', 'bias'), ('1', 'num_batches_tracked'), ('1', 'running_mean'), ('1', 'running_var'), ('1', 'weight')]
    """
    flat: list[tuple[str, Any]] = []
    aliases: dict[str, str] = {}
    if use_state_dict:
        first: dict[int, str] = {}
        for name, value in module.state_dict(keep_vars=True).items():
            if isinstance(value, torch.Tensor):
                key = _storage_key(value)
                if key in first:
                    aliases[name] = first[key]
                    continue
                first[key] = name
            flat.append((name, value))
    else:
        for group in _module_groups(module, extra_state=False):
            if isinstance(group.tensor, nn.parameter.UninitializedTensorMixin):
                raise SourceError(
                    f"{group.names[0]!r} is an uninitialized parameter of a lazy module; run one "
                    "forward pass (or call initialize_parameters) before from_module"
                )
            flat.append((group.names[0], group.tensor))
            aliases.update((alias, group.names[0]) for alias in group.names[1:])
    return _nest(flat, aliases)


def _storage_key(t: torch.Tensor) -> Any:
    """Identity of a tensor's data (state_dict hooks may return new objects for one tensor)."""
    if t.device.type == "meta" or t.numel() == 0:  # no data to compare: only the object counts
        return id(t)
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


# ---------------------------------------------------------------------------------------------
# the source side: any source as flat dotted names


@dataclass
class _Source:
    """A source seen as flat dotted names, with shapes/dtypes known before any data is read."""

    entries: dict[str, Any]  # dotted name -> tensor, non-tensor value, or a lazy mapping's key
    aliases: dict[str, str] = field(default_factory=dict)
    lazy: Mapping[str, Any] | None = None  # a lazy mapping (checkpoint file): read on get()

    def is_tensor(self, name: str) -> bool:
        if self.lazy is not None:
            return self._lazy_spec(name) is not None
        return isinstance(self.entries[name], torch.Tensor)

    def _lazy_spec(self, name: str) -> tuple[torch.Size, torch.dtype] | None:
        spec = getattr(self.lazy, "tensor_spec", None)
        if spec is None:
            value = self.lazy[name]  # type: ignore[index]
            return (value.shape, value.dtype) if isinstance(value, torch.Tensor) else None
        try:
            shape, dtype = spec(name)
        except (TypeError, ValueError, KeyError):
            return None
        return torch.Size(shape), dtype

    def spec(self, name: str) -> tuple[torch.Size, torch.dtype]:
        if self.lazy is not None:
            found = self._lazy_spec(name)
            assert found is not None
            return found
        t = self.entries[name]
        if type(t) is MemoryMappedTensor:  # no __torch_function__ round trip per attribute
            with torch._C.DisableTorchFunctionSubclass():
                return t.shape, t.dtype
        return t.shape, t.dtype

    def get(self, name: str) -> Any:
        if self.lazy is not None:
            return self.lazy[name]
        return self.entries[name]


def _aliases_from(value: Any, where: str) -> dict[str, str]:
    data = value.data if isinstance(value, NonTensor) else value
    if not isinstance(data, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in data.items()
    ):
        raise SourceError(
            f"{where}: {TIED_KEY!r} must map alias names to stored names (str -> str), got "
            f"{type(data).__name__}; it is the record of tied tensors written by from_module"
        )
    return dict(data)


def _source_from_tree(tree: TensorTree) -> _Source:
    entries: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    for key, value in tree.items(include_nested=True, leaves_only=True):
        path = (key,) if isinstance(key, str) else key
        if path == (TIED_KEY,):
            aliases = _aliases_from(value, "tree")
            continue
        name = ".".join(path)
        if name in entries:
            raise SourceError(
                f"the tree gives the dotted name {name!r} twice (as a nested key and as a key "
                "containing '.'); rename one of them"
            )
        entries[name] = value
    return _Source(entries, aliases)


def _source_from_mapping(source: Mapping[Any, Any]) -> _Source:
    if any(isinstance(v, Mapping) and k != TIED_KEY for k, v in source.items()):
        return _source_from_tree(TensorTree(source))
    entries: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    for key, value in source.items():
        name = ".".join(key) if isinstance(key, tuple) else key
        if not isinstance(name, str):
            raise SourceError(f"state_dict keys must be str, got {key!r}")
        if name == TIED_KEY:
            aliases = _aliases_from(value, "state_dict")
        else:
            entries[name] = value
    return _Source(entries, aliases)


def _source_from_file(path: str) -> _Source:
    try:
        from .interop import open_checkpoint  # type: ignore[attr-defined]  # optional layer above
    except ImportError as err:
        raise SourceError(
            f"{path} is a file; loading checkpoint files (torch.save, .safetensors) needs "
            f"memtree.interop.open_checkpoint, which could not be imported ({err}). Pass a "
            "memtree directory, a TensorTree or a state_dict instead"
        ) from err
    mapping = open_checkpoint(path)
    return _Source({k: k for k in mapping.keys() if k != TIED_KEY}, {}, lazy=mapping)


def _as_source(source: Any, *, mode: str = "r") -> _Source:
    if isinstance(source, _Source):
        return source
    if isinstance(source, TensorTree):
        return _source_from_tree(source)
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isfile(path):
            return _source_from_file(path)
        return _source_from_tree(load_memmap(path, mode=mode))
    if isinstance(source, Mapping):
        if callable(getattr(source, "tensor_spec", None)):
            return _Source({k: k for k in source.keys() if k != TIED_KEY}, {}, lazy=source)
        return _source_from_mapping(source)
    raise SourceError(
        f"cannot load from a {type(source).__name__}: pass a TensorTree, a memtree directory, "
        "a checkpoint file path, or a state_dict (a mapping of dotted names to tensors)"
    )


# ---------------------------------------------------------------------------------------------
# matching a source to a module


def _prefixes(keys: Iterable[KeyPrefix] | KeyPrefix | None) -> list[str] | None:
    if keys is None:
        return None
    if isinstance(keys, (str, tuple)):
        keys = [keys]
    out = []
    for key in keys:
        if isinstance(key, tuple) and key and all(isinstance(k, str) and k for k in key):
            out.append(".".join(key))
        elif isinstance(key, str) and key:
            out.append(key)
        else:
            raise MemtreeKeyError(
                f"keys= entries are dotted prefixes ('encoder.0') or tuples of str "
                f"(('encoder', '0')), got {key!r}"
            )
    return out


def _selected(name: str, prefixes: list[str] | None) -> bool:
    if prefixes is None:
        return True
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@dataclass
class _Plan:
    pairs: list[tuple[_Group, str]]  # group -> source name bound to it
    missing_names: list[str]
    unexpected: list[str]


def _describe(shape: Any, dtype: torch.dtype) -> str:
    return f"{str(dtype).replace('torch.', '')}{list(shape)}"


def _plan(groups: list[_Group], src: _Source, prefixes: list[str] | None) -> _Plan:
    """Match module groups to source names; raise on shape/dtype mismatches (before any change)."""
    pairs: list[tuple[_Group, str]] = []
    missing_names: list[str] = []
    consumed: set[str] = set()
    mismatches: list[str] = []
    for group in groups:
        chosen_names = [n for n in group.names if _selected(n, prefixes)]
        if not chosen_names:
            continue
        present = [n for n in group.names if n in src.entries]
        consumed.update(present)
        name = next(iter(present), None)
        if name is None:
            name = next((src.aliases[n] for n in group.names if src.aliases.get(n) in src.entries), None)
        if name is None:
            missing_names.extend(chosen_names)
            continue
        consumed.add(name)
        if group.kind != "extra":
            if not src.is_tensor(name):
                mismatches.append(f"{name!r}: the source holds a non-tensor value, the module a tensor")
                continue
            shape, dtype = src.spec(name)
            mine = group.tensor
            if tuple(shape) != tuple(mine.shape) or dtype != mine.dtype:
                where = name if name == group.names[0] else f"{group.names[0]} (from {name!r})"
                mismatches.append(
                    f"{where!r}: source {_describe(shape, dtype)}, module {_describe(mine.shape, mine.dtype)}"
                )
                continue
        pairs.append((group, name))
    if mismatches:
        more = f" (and {len(mismatches) - _LIST_MAX} more)" if len(mismatches) > _LIST_MAX else ""
        raise ShapeMismatchError(
            "shape/dtype mismatch between the source and the module for "
            + "; ".join(mismatches[:_LIST_MAX])
            + more
            + ". Nothing was changed: load into a module built with matching sizes, or leave "
            "these keys out with keys= (or drop them from the source)"
        )
    consumed.update(a for a, target in src.aliases.items() if target in consumed)
    unexpected = [n for n in src.entries if _selected(n, prefixes) and n not in consumed]
    return _Plan(pairs, missing_names, unexpected)


def _names_list(names: list[str]) -> str:
    more = f" ... ({len(names)} in all)" if len(names) > _LIST_MAX else ""
    return ", ".join(repr(n) for n in names[:_LIST_MAX]) + more


# ---------------------------------------------------------------------------------------------
# binding


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself, or for a ``MemoryMappedTensor`` a plain tensor over the same memory."""
    if isinstance(t, MemoryMappedTensor):
        return t.as_subclass(torch.Tensor)
    return t


def _set_slot(group: _Group, value: Any) -> None:
    for slot in group.slots:
        if group.kind == "param":
            slot.owner._parameters[slot.attr] = value
        elif group.kind == "buffer":
            slot.owner._buffers[slot.attr] = value
        else:
            slot.owner.set_extra_state(value)


def _current(group: _Group) -> Any:
    if group.kind == "extra":
        return group.slots[0].owner.get_extra_state()
    return group.tensor


def _bind(plan: _Plan, src: _Source, convert: Callable[[str, str, Any], Any]) -> list[tuple[_Group, Any]]:
    """Bind every planned pair; returns ``(group, old value)`` for the swap tree.

    ``convert(kind, name, value)`` turns a source value into what is bound; a parameter that
    is not an ``nn.Parameter`` then is wrapped in one (``requires_grad`` from the module).
    """
    made: dict[tuple[str, str], Any] = {}  # one bound object per source name (keeps ties)
    old: list[tuple[_Group, Any]] = []
    for group, name in plan.pairs:
        old.append((group, _current(group)))
        key = (group.kind, name)
        value = made.get(key)
        if value is None:
            value = convert(group.kind, name, src.get(name))
            if group.kind == "param" and not isinstance(value, nn.Parameter):
                value = nn.Parameter(_plain(value), requires_grad=group.tensor.requires_grad)
            elif group.kind == "buffer":
                value = _plain(value.detach() if isinstance(value, nn.Parameter) else value)
            made[key] = value
        _set_slot(group, value)
        group.tensor = value if group.kind != "extra" else None
    return old


def _swap_tree(old: list[tuple[_Group, Any]]) -> TensorTree:
    flat = [(group.names[0], value) for group, value in old]
    aliases = {alias: g.names[0] for g, _ in old for alias in g.names[1:]}
    return _nest(flat, aliases)


def to_module(tree: TensorTree, module: nn.Module, *, return_swap: bool = True) -> TensorTree | None:
    """Bind ``tree``'s tensors as ``module``'s parameters and buffers, without copying.

    Every tensor leaf must match a parameter, persistent buffer or extra state of the module
    by its path (shapes and dtypes must agree); module tensors the tree does not hold are left
    as they are. Everything is checked before anything changes. Works on modules built under
    :func:`empty_init` (meta device).

    Args:
        tree: a tree as built by :func:`from_module` (nested by module path; a flat tree with
            dotted keys works too), typically from ``load_memmap``.
        module: the module to bind into.
        return_swap: return the tensors that were replaced, as a tree (binding it back with
            ``swap.to_module(module)`` restores the module).

    Returns:
        The swapped-out tensors as a :class:`~memtree.TensorTree`, or ``None``.

    Raises:
        MemtreeKeyError: a tree leaf matches nothing in the module.
        ShapeMismatchError: a leaf's shape or dtype differs from the module's tensor.

    Example:
        >>> from torch import nn
        >>> a, b = nn.Linear(2, 2), nn.Linear(2, 2)
        >>> old = to_module(from_module(a), b)
        >>> b.weight.data_ptr() == a.weight.data_ptr(), old["weight"].data_ptr() == a.weight.data_ptr()
        (True, False)
    """
    src = _as_source(tree)
    plan = _plan(_module_groups(module), src, None)
    if plan.unexpected:
        raise MemtreeKeyError(
            f"to_module: {len(plan.unexpected)} leaves of the tree match no parameter or buffer "
            f"of {type(module).__name__}: {_names_list(plan.unexpected)}. Nothing was changed: "
            "select the right sub-tree (tree['encoder'].to_module(model.encoder)), or use "
            "memtree.load_into_module(..., strict=False) to skip them"
        )
    old = _bind(plan, src, lambda _kind, _name, value: value)
    return _swap_tree(old) if return_swap else None


def load_into_module(
    module: nn.Module,
    source: Any,
    *,
    strict: bool = True,
    keys: Iterable[KeyPrefix] | KeyPrefix | None = None,
    device: torch.device | str | None = None,
) -> LoadResult:
    """Load ``source`` into ``module``'s parameters and buffers, binding (not copying) tensors.

    Tensors are bound as in :func:`to_module`: with a memtree directory, the module's weights
    become read-only copy-on-write mappings of the files (no data is read until used, and the
    files never change). Names are the dotted ``state_dict()`` names of the module.

    Module tensors the source does not provide are reported in ``missing`` and keep their
    current value. In a module built under :func:`empty_init` they stay on the meta device, so
    that a checkpoint in several parts (shards) can be loaded by several calls without
    allocating the parts still to come; call :func:`init_missing` once every part is loaded to
    allocate and initialise what no source provided (a new head, for example).

    Args:
        module: the module to load into.
        source: a :class:`~memtree.TensorTree`, a memtree directory, a flat ``state_dict``
            (``{"encoder.0.weight": tensor, ...}``), or a checkpoint file (``torch.save``,
            ``.safetensors``; read through ``memtree.interop``, lazily: only the tensors that
            are bound are read).
        strict: raise :class:`~memtree.MemtreeKeyError` if anything is missing or unexpected,
            before changing anything.
        keys: load only names under these dotted prefixes or tuples (``"encoder"``,
            ``("encoder", "0")``); ``missing``/``unexpected`` are then computed within them.
        device: move the tensors there (a copy) before binding; ``None`` binds them where the
            source has them.

    Returns:
        :class:`LoadResult` ``(missing, unexpected)``, lists of dotted names.

    Raises:
        ShapeMismatchError: a source tensor's shape or dtype differs from the module's (named
            with both sides); raised before anything changes, even with ``strict=False``.
        MemtreeKeyError: ``strict=True`` and names are missing or unexpected.
        SourceError: the source is of an unknown kind or cannot be read.

    Example:
        >>> import tempfile
        >>> from torch import nn
        >>> d = tempfile.mkdtemp() + "/m"
        >>> _ = from_module(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))).memmap(d)
        >>> with empty_init():
        ...     new = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 3))   # a new head
        >>> load_into_module(new, d, keys=["0"])      # "1" differs in shape: load only "0"
        LoadResult(missing=[], unexpected=[])
        >>> init_missing(new)                         # allocate and initialise the new head
        ['1.weight', '1.bias']
        >>> new(torch.ones(1, 4)).shape
        torch.Size([1, 3])
    """
    src = _as_source(source, mode="r")
    prefixes = _prefixes(keys)
    groups = _module_groups(module)
    plan = _plan(groups, src, prefixes)
    if strict and (plan.missing_names or plan.unexpected):
        parts = []
        if plan.missing_names:
            parts.append(f"missing from the source: {_names_list(plan.missing_names)}")
        if plan.unexpected:
            parts.append(f"unexpected in the source: {_names_list(plan.unexpected)}")
        raise MemtreeKeyError(
            f"load_into_module(strict=True) into {type(module).__name__}: "
            + "; ".join(parts)
            + ". Nothing was changed: pass strict=False to load what matches, or keys= to "
            "load only a sub-tree"
        )
    dev = torch.device(device) if device is not None else None

    def convert(_kind: str, _name: str, value: Any) -> Any:
        if dev is not None and isinstance(value, torch.Tensor) and value.device != dev:
            return value.to(dev)
        return value

    _bind(plan, src, convert)
    return LoadResult(plan.missing_names, plan.unexpected)


# ---------------------------------------------------------------------------------------------
# initialising what no source provided


def _direct_tensors(m: nn.Module) -> Iterator[tuple[dict[str, Any], str, torch.Tensor]]:
    for store in (m._parameters, m._buffers):
        for attr, t in store.items():
            if t is not None:
                yield store, attr, t


def _fresh(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    new = torch.empty(t.shape, dtype=t.dtype, device=device)
    return nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new


def init_missing(module: nn.Module, *, device: torch.device | str | None = None) -> list[str]:
    """Allocate and initialise every tensor of ``module`` still on the meta device.

    After :func:`empty_init` and a partial :func:`load_into_module` (a new head, a layer the
    checkpoint lacks), the tensors no source provided are still meta tensors and the module
    cannot run. This allocates each of them on ``device`` and initialises it with its
    sub-module's own ``reset_parameters()`` (or ``_reset_parameters()``), without touching that
    sub-module's loaded tensors. Tensors of a sub-module that has neither are zero-filled, with a
    warning naming them. Tied tensors stay tied.

    Args:
        module: the module to complete.
        device: where to allocate (default: the CPU).

    Returns:
        The dotted names that were initialised (``[]`` if nothing was on the meta device).

    Example:
        >>> from torch import nn
        >>> with empty_init():
        ...     m = nn.Linear(3, 2)
        >>> init_missing(m), m.weight.device.type
        (['weight', 'bias'], 'cpu')
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    fresh_ids: set[int] = set()
    owners: dict[int, nn.Module] = {}
    names: list[str] = []
    for group in _module_groups(module, extra_state=False):
        if group.tensor.device.type != "meta":
            continue
        value = _fresh(group.tensor, dev)
        _set_slot(group, value)
        fresh_ids.add(id(value))
        names.extend(group.names)
        for slot in group.slots:
            owners[id(slot.owner)] = slot.owner
    zeroed: list[str] = []
    with torch.no_grad():
        for m in owners.values():
            reset = getattr(m, "reset_parameters", None) or getattr(m, "_reset_parameters", None)
            if not callable(reset):
                for _store, attr, t in _direct_tensors(m):
                    if id(t) in fresh_ids:
                        t.zero_()
                        zeroed.append(f"{type(m).__name__}.{attr}")
                continue
            # reset() initialises every tensor of the sub-module: hand it scratch tensors in place
            # of the ones that were loaded, then put those back.
            kept = [(store, attr, t) for store, attr, t in _direct_tensors(m) if id(t) not in fresh_ids]
            for store, attr, t in kept:
                store[attr] = _fresh(t, dev)
            try:
                reset()
            finally:
                for store, attr, t in kept:
                    store[attr] = t
    if zeroed:
        warnings.warn(
            "init_missing: these tensors' modules have no reset_parameters(); they were "
            f"zero-filled: {_names_list(zeroed)}",
            stacklevel=2,
        )
    return names


# ---------------------------------------------------------------------------------------------
# empty_init


@contextmanager
def empty_init() -> Iterator[None]:
    """Build modules without allocating their weights: parameters go to the meta device.

    Inside the context, every parameter and every *persistent* buffer registered by a module
    constructor is moved to the meta device as soon as it is registered, so the constructor's
    own initialisation (``reset_parameters``) runs on meta tensors and costs nothing. Bind real
    weights afterwards with ``load_memmap(d).to_module(model)`` or :func:`load_into_module`.

    *Non-persistent* buffers (``register_buffer(..., persistent=False)``: rotary frequencies,
    position ids, causal masks) are never in a checkpoint, so they are kept as the constructor
    computed them (on its device, usually the CPU): the model is runnable once the persistent
    tensors are bound. Non-persistent buffers are usually small; their memory is allocated.

    The context patches ``nn.Module.register_parameter``/``register_buffer`` for its duration
    (like ``accelerate.init_empty_weights``): it affects modules built in other threads meanwhile.
    A constructor that computes a weight eagerly before registering it (e.g.
    ``nn.Parameter(torch.randn(n, m))``) still pays for that one tensor, briefly.

    Example:
        >>> from torch import nn
        >>> with empty_init():
        ...     big = nn.Linear(100_000, 10_000)   # 4 GB of float32: allocates nothing
        >>> big.weight.device, big.weight.requires_grad
        (device(type='meta'), True)
    """
    register_parameter = nn.Module.register_parameter
    register_buffer = nn.Module.register_buffer

    def meta_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register_parameter(self, name, param)
        p = self._parameters.get(name)
        if p is not None and p.device.type != "meta" and not isinstance(p, nn.parameter.UninitializedParameter):
            new = torch.Tensor._make_subclass(type(p), p.data.to("meta"), p.requires_grad)
            new.__dict__.update(p.__dict__)
            self._parameters[name] = new

    def meta_buffer(self: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        if tensor is not None and persistent and not isinstance(tensor, nn.parameter.UninitializedBuffer):
            tensor = tensor.to("meta")
        register_buffer(self, name, tensor, persistent)

    nn.Module.register_parameter = meta_parameter  # type: ignore[method-assign]
    nn.Module.register_buffer = meta_buffer  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
        nn.Module.register_buffer = register_buffer  # type: ignore[method-assign]
