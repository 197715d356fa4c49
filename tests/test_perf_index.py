"""Row assignment into file-backed tensors: the ``pwrite`` path and its properties (issue 9, W3).

``data[i] = item`` on a memory-mapped tree writes each row with ``pwrite`` into the very file
the tensor maps (same device and inode), through one cached descriptor per file; these tests
check, without timings, that the path is taken, opens each file once, never writes a file that
replaced the mapped one, gives bit-exact results against a plain tensor, and that readers
through the mapping see the data.
"""

from __future__ import annotations

import errno
import gc
import os
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memtree
from memtree import MemoryMappedTensor as MMT
from memtree import TensorTree
from memtree.store.reading import mapped as mmap_tensor
from treeutil import plain
from treeutil import raw_bytes as bits

pytestmark = pytest.mark.timeout(120)

SETTINGS = dict(
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def dataset(path, n: int = 64) -> TensorTree:
    datum = TensorTree(
        {
            "img": torch.zeros(3, 4, 4, dtype=torch.uint8),
            "label": torch.zeros((), dtype=torch.int64),
        }
    )
    return datum.expand(n).memmap_like(path)


def item(k: int) -> TensorTree:
    return TensorTree(
        {"img": torch.full((3, 4, 4), k % 256, dtype=torch.uint8), "label": torch.tensor(k)}
    )


@pytest.fixture
def pwrite_only(monkeypatch):
    """Count pwrite calls; fail any assignment that falls back to writing through the mapping."""
    calls: list[int] = []
    real = os.pwrite

    def spy(fd, data, offset):
        calls.append(offset)
        return real(fd, data, offset)

    def no_mapping_writes(*args):
        raise AssertionError("the assignment went through the mapping, not pwrite")

    monkeypatch.setattr(os, "pwrite", spy)
    monkeypatch.setattr(mmap_tensor, "_SETITEM", no_mapping_writes)
    return calls


@pytest.fixture
def leaf_opens(monkeypatch):
    """Paths of ``.memmap`` files opened (by anyone) through os.open."""
    seen: list[str] = []
    real = os.open

    def spy(path, flags, mode=0o777, *, dir_fd=None):
        if os.fspath(path).endswith(".memmap"):
            seen.append(os.fspath(path))
        return real(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", spy)
    return seen


# ------------------------------------------------------------------------------ the fast path


def test_thousand_item_writes_open_each_leaf_file_at_most_once(tmp_path, leaf_opens, pwrite_only):
    data = dataset(tmp_path / "d", n=5000)
    files = {data["img"].filename, data["label"].filename}  # mapped now (trees open lazily)
    leaf_opens.clear()
    pwrite_only.clear()
    g = torch.Generator().manual_seed(0)
    rows = torch.randperm(5000, generator=g)[:1000].tolist()
    for k, i in enumerate(rows):
        data[i] = item(k)
    assert len(pwrite_only) == 2000  # one pwrite per leaf and item
    assert sorted(leaf_opens) == sorted(files)  # one write descriptor per leaf file
    for k, i in enumerate(rows[-5:], start=995):
        assert data["img"][i].eq(k % 256).all() and int(data["label"][i]) == k


@pytest.mark.parametrize(
    "index",
    [
        3,
        -2,
        torch.tensor(5),
        slice(2, 6),
        slice(None, None, 3),
        slice(-4, None),
        [7, 1, 4],
        [-1, 0],
        torch.tensor([9, 2, 3, 4]),
        torch.tensor([-3, 5], dtype=torch.int32),
        torch.arange(10) % 3 == 0,  # a row mask
    ],
    ids=repr,
)
def test_row_selections_take_the_pwrite_path_and_match_a_plain_tensor(tmp_path, index, pwrite_only):
    expected = torch.arange(10 * 6, dtype=torch.float32).reshape(10, 2, 3)
    mt = MMT.from_tensor(expected, filename=tmp_path / "x.memmap")
    count = expected[index].shape[0] if expected[index].ndim == 3 else None
    value = torch.randn(2, 3) if count is None else torch.randn(count, 2, 3)
    expected[index] = value
    mt[index] = value
    assert pwrite_only, "no pwrite"
    assert bits(mt) == bits(expected)
    again = MMT.from_filename(tmp_path / "x.memmap", torch.float32, (10, 2, 3), mode="r")
    assert bits(again) == bits(expected)  # in the file, and seen by another mapping


@pytest.mark.parametrize(
    "index, value",
    [
        (4, 7),  # a Python scalar
        (4, True),
        (-1, torch.tensor([1.5, 2.5, 3.5])),  # broadcast over the row's first dim
        (slice(1, 9), torch.tensor(2.0, dtype=torch.float64)),  # cast and broadcast to 8 rows
        ([0, 5, 9], torch.ones(1, 2, 1)),  # leading 1-dims dropped, then broadcast
        (torch.tensor([3, 6]), torch.arange(2.0).reshape(2, 1, 1)),
        (2, torch.arange(6, dtype=torch.int32).reshape(1, 1, 2, 3)),
        (1, torch.randn(3, 2).t()),  # non-contiguous value
        (0, torch.randn(2, 3, requires_grad=True)),
    ],
    ids=repr,
)
def test_values_that_broadcast_or_convert_take_the_pwrite_path(tmp_path, index, value, pwrite_only):
    expected = torch.zeros(10, 2, 3)
    mt = MMT.from_tensor(expected, filename=tmp_path / "x.memmap")
    with torch.no_grad():
        expected[index] = value
    mt[index] = value
    assert pwrite_only
    assert bits(mt) == bits(expected)


def test_broadcast_over_many_rows_writes_blocks_not_a_full_size_copy(tmp_path, monkeypatch):
    monkeypatch.setattr(mmap_tensor, "_BROADCAST_BYTES", 64)
    mt = MMT.zeros((100, 4), dtype=torch.int32, filename=tmp_path / "x.memmap")
    sizes: list[int] = []
    real = os.pwrite

    def spy(fd, data, offset):
        sizes.append(len(data))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", spy)
    mt[:] = 7
    assert max(sizes) == 64 and sum(sizes) == 100 * 16
    assert plain(mt).eq(7).all()


def test_non_contiguous_but_row_contiguous_views_use_pwrite(tmp_path, pwrite_only):
    expected = torch.arange(40.0).reshape(10, 4)
    mt = MMT.from_tensor(expected, filename=tmp_path / "x.memmap")
    view, expected_view = mt[1::3], expected[1::3]
    assert isinstance(view, MMT)
    view[1] = torch.full((4,), -1.0)
    expected_view[1] = torch.full((4,), -1.0)
    view[[0, 2]] = 9.0
    expected_view[[0, 2]] = 9.0
    assert bits(mt) == bits(expected)


def test_rows_that_are_not_contiguous_go_through_the_mapping(tmp_path):
    expected = torch.arange(12.0).reshape(3, 4)
    mt = MMT.from_tensor(expected, filename=tmp_path / "x.memmap")
    mt.t()[1] = torch.tensor([-1.0, -2.0, -3.0])  # a column of the file: no pwrite path
    expected.t()[1] = torch.tensor([-1.0, -2.0, -3.0])
    assert bits(mt) == bits(expected)


def test_errors_are_torch_errors(tmp_path):
    mt = MMT.zeros((4, 3), dtype=torch.uint8, filename=tmp_path / "x.memmap")
    ref = torch.zeros(4, 3, dtype=torch.uint8)
    for index, value, error in [
        (4, 1, IndexError),
        (-5, 1, IndexError),
        ([0, 9], 1, IndexError),
        (0, torch.ones(4), RuntimeError),  # shape mismatch
        (slice(0, 2), torch.ones(3, 3), RuntimeError),
        (0, 300, RuntimeError),  # overflow of uint8
    ]:
        with pytest.raises(error):
            ref[index] = value
        with pytest.raises(error):
            mt[index] = value
    assert not plain(mt).any()


def test_values_read_from_the_same_file_follow_torch(tmp_path):
    expected = torch.arange(8.0)
    mt = MMT.from_tensor(expected, filename=tmp_path / "x.memmap")
    other = MMT.from_filename(tmp_path / "x.memmap", torch.float32, (8,))
    mt[0] = other[5]  # another mapping of the same file
    expected[0] = expected[5]
    mt[[1, 2]] = mt[[6, 7]]
    expected[[1, 2]] = expected[[6, 7]]
    assert bits(mt) == bits(expected)


def test_read_only_refuses_row_writes_and_leaves_the_file(tmp_path):
    path = tmp_path / "d"
    dataset(path, n=8)
    ro = memtree.load_memmap(path, mode="r")
    before = (path / "img.memmap").read_bytes()
    with pytest.raises(memtree.ReadOnlyError):
        ro[3] = item(1)
    with pytest.raises(memtree.ReadOnlyError):
        ro["img"][[1, 2]] = 5
    with pytest.raises(memtree.ReadOnlyError):
        torch.Tensor.__setitem__(ro["label"], 0, 1)
    assert (path / "img.memmap").read_bytes() == before


def test_full_disk_raises_storage_error_naming_the_file(tmp_path, monkeypatch):
    mt = MMT.zeros((4, 3), filename=tmp_path / "x.memmap")

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(memtree.StorageError, match=r"x\.memmap.*filesystem is full"):
        mt[1] = torch.ones(3)
    with pytest.raises(memtree.StorageError, match=r"x\.memmap"):
        mt[1:3] = 2.0


# ------------------------------------------------------------- the file written is the one mapped


def test_writes_after_the_prefix_was_resaved_reach_the_mapped_tensor_not_the_new_file(tmp_path):
    path = tmp_path / "d"
    old = dataset(path, n=8)
    old[1] = item(1)  # opens and caches a descriptor of the first version's file
    TensorTree({"img": torch.full((8, 3, 4, 4), 9, dtype=torch.uint8),
                "label": torch.full((8,), 9)}, batch_size=[8]).memmap(path)  # re-saved in place
    old[2] = item(2)
    old["img"][[3, 4]] = 7
    assert old["img"][2].eq(2).all() and int(old["label"][2]) == 2
    assert old["img"][[3, 4]].eq(7).all()
    new = memtree.load_memmap(path)
    assert new["img"].eq(9).all() and new["label"].eq(9).all()


def test_a_file_replaced_before_the_first_write_is_not_written(tmp_path):
    path = tmp_path / "x.memmap"
    mt = MMT.from_tensor(torch.zeros(4, 2), filename=path)
    MMT.from_tensor(torch.ones(4, 2), filename=path, existsok=True)  # a new inode at the path
    mt[0] = torch.full((2,), 5.0)
    mt[1:3] = 6.0
    assert plain(mt).tolist() == [[5.0, 5.0], [6.0, 6.0], [6.0, 6.0], [0.0, 0.0]]
    assert MMT.from_filename(path, torch.float32, (4, 2)).eq(1.0).all()


def test_writes_after_the_tree_was_deleted_reach_the_mapped_tensor(tmp_path):
    path = tmp_path / "x.memmap"
    mt = MMT.from_tensor(torch.zeros(4), filename=path)
    os.unlink(path)
    mt[2] = 3.0
    assert plain(mt).tolist() == [0.0, 0.0, 3.0, 0.0]


def _fds_of(path) -> list[str]:
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(os.fspath(path)):
                fds.append(fd)
        except OSError:
            pass
    return fds


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_write_descriptors_close_with_the_mapping_and_stay_bounded(tmp_path, monkeypatch):
    tmp_path = tmp_path.resolve()
    monkeypatch.setattr(mmap_tensor.WRITERS, "size", 2)
    tensors = [MMT.zeros((3,), filename=tmp_path / f"x{k}.memmap") for k in range(5)]
    for k, t in enumerate(tensors):
        t[0] = float(k)
    assert len(_fds_of(tmp_path)) == 2  # the two most recently written files
    assert [float(t[0]) for t in tensors] == [0.0, 1.0, 2.0, 3.0, 4.0]
    del tensors, t
    gc.collect()
    assert _fds_of(tmp_path) == []  # deleting the files now frees their space at once


def test_concurrent_writers_with_constant_eviction(tmp_path, monkeypatch):
    monkeypatch.setattr(mmap_tensor.WRITERS, "size", 1)
    tensors = [
        MMT.zeros((200, 8), dtype=torch.int32, filename=tmp_path / f"x{k}.memmap") for k in range(3)
    ]

    def fill(worker: int) -> None:
        for i in range(worker, 200, 4):
            for k, t in enumerate(tensors):
                t[i] = torch.full((8,), i * 10 + k, dtype=torch.int32)

    threads = [threading.Thread(target=fill, args=(w,)) for w in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for k, t in enumerate(tensors):
        assert plain(t).equal((torch.arange(200) * 10 + k).int()[:, None].expand(200, 8))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_opens_its_own_descriptor_and_its_writes_reach_the_parent(tmp_path):
    mt = MMT.zeros((4,), dtype=torch.int64, filename=tmp_path / "x.memmap")
    mt[0] = 1  # the parent caches a descriptor
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        ok = not mmap_tensor.WRITERS.open and mt._file.writer is None
        mt[1] = 2
        os._exit(0 if ok and mt._file.writer is not None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert plain(mt).tolist() == [1, 2, 0, 0]  # one page cache: the child's pwrite is seen here


# ------------------------------------------------------------------------- bit-exact properties

DTYPES = [torch.uint8, torch.int64, torch.float32, torch.bfloat16, torch.bool, torch.complex64]


def _values(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Values in [0, 100): every conversion between the dtypes used is defined (no NaN, no
    out-of-range float-to-int casts)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return (torch.rand(shape, generator=g, dtype=torch.float64) * 100).to(dtype) * (1 + 1j)
    if dtype.is_floating_point:
        return (torch.rand(shape, generator=g, dtype=torch.float64) * 100).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


@st.composite
def assignments(draw):
    n = draw(st.integers(1, 12))
    row = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    kind = draw(st.sampled_from(["int", "slice", "list", "tensor", "mask"]))
    if kind == "int":
        index = draw(st.integers(-n, n - 1))
    elif kind == "slice":
        start = draw(st.none() | st.integers(-n - 2, n + 2))
        stop = draw(st.none() | st.integers(-n - 2, n + 2))
        index = slice(start, stop, draw(st.none() | st.integers(1, 3)))
    else:
        rows = draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n))
        negate = draw(st.booleans())
        rows = [r - n if negate and r % 2 else r for r in rows]
        if kind == "list":
            index = rows or [0]
        elif kind == "tensor":
            index = torch.tensor(rows, dtype=draw(st.sampled_from([torch.int64, torch.int32])))
        else:
            index = torch.zeros(n, dtype=torch.bool)
            index[[r % n for r in rows]] = True
    dtype = draw(st.sampled_from(DTYPES))
    value_dtype = draw(st.sampled_from([dtype, dtype, torch.float64, torch.int32]))
    broadcast = draw(st.sampled_from(["full", "row", "scalar", "python", "lead1"]))
    return n, row, index, dtype, value_dtype, broadcast, draw(st.integers(0, 2**16))


@given(assignments())
@settings(**SETTINGS)
def test_random_row_assignments_are_bit_exact_with_a_plain_tensor(tmp_path_factory, case):
    n, row, index, dtype, value_dtype, broadcast, seed = case
    expected = _values(dtype, (n, *row), seed)
    path = tmp_path_factory.mktemp("p") / "x.memmap"
    mt = MMT.from_tensor(expected, filename=path)
    selected = expected[index].shape
    count = selected[0] if len(selected) > len(row) else None
    if broadcast == "full" and count is not None:
        value = _values(value_dtype, (count, *row), seed + 1)
    elif broadcast == "lead1":
        value = _values(value_dtype, (1, 1, *row), seed + 1)
    elif broadcast == "scalar":
        value = _values(value_dtype, (), seed + 1)
    elif broadcast == "python":
        value = _values(value_dtype, (), seed + 1).item()
    else:
        value = _values(value_dtype, row, seed + 1)
    try:
        expected[index] = value
    except (RuntimeError, ValueError) as err:
        with pytest.raises(type(err)):
            mt[index] = value
    else:
        mt[index] = value
    assert bits(mt) == bits(expected)
    assert path.read_bytes() == bits(expected)


def test_in_place_layout_changes_are_seen_by_later_row_writes(tmp_path):
    expected = torch.arange(9.0).reshape(3, 3)
    mt = MMT.from_tensor(expected, filename=tmp_path / "x.memmap")
    mt[0] = torch.zeros(3)  # the row layout is now known (and cached)
    expected[0] = torch.zeros(3)
    mt.t_()  # rows are the file's columns now
    expected.t_()
    mt[1] = torch.full((3,), -1.0)
    expected[1] = torch.full((3,), -1.0)
    assert bits(mt) == bits(expected)
    mt.as_strided_((2, 3), (3, 1), 3)  # rows 1 and 2 of the file
    expected.as_strided_((2, 3), (3, 1), 3)
    mt[0] = torch.full((3,), 8.0)
    expected[0] = torch.full((3,), 8.0)
    assert bits(MMT.from_filename(tmp_path / "x.memmap", torch.float32, (9,))) == bits(
        expected.as_strided((9,), (1,), 0)
    )


# ------------------------------------------------------------------------------ batch reads


@pytest.mark.parametrize(
    "index",
    [
        torch.tensor([5, 0, 9, 5]),
        torch.tensor([-1, -10, 3], dtype=torch.int32),
        torch.tensor([], dtype=torch.int64),
        (torch.tensor([2, 1]),),
    ],
    ids=repr,
)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.complex64, torch.bool])
def test_batch_reads_match_torch_indexing(tmp_path, index, dtype):
    expected = torch.arange(10 * 6).reshape(10, 2, 3).to(dtype)
    mt = MMT.from_tensor(expected, filename=tmp_path / "x.memmap")
    out = mt[index]
    assert type(out) is torch.Tensor  # a copy, not a view of the file
    assert out.dtype == dtype and out.shape == expected[index].shape
    assert bits(out) == bits(expected[index])
    assert bits(mt[1::2][index[0] // 2 if isinstance(index, tuple) else index // 2]) == bits(
        expected[1::2][index[0] // 2 if isinstance(index, tuple) else index // 2]
    )


def test_batch_reads_out_of_range_raise_torch_index_error(tmp_path):
    mt = MMT.zeros((4, 2), filename=tmp_path / "x.memmap")
    for index in (torch.tensor([0, 4]), torch.tensor([-5])):
        with pytest.raises(IndexError):
            torch.zeros(4, 2)[index]
        with pytest.raises(IndexError):
            mt[index]


def test_tree_batch_reads_see_rows_written_by_index(tmp_path):
    data = dataset(tmp_path / "d", n=100)
    for i in (3, 50, 99):
        data[i] = item(i)
    batch = data[torch.tensor([99, 3, 7, -50])]
    assert batch.batch_size == torch.Size([4])
    assert batch["label"].tolist() == [99, 3, 0, 50]
    assert batch["img"][:, 0, 0, 0].tolist() == [99, 3, 0, 50]


def test_torch_function_modes_see_row_reads_and_writes(tmp_path, monkeypatch):
    mt = MMT.zeros((6, 2), dtype=torch.int64, filename=tmp_path / "x.memmap")
    seen = []
    pwrites = []
    real = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda *args: pwrites.append(args[2]) or real(*args))

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", func))
            return func(*args, **(kwargs or {}))

    with Spy():
        mt[1] = torch.tensor([4, 5])
        batch = mt[torch.tensor([1, 0])]
    assert seen.count("__setitem__") == 1 and seen.count("__getitem__") == 1
    assert pwrites == [16]  # the write still took the pwrite path
    assert batch.tolist() == [[4, 5], [0, 0]]
