"""Growing memory-mapped trees in place: append_, extend_, resize_ (memtree/grow.py)."""

import multiprocessing as mp
import os
import shutil
import tempfile
from pathlib import Path

import orjson
import pytest
import torch

import memtree
from memtree.store.writing import grow


@memtree.tensorclass(name="tests.grow.Step")
class Step:
    obs: torch.Tensor
    reward: torch.Tensor
    env: str = "cartpole"


def empty_buffer(path, nested=False):
    if nested:
        pairs = memtree.TensorTree({"v": torch.zeros(0, 2, 4)}, batch_size=[0, 2])
        src = {"obs": torch.zeros(0, 3), "next": {"obs": torch.zeros(0, 3)}, "pairs": pairs, "tag": "v1"}
        return memtree.TensorTree(src, batch_size=[0]).memmap(path)
    return memtree.TensorTree({"obs": torch.zeros(0, 3), "step": torch.zeros(0, dtype=torch.int64)},
                              batch_size=[0]).memmap(path)


def item(i, nested=False):
    if nested:
        pairs = memtree.TensorTree({"v": torch.full((2, 4), float(i))}, batch_size=[2])
        return {"obs": torch.full((3,), float(i)), "next": {"obs": torch.full((3,), i + 0.5)},
                "pairs": pairs, "tag": "v1"}
    return {"obs": torch.full((3,), float(i)), "step": torch.tensor(i)}


