"""How a tree shows itself: ``repr`` (one line per entry, truncated) and HTML for notebooks.

A mixin of :class:`~memtree.TensorTree`.

Example:
    >>> import torch, memtree
    >>> print(memtree.TensorTree({"x": torch.zeros(2)}))
    TensorTree(batch_size=[])
      x: float32[2] cpu
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from math import prod
from typing import Any


import torch

from ...format.values import NonTensor
from ...store.reading.mapped import MemoryMappedTensor
from .core import TreeCore

__all__ = ["TreeRepr"]

class TreeRepr(TreeCore):
    """``__repr__`` and ``_repr_html_`` (mixed into :class:`~memtree.TensorTree`)."""

    #: ``repr`` shows at most this many lines of entries, then one summary line.
    _repr_max_lines: int = 60
    #: ``_repr_html_`` (notebooks) shows at most this many entries, then one summary line.
    _repr_html_max_rows: int = 1000

    def _repr_walk(self, depth: int = 0) -> Iterator[tuple[int, str, Any]]:
        """Every entry depth-first as ``(depth, key, value)``, each sub-tree before its content."""
        for k, v in self._data.items():
            yield depth, k, v
            if isinstance(v, TreeRepr):
                yield from v._repr_walk(depth + 1)

    @staticmethod
    def _repr_key(key: str) -> str:
        return key if key.isprintable() else repr(key)

    @staticmethod
    def _repr_size(nbytes: int) -> str:
        for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if nbytes >= scale:
                return f"{nbytes / scale:,.1f} {unit}"
        return f"{nbytes} B"

    @staticmethod
    def _repr_nbytes(tensors: list[torch.Tensor]) -> int:
        with torch._C.DisableTorchFunctionSubclass():  # no MemoryMappedTensor dispatch: fast
            return sum(prod(t.shape) * t.element_size() for t in tensors)

    @staticmethod
    def _repr_leaf(v: Any) -> tuple[str, str]:
        """``(what, where)`` of a leaf: ``("float32[4, 3]", "memmap")`` or ``("'hello'", "")``."""
        if isinstance(v, torch.Tensor):
            what = f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}"
            if isinstance(v, MemoryMappedTensor):
                where = "shared memory" if v.filename is None else "memmap"
                return what, f"{v.device} {where}" + (", read-only" if v.readonly else "")
            if type(v) not in (torch.Tensor, torch.nn.Parameter):  # e.g. OffloadedTensor: name it
                return what, f"{type(v).__name__}, {v.device}"
            return what, str(v.device)
        import reprlib

        short = reprlib.Repr()
        short.maxstring = short.maxother = 56
        short.maxlist = short.maxtuple = short.maxdict = short.maxset = 6
        return short.repr(v.data if isinstance(v, NonTensor) else v), ""

    @staticmethod
    def _repr_file(v: Any) -> str | None:
        """The file behind a file-backed tensor leaf (memory-mapped or offloaded), else None."""
        filename = getattr(v, "filename", None) if isinstance(v, torch.Tensor) else None
        return filename if isinstance(filename, str) else None

    @staticmethod
    def _repr_hidden(rest: Iterator[tuple[int, str, Any]]) -> str:
        """Summary of the entries a truncated repr does not show."""
        trees = others = 0
        leaves: list[torch.Tensor] = []
        for _, _, v in rest:
            if isinstance(v, TreeRepr):
                trees += 1
            elif isinstance(v, torch.Tensor):
                leaves.append(v)
            else:
                others += 1
        tensors, nbytes = len(leaves), TreeRepr._repr_nbytes(leaves)
        parts = [f"{n:,} {word}{'' if n == 1 else 's'}"
                 for n, word in ((tensors, "tensor"), (trees, "sub-tree"), (others, "non-tensor value")) if n]
        return (f"… and {', '.join(parts)} ({TreeRepr._repr_size(nbytes)} of tensors) not shown; "
                "tree.keys(include_nested=True) lists every key")

    def __repr__(self) -> str:
        """Keys, dtypes, shapes and where each leaf lives, one line each, truncated when large.

        Example:
            >>> import torch, memtree
            >>> print(memtree.TensorTree({"obs": torch.zeros(4, 3), "info": {"step": torch.arange(4)}},
            ...                  batch_size=[4]))
            TensorTree(batch_size=[4])
              obs: float32[4, 3] cpu
              info: TensorTree(batch_size=[4])
                step: int64[4] cpu
        """
        lines = [f"{type(self).__name__}(batch_size={list(self._batch_size)}"
                 + (f", device={self._device}" if self._device is not None else "")
                 + (", locked" if self._locked else "") + ")"]
        entries = self._repr_walk()
        for depth, k, v in entries:
            key = self._repr_key(k)
            indent = "  " * (depth + 1)
            if isinstance(v, TreeRepr):
                lines.append(f"{indent}{key}: {type(v).__name__}(batch_size={list(v._batch_size)})")
            else:
                what, where = self._repr_leaf(v)
                lines.append(f"{indent}{key}: {what} {where}".rstrip())
            if len(lines) > self._repr_max_lines:
                rest = list(entries)
                if rest:
                    lines.append("  " + self._repr_hidden(iter(rest)))
                break
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """HTML for notebooks: a collapsible tree of keys with dtypes, shapes and leaf files.

        Keys and values are HTML-escaped. Memory-mapped leaves show their file's path relative to
        the directory that holds them all (the full path is in the tooltip). Sub-trees start
        expanded when the whole tree has at most 50 entries.

        Example:
            >>> import torch, memtree
            >>> html = memtree.TensorTree({"a<b>": torch.zeros(2)})._repr_html_()
            >>> "a&lt;b&gt;" in html and "<details" in html
            True
        """
        import html

        esc = html.escape
        entries = list(self._repr_walk())
        tensors = [v for _, _, v in entries if isinstance(v, torch.Tensor)]
        n_tensors = len(tensors)
        size = self._repr_size(self._repr_nbytes(tensors))
        files = [f for _, _, v in entries[: self._repr_html_max_rows] if (f := self._repr_file(v))]
        base = os.path.commonpath(files) if len(files) > 1 else os.path.dirname(files[0]) if files else ""
        opened = " open" if len(entries) <= 50 else ""
        head = (f"<b>{esc(type(self).__name__)}</b> batch_size={list(self._batch_size)}"
                + (f", device={esc(str(self._device))}" if self._device is not None else "")
                + (", locked" if self._locked else "")
                + f" · {n_tensors:,} tensor{'' if n_tensors == 1 else 's'}, {size}"
                + (f" · files in <code>{esc(base)}</code>" if base else ""))
        out = ['<div class="memtree-repr" style="font-family:monospace;line-height:1.5">',
               f"<details open><summary>{head}</summary>",
               '<ul style="list-style:none;margin:0;padding-left:1.5em">']
        depth_now = 0
        for i, (depth, k, v) in enumerate(entries):
            while depth_now > depth:  # close the sub-trees that ended
                out.append("</ul></details></li>")
                depth_now -= 1
            if i == self._repr_html_max_rows:
                out.append(f"<li><i>{esc(self._repr_hidden(iter(entries[i:])))}</i></li>")
                break
            key = f"<code>{esc(self._repr_key(k))}</code>"
            if isinstance(v, TreeRepr):
                out.append(f"<li><details{opened}><summary>{key}: {esc(type(v).__name__)} "
                           f"batch_size={list(v._batch_size)} ({len(v._data):,} key{'' if len(v._data) == 1 else 's'})</summary>"
                           '<ul style="list-style:none;margin:0;padding-left:1.5em">')
                depth_now += 1
                continue
            what, where = self._repr_leaf(v)
            where = esc(where)
            filename = self._repr_file(v)
            if filename is not None:
                rel = os.path.relpath(filename, base) if base else filename
                where += f' <span title="{esc(filename)}" style="opacity:0.7">{esc(rel)}</span>'
            out.append(f"<li>{key}: {esc(what)}{' ' + where if where else ''}</li>")
        out.append("</ul></details></li>" * depth_now + "</ul></details></div>")
        return "\n".join(out)
