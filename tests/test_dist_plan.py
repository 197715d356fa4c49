"""The placement plan (memtree/dist/placement.py): which indices and which bytes of a leaf file a
rank of a device mesh holds, checked against torch's own split over shapes x meshes x placements
(uneven and empty shards, several mesh dims on one tensor dim, _StridedShard), no process group.
"""

from __future__ import annotations

from itertools import product
from math import prod

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

from memtree.format.subclass import layout_dict, parse_layout
from memtree.dist.placement import (
    Layout,
    assign_writers,
    box_offsets,
    box_runs,
    box_shape,
    check_layout,
    from_annotation,
    local_box,
    parse_placement,
    shards,
    split_runs,
    to_annotation,
)


def torch_placement(text: str):
    kind, dim, split = parse_placement(text)
    if kind == "R":
        return Replicate()
    if kind == "S":
        return Shard(dim)
    return _StridedShard(dim, split_factor=split)


@st.composite
def layouts(draw):
    """A shape, a layout that fits it, and (as strings) the placements torch takes."""
    ndim = draw(st.integers(0, 3))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    placements = []
    for _ in mesh:
        options = ["R"] + ([f"S({d})" for d in range(ndim)] + [f"_S({d}, {k})" for d in range(ndim) for k in (2, 3)])
        placements.append(draw(st.sampled_from(options)))
    return shape, Layout(mesh, tuple(placements))


def torch_local(full: torch.Tensor, layout: Layout, coord: tuple[int, ...]) -> torch.Tensor:
    """The local tensor of ``coord`` as DTensor makes it: each placement's own ``_split_tensor``
    (what ``distribute_tensor`` applies), mesh dim after mesh dim."""
    local = full
    for mesh_dim, text in enumerate(layout.placements):
        if text == "R":
            continue
        pieces, _ = torch_placement(text)._split_tensor(local, layout.mesh[mesh_dim], with_padding=False, contiguous=True)
        local = pieces[coord[mesh_dim]]
    return local


def gather(full: torch.Tensor, box) -> torch.Tensor:
    """``full`` indexed by a box (one index list per dim)."""
    out = full
    for d, intervals in enumerate(box):
        index = torch.tensor([i for a, b in intervals for i in range(a, b)], dtype=torch.long)
        out = out.index_select(d, index)
    return out


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_local_shape_and_offset_are_torchs(case):
    shape, layout = case
    placements = [torch_placement(p) for p in layout.placements]
    for coord in product(*(range(n) for n in layout.mesh)):
        box = local_box(shape, layout, coord)
        want_shape, want_offset = _compute_local_shape_and_global_offset(shape, layout.mesh, list(coord), placements)
        assert box_shape(box) == tuple(want_shape)
        assert box_offsets(shape, layout, box) == tuple(want_offset)


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_box_holds_the_elements_dtensor_holds(case):
    shape, layout = case
    full = torch.arange(prod(shape), dtype=torch.int32).reshape(shape)
    for coord in product(*(range(n) for n in layout.mesh)):
        box = local_box(shape, layout, coord)
        local = torch_local(full, layout, coord)
        assert torch.equal(gather(full, box), local)


@settings(max_examples=150, deadline=None)
@given(layouts(), st.sampled_from([1, 2, 8]))
def test_runs_are_the_local_tensors_bytes_in_order(case, itemsize):
    """Reading the runs of a box from the leaf file, one after another, gives the local tensor's
    bytes; runs never touch (each is as long as it can be)."""
    shape, layout = case
    dtype = {1: torch.uint8, 2: torch.int16, 8: torch.int64}[itemsize]
    full = torch.arange(prod(shape), dtype=torch.int64).to(dtype).reshape(shape)
    data = full.reshape(-1).view(torch.uint8)
    for coord in product(*(range(n) for n in layout.mesh)):
        box = local_box(shape, layout, coord)
        runs = list(box_runs(shape, itemsize, box))
        got = torch.cat([data[o : o + n] for o, n in runs]) if runs else torch.empty(0, dtype=torch.uint8)
        want = gather(full, box).contiguous().reshape(-1).view(torch.uint8) if shape else data
        assert torch.equal(got, want)
        assert all(n > 0 for _, n in runs)
        assert all(a[0] + a[1] < b[0] for a, b in zip(runs, runs[1:]))