@pytest.fixture
def fast_dir(tmp_path_factory):
    """A temporary directory on tmpfs when there is one: thousands of commits, no disk journal."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        path = tempfile.mkdtemp(prefix="memtree-test-grow-", dir=shm)
        yield Path(path)
        shutil.rmtree(path, ignore_errors=True)
    else:
        yield tmp_path_factory.mktemp("grow")


def meta(path):
    return orjson.loads((path / "meta.json").read_bytes())


def entry(path, key):
    return next(e for e in meta(path)["entries"] if e["key"] == key)


# ------------------------------------------------------------------------------ amortised growth


@pytest.mark.slow
def test_append_10000_single_items_grows_files_geometrically(fast_dir):
    tmp_path = fast_dir
    d = tmp_path / "buf"
    buf = empty_buffer(d)
    sizes = []
    n = 10_000
    for i in range(n):
        buf.append_(item(i))
        sizes.append((os.path.getsize(d / "obs.memmap"), os.path.getsize(d / "step.memmap")))
    # capacities 1, 2, 4, ... 16384 rows: the files were grown 15 times, not 10,000
    obs_sizes = sorted({s[0] for s in sizes})
    assert obs_sizes == [12 * 2**k for k in range(15)]
    assert sorted({s[1] for s in sizes}) == [8 * 2**k for k in range(15)]
    for i, (o, _) in enumerate(sizes):
        assert o >= 12 * (i + 1) and o < 2 * 12 * (i + 1)  # never more than twice what is used
    expected_obs = torch.arange(n, dtype=torch.float32)[:, None].expand(n, 3)
    for tree in (buf, memtree.load_memmap(d)):
        assert tree.batch_size == torch.Size([n])
        assert torch.equal(tree["obs"], expected_obs)
        assert torch.equal(tree["step"], torch.arange(n))
    assert entry(d, "obs")["capacity"] == 16384 and entry(d, "obs")["shape"] == [n, 3]
    assert sorted(os.listdir(tmp_path)) == ["buf"]  # no staging, lock or temporary file left
    assert sorted(os.listdir(d)) == ["meta.json", "obs.memmap", "step.memmap"]


def test_existing_rows_are_never_rewritten(tmp_path):
    d = tmp_path / "buf"
    buf = empty_buffer(d, nested=True)
    buf.extend_(memtree.stack([memtree.TensorTree(item(i, True), batch_size=[]) for i in range(3)]))
    inodes = {p: os.stat(p).st_ino for p in d.rglob("*.memmap")}
    before = {p: p.read_bytes() for p in d.rglob("*.memmap")}
    for i in range(3, 40):
        buf.append_(item(i, True))
    assert {p: os.stat(p).st_ino for p in d.rglob("*.memmap")} == inodes  # same files, grown
    for p, data in before.items():
        assert p.read_bytes()[: len(data)] == data


# ------------------------------------------------------------------------------------- shapes


def test_append_nested_tree_with_subtree_batch_dims_and_non_tensor(tmp_path):
    d = tmp_path / "buf"
    buf = empty_buffer(d, nested=True)
    for i in range(5):
        buf.append_(item(i, True))
    loaded = memtree.load_memmap(d)
    for tree in (buf, loaded):
        assert tree.batch_size == torch.Size([5]) and tree["next"].batch_size == torch.Size([5])
        assert tree["pairs"].batch_size == torch.Size([5, 2])
        assert torch.equal(tree["pairs", "v"][:, 1, 3], torch.arange(5.0))
        assert torch.equal(tree["next", "obs"][:, 1], torch.arange(5.0) + 0.5)
        assert tree["tag"] == "v1"
    assert meta(d / "next")["batch_size"] == [5] and meta(d / "pairs")["batch_size"] == [5, 2]


def test_extend_with_tree_or_mapping(tmp_path):
    buf = empty_buffer(tmp_path / "buf")
    buf.extend_({"obs": torch.ones(4, 3), "step": torch.arange(4)})
    rows = memtree.TensorTree({"obs": torch.zeros(2, 3), "step": torch.tensor([7, 8])}, batch_size=[2])
    assert buf.extend_(rows) is buf
    assert buf["step"].tolist() == [0, 1, 2, 3, 7, 8]
    assert memtree.load_memmap(tmp_path / "buf")["step"].tolist() == [0, 1, 2, 3, 7, 8]


def test_appended_rows_are_cast_to_the_leaf_dtype(tmp_path):
    buf = empty_buffer(tmp_path / "buf")
    buf.append_({"obs": torch.tensor([1.5, 2.5, 3.5], dtype=torch.float64),
                 "step": torch.tensor(3, dtype=torch.int8)})
    assert buf["obs"].dtype == torch.float32 and buf["obs"][0].tolist() == [1.5, 2.5, 3.5]


def test_grown_tensorclass_buffer_keeps_its_class(tmp_path):
    buf = Step(torch.zeros(0, 2), torch.zeros(0), batch_size=[0]).memmap(tmp_path / "steps")
    for i in range(6):
        buf.append_(Step(torch.full((2,), float(i)), torch.tensor(float(i))))
    loaded = memtree.load_memmap(tmp_path / "steps")
    assert type(buf) is Step and type(loaded) is Step
    assert loaded.reward.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] and loaded.env == "cartpole"


def test_writes_into_grown_rows_reach_the_files(tmp_path):
    buf = empty_buffer(tmp_path / "buf")
    for i in range(3):
        buf.append_(item(i))
    buf[1] = memtree.TensorTree(item(42), batch_size=[])
    buf["obs"][2, 0] = -1.0
    loaded = memtree.load_memmap(tmp_path / "buf")
    assert loaded["step"].tolist() == [0, 42, 2] and loaded["obs"][2].tolist() == [-1.0, 2.0, 2.0]


# ----------------------------------------------------------------------------------- resize_


def test_resize_up_gives_sparse_zero_rows(tmp_path):
    d = tmp_path / "data"
    data = memtree.TensorTree({"img": torch.ones(2, 1024, dtype=torch.uint8)}, batch_size=[2]).memmap(d)
    data.resize_(100_000)
    assert data["img"].shape == (100_000, 1024) and data["img"][2:].sum() == 0
    assert os.stat(d / "img.memmap").st_blocks * 512 < 10 * 2**20  # 100 MB file, (almost) no blocks
    assert memtree.load_memmap(d)["img"][:2].sum() == 2048


def test_shrink_writes_a_new_generation_and_regrowth_gives_zeros(tmp_path):
    d = tmp_path / "buf"
    buf = empty_buffer(d)
    buf.extend_({"obs": torch.ones(8, 3), "step": torch.arange(1, 9)})
    size, inode = os.path.getsize(d / "step.memmap"), os.stat(d / "step.memmap").st_ino
    old_view = buf["step"]  # maps the file as it was
    buf.resize_(3)
    # a new file (new inode) of the same capacity, holding the kept rows; the old one is intact
    assert os.stat(d / "step.memmap").st_ino != inode and os.path.getsize(d / "step.memmap") == size
    assert (d / "step.memmap").read_bytes()[: 3 * 8] == torch.arange(1, 4).numpy().tobytes()
    assert (d / "step.memmap").read_bytes()[3 * 8 :] == bytes(size - 3 * 8)
    assert entry(d, "step")["shape"] == [3] and entry(d, "step")["capacity"] >= 8
    assert memtree.load_memmap(d)["step"].tolist() == [1, 2, 3]
    buf.resize_(6)
    assert buf["step"].tolist() == [1, 2, 3, 0, 0, 0]
    assert memtree.load_memmap(d)["obs"][3:].sum() == 0
    buf.extend_({"obs": torch.ones(2, 3), "step": torch.tensor([-1, -2])})
    assert old_view.tolist() == list(range(1, 9))  # never rewritten by the shrink and regrowth
    assert memtree.load_memmap(d)["step"].tolist() == [1, 2, 3, 0, 0, 0, -1, -2]
    assert sorted(os.listdir(tmp_path)) == ["buf"]  # no staging, lock or old copy left
    assert sorted(os.listdir(d)) == ["meta.json", "obs.memmap", "step.memmap"]


def test_resize_to_zero_copies_nothing_and_keeps_the_capacity(tmp_path, monkeypatch):
    d = tmp_path / "buf"
    buf = empty_buffer(d)
    buf.extend_({"obs": torch.ones(100, 3), "step": torch.arange(100)})
    copied = []
    real = grow.copy_range
    monkeypatch.setattr(grow, "copy_range", lambda *a, **k: (copied.append(a[4]), real(*a, **k)))
    buf.resize_(0)
    assert copied == [0, 0]
    assert entry(d, "step")["capacity"] == 100 and entry(d, "step")["shape"] == [0]
    assert os.stat(d / "step.memmap").st_blocks == 0  # sparse: a clear costs no disk
    for i in range(5):
        buf.append_(item(i))
    assert memtree.load_memmap(d)["step"].tolist() == list(range(5))


def test_resize_refuses_bad_lengths(tmp_path):
    buf = empty_buffer(tmp_path / "buf")
    for bad in (-1, 2.0, "3"):
        with pytest.raises(ValueError):
            buf.resize_(bad)


def test_resize_checks_free_space_first(tmp_path):
    d = tmp_path / "data"
    data = memtree.TensorTree({"x": torch.ones(2, 2**20, dtype=torch.uint8)}, batch_size=[2]).memmap(d)
    before = meta(d)
    with pytest.raises(memtree.InsufficientSpaceError):
        data.resize_(2**40)
    assert meta(d) == before and data.batch_size == torch.Size([2])


# ------------------------------------------------------------------------------ format on disk


def test_capacity_recorded_and_file_holds_exactly_capacity_rows(tmp_path):
    d = tmp_path / "buf"
    buf = empty_buffer(d)
    buf.extend_({"obs": torch.ones(5, 3), "step": torch.arange(5)})
    buf.append_(item(5))
    e = entry(d, "obs")
    assert e["shape"] == [6, 3] and e["capacity"] == 10
    assert os.path.getsize(d / "obs.memmap") == 10 * 3 * 4
    # a plain re-save compacts: no capacity, files of exactly the tensor's size
    buf.memmap(tmp_path / "copy", copy_existing=True)
    assert "capacity" not in entry(tmp_path / "copy", "obs")
    assert os.path.getsize(tmp_path / "copy" / "obs.memmap") == 6 * 3 * 4


def test_loader_refuses_a_file_that_does_not_hold_capacity_rows(tmp_path):
    d = tmp_path / "buf"
    buf = empty_buffer(d)
    buf.extend_({"obs": torch.ones(5, 3), "step": torch.arange(5)})
    buf.append_(item(5))
    os.truncate(d / "obs.memmap", 6 * 3 * 4)  # the logical size is not enough
    with pytest.raises(memtree.LeafSizeError, match="obs.memmap"):
        memtree.load_memmap(d, lazy=False)


@pytest.mark.parametrize("capacity", [4, -1, 2.5, True, None])
def test_loader_refuses_a_bad_capacity(tmp_path, capacity):
    d = tmp_path / "t"
    memtree.TensorTree({"x": torch.zeros(5, 2)}, batch_size=[5]).memmap(d)
    m = meta(d)
    m["entries"][0]["capacity"] = capacity
    (d / "meta.json").write_bytes(orjson.dumps(m))
    with pytest.raises(memtree.MetaFormatError, match="capacity"):
        memtree.load_memmap(d)


def test_capacity_on_a_zero_dim_leaf_is_refused(tmp_path):
    d = tmp_path / "t"
    memtree.TensorTree({"x": torch.tensor(1.0)}).memmap(d)
    m = meta(d)
    m["entries"][0]["capacity"] = 1
    (d / "meta.json").write_bytes(orjson.dumps(m))
    with pytest.raises(memtree.MetaFormatError, match="capacity"):
        memtree.load_memmap(d)


# ---------------------------------------------------------------------------- what is refused


def test_trees_that_cannot_grow_are_refused(tmp_path):
    with pytest.raises(memtree.NotGrowableError, match="mapped from a file"):
        memtree.TensorTree({"x": torch.zeros(2)}, batch_size=[2]).append_({"x": torch.tensor(1.0)})
    with pytest.raises(memtree.NotGrowableError, match="mapped from a file"):
        memtree.TensorTree({"x": torch.zeros(2)}, batch_size=[2]).memmap().append_({"x": torch.tensor(1.0)})
    with pytest.raises(memtree.NotGrowableError, match="batch_size"):
        memtree.TensorTree({"x": torch.zeros(2)}).memmap(tmp_path / "s").append_({"x": torch.zeros(2)})
    empty_buffer(tmp_path / "buf").append_(item(0))
    with pytest.raises(memtree.ReadOnlyError):
        memtree.load_memmap(tmp_path / "buf", mode="r").append_(item(1))
    with pytest.raises(memtree.NotGrowableError, match="on disk only"):
        memtree.load_memmap(tmp_path / "buf", keys=["obs"]).append_({"obs": torch.zeros(3)})
    with pytest.raises(memtree.NotGrowableError):
        memtree.load_memmap(tmp_path / "buf")[1:].append_(item(1))
    assert memtree.load_memmap(tmp_path / "buf")["step"].tolist() == [0]


def test_rows_that_do_not_fit_are_refused_before_anything_changes(tmp_path):
    d = tmp_path / "buf"
    buf = empty_buffer(d, nested=True)
    buf.append_(item(0, True))
    before = {p: p.read_bytes() for p in d.rglob("*") if p.is_file()}
    bad_items = [
        ({"obs": torch.zeros(3)}, memtree.MemtreeKeyError),
        (dict(item(1, True), extra=torch.zeros(())), memtree.MemtreeKeyError),
        (dict(item(1, True), obs=torch.zeros(4)), memtree.ShapeMismatchError),
        (dict(item(1, True), tag="v2"), memtree.NotGrowableError),
        (dict(item(1, True), next=torch.zeros(3)), memtree.ShapeMismatchError),
    ]
    for bad, error in bad_items:
        with pytest.raises(error):
            buf.append_(bad)
    with pytest.raises(memtree.BatchSizeError):
        buf.extend_(memtree.TensorTree({"obs": torch.zeros(3)}))
    assert {p: p.read_bytes() for p in d.rglob("*") if p.is_file()} == before
    assert len(buf) == 1


def test_stale_handle_is_refused_and_reload_works(tmp_path):
    d = tmp_path / "buf"
    a = empty_buffer(d)
    b = memtree.load_memmap(d)
    a.append_(item(0))
    with pytest.raises(memtree.NotGrowableError, match="load it again"):
        b.append_(item(1))
    memtree.load_memmap(d).append_(item(1))
    assert memtree.load_memmap(d)["step"].tolist() == [0, 1]


def test_failed_capacity_growth_truncates_back_and_keeps_the_tree(tmp_path, monkeypatch):
    d = tmp_path / "buf"
    buf = empty_buffer(d, nested=True)
    buf.append_(item(0, True))
    sizes = {p: os.path.getsize(p) for p in d.rglob("*.memmap")}

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(grow, "publish", fail)
    with pytest.raises(memtree.StorageError, match="No space"):
        buf.append_(item(1, True))
    monkeypatch.undo()
    assert {p: os.path.getsize(p) for p in d.rglob("*.memmap")} == sizes
    assert sorted(os.listdir(tmp_path)) == ["buf"]
    assert len(memtree.load_memmap(d)) == 1
    buf.append_(item(1, True))
    assert memtree.load_memmap(d)["pairs", "v"][:, 0, 0].tolist() == [0.0, 1.0]


@pytest.mark.parametrize("cleanup", ["recover", "next write"])
def test_a_growth_killed_before_its_rename_is_cleaned_up(tmp_path, cleanup):
    d = tmp_path / "buf"
    buf = empty_buffer(d)  # one level: the growth renames a temporary meta.json over meta.json
    buf.append_(item(0))

    def child():
        real = os.rename

        def die(src, dst, *args, **kwargs):
            if os.path.basename(os.fspath(dst)) == "meta.json":
                os._exit(3)  # killed between writing the new meta.json and renaming it
            return real(src, dst, *args, **kwargs)

        os.rename = die
        memtree.load_memmap(d).append_(item(1))
        os._exit(0)

    proc = mp.get_context("fork").Process(target=child)
    proc.start()
    proc.join(60)
    assert proc.exitcode == 3
    left = [n for n in os.listdir(d) if n.startswith(".meta.json")]
    assert len(left) == 1
    with pytest.raises(memtree.LeafSizeError, match=r"memtree\.recover\(\)"):  # the file grew
        memtree.load_memmap(d, lazy=False)
    if cleanup == "recover":
        actions = memtree.recover(tmp_path)
        assert any("temporary meta.json" in a and left[0] in a for a in actions), actions
        assert any("cut" in a and "obs.memmap" in a for a in actions), actions
    else:  # a writer replays the journal under the lock before it replaces the tree
        memtree.TensorTree({"obs": torch.zeros(1, 3), "step": torch.zeros(1, dtype=torch.int64)},
                           batch_size=[1]).memmap(d, existsok=True)
    assert not [n for n in os.listdir(d) if n.startswith(".meta.json")]
    assert sorted(os.listdir(tmp_path)) == ["buf"]
    assert memtree.load_memmap(d)["step"].tolist() == [0]
    memtree.load_memmap(d).append_(item(1))
    assert memtree.load_memmap(d)["step"].tolist() == [0, 1]


def test_a_nested_growth_killed_before_its_exchange_is_cut_back_by_recover(tmp_path):
    d = tmp_path / "buf"
    buf = empty_buffer(d, nested=True)
    buf.append_(item(0, True))
    sizes = {p: p.stat().st_size for p in d.rglob("*.memmap")}

    def child():
        grow.publish = lambda *args, **kwargs: os._exit(3)  # killed after the files grew
        memtree.load_memmap(d).append_(item(1, True))
        os._exit(0)

    proc = mp.get_context("fork").Process(target=child)
    proc.start()
    proc.join(60)
    assert proc.exitcode == 3
    assert any(p.stat().st_size > sizes[p] for p in sizes)  # lengthened, never committed
    actions = memtree.recover(tmp_path)
    assert any(a.startswith("removed staging directory") for a in actions), actions
    assert {p: p.stat().st_size for p in d.rglob("*.memmap")} == sizes
    assert sorted(os.listdir(tmp_path)) == ["buf"]
    assert memtree.load_memmap(d, lazy=False)["pairs", "v"][:, 0, 0].tolist() == [0.0]


# ------------------------------------------------------------------------------ hard-linked leaves


GROWTHS = {
    "append within capacity": lambda buf, i: buf.append_(item(i, "next" in buf.keys())),
    "extend past capacity": lambda buf, i: buf.extend_(memtree.stack(
        [memtree.TensorTree(item(i + k, "next" in buf.keys()), batch_size=[]) for k in range(9)])),
    "resize up": lambda buf, i: buf.resize_(len(buf) + 20),
    "resize down": lambda buf, i: buf.resize_(1),
}


@pytest.mark.parametrize("nested", [False, True], ids=["one level", "nested"])
@pytest.mark.parametrize("growth", list(GROWTHS))
def test_growth_never_writes_into_a_leaf_file_with_another_hard_link(tmp_path, growth, nested):
    d = tmp_path / "buf"
    buf = empty_buffer(d, nested=nested)
    for i in range(3):  # capacity 4: one row free
        buf.append_(item(i, nested))
    outside = tmp_path / "outside"
    outside.mkdir()
    linked = {p: outside / f"{k}.bin" for k, p in enumerate(sorted(d.rglob("*.memmap")))}
    for leaf, other in linked.items():
        os.link(leaf, other)  # e.g. a `cp -al` snapshot, or a link planted from outside
    before = {other: other.read_bytes() for other in linked.values()}
    expected = buf.clone()
    GROWTHS[growth](buf, 3)
    assert {other: other.read_bytes() for other in linked.values()} == before  # bytes and sizes
    for leaf, other in linked.items():
        assert os.stat(leaf).st_nlink == 1 and os.stat(other).st_nlink == 1  # the tree has its own
    loaded = memtree.load_memmap(d)
    n = min(len(loaded), 3)
    assert (loaded[:n] == expected[:n]).all() and (buf == loaded).all()
    assert sorted(os.listdir(tmp_path)) == ["buf", "outside"]


def test_a_grown_new_generation_is_grown_in_place_afterwards(tmp_path):
    d = tmp_path / "buf"
    buf = empty_buffer(d)
    buf.append_(item(0))
    os.link(d / "obs.memmap", tmp_path / "snapshot")
    buf.append_(item(1))  # a new generation: the snapshot keeps one row
    inode = os.stat(d / "obs.memmap").st_ino
    for i in range(2, 30):
        buf.append_(item(i))
    assert os.stat(d / "obs.memmap").st_ino == inode  # no more copies: its only name is the tree's
    assert (tmp_path / "snapshot").read_bytes() == torch.zeros(3).numpy().tobytes()
    assert memtree.load_memmap(d)["step"].tolist() == list(range(30))


# ------------------------------------------------------------------------------ killed shrinks


def _shrink_child(path, fault):
    if fault == "copy":
        real = grow.copy_range

        def die(*args, **kwargs):
            real(*args, **kwargs)
            os._exit(137)  # one new generation written, the others not

        grow.copy_range = die
    else:
        os.environ["MEMTREE_FAULT"] = fault
        from memtree.store.primitives import faults
        faults.reload()
    memtree.load_memmap(path).resize_(2)
    os._exit(0)


@pytest.mark.parametrize("nested", [False, True], ids=["one level", "nested"])
@pytest.mark.parametrize("fault, committed", [
    ("copy", False), ("before_publish", False), ("after_publish", True), ("before_old_removed", True),
])
def test_a_shrink_killed_at_any_step_leaves_the_old_or_the_new_tree(tmp_path, fault, committed, nested):
    d = tmp_path / "buf"
    buf = empty_buffer(d, nested=nested)
    for i in range(5):
        buf.append_(item(i, nested))
    reader = memtree.load_memmap(d, mode="r", lazy=False)
    snapshot = reader.clone()
    proc = mp.get_context("fork").Process(target=_shrink_child, args=(str(d), fault))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 137
    assert (reader == snapshot).all()  # the files the reader maps were never written
    loaded = memtree.load_memmap(d, lazy=False)
    assert (loaded == snapshot[:2 if committed else 5]).all()
    actions = memtree.recover(tmp_path)
    assert any("staging" in a for a in actions), actions
    assert sorted(os.listdir(tmp_path)) == ["buf"]
    assert (memtree.load_memmap(d, lazy=False) == loaded).all()
    memtree.load_memmap(d).resize_(7)  # and it grows again, with zeros
    assert (memtree.load_memmap(d)[len(loaded):]["obs"] == 0).all()
    assert (reader == snapshot).all()


# ------------------------------------------------------------------------------ concurrent readers


def test_reader_loaded_before_growth_keeps_its_view(tmp_path):
    d = tmp_path / "buf"
    buf = empty_buffer(d, nested=True)
    for i in range(3):
        buf.append_(item(i, True))
    reader = memtree.load_memmap(d, mode="r")
    snapshot = reader.clone()
    for i in range(3, 100):
        buf.append_(item(i, True))
    assert reader.batch_size == torch.Size([3])
    assert (reader == snapshot).all()
    assert len(memtree.load_memmap(d)) == 100


def _shrink_reader(path, ready, go, out):
    """Load the tree twice (read-only and read-write), then check both after the parent is done."""
    try:
        views = [memtree.load_memmap(path, mode=mode, lazy=False) for mode in ("r", "r+")]
        expected = views[0].clone()
        ready.set()
        assert go.wait(120)
        fresh = memtree.load_memmap(path)
        out.put([bool((view == expected).all()) for view in views] + [fresh["obs"][:, 0].tolist()])
    except BaseException as err:  # report it: the parent asserts on the answer
        out.put(repr(err))


@pytest.mark.parametrize("nested", [False, True], ids=["one level", "nested"])
def test_reader_process_loaded_before_shrink_and_regrowth_keeps_its_rows(tmp_path, nested):
    d = tmp_path / "buf"
    buf = empty_buffer(d, nested=nested)
    for i in range(8):
        buf.append_(item(i, nested))
    ctx = mp.get_context("fork")
    ready, go, out = ctx.Event(), ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_shrink_reader, args=(str(d), ready, go, out))
    child.start()
    try:
        assert ready.wait(120)
        buf.resize_(4)  # drops rows 4..7, which the child maps
        for i in range(100, 104):  # and grows over them again
            buf.append_(item(i, nested))
        buf.resize_(2)
        buf.resize_(12)  # zeros over rows 2..11
        go.set()
        answer = out.get(timeout=120)
    finally:
        child.join(120)
    assert child.exitcode == 0
    assert answer == [True, True, [0.0, 1.0] + [0.0] * 10]  # its old rows; a new load sees the new


def _reader_process(path, ready, go, out):
    old = memtree.load_memmap(path, mode="r")
    expected_old = old.clone()
    ready.set()
    go.wait()
    loads = fails = 0
    while loads < 30 or not os.path.exists(os.path.join(os.path.dirname(path), "done")):
        assert (old == expected_old).all(), "a view taken before the growth changed"
        try:
            fresh = memtree.load_memmap(path, mode="r")
        except memtree.MemtreeError:  # a load racing a commit may fail; never a partial tree
            fails += 1
            continue
        n = len(fresh)
        assert torch.equal(fresh["step"], torch.arange(n)), "a load saw a partial tree"
        assert torch.equal(fresh["obs"][:, 0], torch.arange(n, dtype=torch.float32))
        loads += 1
        if loads > 2000:
            break
    out.put((loads, fails, len(old)))


def test_concurrent_reader_process_during_growth(fast_dir):
    tmp_path = fast_dir
    d = tmp_path / "buf"
    buf = empty_buffer(d)
    for i in range(10):
        buf.append_(item(i))
    ctx = mp.get_context("fork")
    ready, go, out = ctx.Event(), ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_reader_process, args=(str(d), ready, go, out))
    child.start()
    assert ready.wait(60)
    go.set()
    for i in range(10, 600):
        buf.append_(item(i))
    (tmp_path / "done").touch()
    child.join(120)
    assert child.exitcode == 0  # no SIGBUS, no failed assertion in the reader
    loads, fails, old_length = out.get(timeout=10)
    assert old_length == 10 and loads >= 30
