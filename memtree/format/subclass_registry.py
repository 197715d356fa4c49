"""The registry of tensor subclasses memtree rebuilds, and their groups (format version 3).

A tensor subclass that follows PyTorch's ``__tensor_flatten__``/``__tensor_unflatten__``
protocol (torchao's quantized weights and low-bit optimizer states, a user's class) is written
as a *group* (:mod:`memtree.format.subclass`): its inner tensors as ordinary leaves, its class's
registered **name** and its flatten context as tagged JSON. Loading rebuilds it with
``cls.__tensor_unflatten__(inner, context, shape, stride)``, the inner tensors being the mapped
files (zero-copy), and checks that the result has the recorded class, shape and dtype.

Which classes may be rebuilt is this registry and nothing else: memtree never imports a name
read from a file. Built in, and imported only when a leaf names them (torchao is optional):
torchao's tensor types and the enums, dataclasses and named tuples their contexts hold
(:data:`BUILTIN`), and torch's quantized tensors (``torch.quantized``: the bytes of any
quantized dtype with its scales and zero points). A user's classes are added with
:func:`register_subclass` (a tensor subclass, or an enum, dataclass or ``NamedTuple`` that its
context holds). A ``DTensor`` is not a group: it is stored as its full logical tensor with its
layout (:mod:`memtree.tree.parts.subclasses`, which also fills subclasses in place).

The table of names sits in ``format/`` beside the table of dtypes (:mod:`memtree.format.dtypes`)
for the same reason: it is what names on disk may mean, and every layer that reads or writes
groups uses it (the tree, ``memtree.dcp``, ``memtree.convert``'s torchao safetensors).

Never silently demoted: a tensor subclass memtree cannot represent (no flatten protocol, an
unregistered class, a context JSON cannot hold) raises
:class:`~memtree.errors.SubclassError` naming the class, the key and the fix.

Example:
    >>> import torch
    >>> from torch.utils._pytree import tree_map
    >>> class Scaled(torch.Tensor):                    # int8 values times one float scale
    ...     @staticmethod
    ...     def __new__(cls, qdata, scale):
    ...         return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=torch.float32)
    ...     def __init__(self, qdata, scale):
    ...         self.qdata, self.scale = qdata, scale
    ...     def __tensor_flatten__(self):
    ...         return ["qdata"], {"scale": self.scale}
    ...     @classmethod
    ...     def __tensor_unflatten__(cls, inner, ctx, size, stride):
    ...         return cls(inner["qdata"], ctx["scale"])
    ...     @classmethod
    ...     def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
    ...         plain = lambda x: x.qdata.float() * x.scale if isinstance(x, cls) else x
    ...         return func(*tree_map(plain, args), **tree_map(plain, kwargs or {}))
    >>> _ = register_subclass(Scaled, name="docs.Scaled")
    >>> group = to_group(Scaled(torch.arange(3, dtype=torch.int8), 0.5), ("w",))
    >>> group.subclass.type, group.subclass.context, list(group.entries)
    ('docs.Scaled', {'kind': 'dict', 'items': {'scale': 0.5}}, ['qdata'])
    >>> rebuilt = rebuild(group, ("w",))
    >>> type(rebuilt).__name__, rebuilt.scale, (rebuilt * 2).tolist()
    ('Scaled', 0.5, [0.0, 1.0, 2.0])
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import math
import threading
from typing import Any, TypeVar

import torch

from ..errors import MemtreeError, SubclassError, check_keywords
from .dtypes import any_dtype_from_name, any_dtype_name
from .level import Level, fmt_key
from .schema import TYPE_NAME_MAX, is_type_name
from .subclass import Subclass

__all__ = [
    "BUILTIN",
    "QUANTIZED",
    "register_subclass",
    "is_plain",
    "is_dtensor",
    "to_group",
    "rebuild",
    "describe",
    "is_known",
    "inner_tensors",
    "Layout",
    "layout_of",
]

T = TypeVar("T", bound=type)

#: The built-in names: ``name -> (module, attribute)``, imported only when a leaf or a context
#: names them. torchao's tensor types (the classes ``quantize_`` and torchao's optimizers make),
#: and the classes their flatten contexts hold.
BUILTIN: dict[str, tuple[str, str]] = {
    **{
        f"torchao.{cls}": ("torchao.quantization", cls)
        for cls in (
            "Int8Tensor", "Float8Tensor", "IntxUnpackedToInt8Tensor", "IntxOpaqueTensor", "Int4Tensor",
            "Int4PlainInt32Tensor", "Int4PreshuffledTensor", "Int4TilePackedTo4dTensor",
            "MappingType", "PerAxis", "PerBlock", "PerGroup", "PerRow", "PerTensor", "PerToken",
        )
    },
    "torchao.Int4OpaqueTensor": ("torchao.prototype.quantization.int4", "Int4OpaqueTensor"),
    "torchao.Float8OpaqueTensor": ("torchao.prototype.float8_opaque_tensor", "Float8OpaqueTensor"),
    "torchao.MXTensor": ("torchao.prototype.mx_formats.mx_tensor", "MXTensor"),
    "torchao.NVFP4Tensor": ("torchao.prototype.mx_formats.nvfp4_tensor", "NVFP4Tensor"),
    "torchao.NF4Tensor": ("torchao.quantization.quantize_.workflows.nf4.nf4_tensor", "NF4Tensor"),
    "torchao.OptimState8bit": ("torchao.optim.subclass_8bit", "OptimState8bit"),
    "torchao.OptimState4bit": ("torchao.optim.subclass_4bit", "OptimState4bit"),
    "torchao.OptimStateFp8": ("torchao.optim.subclass_fp8", "OptimStateFp8"),
    "torchao.KernelPreference": ("torchao.quantization.quantize_.common", "KernelPreference"),
    "torchao.QuantizeTensorToInt8Kwargs": ("torchao.quantization.quantize_.workflows", "QuantizeTensorToInt8Kwargs"),
    "torchao.QuantizeTensorToFloat8Kwargs": (
        "torchao.quantization.quantize_.workflows", "QuantizeTensorToFloat8Kwargs"
    ),
    "torchao.QuantizeTensorToMXKwargs": ("torchao.prototype.mx_formats.mx_tensor", "QuantizeTensorToMXKwargs"),
    "torchao.QuantizeTensorToNVFP4Kwargs": (
        "torchao.prototype.mx_formats.nvfp4_tensor", "QuantizeTensorToNVFP4Kwargs"
    ),
    "torchao.ScaleCalculationMode": ("torchao.prototype.mx_formats.config", "ScaleCalculationMode"),
    "torchao.Float8MMConfig": ("torchao.float8.inference", "Float8MMConfig"),
    "torchao.SubclassTensorArgs": ("torchao.quantization.quantize_.workflows.nf4.nf4_tensor", "SubclassTensorArgs"),
}
#: The name of torch's quantized tensors (``qint8``... with their quantizer), stored as a group.
QUANTIZED = "torch.quantized"
#: Prefixes of the names only memtree gives (:func:`register_subclass` refuses them).
RESERVED = ("torch.", "torchao.", "memtree.")

_LOCK = threading.Lock()
_BY_NAME: dict[str, type] = {}  # registered or resolved built-in classes, by name
_NAMES: dict[type, str] = {}  # the reverse


# ---------------------------------------------------------------------------------------------
# the registry


@check_keywords
def register_subclass(cls: T, *, name: str | None = None) -> T:
    """Allow memtree to rebuild ``cls`` from disk under ``name`` (returns ``cls``: a decorator).

    ``cls`` is a tensor subclass with ``__tensor_flatten__`` and ``__tensor_unflatten__``, or a
    class its flatten context holds: an ``enum.Enum``, a dataclass or a ``NamedTuple`` (rebuilt
    from its fields by keyword). Trees record ``name``, never an import path; a tree naming a
    class is loaded only in a process that registered it (memtree never imports a module named
    in a file). Registering the same class again, or a class of the same module and qualified
    name (a module reloaded), replaces it.

    Args:
        cls: the class.
        name: its stable name on disk (default: its qualified name, ``Outer.Inner``): dotted
            words of ASCII letters, digits and ``_``, each starting with a letter; names
            starting with ``torch.``, ``torchao.`` or ``memtree.`` are memtree's own.

    Raises:
        SubclassError: ``cls`` is neither kind, the name is invalid or reserved, or another
            class has it.

    Example:
        >>> import enum, memtree
        >>> class Mode(enum.Enum):
        ...     FAST = 1
        >>> memtree.register_subclass(Mode, name="docs.Mode") is Mode
        True
    """
    if not isinstance(cls, type):
        raise SubclassError(f"register_subclass takes a class, got {type(cls).__name__}")
    tensor = issubclass(cls, torch.Tensor)
    if tensor and not (hasattr(cls, "__tensor_flatten__") and hasattr(cls, "__tensor_unflatten__")):
        raise SubclassError(
            f"{cls.__qualname__} has no __tensor_flatten__/__tensor_unflatten__, so memtree cannot "
            "store its inner tensors: implement PyTorch's flatten protocol, or store a plain tensor "
            "(t.as_subclass(torch.Tensor)) instead"
        )
    if not tensor and not _is_context_class(cls):
        raise SubclassError(
            f"register_subclass takes a tensor subclass, or an enum, dataclass or NamedTuple that a "
            f"subclass's flatten context holds; {cls.__qualname__} is none of these"
        )
    name = cls.__qualname__ if name is None else name
    if not is_type_name(name) or name.startswith(RESERVED):
        raise SubclassError(
            f"name {name!r:.80} for {cls.__qualname__} is not one memtree can record: dotted words of "
            f"ASCII letters, digits and '_', each starting with a letter, at most {TYPE_NAME_MAX} "
            f"characters, not starting with {', '.join(RESERVED)} (memtree's own); pass name='...'"
        )
    with _LOCK:
        current = _BY_NAME.get(name)
        if current is not None and current is not cls and _where(current) != _where(cls):
            raise SubclassError(
                f"subclass name {name!r} is already registered to {_where(current)}; give "
                f"{_where(cls)} another name: names identify classes on disk and must be unique"
            )
        if current is not None:
            _NAMES.pop(current, None)
        _BY_NAME[name] = cls
        _NAMES[cls] = name
    return cls


def _where(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_context_class(cls: type) -> bool:
    return issubclass(cls, enum.Enum) or dataclasses.is_dataclass(cls) or _is_named_tuple(cls)


def _is_named_tuple(cls: type) -> bool:
    return issubclass(cls, tuple) and hasattr(cls, "_fields") and hasattr(cls, "_asdict")


def _name_of(cls: type) -> str | None:
    """The registered name of ``cls`` (a user's, or a built-in one whose class it is)."""
    found = _NAMES.get(cls)
    if found is not None:
        return found
    for name, (module, attr) in BUILTIN.items():
        if attr == cls.__name__ and cls.__module__.split(".")[0] == module.split(".")[0]:
            try:
                builtin = _resolve(name, ())
            except SubclassError:
                continue
            if builtin is cls:
                return name
    return None


def _resolve(name: str, path: tuple[str, ...]) -> type:
    """The class registered (or built in) under ``name``; imports a built-in module only."""
    found = _BY_NAME.get(name)
    if found is not None:
        return found
    spec = BUILTIN.get(name)
    if spec is None:
        raise SubclassError(
            f"{_at(path)}is stored as {name!r}, which no register_subclass registered in this process "
            f"(registered: {sorted(_BY_NAME)[:10]}). Import and register the class before loading "
            "(memtree never imports a module named in a file), or pass unknown_classes='tree' to "
            "load its inner tensors as a sub-tree"
        )
    module, attr = spec
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise SubclassError(
            f"{_at(path)}is stored as {name!r}, built in from {module}.{attr}, which this process "
            f"cannot import ({type(err).__name__}: {err}); install a torchao that has it (pip install "
            "torchao), or pass unknown_classes='tree' to load its inner tensors as a sub-tree"
        ) from None
    with _LOCK:
        _BY_NAME.setdefault(name, cls)
        _NAMES.setdefault(cls, name)
    return cls  # type: ignore[no-any-return]


def is_known(name: str) -> bool:
    """True if a group recorded as ``name`` can be rebuilt here (registered, or built in and
    importable: this imports a built-in name's module).

    Example:
        >>> is_known("torch.quantized"), is_known("nobody.Registered")
        (True, False)
    """
    if name == QUANTIZED:
        return True
    try:
        _resolve(name, ())
    except SubclassError:
        return False
    return True


def _at(path: tuple[str, ...]) -> str:
    return f"leaf {fmt_key(path)} " if path else ""


# ---------------------------------------------------------------------------------------------
# which tensors are groups


def is_plain(t: torch.Tensor) -> bool:
    """True for a tensor stored as one ordinary leaf: a plain tensor or parameter, one of
    memtree's own tensor classes (a mapped file, a lazily read or offloaded tensor: their class
    sets ``_memtree_plain = True``), or tensordict's ``MemoryMappedTensor`` (a file-backed plain
    tensor).

    Example:
        >>> import torch
        >>> is_plain(torch.ones(2)), is_plain(torch.nn.Parameter(torch.ones(2)))
        (True, True)
    """
    cls = type(t)
    if cls is torch.Tensor or cls is torch.nn.Parameter:
        return not t.is_quantized
    return getattr(cls, "_memtree_plain", False) is True or _FOREIGN_PLAIN.get(cls.__name__) == cls.__module__


# Other libraries' classes that only hold an ordinary tensor's storage (a file behind it), with no
# behaviour of their own to keep: stored as plain leaves, by name so that nothing is imported.
_FOREIGN_PLAIN = {"MemoryMappedTensor": "tensordict.memmap"}


def is_dtensor(t: object) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (checked without importing it)."""
    return type(t).__name__ == "DTensor" and type(t).__module__.startswith("torch.distributed")


def to_group(t: torch.Tensor, path: tuple[str, ...]) -> Level:
    """The group a tensor subclass is written as: a :class:`~memtree.format.level.Level` of its
    inner tensors (nested groups for inner subclasses), with ``subclass`` set.

    Raises:
        SubclassError: the class is not registered, has no flatten protocol, or its context
            holds something JSON cannot (names the key, the class and the fix).
    """
    if t.is_quantized:
        inner, ctx, name = _quantized_flatten(t), _quantized_context(t), QUANTIZED
    else:
        cls = type(t)
        if not hasattr(cls, "__tensor_flatten__"):
            raise SubclassError(
                f"leaf {fmt_key(path)} is a {_where(cls)}, a tensor subclass without "
                "__tensor_flatten__: memtree cannot store it without losing its type. Store a plain "
                "tensor (t.as_subclass(torch.Tensor)), or give the class PyTorch's flatten protocol "
                "and memtree.register_subclass it"
            )
        found = _name_of(cls)
        if found is None:
            raise SubclassError(
                f"leaf {fmt_key(path)} is a {_where(cls)}, which is not registered: call "
                f"memtree.register_subclass({cls.__qualname__}) (with the classes its flatten "
                "context holds) before saving, or dequantize it first (t.dequantize())"
            )
        name = found
        names, ctx = _flatten(t)
        inner = {}
        for attr in names:
            value = getattr(t, attr)
            if not isinstance(value, torch.Tensor) or not attr.isidentifier():
                raise SubclassError(
                    f"leaf {fmt_key(path)}: {name}'s __tensor_flatten__ names {attr!r}, which is not a "
                    "tensor attribute; memtree stores a subclass's inner tensors by attribute name"
                )
            inner[attr] = value
    entries: dict[str, Any] = {}
    for attr, value in inner.items():
        if is_dtensor(value):
            raise SubclassError(f"leaf {fmt_key(path)}: inner tensor {attr!r} of {name} is a DTensor")
        entries[attr] = value if is_plain(value) else to_group(value, path + (attr,))
    context = _encode(ctx, path, name)
    return Level((), entries, subclass=Subclass(name, any_dtype_name(t.dtype), tuple(t.shape), tuple(t.stride()), context))


def rebuild(level: Level, path: tuple[str, ...]) -> torch.Tensor:
    """The tensor subclass a group (``level.subclass``) stands for, its inner tensors those of
    ``level`` (not copied).

    Raises:
        SubclassError: the name is not registered (or its torchao class cannot be imported),
            the context names an unregistered class, or ``__tensor_unflatten__`` fails or gives
            another class, shape or dtype than recorded (a damaged or hostile tree).
    """
    sub = level.subclass
    assert sub is not None
    inner = {
        k: rebuild(v, path + (k,)) if isinstance(v, Level) and v.subclass is not None else v
        for k, v in level.entries.items()
    }
    tensors = {k: v for k, v in inner.items() if isinstance(v, torch.Tensor)}
    if len(tensors) != len(inner):
        raise SubclassError(f"{_at(path)}is a {sub.type} group holding something other than tensors")
    cls: type = torch.Tensor
    if sub.type == QUANTIZED:
        out = _quantized_rebuild(tensors, sub, path)
    else:
        cls = _resolve(sub.type, path)
        if not (isinstance(cls, type) and issubclass(cls, torch.Tensor)):
            raise SubclassError(f"{_at(path)}is stored as {sub.type!r}, which names no tensor subclass")
        ctx = _decode(sub.context, path, sub.type)
        try:
            unflatten = getattr(cls, "__tensor_unflatten__")
            out = unflatten(tensors, ctx, torch.Size(sub.shape), tuple(sub.stride))
        except MemtreeError:
            raise
        except Exception as err:  # the class's own code: any error is the tree's problem
            raise SubclassError(
                f"{_at(path)}({sub.type}) could not be rebuilt: {type(err).__name__}: {err}. The tree "
                "is damaged, or was written by another version of the class"
            ) from err
    if type(out) is not cls or out.dtype != any_dtype_from_name(sub.dtype_name) or tuple(out.shape) != sub.shape:
        raise SubclassError(
            f"{_at(path)}was rebuilt as a {type(out).__name__} {str(out.dtype).removeprefix('torch.')}"
            f"{list(out.shape)}, but its "
            f"meta.json records a {sub.type} {sub.dtype_name}{list(sub.shape)}; the tree is damaged or "
            "hostile"
        )
    return out


def describe(type_name: str, inner: dict[str, torch.Tensor], context: Any, where: str) -> Subclass:
    """What a group of class ``type_name`` with these inner tensors (meta tensors will do) and
    this context (tagged JSON) records: the class is rebuilt to learn its outer dtype, shape and
    stride. For groups read from another format (torchao's safetensors convention).

    Raises:
        SubclassError: the class is unknown here, or does not rebuild from these.
    """
    cls = _resolve(type_name, ())
    try:
        out = getattr(cls, "__tensor_unflatten__")(inner, _decode(context, (), type_name), None, None)
    except MemtreeError:
        raise
    except Exception as err:
        raise SubclassError(f"{where}: a {type_name} does not rebuild from what the file holds: {type(err).__name__}: {err}") from None
    if type(out) is not cls or not isinstance(out, torch.Tensor):
        raise SubclassError(f"{where}: {type_name} rebuilt as a {type(out).__name__}")
    return Subclass(type_name, any_dtype_name(out.dtype), tuple(out.shape), tuple(out.stride()), context)


def _flatten(t: torch.Tensor) -> tuple[list[str], Any]:
    """``t.__tensor_flatten__()``: the inner tensors' attribute names, and the context."""
    names, ctx = t.__tensor_flatten__()  # type: ignore[attr-defined]
    return list(names), ctx


def inner_tensors(t: torch.Tensor, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], torch.Tensor]]:
    """Every plain inner tensor of a subclass (nested ones flattened), by attribute path.

    Example:
        >>> import torch
        >>> [(p, x.dtype) for p, x in inner_tensors(torch.ones(2))]
        [((), torch.float32)]
    """
    if is_plain(t) or is_dtensor(t):
        return [(path, t)]
    if t.is_quantized:
        return [(path + (k,), v) for k, v in _quantized_flatten(t).items()]
    out = []
    for attr in _flatten(t)[0]:
        out += inner_tensors(getattr(t, attr), path + (attr,))
    return out


