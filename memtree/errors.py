"""The memtree error hierarchy.

Every error memtree raises derives from :class:`MemtreeError` and, where one fits, from the
builtin exception users already catch (``KeyError``, ``ValueError``, ``FileNotFoundError``, ...).
Messages say what is wrong, where (key and path), and what to do about it.

Example:
    >>> import memtree
    >>> try:
    ...     memtree.load_memmap("/nonexistent/tree")
    ... except FileNotFoundError as err:   # also a memtree.MemtreeError
    ...     print(type(err).__name__)
    NotAMemtreeError
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import ParamSpec, TypeVar

__all__ = [
    "MemtreeError",
    "MemtreeKeyError",
    "KeyTypeError",
    "InvalidKeyError",
    "KeyCollisionError",
    "BatchSizeError",
    "ShapeMismatchError",
    "SourceError",
    "LockedError",
    "ReadOnlyError",
    "DtypeError",
    "NonTensorValueError",
    "PickleNotAllowedError",
    "UnsafePickleError",
    "CheckpointFormatError",
    "LegacyCheckpointError",
    "RoutingError",
    "ExistingMemmapError",
    "NotAMemtreeError",
    "NotCommittedError",
    "DestinationExistsError",
    "MetaFormatError",
    "UnsupportedVersionError",
    "LimitError",
    "MissingLeafError",
    "LeafSizeError",
    "UnsafePathError",
    "StorageError",
    "InsufficientSpaceError",
    "LockError",
    "IntegrityError",
    "DecryptionError",
    "MissingDependencyError",
    "RemoteError",
    "RemoteRangeError",
    "RemoteChangedError",
    "DistributedCheckpointError",
    "PlacementError",
    "TensorclassError",
    "SubclassError",
    "UnknownClassError",
    "NotGrowableError",
    "InvalidArgumentError",
    "UnknownKeywordError",
    "InvalidIndexError",
    "UnsizedTreeError",
    "AmbiguousTruthError",
    "CheckpointSaveError",
    "CheckpointNotFoundError",
    "StepOrderError",
]


class MemtreeError(Exception):
    """Base class of every error raised by memtree."""


class MemtreeKeyError(MemtreeError, KeyError):
    """A key is not in the tree."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class KeyTypeError(MemtreeError, TypeError):
    """A key is not a ``str`` (or a tuple of ``str`` for nested access)."""


class InvalidKeyError(MemtreeError, ValueError):
    """A key is a ``str`` but not a valid one (for example ``""``)."""


class KeyCollisionError(MemtreeError, ValueError):
    """Two keys would become the same key (for example when flattening nested keys)."""


class BatchSizeError(MemtreeError, ValueError):
    """A tensor or sub-tree does not match the tree's ``batch_size``."""


class ShapeMismatchError(MemtreeError, ValueError):
    """A tensor's shape or dtype does not match the one it should replace or fill."""


class SourceError(MemtreeError, ValueError):
    """A source given to ``load_into_module``/``offload`` cannot be used as one (kind, reader)."""


class LockedError(MemtreeError, RuntimeError):
    """A key was added, removed or replaced in a locked tree."""


class ReadOnlyError(MemtreeError, RuntimeError):
    """A write to a tensor mapped read-only (``mode="r"``)."""


class DtypeError(MemtreeError, TypeError):
    """A tensor's dtype (or layout) cannot be stored in the memtree format."""


class NonTensorValueError(MemtreeError, TypeError):
    """A non-tensor value cannot be stored as JSON without changing it."""


class PickleNotAllowedError(MemtreeError, ValueError):
    """Pickle would be needed, but the caller did not pass ``allow_pickle=True``."""


class UnsafePickleError(PickleNotAllowedError):
    """A pickle names a global outside memtree's allowlist (it could run code); nothing was run."""


class CheckpointFormatError(MemtreeError, ValueError):
    """A checkpoint file (``torch.save`` zip, ``.safetensors``) is malformed, truncated or unsupported."""


class LegacyCheckpointError(CheckpointFormatError):
    """A ``torch.save`` file in the legacy (pre-zip, torch < 1.6) format, which needs full unpickling."""


class RoutingError(MemtreeError, RuntimeError):
    """``torch.save``/``torch.load`` routing (``memtree.saving``/``loading``) cannot be used here."""


