"""``memtree convert SRC DST``: convert checkpoints and trees, streaming one tensor at a time.

SRC is a ``torch.save`` file (``.pt``/``.pth``/``.bin``), a ``.safetensors`` file, a tensordict
``memmap`` directory or a memtree directory; DST is a memtree directory, or a file whose name
ends in ``.safetensors``. Peak memory is about the largest tensor (twice it with ``--dtype``),
not the checkpoint. A progress bar is shown on a terminal (with tqdm installed); nothing is
printed otherwise, except a note about non-tensor values the destination cannot hold.

Example:
    $ memtree convert model.pt model_tree --dtype bfloat16
    $ memtree convert model_tree model.safetensors
"""

from __future__ import annotations

import argparse
import sys

from ..interop.conversion import convert

__all__ = ["NAME", "HELP", "add_arguments", "run"]

NAME = "convert"
HELP = (
    "convert a torch.save / .safetensors file or a tensordict / memtree directory into a memtree "
    "directory or a .safetensors file, one tensor at a time"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``memtree convert``."""
    parser.add_argument(
        "src",
        metavar="SRC",
        help="a .pt/.pth/.bin or .safetensors file, or a tensordict or memtree directory",
    )
    parser.add_argument(
        "dst", metavar="DST", help="a memtree directory, or a file ending in .safetensors"
    )
    parser.add_argument(
        "--dtype",
        metavar="DTYPE",
        default=None,
        help="cast floating-point tensors to this dtype while streaming (e.g. bfloat16)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace DST if it exists (atomically)"
    )
    parser.add_argument(
        "--allow-pickle",
        action="store_true",
        help="trusted files only: let a torch.save pickle build objects other than "
        "tensors and plain data",
    )
    parser.add_argument(
        "--flat-keys",
        action="store_true",
        help="keep a checkpoint's dotted keys flat instead of nesting them by '.'",
    )
    parser.add_argument("--fsync", action="store_true", help="make DST durable before it appears")
    bar = parser.add_mutually_exclusive_group()
    bar.add_argument(
        "--progress",
        dest="progress",
        action="store_true",
        default=None,
        help="always show a progress bar (needs tqdm)",
    )
    bar.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="never show a progress bar (default: only on a terminal)",
    )


def run(args: argparse.Namespace) -> int:
    """Convert ``args.src`` into ``args.dst``; returns the exit code."""
    result = convert(
        args.src,
        args.dst,
        dtype=args.dtype,
        overwrite=args.overwrite,
        allow_pickle=args.allow_pickle,
        flat_keys=args.flat_keys,
        fsync=args.fsync,
        progress=args.progress,
    )
    if result.dropped:
        shown = ", ".join(result.dropped[:10]) + (" ..." if len(result.dropped) > 10 else "")
        print(
            f"memtree convert: {len(result.dropped)} non-tensor value(s) not written "
            f"({result.destination} cannot hold them): {shown}",
            file=sys.stderr,
        )
    return 0