Layout = tuple[list[tuple[tuple[str, ...], torch.dtype, tuple[int, ...]]], list[Any]]
"""A subclass's layout: its inner tensors' ``(attribute path, dtype, shape)`` and its flatten
contexts (nested subclasses' too) as tagged JSON."""


def layout_of(t: torch.Tensor) -> Layout:
    """The layout of a subclass (one flatten per level): equal for two tensors that can be filled
    one from the other inner tensor by inner tensor. Devices are left out of the contexts (a
    tensor's device is where it is, not its layout).

    Example:
        >>> import torch, warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")   # torch deprecates its quantized tensors
        ...     q = torch.quantize_per_tensor(torch.ones(2), 0.5, 0, torch.qint8)
        >>> inner, contexts = layout_of(q)
        >>> inner, contexts[0]["items"]["scale"]
        ([(('data',), torch.uint8, (2,))], 0.5)
    """
    inner: list[tuple[tuple[str, ...], torch.dtype, tuple[int, ...]]] = []
    contexts: list[Any] = []
    todo: list[tuple[tuple[str, ...], torch.Tensor]] = [((), t)]
    while todo:
        path, x = todo.pop(0)
        if x.is_quantized:
            contexts.append(_encode(_quantized_context(x), (), QUANTIZED))
            inner += [(path + (k,), v.dtype, tuple(v.shape)) for k, v in _quantized_flatten(x).items()]
            continue
        names, ctx = _flatten(x)
        contexts.append(_encode(ctx, (), type(x).__qualname__, devices=False))
        for n in names:
            value = getattr(x, n)
            if is_plain(value) or is_dtensor(value):
                inner.append((path + (n,), value.dtype, tuple(value.shape)))
            else:
                todo.append((path + (n,), value))
    return inner, contexts


