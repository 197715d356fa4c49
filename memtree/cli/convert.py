"""``memtree convert SRC DST``: convert checkpoints and trees, streaming one tensor at a time.

SRC is a ``torch.save`` file (``.pt``/``.pth``/``.bin``), a ``.safetensors`` file, a shard index
(``model.safetensors.index.json``, ``pytorch_model.bin.index.json``), a Hugging Face model
directory, a tensordict ``memmap`` directory or a memtree directory. DST is, by ``--format``:

* ``memtree`` (the default): a memtree directory;
* ``safetensors`` (the default when DST ends in ``.safetensors``): that one file; or, for any
  other DST, a Hugging Face model directory: ``model.safetensors``, or shards
  ``model-00001-of-0000N.safetensors`` and ``model.safetensors.index.json`` when the tensors
  exceed ``--max-shard-size`` (default 5GB, Hugging Face's units);
* ``tensordict``: a directory that ``tensordict.TensorDict.load_memmap`` reads.

Peak memory is about the largest tensor (twice it with ``--dtype``), not the checkpoint. When it
is done, it prints what it did on standard output: tensors, bytes, time, files; and on standard
error the tensors left out by ``--skip-unsupported`` (sparse, quantized... tensors of a
``torch.save`` file, which are otherwise refused), the non-tensor values the destination cannot
hold (not written) and those written in
another form (a tuple as a list, a list of tensors as keys by index, a tied weight written
once...). ``--json`` prints all of it as one JSON object on standard output instead, and nothing
else. A progress bar is shown on a terminal (with tqdm installed), never with ``--json`` or off
a terminal unless ``--progress`` asks for it.

Example:
    $ memtree convert model.pt model_tree --dtype bfloat16
    $ memtree convert model_tree model.safetensors
    $ memtree convert model_tree hf_model/ --format safetensors --max-shard-size 5GB
    $ memtree convert hf_model/ td_dir --format tensordict --json
"""

from __future__ import annotations

import argparse
import sys

from ..interop.conversion import FORMATS, ConvertResult, convert
from ..interop.pickle_guard import PickleLimits
from .info import _positive_int
from .output import add_json_flag, emit_json, emit_text, format_bytes

__all__ = ["NAME", "HELP", "add_arguments", "run", "report", "summary"]

NAME = "convert"
HELP = (
    "convert a torch.save / .safetensors file, a Hugging Face model directory or a tensordict / "
    "memtree directory into a memtree directory, safetensors (a file or sharded model "
    "directory) or a tensordict directory, one tensor at a time"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``memtree convert``."""
    parser.add_argument(
        "src",
        metavar="SRC",
        help="a .pt/.pth/.bin or .safetensors file, a *.index.json shard index, or a Hugging "
        "Face model, tensordict or memtree directory",
    )
    parser.add_argument(
        "dst",
        metavar="DST",
        help="the destination: a directory, or a file ending in .safetensors (see --format)",
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default=None,
        help="what to write: a memtree directory (default), safetensors (one file when DST "
        "ends in .safetensors, else a Hugging Face model directory), or a tensordict directory",
    )
    parser.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        default=None,
        help="with --format safetensors and a directory DST: the shard size limit, as Hugging "
        "Face's max_shard_size (5GB = 5*10^9 bytes, 500MB, 4GiB, or bytes; default 5GB)",
    )
    add_json_flag(parser)
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
    parser.add_argument(
        "--skip-unsupported",
        action="store_true",
        help="leave out (and list) the tensors of a torch.save file memtree cannot store "
        "(sparse, quantized...) instead of refusing the file",
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
    progress = args.progress
    if args.json and progress is None:
        progress = False  # machine output: a bar only when asked for
    result = convert(
        args.src,
        args.dst,
        format=args.format,
        max_shard_size=args.max_shard_size,
        dtype=args.dtype,
        existsok=args.existsok,
        allow_pickle=args.allow_pickle,
        flat_keys=args.flat_keys,
        skip_unsupported=args.skip_unsupported,
        fsync=args.fsync,
        progress=progress,
        limits=PickleLimits(args.max_pickle_bytes, args.max_pickle_objects, args.max_pickle_depth),
    )
    if args.json:
        emit_json(result.to_dict())
    else:
        emit_text(summary(result, args.src, args.dst))
        report(result)
    return 0


def summary(result: ConvertResult, src: str, dst: str) -> str:
    """One line (two with a model directory's files) saying what :func:`convert` did.

    Example:
        >>> summary(ConvertResult("torch", "memtree", tensors=2, nbytes=2048, seconds=0.5), "m.pt", "t")
        'converted m.pt (torch) -> t (memtree): 2 tensors, 2.0 KiB in 0.50 s'
    """
    tensors = f"{result.tensors} tensor{'' if result.tensors == 1 else 's'}"
    line = (
        f"converted {src} ({result.source}) -> {dst} ({result.destination}): {tensors}, "
        f"{format_bytes(result.nbytes)} in {result.seconds:.2f} s"
    )
    if len(result.files) > 1:
        line += f"\n  {len(result.files)} shards and model.safetensors.index.json"
    elif result.files:
        line += f"\n  {result.files[0]}"
    return line


def report(result: ConvertResult) -> None:
    """Print what :func:`convert` did not write as it was (standard error; nothing otherwise)."""
    if result.skipped:
        print(
            f"memtree convert: {len(result.skipped)} tensor(s) skipped (--skip-unsupported):"
            f"{_listing(result.skipped)}",
            file=sys.stderr,
        )
    if result.dropped:
        shown = ", ".join(result.dropped[:10]) + (" ..." if len(result.dropped) > 10 else "")
        print(
            f"memtree convert: {len(result.dropped)} non-tensor value(s) not written "
            f"({result.destination} cannot hold them): {shown}",
            file=sys.stderr,
        )
    if result.altered:
        print(
            f"memtree convert: {len(result.altered)} value(s) written in another form:{_listing(result.altered)}",
            file=sys.stderr,
        )


def _listing(items: dict[str, str]) -> str:
    """The first 10 ``key: what`` lines, indented, and how many more."""
    lines = "".join(f"\n  {key}: {what}" for key, what in list(items.items())[:10])
    return lines + (f"\n  ... and {len(items) - 10} more" if len(items) > 10 else "")
