"""MemoryMappedTensor: construction, files on disk, views, read-only mode, size checks, dtypes,
and pickling to worker processes (SPEC §2, API.md "MemoryMappedTensor")."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch
import torch.multiprocessing as tmp_mp

import memtree
from memtree import MemoryMappedTensor as MMT
from treeutil import plain, random_tensor, raw_bytes

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

# The closed dtype list of docs/format.md, restricted to the dtypes this torch has.
FORMAT_DTYPE_NAMES = [
    "bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
]
DTYPES = [getattr(torch, n) for n in FORMAT_DTYPE_NAMES if getattr(torch, n, None) is not None]
SHAPES = [(), (0,), (2, 0, 3), (1,), (7,), (3, 5), (2, 3, 4)]


# ----------------------------------------------------------------------------- helpers


def file_bytes(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def write_file(path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


# ----------------------------------------------------------------------------- construction


def test_from_tensor_writes_exact_bytes_to_file(tmp_path):
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    f = tmp_path / "x.memmap"
    mt = MMT.from_tensor(t, filename=str(f))
    assert isinstance(mt, MMT)
    assert isinstance(mt, torch.Tensor)
    assert mt.shape == (3, 4) and mt.dtype == torch.float32
    assert torch.equal(plain(mt), t)
    assert mt.filename == str(f)
    assert os.path.getsize(f) == 12 * 4
    assert file_bytes(f) == raw_bytes(t)


def test_from_tensor_accepts_pathlike_filename(tmp_path):
    t = torch.arange(5, dtype=torch.int64)
    f = tmp_path / "p.memmap"
    mt = MMT.from_tensor(t, filename=f)
    assert mt.filename == str(f)
    assert file_bytes(f) == raw_bytes(t)


def test_from_tensor_does_not_alias_source(tmp_path):
    t = torch.zeros(4)
    mt = MMT.from_tensor(t, filename=str(tmp_path / "x.memmap"))
    mt.fill_(3.0)
    assert torch.equal(t, torch.zeros(4))


def test_from_tensor_of_non_contiguous_source_is_row_major(tmp_path):
    t = torch.arange(12, dtype=torch.int32).reshape(3, 4).t()
    f = tmp_path / "x.memmap"
    mt = MMT.from_tensor(t, filename=str(f))
    assert mt.shape == (4, 3)
    assert torch.equal(plain(mt), t)
    assert file_bytes(f) == t.contiguous().numpy().tobytes()


def test_from_tensor_copy_data_false_has_shape_dtype_and_full_size_file(tmp_path):
    t = torch.ones(6, 2, dtype=torch.float64)
    f = tmp_path / "x.memmap"
    mt = MMT.from_tensor(t, filename=str(f), copy_data=False)
    assert mt.shape == (6, 2) and mt.dtype == torch.float64
    assert os.path.getsize(f) == 6 * 2 * 8


@pytest.mark.parametrize(
    "args", [(2, 3), ((2, 3),), ([2, 3],), (torch.Size([2, 3]),)], ids=["ints", "tuple", "list", "Size"]
)
@pytest.mark.parametrize("ctor", ["empty", "zeros", "ones"])
def test_shape_is_ints_or_one_sequence(tmp_path, ctor, args):
    f = tmp_path / "x.memmap"
    mt = getattr(MMT, ctor)(*args, dtype=torch.float32, filename=str(f))
    assert isinstance(mt, MMT)
    assert mt.shape == (2, 3)
    assert mt.dtype == torch.float32
    assert os.path.getsize(f) == 2 * 3 * 4


@pytest.mark.parametrize("ctor", ["empty", "zeros", "ones"])
def test_default_dtype_is_torch_default(tmp_path, ctor):
    mt = getattr(MMT, ctor)(3, filename=str(tmp_path / "x.memmap"))
    assert mt.dtype == torch.get_default_dtype()


def test_zeros_file_is_all_zero_bytes(tmp_path):
    f = tmp_path / "z.memmap"
    mt = MMT.zeros(4, 5, dtype=torch.int16, filename=str(f))
    assert torch.equal(plain(mt), torch.zeros(4, 5, dtype=torch.int16))
    assert file_bytes(f) == bytes(4 * 5 * 2)


def test_ones_file_holds_ones(tmp_path):
    f = tmp_path / "o.memmap"
    mt = MMT.ones(3, 2, dtype=torch.float32, filename=str(f))
    assert torch.equal(plain(mt), torch.ones(3, 2))
    assert file_bytes(f) == torch.ones(3, 2).numpy().tobytes()


@pytest.mark.parametrize("shape", [(2, 3), [2, 3], torch.Size([2, 3])])
def test_full_fills_value(tmp_path, shape):
    f = tmp_path / "f.memmap"
    mt = MMT.full(shape, 7.5, dtype=torch.float64, filename=str(f))
    assert mt.shape == (2, 3)
    assert torch.equal(plain(mt), torch.full((2, 3), 7.5, dtype=torch.float64))
    assert file_bytes(f) == torch.full((2, 3), 7.5, dtype=torch.float64).numpy().tobytes()


def test_full_integer_dtype(tmp_path):
    mt = MMT.full((4,), -3, dtype=torch.int8, filename=str(tmp_path / "f.memmap"))
    assert torch.equal(plain(mt), torch.full((4,), -3, dtype=torch.int8))


def test_from_filename_maps_existing_file(tmp_path):
    f = tmp_path / "raw.memmap"
    arr = np.arange(12, dtype=np.float32)
    write_file(f, arr.tobytes())
    mt = MMT.from_filename(str(f), torch.float32, (3, 4))
    assert isinstance(mt, MMT)
    assert mt.filename == str(f)
    assert torch.equal(plain(mt), torch.arange(12, dtype=torch.float32).reshape(3, 4))


@pytest.mark.parametrize("shape", [(3, 4), [3, 4], torch.Size([3, 4])])
def test_from_filename_shape_as_any_sequence(tmp_path, shape):
    f = tmp_path / "raw.memmap"
    write_file(f, np.arange(12, dtype=np.int32).tobytes())
    mt = MMT.from_filename(str(f), torch.int32, shape)
    assert mt.shape == (3, 4)


def test_from_filename_zero_element_on_empty_file(tmp_path):
    f = tmp_path / "e.memmap"
    write_file(f, b"")
    mt = MMT.from_filename(str(f), torch.float32, (0, 3))
    assert mt.shape == (0, 3)
    assert mt.numel() == 0


def test_from_filename_r_plus_writes_reach_file(tmp_path):
    f = tmp_path / "raw.memmap"
    write_file(f, bytes(16))
    mt = MMT.from_filename(str(f), torch.int32, (4,), mode="r+")
    mt[2] = 99
    mt.add_(1)
    expected = np.array([1, 1, 100, 1], dtype=np.int32).tobytes()
    assert file_bytes(f) == expected


def test_values_written_are_visible_to_a_second_mapping(tmp_path):
    f = tmp_path / "x.memmap"
    a = MMT.zeros(5, dtype=torch.float32, filename=str(f))
    a[1] = 4.0
    b = MMT.from_filename(str(f), torch.float32, (5,))
    assert b[1].item() == 4.0
    b[3] = 2.0
    assert a[3].item() == 2.0


# ----------------------------------------------------------------------------- anonymous mode


def test_anonymous_from_tensor_has_no_filename_and_creates_no_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    t = torch.randn(3, 4)
    mt = MMT.from_tensor(t)
    assert isinstance(mt, MMT)
    assert mt.filename is None
    assert torch.equal(plain(mt), t)
    mt.fill_(1.0)
    assert torch.equal(plain(mt), torch.ones(3, 4))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("ctor", ["empty", "zeros", "ones"])
def test_anonymous_constructors(tmp_path, monkeypatch, ctor):
    monkeypatch.chdir(tmp_path)
    mt = getattr(MMT, ctor)(2, 3, dtype=torch.float32)
    assert mt.filename is None
    assert mt.shape == (2, 3)
    assert os.listdir(tmp_path) == []


def test_anonymous_full(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mt = MMT.full((2,), 3, dtype=torch.int64)
    assert mt.filename is None
    assert torch.equal(plain(mt), torch.full((2,), 3))
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- existsok


@pytest.mark.parametrize(
    "make",
    [
        lambda f, **kw: MMT.from_tensor(torch.ones(4), filename=f, **kw),
        lambda f, **kw: MMT.empty(4, dtype=torch.float32, filename=f, **kw),
        lambda f, **kw: MMT.zeros(4, dtype=torch.float32, filename=f, **kw),
        lambda f, **kw: MMT.ones(4, dtype=torch.float32, filename=f, **kw),
        lambda f, **kw: MMT.full((4,), 2.0, dtype=torch.float32, filename=f, **kw),
    ],
    ids=["from_tensor", "empty", "zeros", "ones", "full"],
)
def test_existing_file_refused_without_existsok_and_left_unchanged(tmp_path, make):
    f = tmp_path / "x.memmap"
    original = b"precious-bytes!!"  # 16 bytes == 4 float32
    write_file(f, original)
    with pytest.raises(memtree.DestinationExistsError) as ei:
        make(str(f))
    assert isinstance(ei.value, FileExistsError)
    assert isinstance(ei.value, memtree.MemtreeError)
    assert file_bytes(f) == original


def test_existsok_true_overwrites_existing_file(tmp_path):
    f = tmp_path / "x.memmap"
    write_file(f, bytes(16))
    t = torch.tensor([1.0, 2.0, 3.0, 4.0])
    mt = MMT.from_tensor(t, filename=str(f), existsok=True)
    assert torch.equal(plain(mt), t)
    assert file_bytes(f) == t.numpy().tobytes()


def test_existsok_true_new_file_of_different_size(tmp_path):
    f = tmp_path / "x.memmap"
    write_file(f, bytes(3))
    mt = MMT.zeros(10, dtype=torch.int64, filename=str(f), existsok=True)
    assert mt.shape == (10,)
    assert os.path.getsize(f) == 80
    assert file_bytes(f) == bytes(80)


# ----------------------------------------------------------------------------- views write through


def test_slice_view_writes_through_to_file(tmp_path):
    f = tmp_path / "x.memmap"
    mt = MMT.zeros(4, 3, dtype=torch.float32, filename=str(f))
    v = mt[1:3]
    v.fill_(5.0)
    expected = np.zeros((4, 3), dtype=np.float32)
    expected[1:3] = 5.0
    assert file_bytes(f) == expected.tobytes()


def test_integer_index_view_writes_through_to_file(tmp_path):
    f = tmp_path / "x.memmap"
    mt = MMT.zeros(4, 3, dtype=torch.int32, filename=str(f))
    row = mt[2]
    row += 7
    mt[0, 1] = 9
    expected = np.zeros((4, 3), dtype=np.int32)
    expected[2] = 7
    expected[0, 1] = 9
    assert file_bytes(f) == expected.tobytes()


def test_strided_view_writes_through_to_file(tmp_path):
    f = tmp_path / "x.memmap"
    mt = MMT.zeros(6, dtype=torch.int64, filename=str(f))
    mt[::2].copy_(torch.tensor([1, 2, 3]))
    mt.view(2, 3)[1, 1] = 42
    expected = np.array([1, 0, 2, 0, 3, 0], dtype=np.int64)
    expected[4] = 42
    assert file_bytes(f) == expected.tobytes()


def test_writes_reach_file_seen_by_plain_read(tmp_path):
    f = tmp_path / "x.memmap"
    mt = MMT.from_tensor(torch.zeros(8, dtype=torch.uint8), filename=str(f))
    mt[3:5] = 255
    assert file_bytes(f) == bytes([0, 0, 0, 255, 255, 0, 0, 0])


# ----------------------------------------------------------------------------- read-only mode

READ_ONLY_WRITES = {
    "fill_": lambda t: t.fill_(1),
    "add_": lambda t: t.add_(1),
    "setitem_int": lambda t: t.__setitem__(0, 1),
    "setitem_slice": lambda t: t.__setitem__(slice(1, 3), 2),
    "zero_": lambda t: t.zero_(),
    "copy_": lambda t: t.copy_(torch.ones_like(plain(t))),
    "view_fill_": lambda t: t[1:3].fill_(5),
    "row_iadd": lambda t: t[0].add_(3),
    "mul_": lambda t: t.mul_(2),
}


@pytest.mark.parametrize("op", list(READ_ONLY_WRITES), ids=list(READ_ONLY_WRITES))
def test_read_only_mapping_refuses_writes_and_file_unchanged(tmp_path, op):
    f = tmp_path / "ro.memmap"
    data = np.arange(8, dtype=np.int32)
    write_file(f, data.tobytes())
    st = os.stat(f)
    mt = MMT.from_filename(str(f), torch.int32, (4, 2), mode="r")
    with pytest.raises(memtree.ReadOnlyError) as ei:
        READ_ONLY_WRITES[op](mt)
    assert isinstance(ei.value, memtree.MemtreeError)
    assert file_bytes(f) == data.tobytes()
    assert os.stat(f).st_size == st.st_size
    # still readable
    assert torch.equal(plain(mt).reshape(-1), torch.arange(8, dtype=torch.int32))


TO_NUMPY = {
    "numpy()": lambda t: t.numpy(),
    "numpy(force=True)": lambda t: t.numpy(force=True),
    "np.asarray": lambda t: np.asarray(t),
    "view.numpy()": lambda t: t[1:3].numpy(),
    "detach().numpy()": lambda t: t.detach().numpy(),
    "row.numpy()": lambda t: t[0].numpy(),
}


@pytest.mark.parametrize("how", list(TO_NUMPY))
def test_read_only_mapping_gives_read_only_numpy_arrays(tmp_path, how):
    f = tmp_path / "ro.memmap"
    data = np.arange(8, dtype=np.int32)
    write_file(f, data.tobytes())
    mt = MMT.from_filename(str(f), torch.int32, (4, 2), mode="r")
    array = TO_NUMPY[how](mt)
    assert not array.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        array[...] = 7
    with pytest.raises(ValueError):
        array.flags.writeable = True  # numpy refuses to make it writeable again
    assert file_bytes(f) == data.tobytes()
    assert torch.equal(plain(mt).reshape(-1), torch.arange(8, dtype=torch.int32))


@pytest.mark.parametrize("lazy", [True, False])
def test_a_tree_loaded_with_mode_r_gives_read_only_numpy_arrays(tmp_path, lazy):
    memtree.TensorTree({"x": torch.ones(2, 3), "n": {"y": torch.arange(2)}}, batch_size=[2]).memmap(tmp_path / "t")
    before = file_bytes(tmp_path / "t" / "n" / "y.memmap")
    tree = memtree.load_memmap(tmp_path / "t", mode="r", lazy=lazy)
    arrays = [tree["x"].numpy(), tree["n", "y"].numpy(), np.asarray(tree["n"]["y"][1:])]
    assert [a.flags.writeable for a in arrays] == [False, False, False]
    with pytest.raises(ValueError, match="read-only"):
        arrays[1][0] = 5
    assert file_bytes(tmp_path / "t" / "n" / "y.memmap") == before
    assert memtree.load_memmap(tmp_path / "t", lazy=lazy)["n", "y"].numpy().flags.writeable  # r+


def test_read_write_mapping_gives_numpy_arrays_that_write_through(tmp_path):
    f = tmp_path / "rw.memmap"
    write_file(f, np.zeros(4, dtype=np.int32).tobytes())
    array = MMT.from_filename(str(f), torch.int32, (4,)).numpy()
    assert array.flags.writeable
    array[1] = 9
    assert file_bytes(f) == np.array([0, 9, 0, 0], dtype=np.int32).tobytes()


ALIASES = {
    "as_subclass": lambda t: t.as_subclass(torch.Tensor),
    "torch.Tensor(t)": lambda t: torch.Tensor(t),
    "dlpack": lambda t: torch.from_dlpack(t.as_subclass(torch.Tensor)),
}


@pytest.mark.parametrize("how", list(ALIASES))
def test_writes_through_a_plain_alias_of_a_read_only_mapping_never_reach_the_file(tmp_path, how):
    """What torch cannot refuse (it has no read-only tensors): a plain alias can be written, but
    only this process's private copy-on-write pages change (docs/guide/reliability.md)."""
    f = tmp_path / "ro.memmap"
    data = np.arange(8, dtype=np.float32)
    write_file(f, data.tobytes())
    mt = MMT.from_filename(str(f), torch.float32, (8,), mode="r")
    alias = ALIASES[how](mt)
    assert type(alias) is torch.Tensor
    alias[0] = -1.0  # no error: torch cannot know
    assert plain(mt)[0] == -1.0  # this process sees its private copy of the page
    assert file_bytes(f) == data.tobytes()  # the file, and every other mapping of it, do not
    assert MMT.from_filename(str(f), torch.float32, (8,), mode="r")[0] == 0.0


