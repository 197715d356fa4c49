"""Binding tensors to ``nn.Module`` slots by flat dotted names; knows nothing of ``TensorTree``.

The tree layer (:meth:`memtree.TensorTree.from_module`, :meth:`~memtree.TensorTree.to_module`)
and :func:`memtree.load_into_module` are built on these steps:

* :func:`module_groups`: a module's parameters, persistent buffers and extra states, grouped by
  tensor identity (a tied tensor is one group with several names);
* :func:`module_flat`: the flat ``(name, tensor)`` list and tie record a tree is built from;
* :class:`Source`: any source seen as flat dotted names, shapes and dtypes known before data;
* :func:`plan` matches groups to source names (raising on mismatches before any change) and
  :func:`bind` installs the values.
**Tied (shared) tensors.** A tensor reachable under several names (a language model's embedding
and output projection, a sub-module used twice) is stored once, under its first name in
``named_parameters(remove_duplicate=False)`` order. Every other name is recorded in a JSON
non-tensor leaf at the root of the tree, ``tree["__tied__"] = {"decoder.weight":
"embedding.weight"}`` (alias -> stored name), so the record survives ``memmap`` and
``load_memmap``. On binding, ties are restored two ways: names that share one tensor in the
*target* module (because its constructor tied them) all get the same bound parameter (unless
``to_module``'s source gives them different tensors: see "Binding is per name"), and a
name that the source lacks but lists in ``"__tied__"`` is bound to the stored tensor (the
same ``nn.Parameter`` object as its canonical name, so the result is tied again even when the
target module did not tie them itself).

**Filling or binding.** :meth:`memtree.TensorTree.to_module` *binds* by default, as
tensordict's ``to_module`` does: every slot of the module afterwards holds the source's tensor
itself (its memory, zero-copy), whatever the module held before (data, or a meta tensor), and
the tensors it held are returned so that binding them back restores the module exactly
(the same objects). ``to_module(inplace=True)``, :func:`memtree.load_into_module` and
``Checkpointer.restore`` *fill* instead, as ``load_state_dict`` does: a module tensor that holds
data (a *live* tensor: any device but ``meta``) is filled in place, ``with torch.no_grad():
tensor.copy_(source)``, so the module keeps the same ``nn.Parameter`` objects, their storage and
device, and whatever refers to them (an optimizer built before the load, hooks, ties made by the
constructor) keeps working. A tensor on the ``meta`` device (a module built under
:func:`memtree.empty_init`) has no memory to fill: it is bound, as is every tensor with
``load_into_module(assign=True)``. A source tensor on the ``meta`` device has no data to fill
with: filling a live tensor from one raises before anything changes.

**What binding means.** A parameter slot gets a ``nn.Parameter`` that shares the source
tensor's memory: a source that already is an ``nn.Parameter`` is bound as it is (the same
object), any other tensor is wrapped in a new one whose ``requires_grad`` is the module's. With
``to_module``, a source tensor that is not an ``nn.Parameter`` but tracks gradients (it requires
grad, or is batched by ``torch.vmap``) is put in the parameter slot as it is, as
``torch.func.functional_call`` does, so that a forward pass through the module gives gradients
with respect to the source's tensors. A buffer becomes a plain tensor sharing the source's
memory. ``MemoryMappedTensor`` leaves are bound as plain tensors over the same mapping (the one
``load_memmap`` made), so that torch's fast paths (which skip tensor subclasses) run exactly as
for an in-memory model. In-place updates of bound tensors (optimizer steps, BatchNorm running
statistics in training mode) therefore write to the mapping: through to the files with
``load_memmap(..., mode="r+")`` (the default), or into private copy-on-write pages with
``mode="r"``, which :func:`load_into_module` uses for directory sources, so loading a checkpoint
into a model never lets training change the checkpoint.

Binding is per name (``to_module``; ``load_into_module`` refuses such a source, as filling
must): two names of one module tensor (a tie) that the source gives different tensors are each
bound to their own (the module is untied, as the source says), unless they are one attribute of
one sub-module (a sub-module used twice), which cannot hold two tensors. A
swap therefore always binds back: ``swap = tree.to_module(m); swap.to_module(m)`` leaves every
slot of ``m`` holding the object it held before. Non-persistent buffers and extra states
(which ``from_module`` leaves out, ``from_module(use_state_dict=True)`` keeps the latter) are
bound when the source gives them, and are not required.

Everything is checked before the first slot changes (names, shapes, dtypes, ties, meta sources
of fills), and an error while installing (a ``set_extra_state`` that raises) puts back every
slot already changed, so that a failed call leaves the module as it was.

Example:
    >>> from torch import nn
    >>> flat, ties = module_flat(nn.Linear(2, 3))
    >>> [name for name, _ in flat], ties
    (['weight', 'bias'], {})
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Union

import torch
from torch import nn

from ...errors import InvalidArgumentError, MemtreeKeyError, ShapeMismatchError, SourceError
from ...format.names import TIED_KEY
from ...format.values import NonTensor
from ...store.reading.mapped import MemoryMappedTensor
from ...format.subclass_registry import is_plain
from .subclasses import as_dtensor_like, fill_into, layout_problem

__all__ = [
    "TIED_KEY",
    "KeyPrefix",
    "Group",
    "Source",
    "Plan",
    "module_groups",
    "module_flat",
    "aliases_from",
    "source_from_leaves",
    "prefixes",
    "unmatched_prefixes",
    "plan",
    "bind",
    "is_live",
    "refuse_fills_from_meta",
    "shared_memory",
    "check_shared_memory",
    "set_slot",
    "swap_flat",
    "plain",
    "on_ring",
    "names_list",
]

_EXTRA_STATE = "_extra_state"
_LIST_MAX = 10

KeyPrefix = Union[str, tuple[str, ...]]
"""A ``keys=`` entry: a dotted prefix (``"encoder.0"``) or a tuple (``("encoder", "0")``)."""


@dataclass(eq=False)  # holds modules and tensors: compared by identity
class _Slot:
    """Where a tensor is reachable: ``owner``'s attribute ``attr``."""

    owner: nn.Module
    attr: str


