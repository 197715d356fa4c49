"""Many writers, nothing lost (issue 28): processes filling one preallocated tree by index at once.

What must hold (``docs/guide/datasets.md``, "Several writers"):

* any number of processes, each writing its own rows of one tree (``tree[i] = item``,
  ``tree[rows] = batch``, a leaf's rows), lose no row: every row written is in the tree
  afterwards, bit for bit, and the files are the ones the tree had (written in place);
* one process growing the tree (``extend_``) while others fill its existing rows loses neither
  the rows filled nor the rows appended (the writers load every level first); a level a writer
  loads only after the growth is refused with ``MissingLeafError``, never written;
* writers of a tree whose files another tree shares by hard links (an incremental checkpoint)
  all write into the one copy their loads give it, and the other tree does not change.

The children are forked, start together through a barrier, and each fills a random disjoint
set of rows in every form of row write; nothing is timed and nothing waits by sleeping.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

import memtree
from memtree import TensorTree
from treeutil import run_children

pytestmark = pytest.mark.timeout(600)

FORK = mp.get_context("fork")
TIMEOUT = 300.0  # seconds a barrier may wait on a loaded machine before the test fails
ROWS = 240
WRITERS = 4


def item(i: int) -> TensorTree:
    """Row ``i``'s values: 4 KiB, 128 KiB and 24 bytes of nested data, none of them zero."""
    g = torch.Generator().manual_seed(i)
    return TensorTree(
        {
            "small": torch.randint(1, 256, (4096,), dtype=torch.uint8, generator=g),
            "big": torch.rand(32768, generator=g) + 1.0,
            "label": torch.tensor(7 * i + 1),
            "nested": {"pos": torch.tensor([i + 1.0, -i - 1.0, 0.5])},
        }
    )


def rows(idx: list[int]) -> TensorTree:
    return memtree.stack([item(i) for i in idx])


def empty(path, n: int = ROWS, **kw) -> TensorTree:
    template = item(0).apply(torch.zeros_like)
    return template.expand(n).memmap_like(path, **kw)


def fill(tree: TensorTree, mine: list[int]) -> None:
    """Write rows ``mine`` of ``tree`` in turn as one item, a batch by tensor, by list, and leaf
    by leaf."""
    k = 0
    while k < len(mine):
        form = k % 4
        if form == 0:
            tree[mine[k]] = item(mine[k])
            k += 1
        elif form in (1, 2):
            chunk = mine[k : k + 5]
            tree[torch.tensor(chunk) if form == 1 else chunk] = rows(chunk)
            k += len(chunk)
        else:
            i = mine[k]
            for key, value in item(i).items(include_nested=True, leaves_only=True):
                tree[key][i] = value
            k += 1


def _child() -> None:
    """What a forked child does first, as a DataLoader worker does: the parent's OpenMP threads
    do not survive ``fork``, and a parallel torch operation in the child would wait for them."""
    torch.set_num_threads(1)


def _writer(path: str, mine: list[int], barrier) -> None:
    _child()
    tree = memtree.load_memmap(path, lazy=False)  # every level now: a growth may replace the directories
    barrier.wait(TIMEOUT)
    fill(tree, mine)


def _inherited_writer(tree: TensorTree, mine: list[int], barrier) -> None:
    _child()
    barrier.wait(TIMEOUT)
    fill(tree, mine)


def _grower(path: str, count: int, barrier) -> None:
    _child()
    tree = memtree.load_memmap(path)
    barrier.wait(TIMEOUT)
    for j in range(count):
        if j % 2:
            tree.append_(item(ROWS + j))
        else:
            tree.extend_(rows([ROWS + j]))


def shares(n: int, parts: int, seed: int) -> list[list[int]]:
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return [order[k::parts] for k in range(parts)]


def lost_rows(path, n: int) -> list[int]:
    """Rows of the tree at ``path`` that differ from what was written (in any leaf)."""
    tree = memtree.load_memmap(path)
    assert len(tree) == n
    expected = rows(list(range(n)))
    bad = torch.zeros(n, dtype=torch.bool)
    for key, value in expected.items(include_nested=True, leaves_only=True):
        got = tree[key]
        bad |= (got != value).reshape(n, -1).any(1)
    return bad.nonzero().flatten().tolist()


def inodes(path) -> dict[str, int]:
    return {
        os.path.relpath(os.path.join(d, f), path): os.stat(os.path.join(d, f)).st_ino
        for d, _, files in os.walk(path) for f in files if f.endswith(".memmap")
    }


def test_four_writer_processes_filling_disjoint_rows_lose_none(tmp_path):
    d = tmp_path / "data"
    empty(d)
    before = inodes(d)
    barrier = FORK.Barrier(WRITERS)
    run_children(FORK, _writer, *[(str(d), mine, barrier) for mine in shares(ROWS, WRITERS, seed=1)], timeout=TIMEOUT)
    assert lost_rows(d, ROWS) == []
    assert inodes(d) == before  # filled in place


