"""The ``memtree`` command line (also ``python -m memtree``).

Each sub-command lives in its own module under :mod:`memtree.cli` and is imported only when it
runs, so that ``memtree info DIR`` starts without torch. Exit codes and ``--json`` output are
shared by every command (:mod:`memtree.cli.output`): 0 success, 1 failure (a clear one-line
error, no traceback for expected errors; with ``--json`` an ``{"error": ...}`` object), 2 usage
error, 130 interrupted.

Example:
    $ memtree demo --items 10000
    $ memtree info ckpt --json
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from ..errors import MemtreeError
from .output import EXIT_FAILED, EXIT_INTERRUPTED, emit_json, error_document, printable

__all__ = ["main", "COMMANDS"]

#: Sub-command name -> its module under :mod:`memtree.cli`, which defines ``NAME``, ``HELP``,
#: ``add_arguments(parser)`` and ``run(args) -> int``. A module is imported only to run its own
#: command (or for ``memtree --help``, which lists them all).
COMMANDS: dict[str, str] = {"demo": "demo", "info": "info", "verify": "verify", "convert": "convert",
                          "diff": "diff", "du": "du"}


def _module(name: str) -> Any:
    return importlib.import_module(f".{COMMANDS[name]}", __package__)


def _build_parser(command: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memtree", description="Nested tensor trees on disk.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        if command is None or name == command:
            module = _module(name)
            cmd = sub.add_parser(name, help=module.HELP, description=module.HELP)
            module.add_arguments(cmd)
            cmd.set_defaults(_run=module.run)
        else:  # not running: its name only (usage errors still list every command)
            sub.add_parser(name)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code.

    Example:
        >>> main(["info", "/nonexistent/tree"])
        1
    """
    args_in = sys.argv[1:] if argv is None else argv
    command = args_in[0] if args_in and not args_in[0].startswith("-") else None  # None: every command
    args = _build_parser(command if command in COMMANDS else None).parse_args(args_in)
    try:
        return int(args._run(args))
    except MemtreeError as err:
        if getattr(args, "json", False):
            emit_json(error_document(err))
        else:
            print(f"memtree: error: {printable(str(err))}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("memtree: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