# ---------------------------------------------------------------------------------------------
# contexts as tagged JSON (the grammar: memtree.format.subclass.check_context)


def _encode(value: Any, path: tuple[str, ...], owner: str, *, devices: bool = True) -> Any:
    """``value`` (a flatten context) as tagged JSON."""

    def enc(v: Any, where: str) -> Any:
        t = type(v)
        if v is None or t is bool or t is str:
            return v
        if t is int:
            if not -(2**63) <= v < 2**64:
                raise _unstorable(path, owner, where, f"the int {v} (beyond 64 bits)")
            return v
        if t is float:
            return v if math.isfinite(v) else {"kind": "float", "value": str(v)}
        if t is list:
            return [enc(x, f"{where}[{i}]") for i, x in enumerate(v)]
        if t is torch.Size:
            return {"kind": "size", "dims": list(v)}
        if t is tuple:
            return {"kind": "tuple", "items": [enc(x, f"{where}[{i}]") for i, x in enumerate(v)]}
        if t is dict:
            bad = next((k for k in v if type(k) is not str), None)
            if bad is not None:
                raise _unstorable(path, owner, where, f"a dict with the key {bad!r:.40} (not a str)")
            return {"kind": "dict", "items": {k: enc(x, f"{where}[{k!r}]") for k, x in v.items()}}
        if t is torch.dtype:
            return {"kind": "dtype", "name": any_dtype_name(v)}
        if t is torch.device:
            return {"kind": "device", "name": str(v) if devices else "cpu"}
        if isinstance(v, torch.Tensor):
            raise _unstorable(path, owner, where, "a tensor (inner tensors belong in __tensor_flatten__'s names)")
        name = _name_of(t)
        if name is None or not _is_context_class(t):
            raise _unstorable(path, owner, where, f"a {_where(t)}, which is not registered")
        if isinstance(v, enum.Enum):
            return {"kind": "enum", "type": name, "name": v.name}
        if _is_named_tuple(t):
            fields = v._asdict()
        else:
            fields = {f.name: getattr(v, f.name) for f in dataclasses.fields(v) if f.init}
        return {"kind": "object", "type": name, "fields": {k: enc(x, f"{where}.{k}") for k, x in fields.items()}}

    return enc(value, "context")