@settings(max_examples=200, deadline=None)
@given(layouts(), st.integers(1, 4))
def test_distinct_shards_tile_the_file_and_every_one_has_a_writer(case, spare):
    """The distinct shards (replicas merged) cover every byte of the leaf exactly once; each is
    written by one of its holders; the ranks may be any ids (a mesh over part of the world)."""
    shape, layout = case
    size = prod(layout.mesh)
    ranks = [spare + 2 * r for r in range(size)]  # global ranks of the mesh's devices
    found = shards(shape, 4, layout, ranks)
    covered = sorted(run for s in found for run in box_runs(shape, 4, s.box))
    end = 0
    for offset, n in covered:
        assert offset == end
        end += n
    assert end == prod(shape) * 4 if shape else end == 4
    writers = assign_writers([found], spare + 2 * size)[0]
    assert all(w in s.holders for w, s in zip(writers, found))
    held = sorted(r for s in found for r in s.holders)
    assert len(held) == len(set(held))  # a rank holds one box of a leaf (or none)


def test_replicas_spread_over_their_holders():
    """Fully replicated leaves of equal size go to every rank in turn; a shard with one holder
    is that holder's whatever the load."""
    layout = Layout((4,), ("R",))
    leaves = [shards((8,), 4, layout, [0, 1, 2, 3]) for _ in range(8)]
    writers = assign_writers(leaves, 4)
    assert sorted(w[0] for w in writers) == [0, 0, 1, 1, 2, 2, 3, 3]
    sharded = shards((8,), 4, Layout((4,), ("S(0)",)), [0, 1, 2, 3])
    assert assign_writers([sharded], 4) == [[0, 1, 2, 3]]


def test_split_runs_cuts_at_chunk_boundaries():
    assert list(split_runs(iter([(0, 8), (10, 7)]), 4)) == [(0, 4), (4, 4), (10, 2), (12, 4), (16, 1)]


def test_uneven_and_empty_shards_match_torch_chunk():
    layout = Layout((4,), ("S(0)",))
    assert [box_shape(local_box((5, 2), layout, (r,))) for r in range(4)] == [(2, 2), (2, 2), (1, 2), (0, 2)]
    assert list(box_runs((5, 2), 4, local_box((5, 2), layout, (3,)))) == []


def test_column_shard_is_one_range_per_row():
    runs = list(box_runs((3, 4), 4, local_box((3, 4), Layout((2,), ("S(1)",)), (0,))))
    assert runs == [(0, 8), (16, 8), (32, 8)]


@pytest.mark.parametrize("layout", [
    Layout((2, 2), ("R", "S(1)"), ("dp", "tp")),
    Layout((3,), ("_S(0, 2)",)),
])
def test_layout_annotation_round_trip(layout):
    """A layout is recorded as meta.json's ``dtensor`` annotation, which the reader accepts and
    turns back into the same layout."""
    annotation = to_annotation(layout)
    parsed = parse_layout(layout_dict(annotation), "dtensor", lambda p, problem: ValueError(p + problem), (4, 4))
    assert parsed == annotation and from_annotation(parsed) == layout


@pytest.mark.parametrize("layout, problem", [
    (Layout((2,), ("P(sum)",)), "Partial tensor must be reduced"),
    (Layout((2,), ("S(2)",)), "shards dim 2 of a tensor of 2 dims"),
    (Layout((2, 2), ("S(0)",)), "one placement per mesh dim"),
    (Layout((0,), ("R",)), "mesh dims are ints"),
    (Layout((True,), ("R",)), "mesh dims are ints"),
    (Layout((2,), ("S(01)",)), "not a placement"),
    (Layout((2,), ("_S(0, 999999999)",)), "split factor beyond"),
    (Layout((2,), (" S(0)",)), "not a placement"),
    (Layout((2,), (0,)), "not a placement"),  # type: ignore[arg-type]
    (Layout((2,), ("R",), ("a", "b")), "one per mesh dim"),
    (Layout((2, 2), ("R", "R"), ("a", "a")), "distinct"),
])
def test_check_layout_refuses_what_memtree_never_writes(layout, problem):
    """What a collective write checks before it records a layout (the annotation's own JSON
    checks are the reader's: tests/test_subclass_format.py)."""
    with pytest.raises(ValueError, match=problem):
        check_layout(layout, 2)


def test_check_layout_accepts_what_fits():
    check_layout(Layout((2, 4), ("_S(0, 4)", "S(0)")), 1)
