"""Batch gathers (issue 28): ``tree[idx]`` for a batch of rows, ``__getitems__`` and ``collate``.

A batch is read with one ``index_select`` per leaf into a new output (shared memory in a
DataLoader worker): these tests check, without timings, that every index form gives torch's
eager result bit for bit, that bad indices raise a typed error naming the row, the bound and the
leaves before anything is read or written, and which calls and memory the path uses.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

import memtree
from memtree import InvalidIndexError, MemoryMappedTensor, MemtreeError, TensorTree
from memtree.format.dtypes import DTYPE_NAMES, dtype_from_name
from treeutil import assert_identical, random_tensor

pytestmark = pytest.mark.timeout(300)

SETTINGS = dict(deadline=None, max_examples=80, suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.function_scoped_fixture])
N, M = 12, 3  # batch_size [N] or [N, M]


def source(batch_size: tuple[int, ...]) -> TensorTree:
    """Leaves of several dtypes and row shapes, a nested level with one more batch dim, a value."""
    g = torch.Generator().manual_seed(0)
    bs = list(batch_size)
    return TensorTree(
        {
            "img": torch.randint(0, 256, (*bs, 2, 3), dtype=torch.uint8, generator=g),
            "vec": torch.randn(*bs, 4, generator=g).to(torch.bfloat16),
            "flag": torch.rand(*bs, generator=g) > 0.5,
            "z": torch.randn(*bs, 2, dtype=torch.complex64, generator=g),
            "sub": TensorTree({"id": torch.arange(int(np.prod(bs)) * 5).view(*bs, 5)}, batch_size=bs + [5]),
            "name": "train",
        },
        batch_size=bs,
    )


@pytest.fixture(scope="module", params=["plain", "mapped", "lazy", "packed"])
def trees(request, tmp_path_factory):
    """(tree under test, the same tree of plain tensors) for batch sizes [N] and [N, M]; "packed"
    loads a tree whose leaves all share one pack file (format version 3)."""
    out = {}
    for bs in ((N,), (N, M)):
        src = source(bs)
        if request.param == "plain":
            out[bs] = (src, src)
            continue
        d = tmp_path_factory.mktemp("g") / f"t{len(bs)}"
        mapped = src.memmap(d, pack_below=1 << 20 if request.param == "packed" else None)
        assert ((d / "~pack-0.memmap").exists()) == (request.param == "packed")
        out[bs] = (mapped if request.param == "mapped" else memtree.load_memmap(d), src)
    return out


def expected(src: TensorTree, rows: torch.Tensor) -> dict:
    """Torch's eager result, leaf by leaf, with the rows as an int64 tensor (or a bool mask)."""
    return {k: v[rows] if isinstance(v, torch.Tensor) else v for k, v in _flat(src).items()}


def _flat(tree: TensorTree) -> dict:
    return dict(tree.items(include_nested=True, leaves_only=True))


def assert_batch(got: TensorTree, src: TensorTree, rows: torch.Tensor) -> None:
    want = expected(src, rows)
    assert got.batch_size == torch.zeros(src.batch_size)[rows].shape
    assert got["sub"].batch_size == got.batch_size + torch.Size([5])
    flat = _flat(got)
    assert list(flat) == list(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert type(flat[k]) is torch.Tensor and not isinstance(flat[k], MemoryMappedTensor), k
        assert_identical(flat[k], v, f"leaf {k}")


INT_DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint16, torch.uint32, torch.uint64]


