"""``memtree du PATH``: the disk a tree, or a checkpoint root, uses, and what hard links share.

``PATH`` is a tree (a directory with a ``meta.json``) or a checkpoint root: a directory of steps
``root/<step>/``, each a tree, by the one rule of :mod:`memtree.store.reading.steps` that
``Checkpointer.steps()`` applies (other entries, such as staging directories, lock files, stray
directories and links named like steps, are left out). Every file below is counted once per
name for the *apparent* bytes (their sizes), and once per file (inode) for the *allocated* bytes
(``st_blocks``: what the disk really holds; sparse files hold less). Files with several names in
the scope (hard links made by ``WriteOptions(link_from=...)`` between checkpoints, say) are
*shared*: ``linked_bytes`` is what the links save (apparent bytes of every name beyond a file's
first). For each step, ``exclusive_bytes`` are the allocated bytes of files no other step names:
about what deleting that step frees (a file with links outside the scope is never counted as
exclusive). Symbolic links are never followed; the walk stays on the directory's filesystem.

Example:
    $ memtree du ckpt/
    ckpt: 5 steps, 10 GiB apparent, 2.3 GiB allocated, 7.7 GiB saved by hard links
      step 100: 2.0 GiB apparent, 2.0 GiB allocated, 0.1 GiB exclusive
"""

from __future__ import annotations

import argparse
import os
import stat
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import NotAMemtreeError, StorageError
from ..format.names import META_NAME
from ..store.primitives.files import regular_files
from ..store.reading.steps import list_steps
from ..store.reading.storage import local_path
from .output import EXIT_OK, add_json_flag, emit_json, emit_text, format_bytes

__all__ = ["NAME", "HELP", "add_arguments", "run", "DuReport", "StepUsage", "disk_usage"]

NAME = "du"
HELP = "disk use of a tree or a checkpoint root: apparent, allocated, and shared by hard links"

@dataclass
class StepUsage:
    """The usage of one tree (a step of a checkpoint root, or the tree itself).

    Attributes:
        name: the step's directory name (``""`` for a single tree).
        files: file names counted.
        apparent_bytes: sum of their sizes.
        allocated_bytes: blocks of their distinct files (``st_blocks × 512``).
        shared_bytes: apparent bytes of its files that have another name in the scope.
        exclusive_bytes: allocated bytes of its files no other step names (and with no link
            outside the scope).
    """

    name: str
    files: int = 0
    apparent_bytes: int = 0
    allocated_bytes: int = 0
    shared_bytes: int = 0
    exclusive_bytes: int = 0


