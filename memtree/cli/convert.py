"""``memtree convert SRC DST``: convert checkpoints and trees, streaming one tensor at a time.

SRC is a ``torch.save`` file (``.pt``/``.pth``/``.bin``), a ``.safetensors`` file, a tensordict
``memmap`` directory or a memtree directory; DST is a memtree directory, or a file whose name
ends in ``.safetensors``. Peak memory is about the largest tensor (twice it with ``--dtype``),
not the checkpoint. A progress bar is shown on a terminal (with tqdm installed); nothing is
printed otherwise, except notes (on standard error) about non-tensor values the destination
cannot hold (not written) and about values written in another form (a tuple as a list, a list of
tensors as keys by index, ...).

Example:
    $ memtree convert model.pt model_tree --dtype bfloat16
    $ memtree convert model_tree model.safetensors
"""

from __future__ import annotations

import argparse
import sys

from ..interop.conversion import ConvertResult, convert
from ..interop.pickle_guard import PickleLimits
from .info import _positive_int

__all__ = ["NAME", "HELP", "add_arguments", "run", "report"]

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
        "--existsok", "--overwrite", dest="existsok", action="store_true",
        help="replace DST if it exists (atomically); --overwrite is the same flag's older name",
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
    defaults = PickleLimits()
    for field, what in (
        ("bytes", "bytes of a torch.save file's pickle (data.pkl)"),
        ("objects", "objects a torch.save file's pickle may build"),
        ("depth", "nesting depth of a torch.save file's pickled structure"),
    ):
        parser.add_argument(
            f"--max-pickle-{field}",
            metavar="N",
            type=_positive_int,
            default=getattr(defaults, f"max_{field}"),
            help=f"at most N {what} (default: %(default)s); raise it for a trusted file",
        )
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
        existsok=args.existsok,
        allow_pickle=args.allow_pickle,
        flat_keys=args.flat_keys,
        fsync=args.fsync,
        progress=args.progress,
        limits=PickleLimits(args.max_pickle_bytes, args.max_pickle_objects, args.max_pickle_depth),
    )
    report(result)
    return 0


def report(result: ConvertResult) -> None:
    """Print what :func:`convert` did not write as it was (standard error; nothing otherwise)."""
    if result.dropped:
        shown = ", ".join(result.dropped[:10]) + (" ..." if len(result.dropped) > 10 else "")
        print(
            f"memtree convert: {len(result.dropped)} non-tensor value(s) not written "
            f"({result.destination} cannot hold them): {shown}",
            file=sys.stderr,
        )
    if result.altered:
        items = list(result.altered.items())
        lines = "".join(f"\n  {key}: {change}" for key, change in items[:10])
        more = f"\n  ... and {len(items) - 10} more" if len(items) > 10 else ""
        print(
            f"memtree convert: {len(items)} value(s) written in another form:{lines}{more}",
            file=sys.stderr,
        )