@st.composite
def indices(draw):
    """(index in some form, the same rows as an int64 tensor or a bool mask)."""
    kind = draw(st.sampled_from(["tensor", "list", "numpy", "mask", "2d"]))
    if kind == "mask":
        mask = draw(st.lists(st.booleans(), min_size=N, max_size=N))
        form = draw(st.sampled_from(["tensor", "numpy", "list"]))
        idx = {"tensor": torch.tensor(mask), "numpy": np.array(mask), "list": mask}[form]
        return idx, torch.tensor(mask)
    dtype = draw(st.sampled_from(INT_DTYPES))
    low = 0 if not dtype.is_signed else -N
    values = draw(st.lists(st.integers(low, N - 1), max_size=20))  # duplicates, negatives, empty
    rows = torch.tensor(values, dtype=torch.int64)
    if kind == "2d":
        k = len(values) - len(values) % 2
        values, rows = values[:k], rows[:k].view(2, -1) if k else rows[:0].view(2, 0)
        return torch.tensor(values, dtype=torch.int64).view(rows.shape).to(dtype), rows
    if kind == "list":
        return list(values), rows
    if kind == "numpy":
        return np.array(values, dtype=str(dtype).replace("torch.", "")), rows
    return torch.tensor(values, dtype=torch.int64).to(dtype), rows


@settings(**SETTINGS)
@given(case=indices(), two_dims=st.booleans())
def test_every_index_form_gives_torchs_eager_result_bit_exact(trees, case, two_dims):
    tree, src = trees[(N, M) if two_dims else (N,)]
    idx, rows = case
    assert_batch(tree[idx], src, rows)
    assert_batch(tree[(idx,)], src, rows)


@settings(**SETTINGS)
@given(case=indices())
def test_getitems_and_batch_reads_agree(trees, case):
    tree, src = trees[(N,)]
    idx, rows = case
    if rows.dtype == torch.bool or rows.ndim != 1:
        return
    assert_batch(tree.__getitems__(rows.tolist()), src, rows)


@pytest.mark.parametrize(
    "bad, shown",
    [
        ([N], f"index {N} is out of range for dim 0 of size {N}"),
        (torch.tensor([0, -N - 1]), f"index {-N - 1} is out of range"),
        (torch.tensor([3, N + 5], dtype=torch.int32), f"index {N + 5} is out of range"),
        (np.array([2**64 - 1], dtype=np.uint64), f"index {2**64 - 1} is out of range"),
        (torch.tensor([N], dtype=torch.uint16), f"index {N} is out of range"),
        ([2**70], "is out of range"),
        (torch.ones(N + 1, dtype=torch.bool), f"a mask of length {N + 1} cannot select rows of dim 0 of size {N}"),
        ([True, False], f"a mask of length 2 cannot select rows of dim 0 of size {N}"),
    ],
    ids=repr,
)
def test_bad_rows_raise_a_typed_error_naming_the_row_the_bound_and_the_leaves(trees, bad, shown):
    tree, _ = trees[(N,)]
    with pytest.raises(InvalidIndexError) as err:
        tree[bad]
    assert isinstance(err.value, MemtreeError) and isinstance(err.value, IndexError)
    assert shown in str(err.value) and "'img'" in str(err.value) and f"[{N}]" in str(err.value)


def test_an_empty_tree_reports_that_it_has_no_rows():
    tree = TensorTree({"x": torch.zeros(0, 2)}, batch_size=[0])
    assert tree[[]]["x"].shape == (0, 2)
    with pytest.raises(InvalidIndexError, match="it has no rows"):
        tree[[0]]


