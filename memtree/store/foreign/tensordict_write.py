"""Writing tensordict's ``memmap`` layout, so that ``tensordict.TensorDict.load_memmap`` reads it.

The layout is the one :mod:`memtree.store.foreign.tensordict` reads (tensordict 0.15, ``_format_version``
1), written the way tensordict's own ``memmap`` writes it:

* each level is a directory with a ``meta.json``: one entry per key in the level's order (a
  tensor: ``{"device": "cpu", "shape": [...], "dtype": "torch.float32", "is_nested": false}``; a
  sub-level or value: ``{"type": "TensorDict"}`` / ``{"type": "NonTensorData"}`` / ``{"type":
  "<class>"}``), then ``"shape"`` (the batch size), ``"device"``, ``"_type"``,
  ``"_format_version"`` and ``"_class"``;
* a tensor is ``<key>.memmap`` (raw bytes; the key percent-encoded as tensordict encodes it:
  ``a/b`` -> ``a%2Fb``); a zero-element tensor has no file, as with tensordict;
* a non-tensor value is a sub-directory whose ``meta.json`` is a ``NonTensorData`` holding the
  value as JSON in ``"data"`` (never a pickle);
* a level read from a tensordict ``@tensorclass`` (its ``Level.foreign_type``) is written back as
  that class: ``{"_type": "<class 'pkg.Step'>"}`` and its content in ``_tensordict/``, which
  tensordict imports by that name when loading. A memtree ``@tensorclass`` level is written as a
  plain TensorDict (tensordict cannot import a memtree class), and reported.

The directory is published atomically through
:func:`~memtree.store.writing.staged.staged_directory` (the commit of ``write_tree``); an existing
destination is replaced only with ``existsok`` and only if it is itself a tensordict directory.
Values the layout cannot hold (a pickled value, a value JSON would change) are left out and
reported, never written differently.

Example:
    >>> import os, tempfile, torch
    >>> from memtree.format.level import Level
    >>> from memtree.store.foreign.tensordict import read_tensordict_dir
    >>> d = os.path.join(tempfile.mkdtemp(), "td")
    >>> _ = write_tensordict_dir(d, Level((2,), {"x": torch.arange(2)}))
    >>> read_tensordict_dir(d).entries["x"].tolist()
    [0, 1]
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import orjson
import torch

from ...errors import DtypeError, InvalidArgumentError, InvalidKeyError, SubclassError, check_keywords
from ...format.dtypes import itemsize
from ...format.level import Level, as_level
from ...format.names import META_NAME
from ...format.schema import TREE_TYPE
from ...format.values import NonTensor, json_problem, tuples_to_lists
from ..primitives.commit import write_small_file
from ..primitives.files import create_leaf
from ..writing.staged import staged_directory
from .tensordict import _NAME_MAX, _encode, is_tensordict_dir
from ..writing.write import LeafJob, _storable

__all__ = ["TensordictWrite", "save_tensordict", "write_tensordict_dir"]

#: The fields tensordict's ``meta.json`` holds besides the entries: keys named so cannot be written.
_RESERVED = ("shape", "device", "_type", "_format_version", "_class", "_names")
_TENSORDICT_TYPE = "<class 'tensordict._td.TensorDict'>"
_NONTENSOR_TYPE = "<class 'tensordict.tensorclass.NonTensorData'>"
_FORMAT_FIELDS = {"_format_version": 1, "_class": "tensordict:TensorDict"}
#: The dtypes tensordict's loader reads (its ``_STR_DTYPE_TO_DTYPE``; no float8).
TENSORDICT_DTYPES = frozenset(
    f"torch.{name}"
    for name in (
        "bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
        "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    )
)


@dataclass
class TensordictWrite:
    """What :func:`write_tensordict_dir` wrote and what it could not write as it was."""

    tensors: int = 0
    """Tensor leaves written."""
    nbytes: int = 0
    """Bytes of tensor data written."""
    dropped: list[str] = field(default_factory=list)
    """Dotted keys of values the layout cannot hold (not written)."""
    altered: dict[str, str] = field(default_factory=dict)
    """Dotted keys of levels written in another form, with what changed."""


def write_tensordict_dir(
    prefix: str | os.PathLike[str],
    level: Level,
    *,
    existsok: bool = False,
    fsync: bool = False,
) -> TensordictWrite:
    """Write ``level`` as a directory that ``tensordict.TensorDict.load_memmap`` reads.

    Args:
        prefix: the directory to create (published atomically).
        level: the tree (tensors, sub-levels, :class:`~memtree.format.values.NonTensor` values).
        existsok: replace an existing tensordict directory (never any other directory).
        fsync: make the files and directories durable before the directory appears.

    Returns:
        A :class:`TensordictWrite`: counts, and what was left out or written differently.

    Raises:
        InvalidKeyError: a key tensordict's layout cannot hold (a field name of its
            ``meta.json`` such as ``"shape"``, or a file name longer than 255 bytes).
        DestinationExistsError: ``prefix`` exists and may not be replaced.
        DtypeError: a dtype tensordict cannot read (float8), or a tensor that cannot be
            stored (sparse, meta...).
        SubclassError: a tensor subclass (tensordict's layout would lose its type).
    """
    report = TensordictWrite()
    writer = _Writer(report, fsync)
    writer.check(level, ())
    with staged_directory(
        prefix, existsok=existsok, fsync=fsync, nbytes=writer.nbytes, replaceable=is_tensordict_dir
    ) as staging:
        writer.level(staging, level, ())
    return report


@check_keywords
def save_tensordict(
    tree: Any, prefix: str | os.PathLike[str], *, existsok: bool = False, fsync: bool = False
) -> TensordictWrite:
    """Save a :class:`~memtree.TensorTree` as a directory that tensordict's ``load_memmap`` reads.

    The counterpart of :func:`~memtree.interop.save_safetensors` for tensordict; ``memtree
    convert SRC DST --format tensordict`` does the same from any source, one tensor at a time.

    Args:
        tree: a TensorTree (or a :class:`~memtree.format.level.Level`).
        prefix: the directory to create (published atomically).
        existsok: replace an existing tensordict directory.
        fsync: make it durable before it appears.

    Returns:
        A :class:`TensordictWrite` (counts; values left out; levels written differently).

    Example:
        >>> import os, tempfile, torch, memtree
        >>> d = os.path.join(tempfile.mkdtemp(), "td")
        >>> save_tensordict(memtree.TensorTree({"x": torch.ones(2)}, batch_size=[2]), d).tensors
        1
    """
    level = as_level(tree)
    if level is None:
        raise InvalidArgumentError(
            f"save_tensordict saves a memtree.TensorTree, got {type(tree).__name__}; wrap a dict "
            "with memtree.TensorTree(d, batch_size=...)"
        )
    return write_tensordict_dir(prefix, level, existsok=existsok, fsync=fsync)


class _Writer:
    def __init__(self, report: TensordictWrite, fsync: bool) -> None:
        self.report = report
        self.fsync = fsync
        self.nbytes = 0

    def check(self, level: Level, path: tuple[str, ...]) -> None:
        """Refuse keys the layout cannot hold before anything is written; count the bytes."""
        for key, value in level.entries.items():
            where = ".".join(path + (key,))
            if key in _RESERVED:
                raise InvalidKeyError(
                    f"key {where!r}: tensordict's meta.json uses {key!r} for its own field, so a "
                    "tensordict directory cannot hold this key; rename it (tree.rename_key) first"
                )
            suffix = ".memmap" if isinstance(value, torch.Tensor) else ""
            if len((_encode(key) + suffix).encode("utf-8", "surrogatepass")) > _NAME_MAX:
                raise InvalidKeyError(
                    f"key {where!r:.100} makes a file name longer than {_NAME_MAX} bytes in "
                    "tensordict's layout (which does not shorten names); rename it first"
                )
            if isinstance(value, Level) and value.subclass is not None:
                raise SubclassError(
                    f"key {where!r} is a tensor subclass ({value.subclass.type}): tensordict's layout "
                    "holds plain tensors only, and would lose its type (tensordict itself stores a "
                    "quantized tensor dequantized or as a plain tensor); keep a memtree directory, or "
                    "convert to safetensors (torchao's convention)"
                )
            if isinstance(value, Level):
                self.check(value, path + (key,))
            elif isinstance(value, torch.Tensor):
                if str(value.dtype) not in TENSORDICT_DTYPES:
                    raise DtypeError(
                        f"key {where!r}: tensordict's load_memmap cannot read {value.dtype} (it "
                        f"reads {', '.join(sorted(d[6:] for d in TENSORDICT_DTYPES))}); cast it "
                        "first (convert --dtype bfloat16 casts floating-point tensors)"
                    )
                self.nbytes += value.numel() * itemsize(value.dtype)

    def level(self, directory: str, level: Level, path: tuple[str, ...]) -> None:
        if level.foreign_type is not None:  # a tensordict @tensorclass: its content one level down
            self.meta(directory, {"_type": level.foreign_type})
            directory = os.path.join(directory, "_tensordict")
            os.mkdir(directory)
        elif level.type != TREE_TYPE:
            self.report.altered[".".join(path) or "(top level)"] = (
                f"@tensorclass {level.type} -> TensorDict (tensordict cannot import memtree classes)"
            )
        meta: dict[str, Any] = {}
        for key, value in level.entries.items():
            sub = path + (key,)
            if isinstance(value, Level):
                os.mkdir(os.path.join(directory, _encode(key)))
                self.level(os.path.join(directory, _encode(key)), value, sub)
                meta[key] = {"type": "TensorDict" if value.foreign_type is None else _short(value.foreign_type)}
            elif isinstance(value, torch.Tensor):
                meta[key] = self.tensor(directory, key, value, sub)
            elif isinstance(value, NonTensor) and _json_exact(value.data):
                child = os.path.join(directory, _encode(key))
                os.mkdir(child)
                self.meta(child, {"_type": _NONTENSOR_TYPE, "data": value.data, "_metadata": None,
                                  "_is_non_tensor": True})
                meta[key] = {"type": "NonTensorData"}
            else:
                self.report.dropped.append(".".join(sub))
        meta.update(shape=list(level.batch_size), device="cpu", _type=_TENSORDICT_TYPE, **_FORMAT_FIELDS)
        self.meta(directory, meta)

    def tensor(self, directory: str, key: str, value: torch.Tensor, path: tuple[str, ...]) -> dict[str, Any]:
        nbytes = value.numel() * itemsize(value.dtype)
        if nbytes:
            job = LeafJob(_encode(key) + ".memmap", path, value, nbytes)
            create_leaf(os.path.join(directory, job.rel), _storable(job), nbytes, fsync=self.fsync)
        self.report.tensors += 1
        self.report.nbytes += nbytes
        return {"device": "cpu", "shape": list(value.shape), "dtype": str(value.dtype), "is_nested": False}

    def meta(self, directory: str, doc: dict[str, Any]) -> None:
        write_small_file(os.path.join(directory, META_NAME), orjson.dumps(doc), fsync=self.fsync)


def _json_exact(value: Any) -> bool:
    """True if tensordict gives ``value`` back as it is from the JSON of a ``NonTensorData``:
    JSON holds it exactly, and it holds no tuple (which would come back a list)."""
    return json_problem(value) is None and not tuples_to_lists(value)[1]


def _short(type_string: str) -> str:
    """``"<class 'pkg.mod.Step'>"`` -> ``"Step"`` (the entry's ``"type"`` in its parent)."""
    return type_string.removeprefix("<class '").removesuffix("'>").rpartition(".")[2]
