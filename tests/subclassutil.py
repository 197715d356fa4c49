"""Tensor subclasses for the tests, without torchao: a scaled int8 tensor, a wrapper of one, and
the context classes they carry (registered under ``tests.*``).

``ScaledInt8`` holds int8 ``qdata`` and a float ``scale`` (its context, with a ``Cfg``
dataclass, a ``Mode`` enum and a ``Span`` named tuple, so that every kind of context value is
exercised); every op but the ones that keep the class (detach, alias, clone, ``_to_copy``)
runs on the dequantized values. ``Wrapped`` holds a ``ScaledInt8`` as its inner tensor (a
nested group).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_map

import memtree

aten = torch.ops.aten
_KEEP = (aten.detach.default, aten.alias.default, aten.clone.default, aten._to_copy.default)


class Mode(enum.Enum):
    SYMMETRIC = 1
    ASYMMETRIC = 2


@dataclasses.dataclass(frozen=True)
class Cfg:
    mode: Mode
    block: tuple[int, ...]
    eps: float = 1e-6


class Span(NamedTuple):
    start: int
    stop: int


class ScaledInt8(torch.Tensor):
    """int8 values times one scale (a float32 tensor to every op but the class-keeping ones)."""

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: float, cfg: Any = None) -> ScaledInt8:
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=torch.float32, device=qdata.device)  # type: ignore[no-any-return]

    def __init__(self, qdata: torch.Tensor, scale: float, cfg: Any = None) -> None:
        self.qdata, self.scale, self.cfg = qdata, scale, cfg

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, Any]]:
        return ["qdata"], {"scale": self.scale, "cfg": self.cfg}

    @classmethod
    def __tensor_unflatten__(cls, inner: dict[str, torch.Tensor], ctx: dict[str, Any], size: Any, stride: Any) -> ScaledInt8:
        return cls(inner["qdata"], ctx["scale"], ctx["cfg"])

    def dequantize(self) -> torch.Tensor:
        return self.qdata.float() * self.scale

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _KEEP:
            x = args[0]
            if func is aten._to_copy.default:
                kwargs = {k: v for k, v in kwargs.items() if k != "dtype"}
            return cls(func(x.qdata, *args[1:], **kwargs), x.scale, x.cfg)
        plain = lambda t: t.dequantize() if isinstance(t, cls) else t  # noqa: E731
        return func(*tree_map(plain, args), **tree_map(plain, kwargs))

    def __repr__(self) -> str:
        return f"ScaledInt8({self.qdata.tolist()}, scale={self.scale})"


class Wrapped(torch.Tensor):
    """A ScaledInt8 inside another subclass: a group holding a group."""

    @staticmethod
    def __new__(cls, inner: ScaledInt8, tag: str) -> Wrapped:
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)  # type: ignore[no-any-return]

    def __init__(self, inner: ScaledInt8, tag: str) -> None:
        self.inner, self.tag = inner, tag

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, Any]]:
        return ["inner"], {"tag": self.tag}

    @classmethod
    def __tensor_unflatten__(cls, inner: dict[str, Any], ctx: dict[str, Any], size: Any, stride: Any) -> Wrapped:
        return cls(inner["inner"], ctx["tag"])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _KEEP:
            return cls(func(args[0].inner, *args[1:], **(kwargs or {})), args[0].tag)
        plain = lambda t: t.inner.dequantize() if isinstance(t, cls) else t  # noqa: E731
        return func(*tree_map(plain, args), **tree_map(plain, kwargs or {}))


class Unregistered(ScaledInt8):
    """A subclass with the flatten protocol that nobody registered."""


class NoProtocol(torch.Tensor):
    """A subclass without ``__tensor_flatten__`` (tensordict stores it as a plain tensor)."""


for _cls, _name in ((ScaledInt8, "tests.ScaledInt8"), (Wrapped, "tests.Wrapped"), (Mode, "tests.Mode"),
                    (Cfg, "tests.Cfg"), (Span, "tests.Span")):
    memtree.register_subclass(_cls, name=_name)


def scaled(n: int = 6, scale: float = 0.5, seed: int = 0, cfg: Any = None) -> ScaledInt8:
    """A ScaledInt8 of ``n`` int8 values (``cfg`` defaults to one of every context kind)."""
    g = torch.Generator().manual_seed(seed)
    qdata = torch.randint(-128, 128, (n,), dtype=torch.int8, generator=g)
    if cfg is None:
        cfg = {"cfg": Cfg(Mode.ASYMMETRIC, (1, n)), "span": Span(0, n), "dtype": torch.bfloat16,
               "size": torch.Size([1, n]), "device": torch.device("cpu"), "nan": float("nan"),
               "tuple": (1, [2, (3,)]), "none": None}
    return ScaledInt8(qdata, scale, cfg)


def same_subclass(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same class and bit-identical inner tensors (nested ones too)."""
    if type(a) is not type(b):
        return False
    if type(a) is torch.Tensor or isinstance(a, memtree.MemoryMappedTensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    names = a.__tensor_flatten__()[0]
    return names == b.__tensor_flatten__()[0] and all(
        same_subclass(_plain(getattr(a, n)), _plain(getattr(b, n))) for n in names
    )


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor) if isinstance(t, memtree.MemoryMappedTensor) else t