class ExistingMemmapError(MemtreeError, ValueError):
    """A leaf already lives in a file under another prefix (pass ``copy_existing=True``)."""


class NotAMemtreeError(MemtreeError, FileNotFoundError):
    """The path is not a memtree directory (no ``meta.json`` at its root)."""


class NotCommittedError(MemtreeError, FileNotFoundError):
    """The path is a staging directory of a write that never committed."""


class DestinationExistsError(MemtreeError, FileExistsError):
    """The destination exists and the call does not allow replacing it."""


class MetaFormatError(MemtreeError, ValueError):
    """A ``meta.json`` file is malformed or does not follow the format's schema."""


class UnsupportedVersionError(MetaFormatError):
    """A ``meta.json`` names a format or version this memtree cannot read."""


class LimitError(MetaFormatError):
    """A ``meta.json`` exceeds a safety limit (file size, nesting depth, entry count)."""


class MissingLeafError(MemtreeError, FileNotFoundError):
    """A leaf file named by ``meta.json`` does not exist."""


class LeafSizeError(MemtreeError, ValueError):
    """A leaf file's size does not match its dtype and shape."""


class UnsafePathError(MemtreeError, ValueError):
    """A path in the tree is a symlink, not a regular file/directory, or leaves the prefix."""


class StorageError(MemtreeError, OSError):
    """An operating-system error while writing or reading a tree (errno preserved)."""


class InsufficientSpaceError(StorageError):
    """The filesystem cannot hold what ``memmap_like`` (or a write) needs."""


class LockError(MemtreeError, TimeoutError):
    """Another writer holds the lock of the destination (``.<name>.memtree.lock``)."""


class IntegrityError(MemtreeError, ValueError):
    """A leaf file's checksum does not match the one recorded in ``meta.json``."""


class DecryptionError(IntegrityError):
    """An encrypted tree cannot be decrypted: no key, a wrong key, a key for a tree that is not
    encrypted, or data or ``meta.json`` failing authentication (changed, swapped or truncated)."""


class MissingDependencyError(MemtreeError, ImportError):
    """An optional feature needs a package that is not installed (the message names the extra)."""


class RemoteError(MemtreeError, OSError):
    """Reading or writing a remote tree (fsspec URL) failed, after the retries it allows."""


class RemoteRangeError(RemoteError):
    """A remote range read returned a different number of bytes than asked (or HTTP 416)."""


class RemoteChangedError(RemoteError):
    """A remote object changed between the read of its ``meta.json`` and the read of its data."""