def test_read_only_mapping_reads_values(tmp_path):
    f = tmp_path / "ro.memmap"
    write_file(f, np.array([1.5, -2.0], dtype=np.float64).tobytes())
    mt = MMT.from_filename(str(f), torch.float64, (2,), mode="r")
    assert mt.sum().item() == -0.5
    assert torch.equal(plain(mt * 2), torch.tensor([3.0, -4.0], dtype=torch.float64))


def test_read_only_out_of_place_ops_give_writable_results(tmp_path):
    f = tmp_path / "ro.memmap"
    write_file(f, np.ones(4, dtype=np.float32).tobytes())
    mt = MMT.from_filename(str(f), torch.float32, (4,), mode="r")
    c = mt.clone()
    c.add_(1)  # the clone is ordinary memory
    assert torch.equal(plain(c), torch.full((4,), 2.0))
    assert file_bytes(f) == np.ones(4, dtype=np.float32).tobytes()


# ----------------------------------------------------------------------------- size checks


@pytest.mark.parametrize("mode", ["r+", "r"])
@pytest.mark.parametrize("nbytes", [0, 10, 15, 17, 20, 4096], ids=lambda n: f"{n}B")
def test_wrong_size_file_refused_and_unchanged(tmp_path, mode, nbytes):
    f = tmp_path / "bad.memmap"
    data = bytes((i * 7) % 256 for i in range(nbytes))
    write_file(f, data)
    with pytest.raises(memtree.LeafSizeError) as ei:
        MMT.from_filename(str(f), torch.float32, (4,), mode=mode)  # needs 16 bytes
    assert isinstance(ei.value, memtree.MemtreeError)
    assert os.path.getsize(f) == nbytes
    assert file_bytes(f) == data
    assert str(f) in str(ei.value)


