"""What a timed run produced, compared with what it should have produced (untimed, after it).

Every timed run of the suite is checked: a save is read back, a load's tensors or a model's
output are compared with the expected bytes. :func:`digest` is a content hash of a tensor's
bytes (its dtype and shape included), so that expected values can be computed once and carried
to another process; :func:`expect_digests` compares a mapping of tensors with them key by key,
so a loader that fills nothing, fills the wrong key, or fills in the wrong order fails.

Example:
    >>> import torch
    >>> t = torch.arange(6, dtype=torch.float32)
    >>> expect_digests({"a": t}, {"a": digest(t)}, "example")
    >>> expect_digests({"a": t.flip(0)}, {"a": digest(t)}, "example")
    Traceback (most recent call last):
    ...
    checks.CheckFailed: example: wrong bytes in 1 of 1 tensors: ['a']
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, Mapping

import torch

try:  # ISA-L's CRC-32 where installed (memtree's fast-checksums extra): ~5x zlib's speed
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - depends on the environment
    _crc32 = zlib.crc32


class CheckFailed(AssertionError):
    """A timed run produced something other than the expected result."""


def byte_view(t: torch.Tensor) -> Any:
    """The tensor's bytes as a numpy ``uint8`` array (a copy to the CPU when it is elsewhere)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def digest(t: torch.Tensor) -> tuple[str, tuple[int, ...], int]:
    """(dtype, shape, CRC-32 of the bytes): equal exactly when two tensors are bit-identical
    (up to CRC collisions, 2**-32 for a random change)."""
    return str(t.dtype), tuple(t.shape), _crc32(byte_view(t))


Digest = tuple[str, tuple[int, ...], int]


def digests(tensors: Mapping[Any, torch.Tensor]) -> dict[Any, Digest]:
    """:func:`digest` of every tensor, by key."""
    return {k: digest(v) for k, v in tensors.items()}


def expect_digests(
    got: Mapping[Any, torch.Tensor] | Callable[[Any], torch.Tensor],
    expected: Mapping[Any, Any],
    what: str,
) -> None:
    """Raise :class:`CheckFailed` unless every expected key has its expected bytes.

    ``got`` is a mapping or a function of the key (a handle's ``get``); a key it lacks counts
    as wrong.
    """
    bad = []
    for key, want in expected.items():
        try:
            t = got[key] if isinstance(got, Mapping) else got(key)
        except (KeyError, AttributeError):
            bad.append(key)
            continue
        if digest(t) != as_digest(want):
            bad.append(key)
    if bad:
        raise CheckFailed(
            f"{what}: wrong bytes in {len(bad)} of {len(expected)} tensors: {sorted(bad)[:5]}"
        )


def as_digest(want: Any) -> Digest:
    """A digest as :func:`digest` gives it, from its JSON form (lists instead of tuples)."""
    dtype, shape, crc = want
    return str(dtype), tuple(shape), int(crc)


def expect_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Raise :class:`CheckFailed` unless ``got`` is bit-identical to ``want`` (dtype, shape,
    bytes, element by element: ``-0.0`` differs from ``0.0``, a NaN equals the same NaN)."""
    if got.dtype != want.dtype or got.shape != want.shape:
        raise CheckFailed(
            f"{what}: got {got.dtype} {tuple(got.shape)}, expected {want.dtype} {tuple(want.shape)}"
        )
    if got.device != want.device:  # else compared where they are (a GPU compares its own)
        got, want = got.cpu(), want.cpu()
    a, b = got.detach().contiguous(), want.detach().contiguous()
    if not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
        raise CheckFailed(f"{what}: the bytes differ from the expected result")