def test_other_batch_indices_keep_torchs_semantics_with_typed_errors(trees):
    tree, src = trees[(N, M)]
    for idx in (3, slice(2, 9, 3), (slice(None), 1), (torch.tensor([1, 2]), 0), torch.ones(N, M, dtype=torch.bool)):
        got, want = _flat(tree[idx]), _flat(src[idx])
        for k, v in want.items():
            assert_identical(got[k].as_subclass(torch.Tensor) if isinstance(got[k], torch.Tensor) else got[k], v, k)
    with pytest.raises(InvalidIndexError, match=r"does not fit a tree of batch_size \[12, 3\]"):
        tree[:, 7]


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_every_dtype_and_row_layout_is_gathered_bit_exact(name, tmp_path):
    """Regressions: torch has no CPU ``index_select`` for 1-D uint16/uint32/uint64 tensors (on main
    a batch of such a mapped leaf raised ``NotImplementedError``), and ``index_select`` of a
    strided tensor reports a negative row with a ``RuntimeError`` (on main a negative row of a
    strided mapped leaf raised it, instead of counting from the end)."""
    dtype = dtype_from_name(name)
    leaves = {
        "rows": random_tensor((N,), dtype, seed=1),
        "grid": random_tensor((N, 3, 2), dtype, seed=2),
        "strided": random_tensor((N, 4), dtype, seed=3)[:, ::2],
        "empty": random_tensor((N, 0), dtype),
    }
    plain_tree = TensorTree(leaves, batch_size=[N])
    rows = torch.tensor([N - 1, 0, 5, 5, -2])
    want = rows % N
    for tree in (plain_tree, plain_tree.memmap(tmp_path / "t"), memtree.load_memmap(tmp_path / "t", mode="r")):
        batch = tree[rows]
        for key, leaf in leaves.items():
            got = batch[key]
            assert got.dtype == dtype and got.shape == (len(rows), *leaf.shape[1:]), key
            bits = _as_bytes(leaf).reshape(N, -1)
            assert torch.equal(_as_bytes(got).reshape(len(rows), -1), bits[want]), key


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s elements, row-major (viewed as ints of their size first: torch has no
    copy kernel for the sub-byte and bits dtypes)."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.dtype.itemsize)
    return (t.view(ints) if ints is not None and t.ndim else t).contiguous().view(torch.uint8)