@dataclass
class DuReport:
    """The result of :func:`disk_usage` (sizes in bytes).

    Attributes:
        path: the directory (resolved).
        kind: ``"tree"`` or ``"checkpoints"``.
        files: file names counted; ``inodes``: distinct files among them.
        apparent_bytes: sum of the sizes of every name.
        allocated_bytes: blocks of the distinct files.
        unique_bytes: sizes of the distinct files.
        linked_bytes: ``apparent_bytes - unique_bytes``: what the hard links save.
        outside_links_bytes: sizes of files that also have names outside the scope.
        steps: per-step usage (one entry for a single tree).
    """

    path: str
    kind: str
    files: int = 0
    inodes: int = 0
    apparent_bytes: int = 0
    allocated_bytes: int = 0
    unique_bytes: int = 0
    linked_bytes: int = 0
    outside_links_bytes: int = 0
    steps: list[StepUsage] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (what ``memtree du --json`` prints)."""
        return asdict(self)


def disk_usage(path: str | os.PathLike[str]) -> DuReport:
    """Measure a tree or a checkpoint root (see the module docstring).

    Raises:
        NotAMemtreeError: ``path`` is neither a tree nor a directory of step trees.

    Example:
        >>> import tempfile, torch
        >>> from memtree.format.level import Level
        >>> from memtree.store.reading.options import WriteOptions
        >>> from memtree.store.writing.write import write_tree
        >>> root = tempfile.mkdtemp()
        >>> _ = write_tree(root + "/1", Level((), {"w": torch.ones(1024)}))
        >>> _ = write_tree(root + "/2", Level((), {"w": torch.ones(1024)}), WriteOptions.of(link_from=root + "/1"))
        >>> r = disk_usage(root)
        >>> r.kind, len(r.steps), r.linked_bytes
        ('checkpoints', 2, 4096)
    """
    top = os.path.realpath(os.fspath(local_path(path, remote="du measures local directories")))
    try:
        st = os.stat(top)
    except OSError as err:
        raise NotAMemtreeError(f"{top}: {err.strerror}; check the path") from None
    if not stat.S_ISDIR(st.st_mode):
        raise NotAMemtreeError(f"{top} is not a directory")
    if os.path.isfile(os.path.join(top, META_NAME)):
        report, steps = DuReport(top, "tree"), [("", top)]
    else:
        steps = [(str(s), os.path.join(top, str(s))) for s in list_steps(top).steps]
        if not steps:
            raise NotAMemtreeError(
                f"{top} is neither a memtree tree (no {META_NAME}) nor a checkpoint root (no "
                "<step>/ sub-directory holding a tree)"
            )
        report = DuReport(top, "checkpoints")
    per_step = []
    for name, directory in steps:
        try:
            per_step.append((name, regular_files(directory)))
        except StorageError:  # a step deleted meanwhile (retention): nothing of it to count
            per_step.append((name, []))
    names_of: dict[tuple[int, int], int] = {}  # inode -> names in the scope
    steps_of: dict[tuple[int, int], set[str]] = {}
    for name, found in per_step:
        for f in found:
            ino = (f.st_dev, f.st_ino)
            names_of[ino] = names_of.get(ino, 0) + 1
            steps_of.setdefault(ino, set()).add(name)
    seen: set[tuple[int, int]] = set()
    for name, found in per_step:
        usage = StepUsage(name)
        counted: set[tuple[int, int]] = set()
        for f in found:
            ino = (f.st_dev, f.st_ino)
            usage.files += 1
            usage.apparent_bytes += f.st_size
            if ino not in counted:
                counted.add(ino)
                usage.allocated_bytes += f.st_blocks * 512
                if len(steps_of[ino]) == 1 and f.st_nlink <= names_of[ino]:
                    usage.exclusive_bytes += f.st_blocks * 512
            if names_of[ino] > 1:
                usage.shared_bytes += f.st_size
            report.files += 1
            report.apparent_bytes += f.st_size
            if ino not in seen:
                seen.add(ino)
                report.inodes += 1
                report.unique_bytes += f.st_size
                report.allocated_bytes += f.st_blocks * 512
                if f.st_nlink > names_of[ino]:
                    report.outside_links_bytes += f.st_size
        report.steps.append(usage)
    report.linked_bytes = report.apparent_bytes - report.unique_bytes
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``memtree du``."""
    parser.add_argument("path", metavar="PATH", help="a tree, or a checkpoint root of <step>/ trees")
    add_json_flag(parser)


def run(args: argparse.Namespace) -> int:
    """Print the usage (or JSON); 0 on success."""
    r = disk_usage(args.path)
    if args.json:
        emit_json(r.to_dict())
        return EXIT_OK
    what = f"{len(r.steps)} steps" if r.kind == "checkpoints" else "tree"
    line = (
        f"{r.path}: {what}, {r.files} files, {format_bytes(r.apparent_bytes)} apparent, "
        f"{format_bytes(r.allocated_bytes)} allocated, {format_bytes(r.linked_bytes)} saved by hard links"
    )
    if r.outside_links_bytes:
        line += f", {format_bytes(r.outside_links_bytes)} also linked from outside"
    emit_text(line)
    if r.kind == "checkpoints":
        for s in r.steps:
            emit_text(
                f"  step {s.name}: {format_bytes(s.apparent_bytes)} apparent, {format_bytes(s.allocated_bytes)} "
                f"allocated, {format_bytes(s.shared_bytes)} shared, {format_bytes(s.exclusive_bytes)} exclusive"
            )
    return EXIT_OK