def test_zero_element_shape_refuses_non_empty_file(tmp_path):
    f = tmp_path / "bad.memmap"
    write_file(f, b"x")
    with pytest.raises(memtree.LeafSizeError):
        MMT.from_filename(str(f), torch.float32, (0,))
    assert file_bytes(f) == b"x"


@pytest.mark.parametrize("mode", ["r+", "r"])
def test_missing_file_refused_and_not_created(tmp_path, mode):
    f = tmp_path / "missing.memmap"
    with pytest.raises(memtree.MemtreeError) as ei:
        MMT.from_filename(str(f), torch.float32, (4,), mode=mode)
    assert isinstance(ei.value, FileNotFoundError)
    assert not os.path.lexists(f)
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- dtype matrix


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)) or "scalar")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_dtype_round_trip_bit_exact_through_file(tmp_path, dtype, shape):
    t = random_tensor(shape, dtype, seed=hash((str(dtype), shape)) & 0xFFFF)
    f = tmp_path / "x.memmap"
    mt = MMT.from_tensor(t, filename=str(f))
    assert mt.dtype == dtype and mt.shape == torch.Size(shape)
    assert raw_bytes(mt) == raw_bytes(t)
    assert file_bytes(f) == raw_bytes(t)
    assert os.path.getsize(f) == t.numel() * t.element_size()
    for mode in ("r+", "r"):
        back = MMT.from_filename(str(f), dtype, shape, mode=mode)
        assert back.dtype == dtype and back.shape == torch.Size(shape)
        assert raw_bytes(back) == raw_bytes(t)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_dtype_round_trip_bit_exact_anonymous(dtype):
    for shape in [(), (0,), (3, 2)]:
        t = random_tensor(shape, dtype, seed=3)
        mt = MMT.from_tensor(t)
        assert mt.filename is None
        assert mt.dtype == dtype and mt.shape == torch.Size(shape)
        assert raw_bytes(mt) == raw_bytes(t)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_dtype_zeros_and_empty(tmp_path, dtype):
    z = MMT.zeros(2, 3, dtype=dtype, filename=str(tmp_path / "z.memmap"))
    assert z.dtype == dtype
    assert raw_bytes(z) == raw_bytes(torch.zeros(2, 3, dtype=dtype))
    assert file_bytes(tmp_path / "z.memmap") == raw_bytes(torch.zeros(2, 3, dtype=dtype))
    e = MMT.empty(4, dtype=dtype, filename=str(tmp_path / "e.memmap"))
    assert e.dtype == dtype
    assert os.path.getsize(tmp_path / "e.memmap") == 4 * e.element_size()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_dtype_write_through_view(tmp_path, dtype):
    f = tmp_path / "x.memmap"
    mt = MMT.zeros(4, dtype=dtype, filename=str(f))
    src = random_tensor((2,), dtype, seed=11)
    mt[1:3].copy_(src)
    expected = torch.zeros(4, dtype=dtype)
    expected[1:3].copy_(src)
    assert file_bytes(f) == raw_bytes(expected)