@dataclass(eq=False)  # holds modules and tensors: compared by identity
class Group:
    """Every name under which one tensor (or one extra state) is reachable in a module."""

    kind: str  # "param", "buffer" or "extra"
    names: list[str]
    slots: list[_Slot]  # slots[i] is where names[i] is
    tensor: Any  # the current tensor (None for "extra")
    optional: bool = False  # bound when the source gives it, never missing (see module_groups)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _has_extra_state(m: nn.Module) -> bool:
    return type(m).get_extra_state is not nn.Module.get_extra_state


def module_groups(module: nn.Module, *, extra_state: bool = True, binding: bool = False) -> list[Group]:
    """The module's parameters, persistent buffers (and extra states), grouped by identity.

    ``binding``: what :func:`to_module` binds: also the non-persistent buffers, and these and
    the extra states (which ``from_module`` leaves out) as :attr:`Group.optional` groups.
    """
    by_id: dict[tuple[int, bool], Group] = {}
    groups: list[Group] = []
    for path, m in module.named_modules(remove_duplicate=False):
        for kind, store in (("param", m._parameters), ("buffer", m._buffers)):
            for attr, t in store.items():
                optional = kind == "buffer" and attr in m._non_persistent_buffers_set
                if t is None or (optional and not binding):
                    continue
                group = by_id.get((id(t), optional))
                if group is None:
                    group = by_id[id(t), optional] = Group(kind, [], [], t, optional)
                    groups.append(group)
                group.names.append(_join(path, attr))  # a path is reached once: names stay unique
                group.slots.append(_Slot(m, attr))
        if extra_state and _has_extra_state(m):
            groups.append(Group("extra", [_join(path, _EXTRA_STATE)], [_Slot(m, _EXTRA_STATE)], None, binding))
    return groups


def module_flat(module: nn.Module, *, use_state_dict: bool = False) -> tuple[list[tuple[str, Any]], dict[str, str]]:
    """``module``'s tensors as flat ``(dotted name, tensor)`` pairs, and its ties ``{alias: name}``.

    The tensors are the module's own (no copy); a tied tensor appears once, under its first
    name. With ``use_state_dict``, exactly what ``module.state_dict()`` returns (every hook and
    extra state honoured; tensors detached, sharing the module's memory): not
    ``keep_vars=True``, whose parameters are the module's objects, which a post-hook may
    rebind (``p.data = ...``) after the values were taken. Names whose tensors are one memory
    (a tie) are stored once.
    """
    flat: list[tuple[str, Any]] = []
    aliases: dict[str, str] = {}
    if use_state_dict:
        first: dict[Any, str] = {}
        for name, value in module.state_dict().items():
            if isinstance(value, torch.Tensor):
                key = _storage_key(value)
                if key in first:
                    aliases[name] = first[key]
                    continue
                first[key] = name
            flat.append((name, value))
    else:
        for group in module_groups(module, extra_state=False):
            # torch's parameter.pyi leaves out UninitializedTensorMixin (it is in parameter.py)
            if isinstance(group.tensor, nn.parameter.UninitializedTensorMixin):  # type: ignore[attr-defined]
                raise SourceError(
                    f"{group.names[0]!r} is an uninitialized parameter of a lazy module; run one "
                    "forward pass (or call initialize_parameters) before from_module"
                )
            flat.append((group.names[0], group.tensor))
            aliases.update((alias, group.names[0]) for alias in group.names[1:])
    return flat, aliases


