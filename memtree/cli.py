"""The ``memtree`` command line (also ``python -m memtree``).

Example:
    $ memtree demo
"""

from __future__ import annotations

import argparse
import sys

from .errors import MemtreeError

__all__ = ["main"]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memtree", description="Nested tensor trees on disk.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser("demo", help="build, memmap and reload a model and a dataset; print timings")
    demo.add_argument("--workdir", help="directory to work in (default: a temporary one, removed after)")
    demo.add_argument("--items", type=int, default=1_000_000, help="dataset size (default 1,000,000)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 failure, 2 usage error)."""
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            from .demo import run_demo

            print(run_demo(args.workdir, args.items, keep=args.workdir is not None))
    except MemtreeError as err:
        print(f"memtree: error: {err}", file=sys.stderr)
        return 1
    return 0