def test_a_batch_is_one_index_select_per_leaf_and_no_row_by_row_indexing(tmp_path):
    """No per-row Python and no torch advanced indexing of the mapped leaves: each leaf is read
    with one ``index_select``, whatever form the rows come in."""
    tree = source((N,)).memmap(tmp_path / "t")
    leaves = {k: v.filename for k, v in _flat(tree).items() if isinstance(v, torch.Tensor)}
    calls: list[tuple[str, str]] = []

    class Reads(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func.__name__ != "__get__" and args and isinstance(args[0], MemoryMappedTensor):
                calls.append((func.__name__, args[0].filename))
            return func(*args, **(kwargs or {}))

    for idx in (torch.tensor([5, 1, 1]), [5, 1, 1], np.array([5, 1, 1]), torch.arange(N) < 3):
        calls.clear()
        with Reads():
            tree[idx]
        reads = sorted(c for c in calls if c[0] not in ("is_conj", "is_neg"))
        assert reads == sorted(("index_select", f) for f in leaves.values()), idx


def test_a_kept_leaf_keeps_only_its_own_memory(tmp_path):
    tree = source((N,)).memmap(tmp_path / "t")
    batch = tree[torch.arange(6)]
    assert batch["flag"].untyped_storage().nbytes() == 6  # not a share of one buffer for the batch
    assert batch["img"].untyped_storage().nbytes() == 6 * 6


def test_gathers_from_a_read_only_tree_are_writable_copies(tmp_path):
    d = tmp_path / "t"
    source((N,)).memmap(d)
    tree = memtree.load_memmap(d, mode="r")
    before = (d / "img.memmap").read_bytes()
    batch = tree[[0, 1]]
    batch["img"] += 1
    assert (d / "img.memmap").read_bytes() == before


def test_leaves_torch_indexes_itself_keep_autograd_and_devices(tmp_path):
    w = torch.randn(N, 3, requires_grad=True)
    tree = TensorTree({"w": w, "x": torch.arange(N)}, batch_size=[N])
    batch = tree[[4, -1]]
    batch["w"].sum().backward()
    assert w.grad is not None and w.grad[4].tolist() == [1.0] * 3 and w.grad[N - 1].tolist() == [1.0] * 3
    assert batch["x"].tolist() == [4, N - 1]
    d = tmp_path / "t"
    source((N,)).memmap(d)
    meta = memtree.load_memmap(d, device="meta")[torch.tensor([1, 2, 3])]
    assert meta["img"].device.type == "meta" and meta["img"].shape == (3, 2, 3)


def test_row_writes_are_checked_once_before_any_leaf_is_written(tmp_path):
    tree = source((N,)).memmap(tmp_path / "t")
    before = {k: v.clone() for k, v in _flat(tree).items() if isinstance(v, torch.Tensor)}
    rows = source((N,))[[0, 1]]
    for bad in ([0, N], torch.tensor([N], dtype=torch.int16), np.array([-N - 1])):
        with pytest.raises(InvalidIndexError, match="out of range for dim 0 of size 12"):
            tree[bad] = rows
    for k, v in before.items():
        assert torch.equal(tree[k], v), k
    tree[np.array([-1, 0], dtype=np.int16)] = rows
    assert torch.equal(tree["img"][[N - 1, 0]], rows["img"]) and torch.equal(tree["sub", "id"][N - 1], rows["sub", "id"][0])


# ------------------------------------------------------------------------ DataLoader workers


class Probe(Dataset):
    """Reads a batch as the loader's dataset would, and reports from the worker whether its
    leaves were already in shared memory before they were sent."""

    def __init__(self, tree, records: bool = False):
        self.tree, self.records = tree, records

    def __len__(self):
        return len(self.tree)

    def __getitem__(self, idx):
        if self.records:  # a list of records, collated as the default collate_fn would
            batch = memtree.collate([self.tree[int(i)] for i in idx])
        else:
            batch = self.tree[idx]
        shared = [v.is_shared() for v in batch.values(include_nested=True, leaves_only=True)
                  if isinstance(v, torch.Tensor)]
        return batch, shared


@pytest.mark.parametrize("records", [False, True], ids=["gather", "collate"])
def test_workers_gather_into_shared_memory_sent_without_another_copy(tmp_path, records):
    src = source((N,))
    tree = src.memmap(tmp_path / "t")
    sampler = memtree.BatchIndexSampler(tree, 5, shuffle=True, generator=torch.Generator().manual_seed(2))
    loader = DataLoader(Probe(tree, records), sampler=sampler, batch_size=None, num_workers=2,
                        multiprocessing_context="fork")
    got = list(loader)
    order = torch.cat(list(memtree.BatchIndexSampler(N, 5, shuffle=True, generator=torch.Generator().manual_seed(2))))
    assert all(all(shared) and len(shared) == 5 for _, shared in got)
    assert_batch(memtree.cat([b for b, _ in got]), src, order)
    in_process = Probe(tree, records)[torch.tensor([3, 1])]
    assert not any(in_process[1])  # ordinary memory outside a worker


def test_batch_loader_reads_every_item_with_workers(tmp_path):
    src = source((N,))
    tree = src.memmap(tmp_path / "t")
    batches = list(memtree.batch_loader(tree, 5, num_workers=2, multiprocessing_context="fork"))
    assert [len(b) for b in batches] == [5, 5, 2]
    assert_batch(memtree.cat(batches), src, torch.arange(N))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs CUDA")
def test_batch_loader_pins_batches_as_it_gathers_them(tmp_path):  # pragma: no cover - GPU machines
    src = source((N,))
    tree = src.memmap(tmp_path / "t")
    loader = memtree.batch_loader(tree, 5, pin_memory=True)
    batches = list(loader)
    for b in batches:
        assert all(v.is_pinned() for v in b.values(include_nested=True, leaves_only=True) if isinstance(v, torch.Tensor))
    assert_batch(memtree.cat(batches), src, torch.arange(N))


@pytest.mark.parametrize("shape, dtype", [((N, 0), torch.float32), ((N,), torch.uint64), ((N, 2), torch.uint32)], ids=str)
def test_a_mapped_leaf_reads_rows_as_torch_does(shape, dtype, tmp_path):
    """Regression: on main, ``leaf[rows]`` of a mapped leaf with rows of no elements and a
    negative row raised ``RuntimeError`` (from ``index_select``), and a 1-D uint64 leaf
    ``NotImplementedError``: both are left to torch's indexing now, as for a plain tensor."""
    plain_leaf = random_tensor(shape, dtype)
    mapped = TensorTree({"x": plain_leaf}, batch_size=[N]).memmap(tmp_path / "t")["x"]
    rows = torch.tensor([-2, 3, N - 1])
    assert_identical(mapped[rows].as_subclass(torch.Tensor), plain_leaf[rows], "leaf")