# ----------------------------------------------------------------------------- pickling to workers
# Module-level helpers so that spawn workers can import them.


def _worker_sum(mt):
    return float(plain(mt).double().sum().item()), type(mt).__name__, getattr(mt, "filename", "?")


def _worker_bytes(mt):
    return raw_bytes(mt)


def _worker_write(mt, index, value):
    mt[index] = value
    return True


def _process_write(mt, q):
    try:
        mt[0] = 123
        mt[-1] = -5
        q.put("ok")
    except BaseException as e:  # pragma: no cover - reported to the parent
        q.put(repr(e))


class _MMTDataset(torch.utils.data.Dataset):
    def __init__(self, mt):
        self.mt = mt

    def __len__(self):
        return self.mt.shape[0]

    def __getitem__(self, i):
        return self.mt[i]


#: Seconds to wait for a spawn-started process: it imports torch first (5 s on an idle 2-core
#: machine, several times that under load); a hang still fails.
SPAWN_TIMEOUT = 180


@pytest.fixture(scope="module")
def spawn_pool():
    """One spawn-started worker shared by the tests below (starting one costs seconds)."""
    pool = tmp_mp.get_context("spawn").Pool(1)
    yield pool
    pool.terminate()
    pool.join()


def test_plain_pickle_round_trip_keeps_file_and_values(tmp_path):
    f = tmp_path / "x.memmap"
    mt = MMT.from_tensor(torch.arange(6, dtype=torch.float32), filename=str(f))
    back = pickle.loads(pickle.dumps(mt))
    assert torch.equal(plain(back), torch.arange(6, dtype=torch.float32))


