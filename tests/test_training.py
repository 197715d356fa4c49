"""memtree.Checkpointer: training state with its Python types, atomic steps, async saves,
incremental hard links, retention, restore into live objects; the format v2 container fields.

The kill -9 tests are in ``test_training_kill.py``.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
from collections import OrderedDict

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memtree
from memtree.format.schema import parse_level
from memtree.training import commit as commit_module  # a Checkpointer's steps go through its write_tree

# ---------------------------------------------------------------------------------------------
# helpers


def values_bytes(t):
    """The bytes of ``t``'s values in C order: any strides (a one-element tensor's too), its
    conjugate and negative bits applied."""
    flat = t.resolve_conj().resolve_neg().detach().clone(memory_format=torch.contiguous_format).reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def assert_same(got, want, where="state"):
    """``got`` equals ``want`` with the same Python types all the way down; tensors bit-equal
    (restored as plain tensors: no conjugate or negative bit)."""
    if isinstance(want, np.ndarray):  # documented: a numpy array is stored, and restored, as a tensor
        want = torch.from_numpy(want)
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and not got.is_conj() and not got.is_neg(), where
        assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), where
        assert values_bytes(got) == values_bytes(want), where
        return
    if isinstance(want, memtree.TensorTree):
        assert isinstance(got, memtree.TensorTree), where
        assert got.batch_size == want.batch_size, where
        assert set(got.keys()) == set(want.keys()), where
        for k in want.keys():
            assert_same(got[k], want[k], f"{where}[{k!r}]")
        return
    want_type = dict if isinstance(want, OrderedDict) else type(want)
    assert type(got) is want_type, f"{where}: {type(got).__name__} != {want_type.__name__}"
    if isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


def small_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def trained(seed=0, steps=2):
    model = small_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.85, 0.99))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(5, 4, generator=g)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model, opt, sched


def training_state(seed=0):
    model, opt, sched = trained(seed)
    random.seed(seed)
    np.random.seed(seed)
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "sched": sched.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
        "tree": memtree.TensorTree({"obs": torch.ones(3, 2), "sub": {"r": torch.zeros(3)}}, batch_size=[3]),
        "odd": {
            "bf16": torch.randn(3, 5).to(torch.bfloat16),
            "zero_dim": torch.tensor(2.5, dtype=torch.float64),
            "empty": torch.empty(0, 7, dtype=torch.int16),
            "t": base.t(),  # non-contiguous
            "strided": base[:, ::2],
            "bool": torch.tensor([True, False]),
            "uint64": torch.tensor([2**63 + 5], dtype=torch.uint64),
        },
        "mixed": [torch.ones(2), ("a", 1, None, (2.5, True)), {-3: "neg", 10**15: [1, 2]}, []],
        "ints": {0: 1, 1: {2: torch.zeros(1)}},
        "nested_tuple": ((), (1,), [(2, (3,))]),
        "step": 12,
        "lr": 1e-4,
        "flag": False,
        "none": None,
        "name": "run-é/../x",
    }


@pytest.fixture
def ckpt(tmp_path):
    return memtree.Checkpointer(tmp_path / "ckpts")


def meta(path):
    with open(os.path.join(path, "meta.json"), "rb") as f:
        return parse_level(f.read(), path)


# ---------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("blocking", [True, False])
def test_training_state_round_trips_with_its_types(ckpt, blocking):
    state = training_state()
    out = ckpt.save(3, state, blocking=blocking)
    path = out if blocking else out.result(timeout=120)
    assert path == ckpt.path(3) == os.path.join(ckpt.root, "3")
    assert ckpt.steps() == [3] and ckpt.latest() == 3
    assert memtree.verify_tree(path).ok
    back = ckpt.restore(3)
    assert_same(back, state)
    assert type(back["optim"]["param_groups"][0]["betas"]) is tuple
    assert list(back["optim"]["state"]) == [0, 1, 2, 3]


def test_restored_state_resumes_numpy_and_python_random(ckpt):
    state = training_state(seed=5)
    ckpt.save(1, state)
    expect_py, expect_np = random.random(), np.random.rand()
    random.seed(99)
    np.random.seed(99)
    back = ckpt.restore()
    random.setstate(back["rng"]["python"])
    np.random.set_state(back["rng"]["numpy"])
    assert (random.random(), np.random.rand()) == (expect_py, expect_np)


def test_on_disk_layout_uses_the_version_2_container_fields(ckpt):
    path = ckpt.save(0, {"optim": trained()[1].state_dict(), "seq": [torch.ones(1), 2], "t": (torch.ones(1),)})
    root = meta(path)
    optim = meta(os.path.join(path, "optim"))
    state = meta(os.path.join(path, "optim", "state"))
    assert root.type == "dict" and optim.type == "dict" and state.type == "dict"
    assert [e.key for e in state.entries] == ["0", "1", "2", "3"] and all(e.int_key for e in state.entries)
    groups = {e.key: e for e in optim.entries}["param_groups"]
    assert groups.tuples == ((0, "betas"),) and groups.value[0]["betas"] == [0.85, 0.99]
    assert meta(os.path.join(path, "seq")).type == "list"
    assert meta(os.path.join(path, "t")).type == "tuple"


def test_load_memmap_of_a_checkpoint_is_a_tree_with_str_keys(ckpt):
    path = ckpt.save(0, {"optim": trained()[1].state_dict(), "seq": [torch.ones(2), (1, 2)]})
    tree = memtree.load_memmap(path)
    assert isinstance(tree, memtree.TensorTree)
    assert set(tree["optim", "state"].keys()) == {"0", "1", "2", "3"}
    assert tree["optim", "param_groups"][0]["betas"] == (0.85, 0.99)
    assert torch.equal(tree["seq", "0"], torch.ones(2)) and tree["seq", "1"] == (1, 2)


def test_tied_weights_are_copied_once_and_saved_under_both_names(ckpt):
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    sd = model.state_dict()
    assert sd["emb.weight"].data_ptr() == sd["head.weight"].data_ptr()
    ckpt.save(1, {"model": sd}, blocking=False).result(timeout=60)
    back = ckpt.restore()["model"]
    assert torch.equal(back["emb.weight"], emb.weight) and torch.equal(back["head.weight"], emb.weight)
    fresh = torch.nn.ModuleDict({"emb": torch.nn.Embedding(10, 4), "head": torch.nn.Linear(4, 10, bias=False)})
    fresh.head.weight = fresh.emb.weight
    ckpt.restore(into={"model": fresh})
    assert fresh.head.weight is fresh.emb.weight and torch.equal(fresh.emb.weight, emb.weight)


@pytest.mark.parametrize(
    "state, error, match",
    [
        ({1.5: torch.ones(1)}, memtree.KeyTypeError, "float"),
        ({True: 1}, memtree.KeyTypeError, "bool"),
        ({"x": {None: 1}}, memtree.KeyTypeError, r"state\['x'\]"),
        ({"": 1}, memtree.KeyTypeError, "''"),
        ({1: 0, "1": 0}, memtree.KeyCollisionError, "int key 1"),
        ({"lr": float("nan")}, memtree.NonTensorValueError, "nan"),
        ({"s": {1, 2}}, memtree.NonTensorValueError, "set"),
        ({"big": 2**70}, memtree.NonTensorValueError, "64 bits"),
        ({"size": [torch.ones(1), torch.Size([2])]}, memtree.NonTensorValueError, "Size"),
        ({"m": torch.ones(2, device="meta")}, memtree.DtypeError, "meta"),
        ([torch.ones(1)], memtree.InvalidArgumentError, "mapping"),
    ],
)
@pytest.mark.parametrize("blocking", [True, False])
def test_unstorable_state_is_refused_before_anything_is_written(ckpt, state, error, match, blocking):
    with pytest.raises(error, match=match):
        ckpt.save(0, state, blocking=blocking)
    assert os.listdir(ckpt.root) == []
    ckpt.wait()  # nothing failed in the background


# ---------------------------------------------------------------------------------------------
# steps


@pytest.mark.parametrize(
    "step, match",
    [(-1, "in"), (True, "bool"), (2**63, "2\\*\\*63"), (1.0, "float"), ("3", "str"), (None, "NoneType")],
)
def test_bad_steps_are_clear_errors(ckpt, step, match):
    with pytest.raises(memtree.InvalidArgumentError, match=match):
        ckpt.save(step, {"x": 1})
    with pytest.raises(memtree.InvalidArgumentError):
        ckpt.path(step)
    assert os.listdir(ckpt.root) == []


def test_numpy_and_huge_steps_are_ints(ckpt):
    ckpt.save(np.int64(7), {"x": 1})
    ckpt.save(2**63 - 1, {"x": 2})
    assert ckpt.steps() == [7, 2**63 - 1]
    assert ckpt.restore(7) == {"x": 1}


def test_an_existing_step_is_an_error_unless_overwrite(ckpt):
    ckpt.save(5, {"x": torch.zeros(2)})
    for blocking in (True, False):
        with pytest.raises(memtree.DestinationExistsError, match="overwrite=True") as info:
            ckpt.save(5, {"x": torch.ones(2)}, blocking=blocking)
        assert isinstance(info.value, FileExistsError)
    assert torch.equal(ckpt.restore(5)["x"], torch.zeros(2))
    ckpt.save(5, {"x": torch.ones(2)}, overwrite=True)
    assert torch.equal(ckpt.restore(5)["x"], torch.ones(2))
    assert ckpt.steps() == [5] and sorted(os.listdir(ckpt.root)) == ["5"]


def test_steps_ignore_everything_but_committed_step_directories(ckpt):
    ckpt.save(2, {"x": 1})
    for junk in ["007", "-1", "abc", "3.5", ".2.memtree-tmp-" + "0" * 32]:
        os.mkdir(os.path.join(ckpt.root, junk))
    os.mkdir(os.path.join(ckpt.root, "9"))  # a directory without meta.json is not a checkpoint
    with open(os.path.join(ckpt.root, "8"), "w"):
        pass
    os.symlink(ckpt.path(2), os.path.join(ckpt.root, "10"))
    assert ckpt.steps() == [2] and ckpt.latest() == 2


def test_out_of_order_steps_and_restore_errors(ckpt):
    with pytest.raises(memtree.CheckpointNotFoundError, match="no committed checkpoint"):
        ckpt.restore()
    for step in (3, 7, 10):
        ckpt.save(step, {"step": step})
    assert ckpt.steps() == [3, 7, 10] and ckpt.latest() == 10
    assert ckpt.restore() == {"step": 10} and ckpt.restore(3) == {"step": 3}
    with pytest.raises(memtree.CheckpointNotFoundError, match="step 4") as info:
        ckpt.restore(4)
    assert isinstance(info.value, FileNotFoundError)


# ---------------------------------------------------------------------------------------------
# retention


def test_keep_last_and_keep_every(tmp_path):
    ckpt = memtree.Checkpointer(tmp_path, keep_last=2, keep_every=5)
    for step in range(12):
        ckpt.save(step, {"w": torch.full((3,), float(step))}, blocking=step % 2 == 0)
    ckpt.wait()
    assert ckpt.steps() == [0, 5, 10, 11]
    assert sorted(os.listdir(tmp_path)) == ["0", "10", "11", "5"]  # nothing else left behind
    for step in ckpt.steps():
        assert memtree.verify_tree(ckpt.path(step)).ok
        assert torch.equal(ckpt.restore(step)["w"], torch.full((3,), float(step)))


def test_retention_never_deletes_the_newest_step(tmp_path):
    ckpt = memtree.Checkpointer(tmp_path, keep_last=1)
    ckpt.save(10, {"x": 10})
    with pytest.raises(memtree.StepOrderError, match="discard_newer"):
        ckpt.save(3, {"x": 3})  # below the newest: refused (test_attack_checkpointer.py has the rest)
    assert ckpt.steps() == [10]


def test_shrinking_keep_last_later_prunes_at_the_next_save(tmp_path):
    first = memtree.Checkpointer(tmp_path)
    for step in range(5):
        first.save(step, {"x": step})
    second = memtree.Checkpointer(tmp_path, keep_last=2)
    assert second.steps() == [0, 1, 2, 3, 4]  # opening deletes nothing
    second.save(5, {"x": 5})
    assert second.steps() == [4, 5]


@pytest.mark.parametrize("kwargs", [{"keep_last": 0}, {"keep_every": -1}, {"keep_last": True}, {"fsync": 1}, {"incremental": 1}, {"incremental": "no"}])
def test_bad_options(tmp_path, kwargs):
    with pytest.raises(memtree.InvalidArgumentError):
        memtree.Checkpointer(tmp_path, **kwargs)


# ---------------------------------------------------------------------------------------------
# async


def test_async_save_snapshots_the_state_at_the_call(ckpt):
    w = torch.zeros(1000)
    groups = [{"lr": 0.1, "betas": (0.9, [1])}]
    sd = {"w": w, "view": w[::10], "groups": groups, "tree": memtree.TensorTree({"cfg": memtree.NonTensor({"a": [1]})})}
    fut = ckpt.save(1, sd, blocking=False)
    w.fill_(7)  # the training loop goes on right away
    groups[0]["lr"] = 0.05
    groups[0]["betas"][1].append(2)
    sd["tree"]["cfg"]["a"].append(2)
    assert fut.result(timeout=60) == ckpt.path(1)
    back = ckpt.restore(1)
    assert torch.equal(back["w"], torch.zeros(1000)) and torch.equal(back["view"], torch.zeros(100))
    assert back["groups"] == [{"lr": 0.1, "betas": (0.9, [1])}] and back["tree"]["cfg"] == {"a": [1]}


def test_the_staging_buffer_is_reused_and_saves_never_overlap(ckpt, monkeypatch):
    active = []
    overlaps = []
    real = commit_module.write_tree

    def tracking(*args, **kwargs):
        active.append(1)
        overlaps.append(len(active) > 1)
        try:
            return real(*args, **kwargs)
        finally:
            active.pop()

    monkeypatch.setattr(commit_module, "write_tree", tracking)
    futures, buffers = [], []
    for s in range(4):
        futures.append(ckpt.save(s, {"w": torch.full((1 << 16,), float(s))}, blocking=False))
        buffers.append(ckpt._staging.buffer)  # each save's, held: no id is reused meanwhile
    ckpt.wait()
    assert [f.result(timeout=60) for f in futures] == [ckpt.path(s) for s in range(4)]
    assert overlaps == [False] * 4 and all(b is buffers[0] for b in buffers)
    assert [ckpt.restore(s)["w"][0].item() for s in range(4)] == [0.0, 1.0, 2.0, 3.0]


def test_a_background_failure_reaches_the_future_and_the_next_save(ckpt, monkeypatch):
    real = commit_module.write_tree
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise memtree.StorageError("injected disk failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(commit_module, "write_tree", failing)
    fut = ckpt.save(1, {"w": torch.ones(4)}, blocking=False)
    with pytest.raises(memtree.StorageError, match="injected"):
        fut.result(timeout=60)
    with pytest.raises(memtree.CheckpointSaveError, match="step 1.*injected") as info:
        ckpt.save(2, {"w": torch.ones(4)})
    assert isinstance(info.value.__cause__, memtree.StorageError)
    assert ckpt.steps() == []  # the failed save committed nothing, and step 2 was not started
    ckpt.wait()  # reported once
    assert ckpt.save(2, {"w": torch.ones(4)}) == ckpt.path(2)
    ckpt.save(3, {"w": torch.ones(4)}, blocking=False).result(timeout=60)

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(commit_module, "write_tree", no_space)
    fut = ckpt.save(4, {"w": torch.ones(4)}, blocking=False)
    with pytest.raises(memtree.CheckpointSaveError, match="step 4"):
        ckpt.wait()
    assert fut.exception(timeout=1) is not None
    assert ckpt.steps() == [2, 3] and sorted(os.listdir(ckpt.root)) == ["2", "3"]


def test_interpreter_exit_waits_for_the_save_in_flight(tmp_path):
    code = (
        "import torch, memtree, sys\n"
        "c = memtree.Checkpointer(sys.argv[1])\n"
        "c.save(1, {'w': torch.arange(4_000_000, dtype=torch.float64)}, blocking=False)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=300, env=env)
    ckpt = memtree.Checkpointer(tmp_path)
    assert ckpt.steps() == [1] and memtree.verify_tree(ckpt.path(1)).ok
    assert torch.equal(ckpt.restore()["w"], torch.arange(4_000_000, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------
# incremental


def test_unchanged_leaves_are_hard_links_and_every_step_stands_alone(ckpt):
    big = torch.randn(64, 1024)
    small = torch.randn(16)
    ckpt.save(1, {"frozen": big, "adapter": small})
    small.add_(1)  # in place: tensor._version plays no part, the content decides
    ckpt.save(2, {"frozen": big, "adapter": small}, blocking=False).result(timeout=60)
    stats = ckpt.last_stats
    assert (stats.files_linked, stats.bytes_linked, stats.files_written) == (1, big.nbytes, 1)
    ino = lambda s, k: os.stat(os.path.join(ckpt.path(s), f"{k}.memmap")).st_ino  # noqa: E731
    assert ino(1, "frozen") == ino(2, "frozen") and ino(1, "adapter") != ino(2, "adapter")
    memtree.Checkpointer(ckpt.root, keep_last=1).save(3, {"frozen": big, "adapter": small})
    assert ckpt.steps() == [3] and memtree.verify_tree(ckpt.path(3)).ok
    assert torch.equal(ckpt.restore(3)["frozen"], big) and torch.equal(ckpt.restore(3)["adapter"], small)


def test_incremental_false_writes_every_byte(tmp_path):
    ckpt = memtree.Checkpointer(tmp_path, incremental=False)
    w = torch.ones(1000)
    ckpt.save(1, {"w": w})
    ckpt.save(2, {"w": w})
    assert (ckpt.last_stats.files_linked, ckpt.last_stats.bytes_written) == (0, w.nbytes)
    assert os.stat(os.path.join(ckpt.path(2), "w.memmap")).st_nlink == 1


def test_resume_then_save_again_links_against_the_restored_step(tmp_path):
    model, opt, _ = trained()
    first = memtree.Checkpointer(tmp_path)
    first.save(100, {"model": model.state_dict(), "optim": opt.state_dict()})
    ckpt = memtree.Checkpointer(tmp_path)  # a new process, resuming
    model2 = small_model(seed=3)
    opt2 = torch.optim.AdamW(model2.parameters())
    ckpt.restore(into={"model": model2, "optim": opt2})
    ckpt.save(101, {"model": model2.state_dict(), "optim": opt2.state_dict()})
    assert ckpt.last_stats.files_written == 0 and ckpt.last_stats.files_linked == 4 + 4 * 3  # params; step, exp_avg, exp_avg_sq


# ---------------------------------------------------------------------------------------------
# restore into live objects


def test_restore_into_module_and_optimizer_fills_the_same_objects(ckpt):
    model, opt, sched = trained()
    ckpt.save(7, {"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(), "epoch": 3})
    fresh = small_model(seed=1)
    params = list(fresh.parameters())
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1.0)  # built before the restore
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1)
    out = ckpt.restore(into={"model": fresh, "optim": fresh_opt, "sched": fresh_sched})
    assert out["model"] is fresh and out["optim"] is fresh_opt and out["epoch"] == 3
    assert all(a is b for a, b in zip(fresh.parameters(), params))
    for a, b in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert_same(fresh_opt.state_dict(), opt.state_dict())
    assert fresh_sched.state_dict() == sched.state_dict()
    # training goes on from the restored state exactly as from the original
    x = torch.randn(5, 4)
    for m, o in ((model, opt), (fresh, fresh_opt)):
        m(x).sum().backward()
        o.step()
    for a, b in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(ckpt.restore(7)["model"]["0.weight"], trained()[0].state_dict()["0.weight"])  # the files did not change


def test_restore_before_building_the_optimizer_and_into_a_bare_module(ckpt):
    model, opt, _ = trained()
    ckpt.save(1, model.state_dict())
    bare = small_model(seed=2)
    ckpt.restore(into=bare)  # the state is the module's state dict itself
    opt_after = torch.optim.AdamW(bare.parameters())
    ckpt.save(2, {"optim": opt.state_dict()})
    ckpt.restore(2, into={"optim": opt_after})
    assert_same(opt_after.state_dict()["state"], opt.state_dict()["state"])
    for a, b in zip(bare.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_restore_into_a_model_built_under_empty_init(ckpt):
    model, _, _ = trained()
    ckpt.save(1, {"model": model.state_dict()})
    with memtree.empty_init():
        lazy = small_model()
    assert all(p.is_meta for p in lazy.parameters())
    ckpt.restore(into={"model": lazy})
    x = torch.randn(2, 4)
    assert torch.equal(lazy(x), model(x))
    opt = torch.optim.AdamW(lazy.parameters())
    lazy(x).sum().backward()
    opt.step()  # the bound tensors are ordinary memory: training writes them, not the checkpoint
    assert torch.equal(ckpt.restore(1)["model"]["0.weight"], model.state_dict()["0.weight"])


def test_restore_into_errors(ckpt):
    ckpt.save(1, {"model": small_model().state_dict(), "n": 1})
    with pytest.raises(memtree.MemtreeKeyError, match="optim"):
        ckpt.restore(into={"optim": torch.optim.SGD(small_model().parameters(), lr=1)})
    with pytest.raises(memtree.InvalidArgumentError, match="into\\['n'\\]"):
        ckpt.restore(into={"n": {"x": small_model()}})
    with pytest.raises(memtree.InvalidArgumentError, match="int"):
        ckpt.restore(into={"n": 5})
    other = torch.nn.Linear(2, 2)
    before = other.weight.clone()
    with pytest.raises(memtree.MemtreeKeyError, match="missing from the source"):  # load_into_module(strict)
        ckpt.restore(into={"model": other})
    assert torch.equal(other.weight, before)


# ---------------------------------------------------------------------------------------------
# several writers on one root


def test_two_checkpointers_on_one_root(tmp_path):
    a, b = memtree.Checkpointer(tmp_path), memtree.Checkpointer(tmp_path)
    barrier = threading.Barrier(2)
    results = {}

    def run(name, ck):
        barrier.wait()
        try:
            results[name] = ck.save(1, {"w": torch.full((1 << 18,), 1.0 if name == "a" else 2.0)})
        except (memtree.LockError, memtree.DestinationExistsError) as err:
            results[name] = err

    threads = [threading.Thread(target=run, args=(n, c)) for n, c in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    won = [n for n, r in results.items() if isinstance(r, str)]
    assert len(won) == 1, results
    value = 1.0 if won == ["a"] else 2.0
    assert torch.equal(a.restore(1)["w"], torch.full((1 << 18,), value))
    a.save(2, {"x": 1}, blocking=False)
    b.save(3, {"x": 2}, blocking=False)
    a.wait()
    b.wait()
    assert a.steps() == b.steps() == [1, 2, 3]


def test_a_root_that_is_a_file_or_unwritable_is_a_clear_error(tmp_path):
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(memtree.DestinationExistsError, match="not a directory"):
        memtree.Checkpointer(tmp_path / "f")
    with pytest.raises(memtree.MemtreeError):
        memtree.Checkpointer(tmp_path / "f" / "sub")


def test_opening_a_root_cleans_up_after_crashed_writers(tmp_path):
    ckpt = memtree.Checkpointer(tmp_path)
    ckpt.save(1, {"x": 1})
    stale = os.path.join(tmp_path, ".2.memtree-tmp-" + "ab" * 16)
    os.makedirs(os.path.join(stale, "sub"))
    with open(os.path.join(tmp_path, ".2.memtree.lock"), "wb"):
        pass
    memtree.Checkpointer(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["1"]


# ---------------------------------------------------------------------------------------------
# CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_state_goes_through_a_pinned_staging_buffer(ckpt):
    w = torch.randn(1000, 100, device="cuda")
    state = {"w": w, "h": w.half().t(), "cpu": torch.arange(3)}
    fut = ckpt.save(1, state, blocking=False)
    assert ckpt._staging.buffer.is_pinned()
    w.zero_()
    fut.result(timeout=120)
    back = ckpt.restore()
    assert back["w"].device.type == "cpu"
    assert torch.equal(back["h"], state["h"].cpu()) and not back["w"].eq(0).all()
    model = torch.nn.Linear(100, 1000).cuda()
    ckpt.save(2, {"weight": w.clone().fill_(3), "bias": torch.zeros(1000, device="cuda")})
    ckpt.restore(2, into=model)
    assert model.weight.is_cuda and model.weight.eq(3).all()


# ---------------------------------------------------------------------------------------------
# property: any nested state round-trips with its types

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=5),
)
_tensors = st.builds(
    lambda shape, dtype, seed: (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 100).to(dtype),
    st.lists(st.integers(0, 3), max_size=3).map(tuple),
    st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.float16]),
    st.integers(0, 1000),
)
_keys = st.one_of(st.text(min_size=1, max_size=6), st.integers(-5, 10**12))


def _states(leaves):
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.lists(children, max_size=3),
            st.lists(children, max_size=3).map(tuple),
            st.dictionaries(_keys, children, max_size=3),
        ),
        max_leaves=8,
    )


def _unique_keys(value):
    """Whether no dict holds both ``k`` and ``str(k)`` (refused: they would share a name)."""
    if isinstance(value, dict):
        names = [str(k) for k in value]
        return len(names) == len(set(names)) and all(_unique_keys(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_unique_keys(v) for v in value)
    return True


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(state=st.dictionaries(_keys, _states(st.one_of(_scalars, _tensors)), max_size=4).filter(_unique_keys), blocking=st.booleans())
def test_any_nested_state_round_trips(tmp_path_factory, state, blocking):
    ckpt = memtree.Checkpointer(tmp_path_factory.mktemp("prop"))
    out = ckpt.save(0, state, blocking=blocking)
    if not blocking:
        out.result(timeout=60)
    assert_same(ckpt.restore(0), state)


# ---------------------------------------------------------------------------------------------
# the container fields of meta.json are checked like every other field

_GOOD = b'{"format":"memtree","version":2,"type":"%s","byteorder":"little","batch_size":%s,"entries":%s}'


@pytest.mark.parametrize(
    "kind, batch, entries, match",
    [
        ("list", "[]", b'[{"key":"1","kind":"json","value":1}]', "must be '0'"),
        ("tuple", "[]", b'[{"key":"0","kind":"json","value":1},{"key":"2","kind":"json","value":1}]', "must be '1'"),
        ("list", "[2]", b"[]", "batch_size"),
        ("list", "[]", b'[{"key":"0","kind":"json","value":1,"int_key":true}]', "only allowed in a 'dict'"),
        ("TensorTree", "[]", b'[{"key":"0","kind":"json","value":1,"int_key":true}]', "only a 'dict'"),
        ("dict", "[]", b'[{"key":"01","kind":"json","value":1,"int_key":true}]', "decimal form"),
        ("dict", "[]", b'[{"key":"x","kind":"json","value":1,"int_key":true}]', "decimal form"),
        ("dict", "[]", b'[{"key":"1","kind":"json","value":1,"int_key":1}]', "must be true"),
        ("dict", "[]", b'[{"key":"a","kind":"json","value":[1],"tuples":[[1]]}]', "not a path"),
        ("dict", "[]", b'[{"key":"a","kind":"json","value":{"b":1},"tuples":[["b"]]}]', "leads to a int"),
        ("dict", "[]", b'[{"key":"a","kind":"json","value":[],"tuples":[[],[]]}]', "twice"),
        ("dict", "[]", b'[{"key":"a","kind":"json","value":[],"tuples":"x"}]', "list of at most"),
        ("dict", "[]", b'[{"key":"a","kind":"tensor","file":"a.memmap","dtype":"float32","shape":[],"tuples":[]}]', "unknown field"),
    ],
)
def test_damaged_container_fields_are_refused(kind, batch, entries, match):
    with pytest.raises(memtree.MetaFormatError, match=match):
        parse_level(_GOOD % (kind.encode(), batch.encode(), entries), "meta.json")


def test_container_fields_are_version_2_only():
    v1 = b'{"format":"memtree","version":1,"type":"list","byteorder":"little","batch_size":[2],"entries":%s}'
    assert parse_level(v1 % b'[{"key":"x","kind":"json","value":1}]', "meta.json").type == "list"  # a class name in v1
    for entry in (b'{"key":"1","kind":"json","value":1,"int_key":true}', b'{"key":"a","kind":"json","value":[],"tuples":[[]]}'):
        with pytest.raises(memtree.MetaFormatError, match="version 2"):
            parse_level(v1 % (b"[" + entry + b"]"), "meta.json")


def test_container_fields_parse():
    doc = _GOOD % (b"dict", b"[]", b'[{"key":"-4","kind":"json","value":[[1],{"x":[2]}],"int_key":true,"tuples":[[],[1,"x"]]}]')
    (entry,) = parse_level(doc, "meta.json").entries
    assert entry.int_key and entry.tuples == ((), (1, "x"))
    with pytest.raises(memtree.TensorclassError, match="reserved"):
        memtree.tensorclass(name="dict")(type("D", (), {"__annotations__": {"x": torch.Tensor}}))


# ---------------------------------------------------------------------------------------------
# the W7 benchmark keeps running


@pytest.mark.slow
def test_w7_benchmark_quick_run(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "w7_checkpoints.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, script, "--quick", "--workdir", str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 8, out.stdout
    incremental = next(r for r in rows if r.startswith("| memtree blocking, incremental")).split("|")
    full = next(r for r in rows if r.startswith("| memtree blocking, full")).split("|")
    assert float(incremental[9].replace(",", "")) < float(full[9].replace(",", "")) / 2  # MiB written next: 1 layer of 4 changed