def _storage_key(t: torch.Tensor) -> Any:
    """Identity of a tensor's data: equal for two tensors that are one view of one memory (a
    state_dict's detached tensors are new objects for one parameter).

    Tensors with data are compared by address (two storages may map one memory); tensors
    without (meta, or no element) by their storage object, which ``detach`` shares."""
    try:
        storage = t.untyped_storage()
        view = (t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if t.device.type == "meta" or t.numel() == 0:
            return ("storage", storage._cdata, *view)
        return ("memory", t.device, storage.data_ptr(), *view)
    except (RuntimeError, NotImplementedError, TypeError):  # a subclass without storage (a wrapper)
        return ("object", id(t))


@dataclass(eq=False)  # holds modules and tensors: compared by identity
class Source:
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
            value = self.lazy[self.entries[name]]  # type: ignore[index]
            return (value.shape, value.dtype) if isinstance(value, torch.Tensor) else None
        try:
            shape, dtype = spec(self.entries[name])
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
            return self.lazy[self.entries[name]]
        return self.entries[name]

    def key(self, name: str) -> Any:
        """What the tensor of the entry ``name`` is known by: the name in a lazy source, else
        the object (names given one tensor are bound to one value)."""
        return name if self.lazy is not None else id(self.entries[name])

    def names(self) -> list[str]:
        """Every dotted name: the entries, then the tie aliases."""
        return [*self.entries, *self.aliases]

    def renamed(self, rename: Callable[[str], str]) -> Source:
        """The same source under other names (``rename`` maps each entry and alias name).

        Raises:
            SourceError: two names of the source get the same new name.
        """
        first: dict[str, str] = {}
        for name in self.names():
            new = rename(name)
            if new in first:
                raise SourceError(
                    f"the source's names {first[new]!r} and {name!r} would both become {new!r}; "
                    "pass another prefix= (or none)"
                )
            first[new] = name
        entries = {rename(n): v for n, v in self.entries.items()}
        aliases = {rename(a): rename(t) for a, t in self.aliases.items()}
        return Source(entries, aliases, self.lazy)


def aliases_from(value: Any, where: str) -> dict[str, str]:
    data = value.data if isinstance(value, NonTensor) else value
    if not isinstance(data, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in data.items()
    ):
        raise SourceError(
            f"{where}: {TIED_KEY!r} must map alias names to stored names (str -> str), got "
            f"{type(data).__name__}; it is the record of tied tensors written by from_module"
        )
    return dict(data)


def source_from_leaves(leaves: Iterable[tuple[tuple[str, ...], Any]], where: str = "tree") -> Source:
    """A :class:`Source` from nested ``(key path, value)`` leaves: dotted names, ties read."""
    entries: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    for path, value in leaves:
        if path == (TIED_KEY,):
            aliases = aliases_from(value, where)
            continue
        name = ".".join(path)
        if name in entries:
            raise SourceError(
                f"the {where} gives the dotted name {name!r} twice (as a nested key and as a key "
                "containing '.'); rename one of them"
            )
        entries[name] = value
    return Source(entries, aliases)


def prefixes(keys: Iterable[KeyPrefix] | KeyPrefix | None) -> list[str] | None:
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


def unmatched_prefixes(prefixes: list[str], module: nn.Module, src: Source) -> list[str]:
    """The ``keys=`` prefixes that name no tensor and no sub-module of ``module``, nor a source name."""
    names = [n for n, _ in module.named_modules() if n] + [n for g in module_groups(module) for n in g.names]
    names += list(src.entries)
    return [p for p in prefixes if not any(_selected(n, [p]) for n in names)]


def _selected(name: str, prefixes: list[str] | None) -> bool:
    if prefixes is None:
        return True
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@dataclass(eq=False)  # holds modules and tensors: compared by identity
class Plan:
    """What loading a source into a module does: the pairs to bind or fill, and what is left."""

    pairs: list[tuple[Group, str]]  # group -> source name bound to it
    missing_names: list[str]
    unexpected: list[str]
    mismatched: list[str] = field(default_factory=list)  # skipped: the shapes differ


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _describe(shape: Any, dtype: torch.dtype) -> str:
    return f"{_dtype_name(dtype)}{list(shape)}"


def plan(
    groups: list[Group],
    src: Source,
    prefixes: list[str] | None,
    *,
    cast: torch.dtype | None = None,
    ignore_mismatched: bool = False,
    per_name: bool = False,
) -> Plan:
    """Match module groups to source names; raise on shape/dtype mismatches (before any change).

    ``cast``: floating-point source tensors count as that dtype (they are cast on load).
    ``ignore_mismatched``: a tensor whose shape differs is skipped and its module names are
    reported in :attr:`Plan.mismatched` instead of raising.
    ``per_name``: binding: the names of one module tensor that the source gives different
    tensors are planned apart (see :func:`_split`), instead of being refused.
    """
    pairs: list[tuple[Group, str]] = []
    missing_names: list[str] = []
    mismatched: list[str] = []
    consumed: set[str] = set()
    mismatches: list[str] = []
    if per_name:
        groups = [part for group in groups for part in _split(group, src)]
    for group in groups:
        chosen_names = [n for n in group.names if _selected(n, prefixes)]
        if not chosen_names:
            continue
        present = [n for n in group.names if n in src.entries]
        consumed.update(present)
        name = next(iter(present), None)
        if name is None:
            name = next((_resolve(src, n) for n in group.names if _resolve(src, n) is not None), None)
        if name is None:
            if not group.optional:
                missing_names.extend(chosen_names)
            continue
        consumed.add(name)
        if group.kind != "extra":
            differing = [n for n in present[1:] if not _same_values(src, name, n)]
            if differing:
                raise SourceError(
                    f"the source gives {name!r} and {differing[0]!r} different values, but they "
                    f"are one tensor of the module (tied: {', '.join(repr(n) for n in group.names)}), "
                    "which cannot hold both. Nothing was changed: leave the unwanted name out of "
                    "the source, or untie the module's tensors before loading"
                )
            if not src.is_tensor(name):
                mismatches.append(f"{name!r}: the source holds a non-tensor value, the module a tensor")
                continue
            shape, dtype = src.spec(name)
            loaded = cast if cast is not None and dtype.is_floating_point else dtype
            mine = group.tensor
            if tuple(shape) != tuple(mine.shape) and ignore_mismatched:
                mismatched.extend(chosen_names)
                continue
            if tuple(shape) != tuple(mine.shape) or loaded != mine.dtype:
                where = name if name == group.names[0] else f"{group.names[0]} (from {name!r})"
                cast_note = f" (cast to {_dtype_name(loaded)})" if loaded != dtype else ""
                mismatches.append(
                    f"{where!r}: source {_describe(shape, dtype)}{cast_note}, module "
                    f"{_describe(mine.shape, mine.dtype)}"
                )
                continue
        pairs.append((group, name))
    if mismatches:
        more = f" (and {len(mismatches) - _LIST_MAX} more)" if len(mismatches) > _LIST_MAX else ""
        raise ShapeMismatchError(
            "shape/dtype mismatch between the source and the module for "
            + "; ".join(mismatches[:_LIST_MAX])
            + more
            + ". Nothing was changed: load into a module built with matching sizes, leave "
            "these keys out with keys= (or drop them from the source), or with "
            "load_into_module pass ignore_mismatched=True to skip tensors whose shape differs "
            "(a new head) or dtype= to cast floating-point tensors"
        )
    consumed.update(a for a, target in src.aliases.items() if target in consumed)
    unexpected = [n for n in src.entries if _selected(n, prefixes) and n not in consumed]
    return Plan(pairs, missing_names, unexpected, mismatched)


def _resolve(src: Source, name: str) -> str | None:
    """The source entry that gives ``name``: itself, the stored name it is a tie alias of, or none."""
    if name in src.entries:
        return name
    target = src.aliases.get(name)
    return target if target in src.entries else None


def _split(group: Group, src: Source) -> list[Group]:
    """``group`` cut into one group per source entry its names resolve to (names the source
    lacks go with the first), when the source gives its names different entries and the parts
    have no slot in common; otherwise ``[group]`` (whose values :func:`plan` compares)."""
    if group.kind == "extra" or len(group.names) < 2:
        return [group]
    parts: dict[str | None, Group] = {}
    for name, slot in zip(group.names, group.slots):
        part = parts.setdefault(_resolve(src, name), Group(group.kind, [], [], group.tensor, group.optional))
        part.names.append(name)
        part.slots.append(slot)
    lacking = parts.pop(None, None)
    if len(parts) < 2:
        return [group]
    split = list(parts.values())
    if lacking is not None:
        split[0].names += lacking.names
        split[0].slots += lacking.slots
    owners = [{(id(s.owner), s.attr) for s in part.slots} for part in split]
    if len(set().union(*owners)) < sum(map(len, owners)):  # one attribute of a sub-module used twice
        return [group]
    return split


def _same_values(src: Source, a: str, b: str) -> bool:
    """True if the source names ``a`` and ``b`` hold the same tensor bits: one tensor under two
    names, or equal copies (a tied model's ``state_dict`` saved whole). The data is read only
    when they are not one memory; tensors on the meta device hold no data, and never differ."""
    if src.entries[a] is src.entries[b]:
        return True
    if not (src.is_tensor(a) and src.is_tensor(b)) or src.spec(a) != src.spec(b):
        return False
    x, y = plain(src.get(a)).detach(), plain(src.get(b)).detach()
    if x.device.type == "meta" or y.device.type == "meta" or _storage_key(x) == _storage_key(y):
        return True
    return torch.equal(*(t.cpu().contiguous().view(-1).view(torch.uint8) for t in (x, y)))


def names_list(names: list[str]) -> str:
    more = f" ... ({len(names)} in all)" if len(names) > _LIST_MAX else ""
    return ", ".join(repr(n) for n in names[:_LIST_MAX]) + more


def plain(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself, or for a ``MemoryMappedTensor`` a plain tensor over the same memory.

    Example:
        >>> import tempfile, memtree
        >>> x = memtree.TensorTree({"x": torch.ones(2)}).memmap(tempfile.mkdtemp() + "/t")["x"]
        >>> type(plain(x)).__name__, plain(x).data_ptr() == x.data_ptr()
        ('Tensor', True)
    """
    if isinstance(t, MemoryMappedTensor):
        return t.as_subclass(torch.Tensor)
    return t


def set_slot(group: Group, value: Any) -> None:
    for slot in group.slots:
        if group.kind == "param":
            slot.owner._parameters[slot.attr] = value
        elif group.kind == "buffer":
            slot.owner._buffers[slot.attr] = value
        else:
            slot.owner.set_extra_state(value)


def _current(group: Group) -> Any:
    if group.kind == "extra":
        return group.slots[0].owner.get_extra_state()
    return group.tensor


def is_live(group: Group) -> bool:
    """A parameter or buffer that holds data (not on the meta device): filled in place."""
    return group.kind != "extra" and group.tensor.device.type != "meta"


def refuse_fills_from_meta(found: Plan, src: Source, where: str) -> None:
    """Raise unless every live tensor of ``found`` has data to be filled with (a source tensor
    on the meta device has none). Sources read lazily always have data: not looked at.

    Raises:
        SourceError: a planned fill's source tensor is on the meta device.
    """
    if src.lazy is not None:
        return
    empty = []
    for group, name in found.pairs:
        value = src.entries[name]
        if type(value) is not MemoryMappedTensor and isinstance(value, torch.Tensor) and is_live(group):
            if value.device.type == "meta":
                empty.append(name)
    if empty:
        raise SourceError(
            f"{where}: the source's tensors {names_list(empty)} are on the meta device (shapes "
            "only, no data), and the module tensors they would fill hold data. Nothing was "
            "changed: bind them instead (tree.to_module(module) without inplace=True, or "
            "load_into_module(..., assign=True)), or load the source with its data (load_memmap "
            "without device='meta')"
        )


#: The fix for a fill in place that cannot be done: binding instead.
_BIND_INSTEAD = (
    "bind new tensors instead (load_into_module(..., assign=True), or tree.to_module(module) "
    "without inplace=True)"
)


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[begin, end)`` of its storage that the elements of ``t`` (not empty) lie in."""
    size = t.element_size()
    begin = int(t.storage_offset()) * size
    return begin, begin + (sum((int(n) - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * size


def _may_overlap_itself(t: torch.Tensor) -> bool:
    """False when no two elements of ``t`` can share memory (each stride, smallest first, passes
    the reach of the smaller ones); True for an expanded view, and for layouts too odd to tell."""
    reach = 0
    for stride, n in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1):
        if stride <= reach:
            return True
        reach += (n - 1) * stride
    return False


def shared_memory(found: Plan) -> list[list[tuple[Group, str]]]:
    """The planned live tensors that may share memory, which a fill would write in any order
    (rare: views of one storage made by the constructor): groups of tensors whose byte ranges
    of one storage overlap, and single tensors that may overlap themselves.

    Per tensor only its storage is looked at; extents are computed for the storages that hold
    several tensors, and strides for the tensors that are not contiguous (this runs on every
    load into live tensors)."""
    by_storage: dict[tuple[torch.device, int], list[tuple[Group, str]]] = {}
    for group, name in found.pairs:
        t = group.tensor
        if is_live(group) and t.numel() and is_plain(t):  # a subclass: filled by its inner tensors
            by_storage.setdefault((t.device, t.untyped_storage().data_ptr()), []).append((group, name))
    clusters: list[list[tuple[Group, str]]] = []
    for pairs in by_storage.values():
        if len(pairs) == 1:
            if not pairs[0][0].tensor.is_contiguous():  # a contiguous tensor never overlaps itself
                clusters.append(pairs)
            continue
        end = -1
        spans = sorted(((*_extent(g.tensor), g, n) for g, n in pairs), key=lambda s: s[:2])
        for begin, stop, group, name in spans:
            if begin < end:
                clusters[-1].append((group, name))
                end = max(end, stop)
            else:
                clusters.append([(group, name)])
                end = stop
    return [c for c in clusters if len(c) > 1 or _may_overlap_itself(c[0][0].tensor)]


def check_shared_memory(found: Plan, src: Source, where: str) -> None:
    """Refuse to fill live tensors that share memory unless the source's values agree on it:
    every fill in place checks this first (:func:`bind`, :func:`memtree.load_into_module`), so
    that none is last-write-wins. ``where`` names the caller in messages.

    Each group's values are written, in order, into a scratch copy of the shared bytes laid out
    as the module's tensors are; every tensor must then read back its own value.

    Raises:
        SourceError: two tensors sharing memory are given different values for it.
        InvalidArgumentError: a tensor's elements share memory (an expanded view): it cannot be
            filled in place.
    """
    for cluster in shared_memory(found):
        tensors = [group.tensor.detach() for group, _ in cluster]
        base = min(_extent(t)[0] for t in tensors)
        base -= base % 16
        scratch = torch.empty(
            max(_extent(t)[1] for t in tensors) - base, dtype=torch.uint8, device=tensors[0].device
        ).untyped_storage()
        written = []
        for (group, name), t in zip(cluster, tensors):
            offset = (_extent(t)[0] - base) // t.element_size()
            view = torch.empty(0, dtype=t.dtype, device=t.device).set_(scratch, offset, t.shape, t.stride())
            value = src.get(name).detach()
            try:
                view.copy_(value)
            except RuntimeError:
                raise InvalidArgumentError(
                    f"{where}: the module's tensor {group.names[0]!r} has elements that share "
                    f"memory ({list(t.shape)} with strides {list(t.stride())}: an expanded view), so it "
                    f"cannot be filled in place. Nothing was changed: {_BIND_INSTEAD}, or give the "
                    "module a tensor of its own"
                ) from None
            written.append((group, view, value.to(device=t.device, dtype=t.dtype)))
        for group, view, value in written:
            if not torch.equal(*(t.contiguous().view(-1).view(torch.uint8) for t in (view, value))):
                names = [g.names[0] for g, _ in cluster]
                raise SourceError(
                    f"{where}: the module's tensors {names_list(names)} share memory (views "
                    f"of one storage), and the source gives {group.names[0]!r} values that another of "
                    f"them overwrites. Nothing was changed: {_BIND_INSTEAD}, or load a source whose "
                    "values agree on the shared memory"
                )


def _tracks_gradients(t: torch.Tensor) -> bool:
    """A tensor whose gradients a new ``nn.Parameter`` would cut off: one that requires grad,
    or a ``torch.vmap`` slice (what tensordict keeps in a parameter slot as it is)."""
    return t.requires_grad or bool(torch._C._functorch.is_batchedtensor(t))


def _bound_value(group: Group, value: Any, track_gradients: bool) -> Any:
    """What a slot of ``group`` holds once ``value`` is bound into it (see the module docstring)."""
    if type(value) is MemoryMappedTensor and group.kind != "extra":
        value = plain(value)  # bound as a plain tensor anyway: asked no question through its __torch_function__
    if group.kind == "param":
        if isinstance(value, nn.Parameter):
            return value
        if track_gradients and _tracks_gradients(value):
            return value if type(value) is torch.Tensor else plain(value)
        return nn.Parameter(plain(value), requires_grad=group.tensor.requires_grad)
    if group.kind == "buffer":
        return plain(value.detach() if isinstance(value, nn.Parameter) else value)
    return value


def _put_back(group: Group, value: Any) -> None:
    set_slot(group, value)
    if group.kind != "extra":
        group.tensor = value


def _copy_back(tensor: torch.Tensor, value: torch.Tensor) -> None:
    fill_into(tensor, value)


def bind(
    plan: Plan,
    src: Source,
    convert: Callable[[str, str, Any], Any],
    *,
    assign: bool = True,
    keep_old: bool = True,
    track_gradients: bool = False,
    where: str = "load_into_module",
) -> list[tuple[Group, Any]]:
    """Install every planned pair; returns ``(group, old value)`` for the swap tree, in plan order.

    With ``assign=False``, a live tensor (not on the meta device) is filled in place,
    ``tensor.copy_(source)`` without autograd (``copy_`` casts and moves across devices;
    ``convert`` is not called); its old value is returned as a detached copy taken before the
    fill, so that it does not change with the module. Every other slot is bound:
    ``convert(kind, name, value)`` turns the source value into what is bound (once per source
    tensor, so that names given one tensor stay one), and a parameter that is not an
    ``nn.Parameter`` then is wrapped in one (``requires_grad`` from the module), unless
    ``track_gradients`` and it tracks gradients (then it is bound as it is). A bound slot's old
    value is the object it held. ``keep_old=False`` returns nothing (and copies nothing).

    Every bound value is made, and every fill checked, before the first slot changes; then
    the slots are bound, the extra states set (the module's own code, which may raise) and the
    live tensors filled, in that order. If one of these raises, every slot already bound and
    every extra state already set is put back (and, with ``keep_old``, every filled tensor's
    old values copied back) before the error propagates. ``where`` names the caller in error
    messages.

    Raises:
        SourceError: a live tensor would be filled from a meta tensor.
    """
    if not assign:
        refuse_fills_from_meta(plan, src, where)
        check_shared_memory(plan, src, where)
    made: dict[tuple[str, Any], Any] = {}  # one bound object per source tensor (keeps ties)
    old: list[tuple[Group, Any]] = []
    bound: list[tuple[Group, Any]] = []
    fills: list[tuple[Group, str, Any]] = []
    extras: list[tuple[Group, Any, Any]] = []
    for group, name in plan.pairs:
        if not assign and is_live(group):
            if src.lazy is None or not is_plain(group.tensor):  # a lazy source is read when filled
                problem = layout_problem(plain(src.get(name)), group.tensor)
                if problem is not None:  # a quantized module and another source: before any change
                    raise ShapeMismatchError(f"{where}: {group.names[0]!r}: {problem}. Nothing was changed")
            before = plain(group.tensor).detach().clone() if keep_old else None
            fills.append((group, name, before))
            if keep_old:
                old.append((group, before))
            continue
        current = _current(group)
        if keep_old:
            old.append((group, current))
        key = (group.kind, src.key(name))
        value = made.get(key)
        if value is None:
            value = convert(group.kind, name, src.get(name))
            if group.kind != "extra":  # a DTensor slot gets a DTensor: its part of the full tensor
                value = as_dtensor_like(value, group.tensor)
            value = made[key] = _bound_value(group, value, track_gradients)
        if group.kind == "extra":
            extras.append((group, value, current))
        else:
            bound.append((group, value))
    undo: list[Callable[[], None]] = []
    try:
        for group, value in bound:
            undo.append(functools.partial(_put_back, group, group.tensor))
            _put_back(group, value)
        for group, value, current in extras:  # the module's set_extra_state: before any fill
            set_slot(group, value)  # one that raises is taken to have changed nothing
            undo.append(functools.partial(set_slot, group, current))
        for group, name, before in fills:
            if before is not None:
                undo.append(functools.partial(_copy_back, group.tensor, before))
        _fill_in_place([(group, src.get(name)) for group, name, _ in fills])
    except BaseException:
        for step in reversed(undo):
            with contextlib.suppress(Exception):  # put back what can be: the first error is raised
                step()
        raise
    return old


def on_ring(device: torch.device | None) -> bool:
    """Whether tensors loaded onto ``device`` are filled through the pinned ring of
    :mod:`memtree.store.primitives.fill` (CUDA) rather than copied from host memory one by one.

    Example:
        >>> on_ring(torch.device("cuda:1")), on_ring(torch.device("cpu")), on_ring(None)
        (True, False, False)
    """
    return device is not None and device.type == "cuda"


def _ring_dest(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor`` as the plain tensor the pinned ring fills, or ``None`` (not on the ring's
    device, or a tensor subclass: copied with ``copy_``)."""
    if not on_ring(tensor.device):
        return None
    dest = tensor.detach()
    return dest if type(dest) is torch.Tensor else None


def _fill_in_place(fills: list[tuple[Group, Any]]) -> None:
    """``tensor.copy_(value)`` for each live group's tensor, without autograd. CUDA tensors
    filled from host memory (a tensor in memory, or a file mapping) go through the pinned ring
    (:func:`memtree.store.primitives.fill.fill`: threaded copies into page-locked buffers, host-to-device
    copies overlapping them), not one ``copy_`` each from pageable memory; tensors that share
    a storage with another are copied in order, one after the other (the ring fills in any
    order)."""
    dests = [_ring_dest(group.tensor) for group, _ in fills]
    storages = Counter((d.device, d.untyped_storage().data_ptr()) for d in dests if d is not None)
    jobs = []
    with torch.no_grad():
        for (group, value), dest in zip(fills, dests):
            job = None
            if dest is not None and storages[dest.device, dest.untyped_storage().data_ptr()] == 1:
                from ...store.primitives.fill import memory_job  # imported only where a CUDA tensor is filled

                job = memory_job(dest, plain(value).detach(), f"tensor {group.names[0]!r}")
            if job is None:  # a subclass inner tensor by inner tensor, a DTensor its part
                fill_into(group.tensor, plain(value))
            else:
                jobs.append(job)
        if jobs:
            from ...store.primitives.fill import fill

            fill(jobs)


def swap_flat(old: list[tuple[Group, Any]]) -> tuple[list[tuple[str, Any]], dict[str, str]]:
    """What :func:`bind` returned as :func:`module_flat` returns a module: ``(name, value)``
    pairs and ties, a value held by several groups (one object) stored once."""
    flat: list[tuple[str, Any]] = []
    aliases: dict[str, str] = {}
    stored: dict[int, str] = {}
    for group, value in old:
        target = stored.get(id(value)) if group.kind != "extra" else None
        if target is None:
            target = group.names[0]
            flat.append((target, value))
            if group.kind != "extra":
                stored[id(value)] = target
        aliases.update((name, target) for name in group.names if name != target)
    return flat, aliases


def to_module(
    src: Source, module: nn.Module, *, inplace: bool = False, return_swap: bool = True
) -> tuple[list[tuple[str, Any]], dict[str, str]]:
    """Bind (or with ``inplace``, fill) every tensor of ``src`` into ``module``; return the swap.

    What :meth:`memtree.TensorTree.to_module` does: every source name must match a slot of the
    module (a parameter or persistent buffer, all required; an extra state or non-persistent
    buffer, bound if given), checked before anything changes. Binding is per name (see
    :func:`_split`) and keeps a source tensor that tracks gradients as it is; with ``inplace``,
    live tensors are filled and meta ones bound (see :func:`bind`). Returns what was replaced
    (``[]`` unless ``return_swap``), as :func:`module_flat` returns it (to build the swap
    tree): the objects the slots held, or copies of filled tensors' old values.

    Raises:
        MemtreeKeyError: a source name matches nothing in the module, or a tensor of the module
            has no source name (``to_module`` loads the whole module; use
            :func:`memtree.load_into_module` with ``strict=False`` for part of it).
        ShapeMismatchError: a shape or dtype differs from the module's tensor.
        SourceError: ``inplace`` and a live tensor's source is on the meta device, or the
            source gives two names of one slot (a sub-module used twice; with ``inplace``, of
            one tensor) different values.
    """
    found = plan(module_groups(module, binding=True), src, None, per_name=not inplace)
    if found.missing_names or found.unexpected:
        parts = []
        if found.unexpected:
            parts.append(
                f"{len(found.unexpected)} leaves of the tree match no parameter or buffer: "
                f"{names_list(found.unexpected)}"
            )
        if found.missing_names:
            parts.append(f"the tree lacks {len(found.missing_names)} tensors: {names_list(found.missing_names)}")
        raise MemtreeKeyError(
            f"to_module into {type(module).__name__}: " + "; ".join(parts) + ". Nothing was changed: "
            "bind the matching sub-tree into its sub-module (tree['encoder'].to_module(model.encoder)), "
            "or use memtree.load_into_module(..., strict=False) to load what matches"
        )
    old = bind(
        found, src, lambda _kind, _name, value: value, assign=not inplace, keep_old=return_swap,
        track_gradients=True, where="to_module(inplace=True)",
    )
    return swap_flat(old)
