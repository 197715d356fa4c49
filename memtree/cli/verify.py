"""``memtree verify DIR_OR_URL``: check a tree on disk or at a URL and list every damaged leaf.

Checks what the loader checks (every ``meta.json``, every leaf file's kind and exact size) and
compares every recorded checksum with the file's bytes, without stopping at the first problem
(:func:`memtree.store.verify.verify_tree`). Works on every directory ``load_memmap`` reads: a
memtree directory, a directory written by tensordict's ``memmap``, and a URL (``https://``,
``s3://``... with the ``memtree[remote]`` extra; its leaves are downloaded to be hashed, with a
progress bar on a terminal). Exit code 0 when the tree is clean, 1 when anything is wrong.

Example:
    $ memtree verify /data/ckpt
    OK /data/ckpt: 148 leaves, 148 checksums compared
    $ memtree verify --json https://host/ckpt
"""

from __future__ import annotations

import argparse

from ..store.verify import DEFAULT_THREADS, verify_tree
from .info import _positive_int
from .output import EXIT_FAILED, EXIT_OK, add_json_flag, emit_json, emit_text

__all__ = ["NAME", "HELP", "add_arguments", "run"]

NAME = "verify"
HELP = "check a tree's meta.json files, leaf sizes and checksums; list every problem (exit 1 if any)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``memtree verify``."""
    parser.add_argument("path", metavar="DIR_OR_URL",
                        help="the tree's directory (memtree or tensordict), or its URL")
    add_json_flag(parser)
    parser.add_argument(
        "--no-checksums",
        action="store_true",
        help="check structure and sizes only (reads no leaf data)",
    )
    parser.add_argument("--threads", type=_positive_int, metavar="N", default=DEFAULT_THREADS,
                        help="files checked at a time (default: %(default)s)")
    parser.add_argument("--timeout", type=float, metavar="SECONDS", default=None,
                        help="URLs only: seconds one request may take (default 60)")
    bar = parser.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None,
                     help="always show a progress bar (needs tqdm)")
    bar.add_argument("--no-progress", dest="progress", action="store_false",
                     help="never show a progress bar (default: only on a terminal; never with --json)")


def run(args: argparse.Namespace) -> int:
    """Verify the tree; print one line per problem (or JSON); 0 if clean, 1 otherwise."""
    report = verify_tree(args.path, checksums=not args.no_checksums, num_threads=args.threads,
                         timeout=args.timeout, progress=False if args.json else args.progress)
    if args.json:
        emit_json(report.to_dict())
        return EXIT_OK if report.ok else EXIT_FAILED
    lines = []
    for p in report.problems:
        key = "/".join(p.key) if p.key else "(root)"
        if p.expected is not None and p.found is not None:
            lines.append(f"BAD {p.path} [key {key}] {p.kind}: expected {p.expected}, found {p.found}")
        else:
            lines.append(f"BAD {p.path} [key {key}] {p.kind}: {p.message}")
    unchecked = report.leaves - report.checksummed
    layout = " (tensordict directory)" if report.layout == "tensordict" else ""
    summary = f"{report.path}{layout}: {report.leaves} leaves, {report.checksummed} checksums compared"
    if unchecked and not args.no_checksums:
        summary += f" ({unchecked} leaves have no checksum: size checked only)"
    if report.tree_hash in ("ok", "mismatch"):
        summary += ", tree hash " + ("matches" if report.tree_hash == "ok" else "differs")
    if report.sealed:
        summary += (
            "; encrypted with sealed names: without the key no key, sub-tree or leaf below the "
            "root is listed or checked, only the root's meta.json (check the contents with "
            "memtree.load_memmap(path, encryption=key, verify=True))"
        )
    elif report.encrypted:
        summary += (
            "; encrypted: checksums compared with the ciphertext, nothing decrypted or "
            "authenticated without the key (memtree.load_memmap(path, encryption=key, verify=True) does both)"
        )
    if report.ok:
        lines.append(f"OK {summary}")
    else:
        lines.append(f"FAILED {summary}, {len(report.problems)} problem(s)")
    emit_text("\n".join(lines))
    return EXIT_OK if report.ok else EXIT_FAILED
