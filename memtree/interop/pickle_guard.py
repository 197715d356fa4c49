"""Bounds on reading a pickle: size, objects built, nesting, sharing and cycles.

The restricted unpickler of :mod:`memtree.interop.torchsave` decides *what* a ``torch.save``
pickle may build (tensors, containers, scalars). This module bounds *how much*, so that a
hostile ``data.pkl`` can neither exhaust memory nor hang the reader:

* :class:`PickleScanner` reads every operation of the pickle **before anything is built**: an
  unknown opcode, an argument that runs past the data, a memo index out of sequence (the C
  unpickler allocates its memo up to twice the largest index it is given: a 5-byte
  ``LONG_BINPUT`` could ask for gigabytes) or a declared length beyond the data is refused, and
  the values the pickle creates or references are counted against
  :attr:`PickleLimits.max_objects`. It scans a growing buffer, so a compressed ``data.pkl`` is
  refused while it is being inflated, at most ``max_bytes`` in;
* :class:`Budget` charges what the allowed calls build as they run (``torch.Size(list)``,
  ``OrderedDict(pairs)``, ``bytes`` from ``_codecs.encode``, the state a ``BUILD`` sets on an
  ``OrderedDict``): a handful of operations that refer to one big list again and again would
  otherwise multiply it;
* :func:`flatten_pickled` walks the unpickled object in time linear in its number of distinct
  containers (each is analysed once, by identity, however often it is shared), refuses cycles
  and nesting deeper than :attr:`PickleLimits.max_depth` with an error naming the path, and
  refuses a structure whose shared parts would repeat into more than ``max_objects`` entries.

The limits have defaults that no ordinary checkpoint reaches; :func:`pickle_limits` raises or
lowers them for the files opened inside a ``with`` block (every reader: ``open_checkpoint``,
``convert``, ``load_into_module``).

Example:
    >>> import pickle
    >>> from memtree.interop.pickle_guard import PickleLimits, PickleScanner
    >>> scan = PickleScanner(PickleLimits(max_objects=10), "demo")
    >>> scan.feed(pickle.dumps([1, 2], protocol=2), final=True)
    >>> scan.objects, scan.done
    (6, True)
    >>> try:
    ...     PickleScanner(PickleLimits(max_objects=10), "demo").feed(
    ...         pickle.dumps(list(range(20)), protocol=2), final=True)
    ... except Exception as err:
    ...     print(type(err).__name__)
    CheckpointFormatError
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any

from ..errors import CheckpointFormatError

__all__ = [
    "PickleLimits",
    "pickle_limits",
    "current_limits",
    "PickleScanner",
    "Budget",
    "SafeCall",
    "Flattened",
    "flatten_pickled",
]


@dataclass(frozen=True)
class PickleLimits:
    """How much a checkpoint's pickle may hold; beyond it, reading stops with a clear error.

    Attributes:
        max_bytes: size of the pickle (``data.pkl``, after inflating a compressed one), plus the
            ``bytes`` values the pickle builds from text.
        max_objects: values the pickle creates or references (each operation of the pickle makes
            at most one; a list or dict counts 2, a set 6, for their size), plus the items
            that calls such as ``torch.Size(list)`` copy; also the most entries a structure may
            flatten to. About 25 per tensor in a ``torch.save`` file: the default covers
            checkpoints of some 400,000 tensors.
        max_depth: nesting of dicts, lists and tuples.

    Example:
        >>> PickleLimits().max_depth, PickleLimits(max_depth=500).max_depth
        (100, 500)
    """

    max_bytes: int = 256 * 2**20
    max_objects: int = 10_000_000
    max_depth: int = 100

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_objects", "max_depth"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"PickleLimits.{name} must be a positive int, got {value!r}")


_LIMITS: ContextVar[PickleLimits] = ContextVar("memtree_pickle_limits", default=PickleLimits())


def current_limits() -> PickleLimits:
    """The limits in force here (the defaults, or those of the innermost :func:`pickle_limits`)."""
    return _LIMITS.get()


@contextmanager
def pickle_limits(
    limits: PickleLimits | None = None,
    *,
    max_bytes: int | None = None,
    max_objects: int | None = None,
    max_depth: int | None = None,
) -> Iterator[PickleLimits]:
    """Use other :class:`PickleLimits` for the ``torch.save`` files read inside the block.

    Args:
        limits: the limits to start from (default: those in force).
        max_bytes: a new :attr:`PickleLimits.max_bytes` (default: unchanged).
        max_objects: a new :attr:`PickleLimits.max_objects` (default: unchanged).
        max_depth: a new :attr:`PickleLimits.max_depth` (default: unchanged).

    Example:
        >>> import memtree
        >>> with memtree.interop.pickle_limits(max_objects=50_000_000) as limits:
        ...     limits.max_objects
        50000000
    """
    base = current_limits() if limits is None else limits
    changes = {
        k: v
        for k, v in (("max_bytes", max_bytes), ("max_objects", max_objects), ("max_depth", max_depth))
        if v is not None
    }
    token = _LIMITS.set(replace(base, **changes))
    try:
        yield _LIMITS.get()
    finally:
        _LIMITS.reset(token)


def limit_error(where: str, what: str, field: str, value: int) -> CheckpointFormatError:
    """The error for a pickle beyond one of its limits: what, which limit, how to raise it."""
    return CheckpointFormatError(
        f"{where}: {what}, beyond the limit PickleLimits.{field}={value:,}; memtree stops here so "
        "that a hostile file cannot exhaust memory or time. If you trust this file, raise the "
        f"limit: `with memtree.interop.pickle_limits({field}=...):` around the call "
        f"(memtree convert: --max-pickle-{field.removeprefix('max_').replace('_', '-')})"
    )


# -- the scan ------------------------------------------------------------------------------------
# An operation's argument: a fixed number of bytes (>= 0), or one of these.
_LINE, _LINES2, _LEN1, _LEN4, _LEN4S, _LEN8 = -1, -2, -3, -4, -5, -6
_LEN_SIZE = {_LEN1: 1, _LEN4: 4, _LEN4S: 4, _LEN8: 8}
# opcode: (argument, weight). Weight: what the operation adds to memory, in objects (0: it only
# moves values already counted, or reads the stream).
_OPS: dict[str, tuple[int, int]] = {
    "I": (_LINE, 1), "J": (4, 1), "K": (1, 1), "M": (2, 1), "L": (_LINE, 1),
    "\x8a": (_LEN1, 1), "\x8b": (_LEN4S, 1), "S": (_LINE, 1), "T": (_LEN4S, 1),
    "U": (_LEN1, 1), "B": (_LEN4, 1), "C": (_LEN1, 1), "\x8e": (_LEN8, 1), "\x96": (_LEN8, 1),
    "\x97": (0, 1), "\x98": (0, 1), "N": (0, 1), "\x88": (0, 1), "\x89": (0, 1),
    "V": (_LINE, 1), "\x8c": (_LEN1, 1), "X": (_LEN4, 1), "\x8d": (_LEN8, 1), "F": (_LINE, 1),
    "G": (8, 1), "]": (0, 2), "a": (0, 0), "e": (0, 0), "l": (0, 2), ")": (0, 1), "t": (0, 1),
    "\x85": (0, 1), "\x86": (0, 1), "\x87": (0, 1), "}": (0, 2), "d": (0, 2), "s": (0, 0),
    "u": (0, 0), "\x8f": (0, 6), "\x90": (0, 0), "\x91": (0, 6), "0": (0, 0), "2": (0, 1),
    "(": (0, 1), "1": (0, 0), "g": (_LINE, 1), "h": (1, 1), "j": (4, 1), "p": (_LINE, 1),
    "q": (1, 1), "r": (4, 1), "\x94": (0, 1), "\x82": (1, 1), "\x83": (2, 1), "\x84": (4, 1),
    "c": (_LINES2, 1), "\x93": (0, 1), "R": (0, 1), "b": (0, 0), "i": (_LINES2, 1), "o": (0, 1),
    "\x81": (0, 1), "\x92": (0, 1), "\x80": (1, 0), ".": (0, 0), "\x95": (8, 0), "P": (_LINE, 1),
    "Q": (0, 1),
}  # fmt: skip
_ARG: list[int | None] = [None] * 256
_WEIGHT = [0] * 256
for _code, (_arg, _weight) in _OPS.items():
    _ARG[ord(_code)], _WEIGHT[ord(_code)] = _arg, _weight
_PUT, _BINPUT, _LONG_BINPUT, _MEMOIZE, _STOP = ord("p"), ord("q"), ord("r"), 0x94, ord(".")
_FRAME = 0x95
_SPECIAL = frozenset((_BINPUT, _LONG_BINPUT, _MEMOIZE, _FRAME, _STOP))
_MAX_LINE = 1 << 20  # a text argument (protocol 0: a number, a name, a string) longer is refused


class PickleScanner:
    """Checks and counts the operations of a pickle, fed as a growing buffer.

    Call :meth:`feed` with the whole buffer so far each time it grows (``final=True`` with the
    last); it resumes where it stopped. After the ``STOP`` operation :attr:`done` is True.

    Args:
        limits: the limits to enforce.
        where: the pickle's name, for messages.

    Raises:
        CheckpointFormatError: a malformed operation, or a limit exceeded (from :meth:`feed`).
    """

    def __init__(self, limits: PickleLimits, where: str) -> None:
        self.limits = limits
        self.where = where
        self.objects = 0
        self.memo = 0  # one more than the largest memo index put so far
        self.done = False
        self._pos = 0
        self._frame_end = 0

    def feed(self, data: bytes | bytearray, *, final: bool = False) -> None:
        """Scan the operations from where the last call stopped to the end of ``data``.

        Raises:
            CheckpointFormatError: see the class.
        """
        n, i = len(data), self._pos
        arg_of, weight_of, special = _ARG, _WEIGHT, _SPECIAL
        objects, limit, memo = self.objects, self.limits.max_objects, self.memo
        if self.done:  # an earlier call reached STOP
            n = i
        while i < n:
            op = data[i]
            arg = arg_of[op]
            if arg is None:
                raise self._malformed(f"unknown opcode 0x{op:02x} at byte {i:,}")
            if arg >= 0:  # the common case: a fixed-size argument
                if i + 1 + arg > n:
                    break
                if op in special:
                    if op == _LONG_BINPUT:  # the C unpickler sizes its memo by the index
                        index = data[i + 1] | data[i + 2] << 8 | data[i + 3] << 16 | data[i + 4] << 24
                        if index >= memo:
                            if index > memo and index > 255:
                                raise self._skips(index, memo, i)
                            memo = index + 1
                    elif op == _BINPUT:
                        if data[i + 1] >= memo:
                            memo = data[i + 1] + 1
                    elif op == _MEMOIZE:
                        memo += 1
                    elif op == _FRAME:
                        self._frame_end = max(self._frame_end, i + 9 + _uint(data, i + 1, 8))
                    else:  # STOP
                        self.done = True
                        i += 1
                        objects += weight_of[op]
                        break
                i += 1 + arg
            else:
                self.memo = memo
                nxt = self._variable(op, arg, data, i, n)
                memo = self.memo
                if nxt < 0:
                    break
                i = nxt
                if objects > limit:  # (a long run of fixed-size operations is caught below)
                    break
            objects += weight_of[op]
        self.memo = memo
        self._pos, self.objects = i, objects
        if objects > limit:
            raise limit_error(
                self.where, f"the pickle builds more than {limit:,} objects", "max_objects", limit
            )
        if final and not (self.done and self._frame_end <= len(data)):
            raise self._malformed(
                f"the pickle ends before its STOP operation or past its {n:,} bytes: truncated "
                "or damaged"
            )

    def _skips(self, index: int, memo: int, at: int) -> CheckpointFormatError:
        return self._malformed(
            f"memo index {index:,} at byte {at:,} skips ahead of the {memo:,} entries put so "
            "far (pickle writers number them in order)"
        )

    def _variable(self, op: int, arg: int, data: bytes | bytearray, i: int, n: int) -> int:
        """The offset after the operation at ``i``; -1 if ``data`` does not hold it yet."""
        if arg in _LEN_SIZE:
            size = _LEN_SIZE[arg]
            if i + 1 + size > n:
                return -1
            length = int.from_bytes(data[i + 1 : i + 1 + size], "little", signed=arg == _LEN4S)
            if length < 0 or length > self.limits.max_bytes:
                raise self._malformed(f"a value at byte {i:,} declares {length:,} bytes")
            return i + 1 + size + length  # may lie past n: the scan waits for those bytes
        # a text argument: one line (two for GLOBAL and INST). Lines are short, so looking
        # again from the start when more data comes costs little.
        end = data.find(b"\n", i + 1, i + 2 + _MAX_LINE)
        if arg == _LINES2 and end >= 0:
            end = data.find(b"\n", end + 1, i + 2 + _MAX_LINE)
        if end < 0:
            if min(n, i + 2 + _MAX_LINE) - i > _MAX_LINE:
                raise self._malformed(
                    f"a text argument at byte {i:,} is longer than {_MAX_LINE:,} bytes "
                    "(protocol 0 text: save it again with torch.save's default protocol)"
                )
            return -1
        if op == _PUT:
            text = bytes(data[i + 1 : end])
            if not text.isdigit() or len(text) > 18:
                raise self._malformed(f"a malformed memo index {text[:20]!r} at byte {i:,}")
            if int(text) > self.memo and int(text) > 255:
                raise self._skips(int(text), self.memo, i)
            self.memo = max(self.memo, int(text) + 1)
        return end + 1

    def _malformed(self, what: str) -> CheckpointFormatError:
        return CheckpointFormatError(f"{self.where} is malformed: {what}")


def _uint(data: bytes | bytearray, at: int, size: int) -> int:
    return int.from_bytes(data[at : at + size], "little")


# -- what calls build while the pickle runs -------------------------------------------------------
class Budget:
    """What is left of the limits after the scan; the allowed calls charge what they build.

    Args:
        limits: the limits.
        where: the pickle's name, for messages.
        objects: objects already counted (by the scan).
        nbytes: bytes already used (the pickle itself).
    """

    def __init__(self, limits: PickleLimits, where: str, objects: int = 0, nbytes: int = 0) -> None:
        self.limits = limits
        self.where = where
        self.objects = objects
        self.nbytes = nbytes
        self._hooked: list[OrderedDict[Any, Any]] = []

    def charge(self, objects: int = 0, nbytes: int = 0) -> None:
        """Count ``objects`` and ``nbytes`` more; raise past a limit (before they are built)."""
        self.objects += objects
        self.nbytes += nbytes
        if self.objects > self.limits.max_objects:
            raise limit_error(
                self.where,
                f"the pickle builds more than {self.limits.max_objects:,} objects",
                "max_objects",
                self.limits.max_objects,
            )
        if self.nbytes > self.limits.max_bytes:
            raise limit_error(
                self.where,
                f"the pickle and the bytes it builds exceed {self.limits.max_bytes:,} bytes",
                "max_bytes",
                self.limits.max_bytes,
            )

    def sized(self, value: Any, what: str) -> int:
        """``len(value)`` of a list, tuple or dict argument, charged; anything else is refused."""
        if not isinstance(value, (list, tuple, dict)):
            raise CheckpointFormatError(
                f"{self.where}: {what} is called with a {type(value).__name__}"
            )
        self.charge(len(value))
        return len(value)

    def ordered_dict(self, *args: Any) -> OrderedDict[Any, Any]:
        """``OrderedDict(*args)``, charged, whose ``BUILD`` (attributes) is charged too.

        The C unpickler applies a ``BUILD`` state by copying it into the instance's
        ``__dict__`` unless the instance has ``__setstate__``: one is set on the instance for
        the time of the load (:meth:`release` removes it).
        """
        if args:
            if len(args) > 1:
                raise CheckpointFormatError(
                    f"{self.where}: OrderedDict() called with {len(args)} arguments"
                )
            self.sized(args[0], "OrderedDict()")
        self.charge(4)  # the dict, its __dict__ and the hook
        out: OrderedDict[Any, Any] = OrderedDict(*args)
        out.__setstate__ = _SetState(self, out)  # type: ignore[attr-defined]
        self._hooked.append(out)
        return out

    def release(self) -> None:
        """Remove the ``__setstate__`` hooks of the ``OrderedDict`` objects built."""
        for obj in self._hooked:
            if type(vars(obj).get("__setstate__")) is _SetState:
                del vars(obj)["__setstate__"]
        self._hooked.clear()


class _SetState:
    """An ``OrderedDict``'s ``__setstate__`` during a load: charges the attributes it sets."""

    __slots__ = ("_budget", "_target")

    def __init__(self, budget: Budget, target: OrderedDict[Any, Any]) -> None:
        self._budget = budget
        self._target = target

    def __call__(self, state: Any) -> None:
        if state is None:
            return
        if type(state) is not dict:
            raise CheckpointFormatError(
                f"{self._budget.where}: an OrderedDict is given a {type(state).__name__} state"
            )
        self._budget.charge(len(state))
        attributes = vars(self._target)
        attributes.update(state)
        attributes["__setstate__"] = self