@pytest.mark.timeout(3 * SPAWN_TIMEOUT)
def test_spawn_pool_receives_file_backed_tensor(tmp_path, spawn_pool):
    f = tmp_path / "x.memmap"
    t = torch.arange(100, dtype=torch.float32).reshape(10, 10)
    mt = MMT.from_tensor(t, filename=str(f))
    total, tname, fname = spawn_pool.apply_async(_worker_sum, (mt,)).get(timeout=SPAWN_TIMEOUT)
    data = spawn_pool.apply_async(_worker_bytes, (mt[2:5],)).get(timeout=SPAWN_TIMEOUT)
    assert total == float(t.sum())
    assert tname == "MemoryMappedTensor"
    assert fname == str(f)
    assert data == raw_bytes(t[2:5])


@pytest.mark.timeout(3 * SPAWN_TIMEOUT)
def test_spawn_pool_worker_writes_reach_the_file(tmp_path, spawn_pool):
    f = tmp_path / "x.memmap"
    mt = MMT.zeros(6, dtype=torch.int64, filename=str(f))
    assert spawn_pool.apply_async(_worker_write, (mt, 3, 77)).get(timeout=SPAWN_TIMEOUT)
    expected = np.zeros(6, dtype=np.int64)
    expected[3] = 77
    assert file_bytes(f) == expected.tobytes()
    assert mt[3].item() == 77