class DistributedCheckpointError(MemtreeError, RuntimeError):
    """A ``torch.distributed.checkpoint`` save or load failed; ``failures`` maps rank to error."""

    def __init__(self, message: str, failures: dict[int, BaseException] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[int, BaseException] = dict(failures or {})


class PlacementError(MemtreeError, ValueError):
    """A distributed tensor's placement memtree cannot store or read (a mesh that differs from
    the one recorded, ranks whose trees differ; a ``Partial`` one is a :class:`SubclassError`)."""


class TensorclassError(MemtreeError, TypeError):
    """A ``@tensorclass`` is defined, named or constructed wrongly (bad field, name taken...)."""


class SubclassError(MemtreeError, TypeError):
    """A tensor subclass cannot be stored or rebuilt: no flatten protocol, a class not registered
    (``memtree.register_subclass``), a flatten context JSON cannot hold, a ``Partial`` DTensor, or
    a group on disk that does not rebuild into the class, shape and dtype it records."""


class UnknownClassError(MetaFormatError):
    """A ``meta.json`` names a class (``"type"``) that no ``@tensorclass`` registered here."""


class NotGrowableError(MemtreeError, ValueError):
    """A tree cannot grow in place: not mapped from a prefix, or its files changed on disk."""


class InvalidArgumentError(MemtreeError, ValueError):
    """An argument of a memtree function has a value it does not accept (a ``mode``, a length...)."""


class UnknownKeywordError(InvalidArgumentError, TypeError):
    """A keyword argument that the function does not take, usually a typo: the message names the
    closest keyword it takes ("did you mean 'mode'?") and lists them all. A ``TypeError`` too,
    as Python's own error for an unexpected keyword is.

    Example:
        >>> import memtree
        >>> try:
        ...     memtree.load_memmap("tree", mdoe="r")
        ... except TypeError as err:
        ...     print(str(err)[:77])
        load_memmap() got an unexpected keyword argument 'mdoe': did you mean 'mode'?
    """

    @classmethod
    def of(cls, function: str, unknown: Iterable[str], accepted: Iterable[str]) -> UnknownKeywordError:
        """The error for ``function`` called with the keywords ``unknown``, which are not among
        ``accepted`` (in the order the function declares them)."""
        import difflib

        names = list(accepted)
        bad = sorted(unknown)
        close = difflib.get_close_matches(bad[0], names, n=1, cutoff=0.6)
        hint = f": did you mean {close[0]!r}?" if close else ""
        what = f"keyword argument {bad[0]!r}" if len(bad) == 1 else f"keyword arguments {bad}"
        return cls(f"{function}() got an unexpected {what}{hint} It takes: {', '.join(names)}")


_P = ParamSpec("_P")
_R = TypeVar("_R")


def keyword_names(func: Callable[..., object]) -> list[str]:
    """The names ``func`` takes as keywords, in the order it declares them.

    Example:
        >>> def f(a, /, b, *, c=1, **rest): ...
        >>> keyword_names(f)
        ['b', 'c']
    """
    import inspect

    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    params = inspect.signature(func).parameters.values()
    return [p.name for p in params if p.kind in kinds and p.name not in ("self", "cls")]


def check_keywords(func: Callable[_P, _R]) -> Callable[_P, _R]:
    """Answer a misspelt keyword of a public function with :class:`UnknownKeywordError` ("did you
    mean ...?") instead of Python's bare ``TypeError``.

    The signature stays the function's own (``help()``, :func:`inspect.signature` and the
    documentation show it), and a call that binds costs one more frame, nothing else: the names
    are looked up only once Python has refused the call (a ``TypeError`` raised by the call
    itself, not from inside the function).

    Example:
        >>> @check_keywords
        ... def save(path, *, num_threads=0): ...
        >>> save("x", num_thread=2)
        Traceback (most recent call last):
        ...
        memtree.errors.UnknownKeywordError: save() got an unexpected keyword argument 'num_thread': did you mean 'num_threads'? It takes: path, num_threads
    """

    @functools.wraps(func)
    def checked(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return func(*args, **kwargs)
        except TypeError as err:
            if not kwargs or err.__traceback__ is None or err.__traceback__.tb_next is not None:
                raise  # raised inside the function, or not about keywords
            accepted = keyword_names(func)
            unknown = [k for k in kwargs if k not in accepted]
            if not unknown:
                raise
            name = func.__qualname__.removesuffix(".__init__") if func.__name__ == "__init__" else func.__name__
            raise UnknownKeywordError.of(name, unknown, accepted) from None

    return checked


class InvalidIndexError(MemtreeError, IndexError):
    """A dim or an index is out of range for the tree's batch dims."""


class UnsizedTreeError(MemtreeError, TypeError):
    """``len()`` of a tree with ``batch_size ()``: it has no first dim (like a 0-dim tensor)."""


class AmbiguousTruthError(MemtreeError, ValueError):
    """``bool(tree)``: a tree of several values has no single truth value; use ``.all()``/``.any()``."""


class CheckpointSaveError(MemtreeError, RuntimeError):
    """A save of :class:`memtree.Checkpointer` failed: a background save, or the deletion of the
    newer steps that ``discard_newer=True`` asked for (its cause is chained; the message says what
    was and was not committed)."""


class CheckpointNotFoundError(MemtreeError, FileNotFoundError):
    """A :class:`memtree.Checkpointer` root has no (such) committed step."""


class StepOrderError(MemtreeError, ValueError):
    """A :class:`memtree.Checkpointer` save of a step below the newest step of its root (a roll
    back): refused unless ``discard_newer=True`` deletes the newer steps."""


class RetentionWarning(UserWarning):  # a warning, not an error: memtree.RetentionWarning, not in __all__
    """A :class:`memtree.Checkpointer` save committed its step, but retention could not delete an
    old step (it is kept; the next save tries again). A warning, not an error: the save itself
    succeeded. ``warnings.simplefilter("error", memtree.RetentionWarning)`` makes it one."""