def _unstorable(path: tuple[str, ...], owner: str, where: str, what: str) -> SubclassError:
    return SubclassError(
        f"leaf {fmt_key(path)} ({owner}): its flatten {where} holds {what}, which memtree cannot "
        "store as JSON. Register the class with memtree.register_subclass (an enum, dataclass or "
        "NamedTuple), or dequantize the tensor first"
    )


def _decode(value: Any, path: tuple[str, ...], owner: str) -> Any:
    """A context's tagged JSON back as Python objects (classes by registered name only)."""

    def dec(v: Any) -> Any:
        if type(v) is list:
            return [dec(x) for x in v]
        if type(v) is not dict:
            return v
        kind = v["kind"]
        if kind == "tuple":
            return tuple(dec(x) for x in v["items"])
        if kind == "dict":
            return {k: dec(x) for k, x in v["items"].items()}
        if kind == "size":
            return torch.Size(v["dims"])
        if kind == "float":
            return float(v["value"])
        if kind == "dtype":
            found = any_dtype_from_name(v["name"])
            if found is None:
                raise SubclassError(f"{_at(path)}({owner}): this torch has no dtype {v['name']!r}")
            return found
        if kind == "device":
            try:
                return torch.device(v["name"])
            except RuntimeError as err:
                raise SubclassError(f"{_at(path)}({owner}): bad device {v['name']!r:.40}: {err}") from None
        cls = _resolve(v["type"], path)
        if kind == "enum":
            if not issubclass(cls, enum.Enum) or v["name"] not in cls.__members__:
                raise SubclassError(f"{_at(path)}({owner}): {v['type']} has no member {v['name']!r:.40}")
            return cls.__members__[v["name"]]
        if not (dataclasses.is_dataclass(cls) or _is_named_tuple(cls)):
            raise SubclassError(f"{_at(path)}({owner}): {v['type']} is not a dataclass or NamedTuple")
        try:
            return cls(**{k: dec(x) for k, x in v["fields"].items()})
        except MemtreeError:
            raise
        except Exception as err:
            raise SubclassError(f"{_at(path)}({owner}): cannot make a {v['type']}: {type(err).__name__}: {err}") from None

    return dec(value)