@pytest.mark.timeout(3 * SPAWN_TIMEOUT)
def test_spawn_pool_receives_read_only_tensor(tmp_path, spawn_pool):
    f = tmp_path / "ro.memmap"
    write_file(f, np.arange(10, dtype=np.float64).tobytes())
    mt = MMT.from_filename(str(f), torch.float64, (10,), mode="r")
    total, _, _ = spawn_pool.apply_async(_worker_sum, (mt,)).get(timeout=SPAWN_TIMEOUT)
    assert total == 45.0


@pytest.mark.timeout(3 * SPAWN_TIMEOUT)
def test_spawn_pool_receives_anonymous_tensor(spawn_pool):
    t = torch.arange(20, dtype=torch.int32)
    mt = MMT.from_tensor(t)
    total, _, fname = spawn_pool.apply_async(_worker_sum, (mt,)).get(timeout=SPAWN_TIMEOUT)
    assert total == float(t.sum())
    assert fname is None


@pytest.mark.timeout(3 * SPAWN_TIMEOUT)
def test_spawn_process_writes_through_shared_file(tmp_path):
    f = tmp_path / "x.memmap"
    mt = MMT.zeros(4, dtype=torch.int32, filename=str(f))
    ctx = tmp_mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_process_write, args=(mt, q))
    p.start()
    try:
        msg = q.get(timeout=SPAWN_TIMEOUT)
    finally:
        p.join(timeout=SPAWN_TIMEOUT)
        if p.is_alive():
            p.kill()
    assert msg == "ok"
    assert p.exitcode == 0
    assert file_bytes(f) == np.array([123, 0, 0, -5], dtype=np.int32).tobytes()