class SafeCall:
    """A callable the unpickler may call, that a ``BUILD`` cannot change (no attributes).

    Args:
        fn: what a call runs.
        name: the global's dotted name, for ``repr``.
    """

    __slots__ = ("fn", "name")
    fn: Callable[..., Any]
    name: str

    def __init__(self, fn: Callable[..., Any], name: str) -> None:
        object.__setattr__(self, "fn", fn)
        object.__setattr__(self, "name", name)

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{self.name} cannot be changed")

    def __repr__(self) -> str:
        return f"<{self.name}>"


# -- the walk ------------------------------------------------------------------------------------
@dataclass
class Flattened:
    """An unpickled dict flattened to entries (see :func:`flatten_pickled`)."""

    entries: list[tuple[tuple[str, ...], Any, bool]]
    """``(path, value, is_leaf)`` in order: an instance of the leaf type (a tensor), or any
    other value."""
    containers: dict[tuple[str, ...], str]
    """Containers flattened other than str-keyed dicts: path -> ``"list"``, ``"tuple"`` or
    ``"int keys"`` (a dict whose int keys became str parts)."""


def _items(obj: Any) -> Iterator[tuple[Any, Any]]:
    return iter(obj.items()) if isinstance(obj, dict) else enumerate(obj)


def _show(parts: list[Any] | tuple[Any, ...]) -> str:
    """A path for a message: dotted, and shortened when it is deep."""
    if len(parts) > 12:
        return (
            ".".join(str(p)[:40] for p in parts[:5]) + " ... "
            + ".".join(str(p)[:40] for p in parts[-5:]) + f" ({len(parts)} levels)"
        )
    return ".".join(str(p)[:80] for p in parts) or "the top level"