# ---------------------------------------------------------------------------------------------
# torch's quantized tensors (torch.quantized): the storage's bytes, scales and zero points


def _quantized_flatten(t: torch.Tensor) -> dict[str, torch.Tensor]:
    t = t.detach().contiguous()
    storage = t.untyped_storage()
    data = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))
    if t.qscheme() == torch.per_tensor_affine:
        return {"data": data}
    if t.qscheme() in (torch.per_channel_affine, torch.per_channel_affine_float_qparams):
        return {"data": data, "scales": t.q_per_channel_scales(), "zero_points": t.q_per_channel_zero_points()}
    raise SubclassError(f"quantized tensors of scheme {t.qscheme()} cannot be stored; dequantize first")


def _quantized_context(t: torch.Tensor) -> dict[str, Any]:
    ctx: dict[str, Any] = {"dtype": t.dtype, "qscheme": str(t.qscheme()).split(".")[-1]}
    if t.qscheme() == torch.per_tensor_affine:
        ctx.update(scale=float(t.q_scale()), zero_point=int(t.q_zero_point()))
    else:
        ctx["axis"] = int(t.q_per_channel_axis())
    return ctx


def _quantized_rebuild(inner: dict[str, torch.Tensor], sub: Subclass, path: tuple[str, ...]) -> torch.Tensor:
    ctx = _decode(sub.context, path, QUANTIZED)
    try:
        dtype, scheme, data = ctx["dtype"], ctx["qscheme"], inner["data"]
        shape = torch.Size(sub.shape)
        if scheme == "per_tensor_affine":
            out = torch._empty_affine_quantized(shape, scale=ctx["scale"], zero_point=ctx["zero_point"], dtype=dtype)
        else:
            make = torch._empty_per_channel_affine_quantized
            out = make(shape, scales=inner["scales"], zero_points=inner["zero_points"], axis=ctx["axis"], dtype=dtype)
        if out.untyped_storage().nbytes() != data.numel() or data.dtype != torch.uint8:
            raise SubclassError(
                f"{_at(path)}(a quantized tensor) has {data.numel()} bytes of data for a {dtype}"
                f"{list(shape)}; the tree is damaged"
            )
        start = data.storage_offset()  # (a view: a packed leaf's storage is its whole pack)
        out.untyped_storage().copy_(data.untyped_storage()[start : start + data.numel()])
    except MemtreeError:
        raise
    except Exception as err:
        raise SubclassError(
            f"{_at(path)}(a quantized tensor) could not be rebuilt: {type(err).__name__}: {err}; the "
            "tree is damaged"
        ) from None
    return out