@pytest.mark.slow
@pytest.mark.timeout(3 * SPAWN_TIMEOUT)
@pytest.mark.parametrize("batch_size", [None, 2], ids=["uncollated", "collated"])
def test_dataloader_spawn_workers_read_right_values(tmp_path, batch_size):
    f = tmp_path / "x.memmap"
    t = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    mt = MMT.from_tensor(t, filename=str(f))
    loader = torch.utils.data.DataLoader(
        _MMTDataset(mt),
        batch_size=batch_size,
        num_workers=2,
        multiprocessing_context="spawn",
        timeout=SPAWN_TIMEOUT,
    )
    got = [plain(b) for b in loader]
    if batch_size is None:
        assert len(got) == 8
        out = torch.stack(got)
    else:
        assert len(got) == 4
        out = torch.cat(got)
    assert torch.equal(out, t)


def test_sending_a_tensor_whose_file_was_replaced_is_refused(tmp_path):
    """A receiver (DataLoader worker) maps the path again: it must be the very file the sender mapped."""
    from multiprocessing.reduction import ForkingPickler

    path = tmp_path / "x.memmap"
    mt = MMT.from_tensor(torch.arange(4.0), filename=path)
    sent = bytes(ForkingPickler.dumps(mt))
    assert pickle.loads(sent).tolist() == [0.0, 1.0, 2.0, 3.0]  # same file: mapped again
    replacement = tmp_path / "y.memmap"
    replacement.write_bytes(torch.full((4,), 9.0).numpy().tobytes())
    os.replace(replacement, path)  # a re-save puts a new file (new inode) at the same path
    with pytest.raises(memtree.MissingLeafError, match="no longer the file"):
        pickle.loads(sent)
    assert mt.tolist() == [0.0, 1.0, 2.0, 3.0]  # the sender's mapping still shows its data


def test_a_write_descriptor_closes_quietly_when_module_globals_are_gone(tmp_path, monkeypatch):
    """At interpreter exit a module's globals may already be None when the last mapping of a
    written file goes (a script that writes dataset rows at module level): the descriptor still
    closes, and nothing is printed ("Exception ignored in WriteFd.__del__ ... AttributeError")."""
    import sys

    from memtree.store.reading import mapped_files

    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_WRONLY)
    writer = mapped_files.WriteFd(fd)
    unraisable: list[object] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    monkeypatch.setattr(mapped_files, "os", None)  # as the interpreter's shutdown leaves it
    del writer
    monkeypatch.undo()
    assert unraisable == []
    with pytest.raises(OSError):
        os.fstat(fd)  # closed