def test_four_writers_filling_rows_of_leaves_that_share_a_pack_lose_none(tmp_path):
    """Three of the four leaves share one pack file (format version 3): the writers' rows of
    different leaves land in disjoint ranges of the one mapping of that file."""
    d = tmp_path / "data"
    empty(d, pack_below=2 << 20)
    assert sorted(f for f in os.listdir(d) if f.startswith("~pack-")) == ["~pack-0.memmap"]
    assert len(inodes(d)) == 2  # the pack and the big leaf's own file
    before = inodes(d)
    barrier = FORK.Barrier(WRITERS)
    run_children(FORK, _writer, *[(str(d), mine, barrier) for mine in shares(ROWS, WRITERS, seed=5)], timeout=TIMEOUT)
    assert lost_rows(d, ROWS) == []
    assert inodes(d) == before  # filled in place


def test_writers_sharing_one_loaded_tree_through_fork_lose_none(tmp_path):
    """Children forked from a process that holds the tree open write through inherited mappings
    and their own descriptors."""
    d = tmp_path / "data"
    tree = empty(d)
    tree[0] = item(0)  # the parent has written: its descriptors are cached before the fork
    barrier = FORK.Barrier(WRITERS)
    parts = shares(ROWS - 1, WRITERS, seed=2)
    run_children(FORK, _inherited_writer, *[(tree, [i + 1 for i in mine], barrier) for mine in parts],
                 timeout=TIMEOUT)
    assert lost_rows(d, ROWS) == []


def _lazy_writer(path: str, mine: list[int], barrier, grown) -> None:
    _child()
    tree = memtree.load_memmap(path)  # the nested level loads on first use
    barrier.wait(TIMEOUT)
    grown.wait(TIMEOUT)
    try:
        fill(tree, mine)
    except memtree.MissingLeafError:
        return  # the documented error: load the tree again
    raise AssertionError("a level loaded after the tree was grown (its directories replaced)")


def _growing_once(path: str, barrier, grown) -> None:
    _child()
    tree = memtree.load_memmap(path)
    barrier.wait(TIMEOUT)
    tree.extend_(rows([ROWS]))
    grown.set()


def test_a_level_loaded_after_another_process_grew_the_tree_is_refused_not_written(tmp_path):
    """A writer whose nested level was still unloaded when another process grew the tree (its
    directories exchanged for the grown ones) gets ``MissingLeafError`` when it first writes
    there: an error, not rows written into files that are no longer the tree's."""
    d = tmp_path / "data"
    empty(d)
    barrier, grown = FORK.Barrier(2), FORK.Event()
    run_children(FORK, lambda *a: _growing_once(*a) if len(a) == 3 else _lazy_writer(*a),
                 (str(d), [5, 6], barrier, grown), (str(d), barrier, grown), timeout=TIMEOUT)
    tree = memtree.load_memmap(d)
    assert len(tree) == ROWS + 1 and not tree["nested", "pos"][:ROWS].any()


def test_a_process_appending_while_others_fill_loses_no_row(tmp_path):
    d = tmp_path / "data"
    empty(d)
    grown = 9
    barrier = FORK.Barrier(WRITERS)
    fillers = [(str(d), mine, barrier) for mine in shares(ROWS, WRITERS - 1, seed=3)]
    run_children(FORK, lambda *a: _grower(*a) if isinstance(a[1], int) else _writer(*a),
                 *fillers, (str(d), grown, barrier), timeout=TIMEOUT)
    assert lost_rows(d, ROWS + grown) == []


def test_writers_of_a_tree_sharing_its_files_with_another_lose_none_and_leave_the_other_unchanged(tmp_path):
    """An incremental save hard-links unchanged leaves to the previous tree: each writer's load
    gives the leaves their own copy first (one copy, under the tree's writer lock, which every
    writer then maps), so the rows all land in the new tree and none in the old one."""
    zeros = item(0).apply(torch.zeros_like).expand(ROWS).clone()
    checkpoints = memtree.Checkpointer(tmp_path / "steps")
    old, new = checkpoints.save(1, zeros), checkpoints.save(2, zeros)  # step 2 links step 1's files
    shared = inodes(new)
    assert shared == inodes(old)  # every leaf file is step 1's
    barrier = FORK.Barrier(WRITERS)
    run_children(FORK, _writer, *[(new, mine, barrier) for mine in shares(ROWS, WRITERS, seed=4)], timeout=TIMEOUT)
    assert lost_rows(new, ROWS) == []
    for key, value in memtree.load_memmap(old, mode="r").items(include_nested=True, leaves_only=True):
        assert not value.any(), key  # nothing written into the other tree
    assert not set(inodes(new).values()) & set(shared.values())