def _analyse(
    root: dict[Any, Any], leaf: type, limits: PickleLimits, where: str
) -> tuple[dict[int, bool], int]:
    """``holds[id]`` (a container reaches a leaf) and the number of entries ``root`` flattens to.

    Each container is analysed once (memoised by identity), so the time is linear in the
    number of distinct containers and of their items, however the containers are shared.
    """
    cap = limits.max_objects + 1
    holds: dict[int, bool] = {}
    size: dict[int, int] = {}  # entries a container becomes where it is flattened
    on_path = {id(root)}
    parts: list[Any] = []
    stack: list[tuple[Any, Iterator[tuple[Any, Any]], list[Any]]] = [(root, _items(root), [False, 0])]
    while stack:
        obj, items, acc = stack[-1]
        for part, child in items:
            if isinstance(child, leaf):
                acc[0], acc[1] = True, acc[1] + 1
                continue
            if not isinstance(child, (dict, list, tuple)):
                acc[1] += 1
                continue
            key = id(child)
            if key in holds:
                acc[0] = acc[0] or holds[key]
                acc[1] = min(cap, acc[1] + size[key])
                continue
            if key in on_path:
                raise CheckpointFormatError(
                    f"{where}: the {type(child).__name__} at {_show(parts + [part])} contains "
                    f"itself (it is also at {_show(parts[: _depth_of(stack, child)])}): a cycle, "
                    "which memtree cannot flatten; the file is damaged or hostile"
                )
            if len(stack) >= limits.max_depth:
                raise limit_error(
                    where,
                    f"{_show(parts + [part])} is nested more than {limits.max_depth} levels deep",
                    "max_depth",
                    limits.max_depth,
                )
            parts.append(part)
            on_path.add(key)
            stack.append((child, _items(child), [False, 0]))
            break
        else:
            stack.pop()
            key = id(obj)
            on_path.discard(key)
            found, count = acc
            holds[key] = found
            if isinstance(obj, dict):
                size[key] = max(1, count)
            else:
                size[key] = count if found else 1
            if stack:
                parts.pop()
                parent = stack[-1][2]
                parent[0] = parent[0] or found
                parent[1] = min(cap, parent[1] + size[key])
    return holds, (size[id(root)] if root else 0)


