"""The ``memtree`` command line (also ``python -m memtree``).

Each sub-command lives in its own module under :mod:`memtree.cli`. Exit codes: 0 success,
1 failure (a clear one-line error, no traceback for expected errors), 2 usage error.

Example:
    $ memtree demo --items 10000
"""

from __future__ import annotations

import argparse
import sys
from types import ModuleType

from . import convert, demo, diff, du, info, verify
from ..errors import MemtreeError

__all__ = ["main"]

COMMANDS: list[ModuleType] = [demo, info, verify, convert, diff, du]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memtree", description="Nested tensor trees on disk.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        cmd = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = _build_parser().parse_args(argv)
    try:
        return int(args._run(args))
    except MemtreeError as err:
        print(f"memtree: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("memtree: interrupted", file=sys.stderr)
        return 130
