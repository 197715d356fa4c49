"""``memtree verify DIR``: check a tree on disk and list every damaged leaf.

Checks what the loader checks (every ``meta.json``, every leaf file's kind and exact size) and
compares every recorded checksum with the file's bytes, without stopping at the first problem.
A directory written by tensordict's ``memmap`` is checked as ``load_memmap`` reads it. Exit code
0 when the tree is clean, 1 when anything is wrong.

Example:
    $ memtree verify /data/ckpt
    OK /data/ckpt: 148 leaves, 148 checksums match
    $ memtree verify --json /data/ckpt
"""

from __future__ import annotations

import argparse
import json

from ..store.verify import verify_tree

__all__ = ["NAME", "HELP", "add_arguments", "run"]

NAME = "verify"
HELP = "check a tree's meta.json files, leaf sizes and checksums; list every problem (exit 1 if any)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``memtree verify``."""
    parser.add_argument("path", metavar="DIR", help="the tree's directory")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument(
        "--no-checksums",
        action="store_true",
        help="check structure and sizes only (reads no leaf data)",
    )


def run(args: argparse.Namespace) -> int:
    """Verify the tree; print one line per problem (or JSON); 0 if clean, 1 otherwise."""
    report = verify_tree(args.path, checksums=not args.no_checksums, progress=None if not args.json else False)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0 if report.ok else 1
    for p in report.problems:
        key = "/".join(p.key) if p.key else "(root)"
        if p.expected is not None and p.found is not None:
            print(f"BAD {p.path} [key {key}] {p.kind}: expected {p.expected}, found {p.found}")
        else:
            print(f"BAD {p.path} [key {key}] {p.kind}: {p.message}")
    unchecked = report.leaves - report.checksummed
    layout = " (tensordict directory)" if report.layout == "tensordict" else ""
    summary = f"{report.path}{layout}: {report.leaves} leaves, {report.checksummed} checksums compared"
    if unchecked and not args.no_checksums:
        summary += f" ({unchecked} leaves have no checksum: size checked only)"
    if report.tree_hash in ("ok", "mismatch"):
        summary += ", tree hash " + ("matches" if report.tree_hash == "ok" else "differs")
    if report.ok:
        print(f"OK {summary}")
        return 0
    print(f"FAILED {summary}, {len(report.problems)} problem(s)")
    return 1
