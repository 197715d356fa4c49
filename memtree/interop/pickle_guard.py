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
  refuses a structure whose shared parts would repeat into too many entries (more than
  ``max_objects``, or 100,000 more than the objects the pickle built) or too long keys.

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

import itertools
import reprlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from ..errors import CheckpointFormatError, InvalidArgumentError, check_keywords

__all__ = [
    "PickleLimits",
    "pickle_limits",
    "current_limits",
    "PickleScanner",
    "Budget",
    "SafeCall",
    "Flattened",
    "flatten_pickled",
    "short",
]

_D = TypeVar("_D", bound="dict[Any, Any]")
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 60, 60, 40


def short(value: object) -> str:
    """A short ``repr`` of a value a pickle built: bounded in length and in nesting (a plain
    ``repr`` of a structure nested 100,000 deep raises ``RecursionError``).

    Example:
        >>> short(list(range(100)))
        '[0, 1, 2, 3, 4, 5, ...]'
    """
    return _REPR.repr(value)


@dataclass(frozen=True)
class PickleLimits:
    """How much a checkpoint's pickle may hold; beyond it, reading stops with a clear error.

    Attributes:
        max_bytes: size of the pickle (``data.pkl``, after inflating a compressed one), plus the
            ``bytes`` values the pickle builds from text; also the keys the structure flattens
            to (their text and paths, about 150 bytes an entry besides).
        max_objects: values the pickle creates or references, in units of about 40 bytes (each
            operation of the pickle makes at most one value: a list or dict counts 2, a set 6),
            plus what calls such as ``torch.Size(list)`` copy; also the most entries a
            structure may flatten to. A ``torch.save`` file uses about 34 per tensor: the
            default covers some 300,000 tensors, and bounds the objects to about 400 MB.
        max_depth: nesting of dicts, lists and tuples, the top-level dict included.

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
                raise InvalidArgumentError(f"PickleLimits.{name} must be a positive int, got {value!r}")


_LIMITS: ContextVar[PickleLimits] = ContextVar("memtree_pickle_limits", default=PickleLimits())


def current_limits() -> PickleLimits:
    """The limits in force here (the defaults, or those of the innermost :func:`pickle_limits`)."""
    return _LIMITS.get()


@contextmanager
@check_keywords
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
# What an operation does to the stack, as far as the scan follows it: it tracks how deeply
# each value nests tuples (0: not a tuple), because hashing a tuple (as a dict key, a set item)
# recurses in C without a guard, and one nested some 100,000 deep crashes the interpreter.
(_PUSH, _TUPLE_OF, _TUPLE_MARK, _MARK, _FROM_MARK, _TO_MARK, _POP, _CALL, _DUP, _GET, _PUT,
 _MEMO, _NONE) = range(13)  # fmt: skip
# opcode: (argument, weight, effect, n). Weight: what the operation adds to memory, in objects
# (0: it only moves values already counted). n: values popped (_POP, _CALL), tuple items
# (_TUPLE_OF), memo index bytes (_GET, _PUT), or objects more per item (_FROM_MARK, _TO_MARK:
# a dict or set grows its table for each item it takes).
_OPS: dict[str, tuple[int, int, int, int]] = {
    "I": (_LINE, 1, _PUSH, 0), "J": (4, 1, _PUSH, 0), "K": (1, 1, _PUSH, 0),
    "M": (2, 1, _PUSH, 0), "L": (_LINE, 1, _PUSH, 0), "\x8a": (_LEN1, 1, _PUSH, 0),
    "\x8b": (_LEN4S, 1, _PUSH, 0), "S": (_LINE, 1, _PUSH, 0), "T": (_LEN4S, 1, _PUSH, 0),
    "U": (_LEN1, 1, _PUSH, 0), "B": (_LEN4, 1, _PUSH, 0), "C": (_LEN1, 1, _PUSH, 0),
    "\x8e": (_LEN8, 1, _PUSH, 0), "\x96": (_LEN8, 1, _PUSH, 0), "\x97": (0, 1, _PUSH, 0),
    "\x98": (0, 1, _CALL, 1), "N": (0, 1, _PUSH, 0), "\x88": (0, 1, _PUSH, 0),
    "\x89": (0, 1, _PUSH, 0), "V": (_LINE, 1, _PUSH, 0), "\x8c": (_LEN1, 1, _PUSH, 0),
    "X": (_LEN4, 1, _PUSH, 0), "\x8d": (_LEN8, 1, _PUSH, 0), "F": (_LINE, 1, _PUSH, 0),
    "G": (8, 1, _PUSH, 0), "]": (0, 2, _PUSH, 0), "a": (0, 0, _POP, 1), "e": (0, 0, _TO_MARK, 0),
    "l": (0, 2, _FROM_MARK, 0), ")": (0, 1, _TUPLE_OF, 0), "t": (0, 1, _TUPLE_MARK, 0),
    "\x85": (0, 1, _TUPLE_OF, 1), "\x86": (0, 1, _TUPLE_OF, 2), "\x87": (0, 1, _TUPLE_OF, 3),
    "}": (0, 2, _PUSH, 0), "d": (0, 2, _FROM_MARK, 1), "s": (0, 2, _POP, 2),
    "u": (0, 0, _TO_MARK, 1), "\x8f": (0, 6, _PUSH, 0), "\x90": (0, 0, _TO_MARK, 1),
    "\x91": (0, 6, _FROM_MARK, 1), "0": (0, 0, _POP, 1), "2": (0, 1, _DUP, 0),
    "(": (0, 1, _MARK, 0), "1": (0, 0, _TO_MARK, 0), "g": (_LINE, 1, _GET, 0),
    "h": (1, 1, _GET, 1), "j": (4, 1, _GET, 4), "p": (_LINE, 1, _PUT, 0), "q": (1, 1, _PUT, 1),
    "r": (4, 1, _PUT, 4), "\x94": (0, 1, _MEMO, 0), "\x82": (1, 1, _PUSH, 0),
    "\x83": (2, 1, _PUSH, 0), "\x84": (4, 1, _PUSH, 0), "c": (_LINES2, 1, _PUSH, 0),
    "\x93": (0, 1, _CALL, 2), "R": (0, 1, _CALL, 2), "b": (0, 0, _POP, 1),
    "i": (_LINES2, 1, _FROM_MARK, 0), "o": (0, 1, _FROM_MARK, 0), "\x81": (0, 1, _CALL, 2),
    "\x92": (0, 1, _CALL, 3), "\x80": (1, 0, _NONE, 0), ".": (0, 0, _NONE, 0),
    "\x95": (8, 0, _NONE, 0), "P": (_LINE, 1, _PUSH, 0), "Q": (0, 1, _CALL, 1),
}  # fmt: skip
_TABLE: list[tuple[int, int, int, int] | None] = [None] * 256
for _code, _spec in _OPS.items():
    _TABLE[ord(_code)] = _spec
_PUT_TEXT, _FRAME, _STOP = ord("p"), 0x95, ord(".")
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
        self.done = False
        self._pos = 0
        self._frame_end = 0
        self._stack: list[int] = []  # tuple nesting of each value on the unpickler's stack
        self._marks: list[int] = []
        self._memo: list[int] = []  # tuple nesting of each memo entry

    def feed(self, data: bytes | bytearray, *, final: bool = False) -> None:
        """Scan the operations from where the last call stopped to the end of ``data``.

        Raises:
            CheckpointFormatError: see the class.
        """
        n, i = len(data), self._pos
        if self.done:  # an earlier call reached STOP
            n = i
        table, stack, marks, memo = _TABLE, self._stack, self._marks, self._memo
        objects, limit, max_depth = self.objects, self.limits.max_objects, self.limits.max_depth
        try:
            while i < n:
                op = data[i]
                try:
                    arg, weight, effect, count = table[op]  # type: ignore[misc]
                except TypeError:  # None: not an opcode
                    raise self._malformed(f"unknown opcode 0x{op:02x} at byte {i:,}") from None
                if arg >= 0:  # a fixed-size argument (or none)
                    end = i + 1 + arg
                    if end > n:
                        break
                else:
                    end = self._variable(op, arg, data, i, n)
                    if end < 0 or objects > limit:  # (a long run of fixed-size operations
                        break  # is caught below)
                objects += weight
                if effect == _PUSH:
                    stack.append(0)
                elif effect == _PUT:
                    if count == 4:
                        index = data[i + 1] | data[i + 2] << 8 | data[i + 3] << 16 | data[i + 4] << 24
                    else:
                        index = data[i + 1] if count == 1 else self._text_index(data, i, end)
                    if index == len(memo):
                        memo.append(stack[-1])
                    elif index < len(memo):
                        memo[index] = stack[-1]
                    elif index > 255:  # the C unpickler sizes its memo by the largest index
                        raise self._malformed(
                            f"memo index {index:,} at byte {i:,} skips ahead of the "
                            f"{len(memo):,} entries put so far (writers number them in order)"
                        )
                    else:
                        memo.extend([0] * (index - len(memo)))
                        memo.append(stack[-1])
                elif effect == _GET:
                    if count == 1:
                        index = data[i + 1]
                    elif count == 4:
                        index = data[i + 1] | data[i + 2] << 8 | data[i + 3] << 16 | data[i + 4] << 24
                    else:
                        index = self._text_index(data, i, end)
                    stack.append(memo[index] if index < len(memo) else 0)
                elif effect == _TUPLE_OF or effect == _TUPLE_MARK:
                    if effect == _TUPLE_MARK:
                        start = marks.pop()
                        depth = 1 + max(stack[start:], default=0)
                        del stack[start:]
                        stack.append(depth)
                    elif count == 0:
                        depth = 1
                        stack.append(1)
                    else:
                        depth = 1 + max(stack[-count:])
                        if count > 1:
                            del stack[1 - count :]
                        stack[-1] = depth
                    if depth > max_depth:
                        raise limit_error(
                            self.where,
                            f"tuples nest more than {max_depth} levels deep at byte {i:,}",
                            "max_depth",
                            max_depth,
                        )
                elif effect == _CALL:
                    if count > 1:
                        del stack[1 - count :]
                    stack[-1] = 0
                elif effect == _MARK:
                    marks.append(len(stack))
                elif effect == _POP:
                    del stack[len(stack) - count :]
                elif effect == _FROM_MARK or effect == _TO_MARK:
                    start = marks.pop()
                    objects += count * (len(stack) - start)
                    del stack[start:]
                    if effect == _FROM_MARK:
                        stack.append(0)
                elif effect == _DUP:
                    stack.append(stack[-1])
                elif effect == _MEMO:
                    memo.append(stack[-1])
                elif op == _FRAME:
                    self._frame_end = max(self._frame_end, end + _uint(data, i + 1, 8))
                elif op == _STOP:
                    self.done = True
                    i = end
                    break
                i = end
        except IndexError:  # an empty stack, or no mark: the unpickler would refuse it too
            raise self._malformed(f"stack underflow at byte {i:,}") from None
        self._pos, self.objects = i, objects
        if objects > limit:
            raise limit_error(
                self.where, f"the pickle builds more than {limit:,} objects", "max_objects", limit
            )
        if final and not (self.done and self._frame_end <= len(data)):
            raise self._malformed(
                f"the pickle ends before its STOP operation or past its {len(data):,} bytes: "
                "truncated or damaged"
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
        return end + 1

    def _text_index(self, data: bytes | bytearray, i: int, end: int) -> int:
        """The memo index of a protocol-0 GET or PUT (its line, without the newline)."""
        text = bytes(data[i + 1 : end - 1])
        if not text.isdigit() or len(text) > 18:
            raise self._malformed(f"a malformed memo index {text[:20]!r} at byte {i:,}")
        return int(text)

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
        self._hooked: list[dict[Any, Any]] = []

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

    def sized(self, value: Any, what: str, weight: int = 1) -> None:
        """Charge ``weight`` objects per item of a list, tuple or dict argument that a call
        copies; refuse any other argument."""
        if not isinstance(value, (list, tuple, dict)):
            raise CheckpointFormatError(
                f"{self.where}: {what} is called with a {type(value).__name__}"
            )
        self.charge(weight * len(value))

    def mapping(self, cls: type[_D], *args: Any) -> _D:
        """``cls(*args)`` (``OrderedDict`` or ``Counter``), charged, whose ``BUILD``
        (attributes) is charged too.

        The C unpickler applies a ``BUILD`` state by copying it into the instance's
        ``__dict__`` unless the instance has ``__setstate__``: one is set on the instance for
        the time of the load (:meth:`release` removes it).
        """
        if args:
            if len(args) > 1:
                raise CheckpointFormatError(
                    f"{self.where}: {cls.__name__}() called with {len(args)} arguments"
                )
            self.sized(args[0], f"{cls.__name__}()", 3)  # ~90 bytes an item
        self.charge(6)  # the dict, its __dict__ and the hook
        out = cls(*args)
        out.__setstate__ = _SetState(self, out)  # type: ignore[attr-defined]
        self._hooked.append(out)
        return out

    def set_of(self, *args: Any) -> set[Any]:
        """``set(items)``, charged (a set grows its table for each item)."""
        if args:
            if len(args) > 1:
                raise CheckpointFormatError(f"{self.where}: set() called with {len(args)} arguments")
            self.sized(args[0], "set()", 3)
        self.charge(6)
        return set(*args)

    def release(self) -> None:
        """Remove the ``__setstate__`` hooks of the ``OrderedDict`` and ``Counter`` objects built."""
        for obj in self._hooked:
            if type(vars(obj).get("__setstate__")) is _SetState:
                del vars(obj)["__setstate__"]
        self._hooked.clear()


class _SetState:
    """An ``OrderedDict``'s (a ``Counter``'s) ``__setstate__`` during a load: charges the
    attributes it sets."""

    __slots__ = ("_budget", "_target")

    def __init__(self, budget: Budget, target: dict[Any, Any]) -> None:
        self._budget = budget
        self._target = target

    def __call__(self, state: Any) -> None:
        if state is None:
            return
        if type(state) is not dict:
            raise CheckpointFormatError(
                f"{self._budget.where}: a BUILD gives the {type(self._target).__name__} a "
                f"{type(state).__name__} state, not a dict of attributes"
            )
        self._budget.charge(2 * len(state))
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
    buried: set[tuple[str, ...]] = field(default_factory=set)
    """Paths of the entries that are not leaves but hold one: a set, or a dict with a key other
    than a non-empty ``str`` or an ``int``, with a leaf inside (it cannot be keyed)."""


#: The containers the walk looks into (subclasses too: ``OrderedDict``, ``Counter``).
_CONTAINERS = (dict, list, tuple, set, frozenset)


def _keyable(obj: dict[Any, Any]) -> bool:
    """True if every key of ``obj`` can be a part of a dotted key: a non-empty ``str``, or an
    ``int`` (not a ``bool``)."""
    return all((type(k) is str and k != "") or type(k) is int for k in obj)


def _items(obj: Any) -> Iterator[tuple[Any, Any]]:
    """A container's children with their path parts: a dict's values (and, if they cannot be
    keyed, its keys too), a sequence's or set's items."""
    if not isinstance(obj, dict):
        return enumerate(obj)
    # dict.items, not obj.items: a BUILD may have set an attribute "items" on an OrderedDict
    if _keyable(obj):
        return iter(dict.items(obj))
    return itertools.chain(dict.items(obj), ((f"<key {short(k)}>", k) for k in obj))


def _show(parts: list[Any] | tuple[Any, ...]) -> str:
    """A path for a message: dotted, and shortened when it is deep."""
    if len(parts) > 12:
        return (
            ".".join(str(p)[:40] for p in parts[:5]) + " ... "
            + ".".join(str(p)[:40] for p in parts[-5:]) + f" ({len(parts)} levels)"
        )
    return ".".join(str(p)[:80] for p in parts) or "the top level"


def _analyse(
    root: dict[Any, Any], leaf: type | tuple[type, ...], limits: PickleLimits, where: str
) -> tuple[dict[int, bool], int]:
    """``holds[id]`` (a container reaches a leaf) and the number of entries ``root`` flattens to.

    Each container is analysed once (memoised by identity), so the time is linear in the
    number of distinct containers and of their items, however the containers are shared.
    """
    cap = limits.max_objects + 1
    holds: dict[int, bool] = {}
    size: dict[int, int] = {}  # entries a container becomes where it is flattened
    height: dict[int, int] = {}  # levels of containers from this one down (itself included)
    on_path = {id(root)}
    parts: list[Any] = []
    # each frame: (container, its items, [reaches a leaf, entries, height of its deepest child])
    stack: list[tuple[Any, Iterator[tuple[Any, Any]], list[Any]]] = [(root, _items(root), [False, 0, 0])]
    while stack:
        obj, items, acc = stack[-1]
        for part, child in items:
            if isinstance(child, leaf):
                acc[0], acc[1] = True, acc[1] + 1
                continue
            if not isinstance(child, _CONTAINERS):
                acc[1] += 1
                continue
            key = id(child)
            if key in holds:  # analysed already, maybe at a shallower place: its height counts here
                if len(stack) + height[key] > limits.max_depth:
                    raise limit_error(
                        where,
                        f"{_show(parts + [part])} is nested more than {limits.max_depth} levels deep",
                        "max_depth",
                        limits.max_depth,
                    )
                acc[0] = acc[0] or holds[key]
                acc[1] = min(cap, acc[1] + size[key])
                acc[2] = max(acc[2], height[key])
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
            stack.append((child, _items(child), [False, 0, 0]))
            break
        else:
            stack.pop()
            key = id(obj)
            on_path.discard(key)
            found, count, below = acc
            holds[key] = found
            height[key] = below + 1
            if isinstance(obj, dict) and _keyable(obj):
                size[key] = max(1, count)
            elif isinstance(obj, (list, tuple)) and found:
                size[key] = count
            else:
                size[key] = 1  # one entry: a value
            if stack:
                parts.pop()
                parent = stack[-1][2]
                parent[0] = parent[0] or found
                parent[1] = min(cap, parent[1] + size[key])
                parent[2] = max(parent[2], height[key])
    return holds, (size[id(root)] if root else 0)


def _depth_of(stack: list[tuple[Any, Any, Any]], obj: Any) -> int:
    return next(i for i, frame in enumerate(stack) if frame[0] is obj)


#: How many more entries than objects built sharing may give (see flatten_pickled).
_SHARED_EXTRA = 100_000
#: What an entry costs besides its key's text and path items: str and tuple headers, slots.
_ENTRY_BYTES = 150


def flatten_pickled(
    root: dict[Any, Any],
    leaf: type | tuple[type, ...],
    limits: PickleLimits,
    where: str,
    built: int | None = None,
) -> Flattened:
    """Flatten an unpickled dict into dotted entries, in time linear in its distinct containers.

    Dicts are flattened by key (``int`` keys become ``str`` parts) when every key is a
    non-empty ``str`` or an ``int``; lists and tuples that hold an instance of ``leaf``
    somewhere, by index; anything else (an empty dict, a dict with other keys, a set) is one
    entry, listed in :attr:`Flattened.buried` too if it holds a leaf. A container shared by
    several places is flattened at each of them (the entries share the leaves: tied weights
    stay tied), but sharing may add at most 100,000 entries to the
    number of objects the pickle built (``built``: sharing is how a few bytes of pickle ask for
    billions of entries); the entries are at most ``limits.max_objects``, and their keys (text,
    paths and bookkeeping, about 150 bytes an entry) at most ``limits.max_bytes``.

    Args:
        root: the unpickled object.
        leaf: the type (or types) of the leaves (the tensor references).
        limits: the limits.
        where: the pickle's name, for messages.
        built: the objects the pickle built (:attr:`PickleScanner.objects`), if known.

    Raises:
        CheckpointFormatError: a cycle, nesting deeper than ``limits.max_depth``, too many
            entries or too long keys, or a key of ``root`` that is neither a non-empty ``str``
            nor an ``int``; each names the path.

    Example:
        >>> shared = [1, 2]
        >>> flat = flatten_pickled({"a": {"x": shared}, "b": [3, 4.5]}, float, PickleLimits(), "demo")
        >>> [(".".join(p), v) for p, v, _ in flat.entries], flat.containers
        ([('a.x', [1, 2]), ('b.0', 3), ('b.1', 4.5)], {('b',): 'list'})
    """
    holds, total = _analyse(root, leaf, limits, where)
    if built is not None and total > built + _SHARED_EXTRA and total <= limits.max_objects:
        raise CheckpointFormatError(
            f"{where}: the object flattens to {total:,} entries, though the pickle builds "
            f"{built:,} objects: a part shared by several places is repeated at each, more "
            "than any checkpoint needs; the file is damaged or hostile"
        )
    if total > limits.max_objects:
        raise limit_error(
            where,
            f"the object flattens to more than {limits.max_objects:,} entries (a part shared by "
            "several places is repeated at each)",
            "max_objects",
            limits.max_objects,
        )
    out = Flattened([], {})
    nbytes = 0  # the keys' text and paths
    stack: list[tuple[Iterator[tuple[str, Any]], tuple[str, ...], int]] = [
        (_dict_items(root, (), out, where), (), 0)
    ]
    while stack:
        items, path, chars = stack[-1]
        for part, value in items:
            sub = path + (part,)
            width = chars + len(part) + 1
            nbytes += width + 8 * len(sub) + _ENTRY_BYTES
            if nbytes > limits.max_bytes:
                raise limit_error(
                    where,
                    f"the keys of the entries it flattens to take more than {limits.max_bytes:,} "
                    f"bytes (at {_show(sub)})",
                    "max_bytes",
                    limits.max_bytes,
                )
            if isinstance(value, leaf):
                out.entries.append((sub, value, True))
            elif isinstance(value, dict) and value and _keyable(value):
                stack.append((_dict_items(value, sub, out, where), sub, width))
                break
            elif isinstance(value, (list, tuple)) and holds.get(id(value)):
                out.containers[sub] = "tuple" if isinstance(value, tuple) else "list"
                stack.append((((str(i), v) for i, v in enumerate(value)), sub, width))
                break
            else:
                if holds.get(id(value)):
                    out.buried.add(sub)
                out.entries.append((sub, value, False))
        else:
            stack.pop()
    return out


def _dict_items(
    obj: dict[Any, Any], path: tuple[str, ...], out: Flattened, where: str
) -> Iterator[tuple[str, Any]]:
    for key, value in dict.items(obj):  # (not obj.items: see _items)
        if type(key) is int:
            out.containers[path] = "int keys"
            key = str(key)
        elif not isinstance(key, str) or not key:
            raise CheckpointFormatError(
                f"{where}: the dict at {_show(path)} has the key {short(key)}; memtree needs "
                "non-empty str (or int) keys"
            )
        yield key, value
