"""numpy interop: ``tree.numpy()`` views, numpy rows assigned into trees, numpy indices."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memtree
from memtree import DtypeError, MemoryMappedTensor, ReadOnlyError

N = 6


def make_tree() -> memtree.TensorTree:
    return memtree.TensorTree(
        {
            "x": torch.arange(N * 3, dtype=torch.float32).reshape(N, 3),
            "sub": {"y": torch.arange(N), "flag": torch.zeros(N, dtype=torch.bool)},
            "name": "run-1",
        },
        batch_size=[N],
    )


@pytest.fixture(params=["memory", "mapped"])
def tree(request, tmp_path):
    t = make_tree()
    return t if request.param == "memory" else t.memmap(tmp_path / "t")


def shares(arr: np.ndarray, leaf: torch.Tensor) -> bool:
    return arr.__array_interface__["data"][0] == leaf.data_ptr()


# ------------------------------------------------------------------------------- tree.numpy()


def test_numpy_nested_dict_of_views(tree):
    arrays = tree.numpy()
    assert set(arrays) == {"x", "sub", "name"} and set(arrays["sub"]) == {"y", "flag"}
    assert arrays["name"] == "run-1"
    assert arrays["x"].dtype == np.float32 and arrays["sub"]["y"].dtype == np.int64
    assert arrays["sub"]["flag"].dtype == np.bool_
    np.testing.assert_array_equal(arrays["x"], tree["x"].numpy())
    assert shares(arrays["x"], tree["x"]) and shares(arrays["sub"]["y"], tree["sub", "y"])
    arrays["x"][2, 1] = -5.0  # writes through to the leaf
    assert tree["x"][2, 1].item() == -5.0


def test_numpy_of_mapped_tree_writes_the_file(tmp_path):
    make_tree().memmap(tmp_path / "t")
    arrays = memtree.load_memmap(tmp_path / "t", mode="r+").numpy()
    arrays["sub"]["y"][:] = 9
    assert memtree.load_memmap(tmp_path / "t", mode="r")["sub", "y"].tolist() == [9] * N


def test_numpy_of_index_view_shares_the_file(tmp_path):
    t = make_tree().memmap(tmp_path / "t")
    rows = t[2:4].numpy()
    assert shares(rows["x"], t["x"][2:4])
    np.testing.assert_array_equal(rows["x"], make_tree()["x"][2:4].numpy())


def test_numpy_read_only_for_mode_r(tmp_path):
    make_tree().memmap(tmp_path / "t")
    t = memtree.load_memmap(tmp_path / "t", mode="r")
    arrays = t.numpy()
    for arr in (arrays["x"], arrays["sub"]["y"], arrays["sub"]["flag"]):
        assert not arr.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            arr[0] = 1
    assert isinstance(t["x"], MemoryMappedTensor) and shares(arrays["x"], t["x"])
    assert torch.equal(t["x"], make_tree()["x"])


def test_numpy_grad_and_conj_leaves():
    p = torch.nn.Parameter(torch.ones(2))
    c = torch.tensor([1 + 2j, 3 - 1j]).conj()
    arrays = memtree.TensorTree({"p": p, "c": c}, batch_size=[2]).numpy()
    np.testing.assert_array_equal(arrays["p"], [1.0, 1.0])
    np.testing.assert_array_equal(arrays["c"], [1 - 2j, 3 + 1j])


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.complex32])
def test_numpy_unsupported_dtype_names_the_leaf(dtype):
    t = memtree.TensorTree({"a": {"w": torch.zeros(2, dtype=dtype)}}, batch_size=[2])
    with pytest.raises(DtypeError, match=r"\('a', 'w'\).*no numpy dtype.*torch.float32"):
        t.numpy()
    bits = t["a", "w"].view({1: torch.uint8, 2: torch.uint16, 4: torch.uint32}[dtype.itemsize])
    assert bits.numpy().tolist() == [0, 0]  # the workaround the message names


# ------------------------------------------------------------------------- numpy assignment


def test_assign_numpy_rows_int_and_slice(tree):
    tree[0:2] = {"x": np.full((2, 3), 7.0, dtype=np.float32), "sub": {"y": np.array([10, 11])}}
    tree[3] = {"x": np.ones(3), "sub": {"y": np.int64(30), "flag": np.True_}}  # float64 cast
    tree[np.int64(4)] = {"x": np.arange(3, dtype=np.int32)}
    assert tree["x"].dtype == torch.float32
    assert tree["x"][:2].eq(7).all() and tree["x"][3].tolist() == [1.0] * 3
    assert tree["x"][4].tolist() == [0.0, 1.0, 2.0]
    assert tree["sub", "y"].tolist() == [10, 11, 2, 30, 4, 5]
    assert tree["sub", "flag"].tolist() == [False, False, False, True, False, False]


def test_assign_numpy_broadcast_value(tree):
    tree[1] = np.float32(3)  # a value for every leaf of the row
    assert tree["x"][1].tolist() == [3.0] * 3 and tree["sub", "y"][1].item() == 3


def test_assign_read_only_and_byteswapped_arrays(tree):
    ro = np.full((2, 3), 5.0, dtype=np.float32)
    ro.setflags(write=False)
    tree[1:3] = {"x": ro, "sub": {"y": np.array([8, 9], dtype=">i8")}}
    assert tree["x"][1:3].eq(5).all() and tree["sub", "y"][1:3].tolist() == [8, 9]


def test_assign_object_array_raises(tree):
    with pytest.raises(DtypeError, match="'x'"):
        tree[0] = {"x": np.array([object()] * 3)}


def test_numpy_row_fill_into_mapped_tree_takes_pwrite(tmp_path, monkeypatch):
    """Filling a memory-mapped dataset with numpy rows: every row is one pwrite, never a
    write through the mapping (the dataset-filling fast path)."""
    from memtree.store.reading import mapped

    t = make_tree().memmap(tmp_path / "t")
    calls = []
    real = mapped._pwrite_row
    monkeypatch.setattr(mapped, "_pwrite_row", lambda *a: calls.append(1) or real(*a))
    for i in range(N):
        t[i] = {"x": np.full(3, i, dtype=np.float32), "sub": {"y": np.int64(-i)}}
    assert len(calls) == 2 * N
    back = memtree.load_memmap(tmp_path / "t", mode="r")
    assert back["x"].tolist() == [[float(i)] * 3 for i in range(N)]
    assert back["sub", "y"].tolist() == [-i for i in range(N)]


def test_assign_into_mode_r_tree_raises(tmp_path):
    make_tree().memmap(tmp_path / "t")
    t = memtree.load_memmap(tmp_path / "t", mode="r")
    with pytest.raises(ReadOnlyError):
        t[0] = {"x": np.zeros(3, dtype=np.float32)}


@st.composite
def row_selection(draw):
    kind = draw(st.sampled_from(["int", "slice", "index", "mask", "int64"]))
    if kind == "int":
        return draw(st.integers(-N, N - 1))
    if kind == "int64":
        return np.int64(draw(st.integers(-N, N - 1)))
    if kind == "slice":
        start, stop = draw(st.integers(0, N)), draw(st.integers(0, N))
        return slice(start, stop, draw(st.sampled_from([None, 1, 2])))
    if kind == "index":
        rows = draw(st.lists(st.integers(-N, N - 1), min_size=1, max_size=N, unique_by=lambda r: r % N))
        return np.array(rows, dtype=draw(st.sampled_from([np.int64, np.int32])))
    return np.array(draw(st.lists(st.booleans(), min_size=N, max_size=N)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sel=row_selection(), dtype=st.sampled_from([np.float32, np.float64, np.int16]), mapped=st.booleans())
def test_numpy_selection_assign_and_read_match_numpy(tmp_path_factory, sel, dtype, mapped):
    """Reads and writes with numpy indices/masks and numpy values match numpy itself."""
    tree = make_tree()
    path = tmp_path_factory.mktemp("h") / "t"
    if mapped:
        tree = tree.memmap(path)
    expected = make_tree()["x"].numpy().copy()
    got = tree[sel]["x"]
    np.testing.assert_array_equal(got.numpy(), expected[sel])
    value = (np.arange(np.asarray(expected[sel]).size).reshape(np.shape(expected[sel])) + 100).astype(dtype)
    expected[sel] = value
    tree[sel] = {"x": value}
    np.testing.assert_array_equal(tree["x"].numpy(), expected)
    if mapped:
        np.testing.assert_array_equal(memtree.load_memmap(path, mode="r")["x"].numpy(), expected)