def _depth_of(stack: list[tuple[Any, Any, Any]], obj: Any) -> int:
    return next(i for i, frame in enumerate(stack) if frame[0] is obj)


def flatten_pickled(
    root: dict[Any, Any], leaf: type, limits: PickleLimits, where: str
) -> Flattened:
    """Flatten an unpickled dict into dotted entries, in time linear in its distinct containers.

    Dicts are flattened by key (``int`` keys become ``str`` parts); lists and tuples that hold
    an instance of ``leaf`` somewhere, by index; anything else (including an empty dict) is one entry. A
    container shared by several places is flattened at each of them (the entries share the
    leaves: tied weights stay tied).

    Raises:
        CheckpointFormatError: a cycle, nesting deeper than ``limits.max_depth``, more than
            ``limits.max_objects`` entries, or a key that is neither a non-empty ``str`` nor an
            ``int``; each names the path.

    Example:
        >>> shared = [1, 2]
        >>> flat = flatten_pickled({"a": {"x": shared}, "b": [3, 4.5]}, float, PickleLimits(), "demo")
        >>> [(".".join(p), v) for p, v, _ in flat.entries], flat.containers
        ([('a.x', [1, 2]), ('b.0', 3), ('b.1', 4.5)], {('b',): 'list'})
    """
    holds, total = _analyse(root, leaf, limits, where)
    if total > limits.max_objects:
        raise limit_error(
            where,
            f"the object flattens to more than {limits.max_objects:,} entries (a part shared by "
            "several places is repeated at each)",
            "max_objects",
            limits.max_objects,
        )
    out = Flattened([], {})
    stack: list[tuple[Iterator[tuple[str, Any]], tuple[str, ...]]] = [
        (_dict_items(root, (), out, where), ())
    ]
    while stack:
        items, path = stack[-1]
        for part, value in items:
            sub = path + (part,)
            if isinstance(value, leaf):
                out.entries.append((sub, value, True))
            elif isinstance(value, dict) and value:
                stack.append((_dict_items(value, sub, out, where), sub))
                break
            elif isinstance(value, (list, tuple)) and holds.get(id(value)):
                out.containers[sub] = "tuple" if isinstance(value, tuple) else "list"
                stack.append((((str(i), v) for i, v in enumerate(value)), sub))
                break
            else:
                out.entries.append((sub, value, False))
        else:
            stack.pop()
    return out


def _dict_items(
    obj: dict[Any, Any], path: tuple[str, ...], out: Flattened, where: str
) -> Iterator[tuple[str, Any]]:
    for key, value in obj.items():
        if type(key) is int:
            out.containers[path] = "int keys"
            key = str(key)
        elif not isinstance(key, str) or not key:
            raise CheckpointFormatError(
                f"{where}: the dict at {_show(path)} has the key {key!r:.60}; memtree needs "
                "non-empty str (or int) keys"
            )
        yield key, value
