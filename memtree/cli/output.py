"""What every sub-command prints: one JSON document with ``--json``, text otherwise; exit codes.

Every sub-command takes ``--json`` (:func:`add_json_flag`) and, with it, writes exactly one JSON
object to standard output (:func:`emit_json`) and nothing else there: notes go to standard
error, progress bars are off. An error the command expected (a :class:`~memtree.MemtreeError`)
is, with ``--json``, the object ``{"error": {"type": "<class name>", "message": "..."}}`` on
standard output (:func:`error_document`), and exit code 1. The schemas are documented in
``docs/guide/cli.md``.

Paths are bytes on Linux and need not be UTF-8; Python holds such a byte as a lone surrogate
(``os.fsdecode``), which neither a terminal nor JSON can hold. Every text and JSON string is
written through :func:`printable`, which shows such a byte as ``\\xNN`` (its hex value): the
JSON stays valid UTF-8, and the path reads as ``ls -b`` and Python's ``repr`` of bytes show it.

Exit codes (the same for every command):

* :data:`EXIT_OK` (0): done; for ``verify`` the tree is clean, for ``diff`` the trees are equal;
* :data:`EXIT_FAILED` (1): an error (no traceback: one line naming the path and the fix), or
  the check found something (``verify``: a problem; ``diff``: a difference);
* :data:`EXIT_USAGE` (2): the command line itself is wrong (argparse's message);
* :data:`EXIT_INTERRUPTED` (130): Ctrl-C.

Example:
    >>> import argparse
    >>> parser = argparse.ArgumentParser()
    >>> add_json_flag(parser)
    >>> parser.parse_args(["--json"]).json
    True
    >>> emit_json({"ok": True, "path": "/data/ckpt"})
    {
      "ok": true,
      "path": "/data/ckpt"
    }
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any

import orjson

__all__ = [
    "EXIT_OK",
    "EXIT_FAILED",
    "EXIT_USAGE",
    "EXIT_INTERRUPTED",
    "add_json_flag",
    "emit_json",
    "emit_text",
    "error_document",
    "format_bytes",
    "printable",
    "to_json",
]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    """Add the ``--json`` flag (``args.json``) that every sub-command takes.

    Example:
        >>> p = argparse.ArgumentParser(); add_json_flag(p); p.parse_args([]).json
        False
    """
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object on standard output (schema: docs/guide/cli.md); no progress bar",
    )


_SURROGATE = re.compile("[\ud800-\udfff]")


def _escape_surrogate(match: re.Match[str]) -> str:
    code = ord(match.group())
    if 0xDC80 <= code <= 0xDCFF:  # a byte that is not UTF-8, as os.fsdecode holds it
        return f"\\x{code - 0xDC00:02x}"
    return f"\\u{code:04x}"  # any other lone surrogate


def printable(text: str) -> str:
    """``text`` as valid UTF-8: each byte of a path that is not UTF-8 (held by ``os.fsdecode``
    as a lone surrogate) becomes ``\\xNN``, any other lone surrogate ``\\uXXXX``; other text is
    returned as it is.

    Example:
        >>> import os
        >>> printable(os.fsdecode(b"/data/caf\\xe9/ckpt")), printable("/data/café")
        ('/data/caf\\\\xe9/ckpt', '/data/café')
    """
    return _SURROGATE.sub(_escape_surrogate, text)


def _printable_document(value: Any) -> Any:
    """``value`` with every string (keys included) through :func:`printable`."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {_printable_document(k): _printable_document(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_printable_document(v) for v in value]
    return value


def _default(value: Any) -> str:
    return printable(repr(value))


def to_json(value: Any, *, indent: bool = False) -> str:
    """``value`` as JSON text. What JSON cannot hold is written as text: a key that is not a
    string as its ``str``, a value orjson does not know (``bytes``, ``complex``, a
    ``torch.Size``...) as its ``repr``; NaN and infinities as ``null``; a string that is not
    valid UTF-8 (a path with bytes that are not) through :func:`printable`.

    Example:
        >>> import os
        >>> print(to_json({"a": (1, 2), 3: b"x", "c": 1j}))
        {"a":[1,2],"3":"b'x'","c":"1j"}
        >>> print(to_json({"path": os.fsdecode(b"/data/caf\\xe9")}))
        {"path":"/data/caf\\\\xe9"}
    """
    option = orjson.OPT_NON_STR_KEYS | (orjson.OPT_INDENT_2 if indent else 0)
    try:
        return orjson.dumps(value, default=_default, option=option).decode()
    except orjson.JSONEncodeError:  # a str that is not UTF-8 (the rest fails the same way again)
        return orjson.dumps(_printable_document(value), default=_default, option=option).decode()


def format_bytes(n: int) -> str:
    """Human-readable size in binary units.

    Example:
        >>> format_bytes(48), format_bytes(4 * 2**20), format_bytes(1536)
        ('48 B', '4.0 MiB', '1.5 KiB')
    """
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            break
    return f"{value:,.1f} {unit}"


def emit_json(document: dict[str, Any]) -> None:
    """Print ``document`` as one indented JSON object (see :func:`to_json`).

    Example:
        >>> emit_json({"n": 1})
        {
          "n": 1
        }
    """
    _write(to_json(document, indent=True))


def emit_text(text: str) -> None:
    """Print ``text`` (a line break is added), degraded to what the terminal's encoding can show
    (bytes of a path that are not UTF-8 as ``\\xNN``: :func:`printable`).

    Example:
        >>> emit_text("OK ckpt: 3 leaves")
        OK ckpt: 3 leaves
    """
    text = printable(text)
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    try:
        text.encode(encoding)
    except (UnicodeEncodeError, LookupError):  # e.g. an ASCII-only terminal
        text = text.replace("…", "...").encode(encoding, "backslashreplace").decode(encoding)
    _write(text)


def error_document(err: BaseException) -> dict[str, Any]:
    """The ``--json`` form of an error: ``{"error": {"type": ..., "message": ...}}``.

    Example:
        >>> from memtree.errors import NotAMemtreeError
        >>> error_document(NotAMemtreeError("x has no meta.json"))
        {'error': {'type': 'NotAMemtreeError', 'message': 'x has no meta.json'}}
    """
    return {"error": {"type": type(err).__name__, "message": str(err)}}


def _write(text: str) -> None:
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:  # `memtree info big | head`: the reader has gone; that is fine
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
