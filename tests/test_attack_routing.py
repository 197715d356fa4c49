"""Attacks on memtree.saving/loading, by class:

- patched loaders: wrappers of torch.save/torch.load made inside or outside the contexts
  (functools.partial, decorators, a library's monkeypatch), in any order with the contexts, and a
  hypothesis-driven sequence of enter/patch/unpatch/exit/call operations checked against a model;
- scope: asyncio tasks and threads entering and leaving contexts in random orders, a task created
  inside a context that runs after it;
- copies of a routed file (cp, os.replace, a hard link, another directory) and who owns a tree;
- durability: what fsync=True makes durable, and in which order;
- hostile routed entries: a generator of hostile references (size, offset, stride, dtype, key)
  checked against what torch does on the same bytes, hostile but valid trees (short, empty,
  2-d, nested, non-tensor leaves), links, FIFOs and a directory swapped for a link.

Also: tensor subclasses, callable map_location with weights_only, nested contexts with different
path callbacks, an error in the middle of a save.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import shutil
import threading
from collections import OrderedDict

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import memtree
from memtree import CheckpointFormatError, MemtreeError, NotAMemtreeError, RoutingError, UnsafePathError
from memtree import routing
from memtree.format.dtypes import dtype_from_name
from memtree.format.names import ROUTED_ENTRY
from treeutil import raw_bytes, snapshot

REAL = {"save": torch.serialization.save, "load": torch.serialization.load}
WRAPPER = {"save": routing._save, "load": routing._load}


def _restore_torch_functions():
    for name, function in REAL.items():
        setattr(torch, name, function)
        setattr(torch.serialization, name, function)


@pytest.fixture(autouse=True)
def _torch_functions_restored():
    """Each test starts and ends with torch's own functions (a failing one must not leak patches)."""
    yield
    _restore_torch_functions()


def entries(path) -> list[str]:
    d = f"{path}.memtree"
    return sorted(n for n in os.listdir(d) if ROUTED_ENTRY.fullmatch(n)) if os.path.isdir(d) else []


def save_routed(obj, target, **kw):
    with memtree.saving(**kw):
        torch.save(obj, target)


def load_routed(path, path_choice=None, **kw):
    with memtree.loading(path_choice):
        return torch.load(path, **kw)


def test_parameters_views_and_mapped_tensors_round_trip(tmp_path):
    memtree.TensorTree({"x": torch.arange(5.0)}).memmap(tmp_path / "tree")
    mapped = memtree.load_memmap(tmp_path / "tree")["x"]
    base = torch.arange(10.0)
    obj = {"p": torch.nn.Parameter(torch.ones(3)), "view": base[2:5], "base": base, "mapped": mapped}
    with memtree.saving():
        torch.save(obj, tmp_path / "ck.pt")
    assert os.path.isdir(tmp_path / "ck.pt.memtree")
    with memtree.loading():
        got = torch.load(tmp_path / "ck.pt", weights_only=True, map_location=lambda storage, loc: storage)
    assert type(got["p"]) is torch.nn.Parameter and got["p"].requires_grad
    assert torch.equal(got["view"], torch.tensor([2.0, 3.0, 4.0]))
    assert got["view"].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr()
    assert torch.equal(got["mapped"], torch.arange(5.0))


def test_nested_contexts_the_innermost_callback_decides(tmp_path):
    with memtree.saving(path=lambda f: str(tmp_path / "outer")):
        with memtree.saving(path=lambda f: None):
            torch.save({"x": torch.ones(2)}, tmp_path / "plain.pt")
        torch.save({"x": torch.ones(2)}, tmp_path / "routed.pt")
    assert sorted(os.listdir(tmp_path)) == ["outer", "plain.pt", "routed.pt"]
    assert torch.equal(torch.load(tmp_path / "plain.pt")["x"], torch.ones(2))  # a plain torch.save file
    with memtree.loading(path=lambda f: str(tmp_path / "outer")):
        assert torch.equal(torch.load(tmp_path / "routed.pt")["x"], torch.ones(2))


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("cannot pickle this")


def test_an_error_in_the_middle_of_a_save_leaves_the_old_pair(tmp_path):
    with memtree.saving():
        torch.save({"x": torch.ones(2)}, tmp_path / "ck.pt")
    before = sorted(os.listdir(tmp_path)), sorted(os.listdir(tmp_path / "ck.pt.memtree"))
    with pytest.raises(RuntimeError, match="cannot pickle"):
        with memtree.saving():
            torch.save({"x": torch.zeros(2), "bad": _Unpicklable()}, tmp_path / "ck.pt")
    assert (sorted(os.listdir(tmp_path)), sorted(os.listdir(tmp_path / "ck.pt.memtree"))) == before
    with memtree.loading():
        assert torch.equal(torch.load(tmp_path / "ck.pt", weights_only=True)["x"], torch.ones(2))


# ------------------------------------------------------------------------- patched loaders


class _NeedsPickle:
    """An object only ``weights_only=False`` loads."""

    def __init__(self, w):
        self.w = w


def test_a_partial_of_torch_load_made_inside_loading_never_recurses(tmp_path):
    """The issue's case: the common ``functools.partial(torch.load, weights_only=False)`` assigned
    inside loading() made every later torch.load raise RecursionError."""
    save_routed(_NeedsPickle(torch.arange(3.0)), tmp_path / "c.pt")
    with memtree.loading():
        torch.load = functools.partial(torch.load, weights_only=False)
        assert torch.equal(torch.load(tmp_path / "c.pt").w, torch.arange(3.0))
    assert torch.load.func is WRAPPER["load"]  # the user's partial stays, as they assigned it
    with pytest.raises(RoutingError, match=r"memtree.loading\(\)"):
        torch.load(tmp_path / "c.pt")  # outside every context: not routed, and no recursion
    for _ in range(3):  # and inside any number of later contexts
        with memtree.loading():
            assert torch.equal(torch.load(tmp_path / "c.pt").w, torch.arange(3.0))
            with memtree.loading():
                assert torch.equal(torch.load(tmp_path / "c.pt").w, torch.arange(3.0))
    REAL["save"]({"plain": 1}, tmp_path / "plain.pt")
    assert torch.load(tmp_path / "plain.pt") == {"plain": 1}


def test_a_decorator_of_torch_save_made_inside_saving_runs_once_per_call(tmp_path):
    calls = []
    with memtree.saving():
        inner = torch.save

        @functools.wraps(inner)
        def logged(obj, f, *a, **kw):
            calls.append(os.path.basename(f))
            return inner(obj, f, *a, **kw)

        torch.save = logged
        torch.save({"w": torch.ones(2)}, tmp_path / "a.pt")
    torch.save({"w": torch.ones(2)}, tmp_path / "b.pt")  # outside: the decorator, once, not routed
    with memtree.saving():  # the decorator calls memtree's wrapper: left in place, it routes
        assert torch.save is logged
        torch.save({"w": torch.ones(2)}, tmp_path / "c.pt")
        with memtree.saving(path=lambda f: None):
            torch.save({"w": torch.ones(2)}, tmp_path / "d.pt")
    assert calls == ["a.pt", "b.pt", "c.pt", "d.pt"]
    assert [bool(entries(tmp_path / n)) for n in ("a.pt", "b.pt", "c.pt", "d.pt")] == [True, False, True, False]
    assert torch.save is logged and torch.serialization.save is REAL["save"]


def test_a_wrapper_that_hides_what_it_wraps_runs_once_per_call(tmp_path):
    """A closure around memtree's wrapper without functools.wraps: the next context installs
    over it and calls through to it; neither inside nor outside does it run twice."""
    calls = []
    with memtree.saving():
        inner = torch.save

        def hidden(obj, f, *a, **kw):
            calls.append(os.path.basename(f))
            return inner(obj, f, *a, **kw)

        torch.save = hidden
    with memtree.saving(path=lambda f: None):
        assert torch.save is WRAPPER["save"]
        torch.save({"w": torch.ones(2)}, tmp_path / "a.pt")  # not routed: through hidden, once
    torch.save({"w": torch.ones(2)}, tmp_path / "b.pt")  # hidden -> wrapper -> torch: once
    assert calls == ["a.pt", "b.pt"] and torch.save is hidden
    assert torch.equal(torch.load(tmp_path / "b.pt")["w"], torch.ones(2))


def test_a_library_patch_made_before_the_context_keeps_working_and_comes_back(tmp_path):
    """A library replaced torch.load at import with a wrapper of the function it captured (the
    shape of Lightning's or a repository's weights_only=False patch): inside loading() it still
    runs, routed references resolve, and it is torch.load again afterwards."""
    captured = torch.load
    calls = []

    def library_load(f, *args, **kwargs):
        calls.append(f)
        kwargs.setdefault("weights_only", False)
        return captured(f, *args, **kwargs)

    torch.load = library_load
    save_routed(_NeedsPickle(torch.arange(4.0)), tmp_path / "c.pt")
    with memtree.loading():
        assert torch.load is WRAPPER["load"]
        assert torch.equal(torch.load(tmp_path / "c.pt").w, torch.arange(4.0))
    assert torch.load is library_load and calls == [tmp_path / "c.pt"]
    assert torch.serialization.load is REAL["load"]


def test_a_wrapper_that_changes_the_arguments_loads_with_its_arguments(tmp_path):
    """A wrapper of memtree's wrapper that turns the path into a str and adds map_location: the
    routed load uses what the wrapper passed (torch's own function is called once)."""
    save_routed({"w": torch.arange(3.0)}, tmp_path / "c.pt")
    seen = []
    with memtree.loading():
        inner = torch.load

        def wrapper(f, *a, **kw):
            seen.append(type(f))
            return inner(os.fspath(f), *a, map_location="cpu", **kw)

        torch.load = wrapper
    with memtree.loading():  # the wrapper is now what memtree's wrapper calls through
        assert torch.load is WRAPPER["load"]
        assert torch.equal(torch.load(tmp_path / "c.pt")["w"], torch.arange(3.0))
    assert seen == [type(tmp_path)]
    assert torch.load is wrapper


# what a user (or a library) assigns to torch.<name>: a wrapper of what is there now
def _partial(current):
    return functools.partial(current)


def _decorator(current):
    @functools.wraps(current)
    def wrapped(*a, **kw):
        return current(*a, **kw)

    return wrapped


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("enter"), st.sampled_from(["save", "load"]), st.booleans()),
        st.tuples(st.just("exit"), st.integers(0, 7)),
        st.tuples(st.just("patch"), st.sampled_from(["save", "load"]), st.sampled_from([_partial, _decorator])),
        st.tuples(st.just("unpatch"), st.sampled_from(["save", "load"])),
        st.tuples(st.just("call")),
    ),
    max_size=16,
)


def _reaches(function, wrapper) -> bool:
    """Whether calling ``function`` calls ``wrapper`` (through partials and decorators)."""
    while function is not None:
        if function is wrapper:
            return True
        function = getattr(function, "func", None) or getattr(function, "__wrapped__", None)
    return False


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, exit_order=st.randoms(use_true_random=False))
@example(  # the sequence: a partial made inside loading(), then another loading()
    ops=[("enter", "load", True), ("patch", "load", _partial), ("exit", 0), ("enter", "load", True), ("call",)],
    exit_order=random.Random(0),
)
@example(  # a decorator made inside saving(), then contexts exited out of order
    ops=[
        ("enter", "save", True), ("patch", "save", _decorator), ("enter", "save", False), ("exit", 0),
        ("call",), ("exit", 0), ("enter", "save", True), ("call",), ("unpatch", "save"), ("call",),
    ],
    exit_order=random.Random(0),
)
def test_property_any_sequence_of_contexts_and_patches(tmp_path_factory, ops, exit_order):
    """Contexts entered and exited in any order, torch.save/torch.load wrapped and unwrapped in
    between: each call routes exactly when an active routing context of the caller decides so and
    the function called reaches memtree's wrapper, never recurses, and once every context has
    exited torch.save/torch.load are torch's own functions or what the user assigned last."""
    d = tmp_path_factory.mktemp("seq")
    active: list[tuple[str, bool, object]] = []  # kind, routes, context manager
    patches: dict[str, list] = {"save": [], "load": []}  # what each user patch replaced
    model = {name: {"torch": REAL[name], "serialization": REAL[name], "original": REAL[name]} for name in REAL}

    def installs(name):
        m = model[name]
        if not _reaches(m["torch"], WRAPPER[name]):
            m["original"] = m["torch"]
            if m["serialization"] is m["torch"]:
                m["serialization"] = WRAPPER[name]
            m["torch"] = WRAPPER[name]

    def uninstalls(name):
        m = model[name]
        for where in ("torch", "serialization"):
            if m[where] is WRAPPER[name]:
                m[where] = m["original"]

    def check_model():
        for name, m in model.items():
            assert getattr(torch, name) is m["torch"], name
            assert getattr(torch.serialization, name) is m["serialization"], name

    def innermost(kind):
        return next((routes for k, routes, _ in reversed(active) if k == kind), None)

    def exit_at(i):
        kind, _, cm = active.pop(i)
        cm.__exit__(None, None, None)
        if not any(k == kind for k, _, _ in active):
            uninstalls(kind)

    calls = 0
    try:
        for op in ops:
            if op[0] == "enter":
                _, kind, routes = op
                cm = (memtree.saving if kind == "save" else memtree.loading)(None if routes else (lambda f: None))
                cm.__enter__()
                if not any(k == kind for k, _, _ in active):
                    installs(kind)
                active.append((kind, routes, cm))
            elif op[0] == "exit" and active:
                exit_at(op[1] % len(active))
            elif op[0] == "patch":
                _, name, make = op
                patches[name].append(getattr(torch, name))
                model[name]["torch"] = make(getattr(torch, name))
                setattr(torch, name, model[name]["torch"])
            elif op[0] == "unpatch" and patches[op[1]]:
                model[op[1]]["torch"] = patches[op[1]].pop()
                setattr(torch, op[1], model[op[1]]["torch"])
            elif op[0] == "call":
                calls += 1
                path = d / f"f{calls}.pt"
                torch.save({"w": torch.full((3,), float(calls))}, path)
                routed = bool(innermost("save")) and _reaches(torch.save, WRAPPER["save"])
                assert bool(entries(path)) == routed, (ops, calls)
                loads = not routed or (bool(innermost("load")) and _reaches(torch.load, WRAPPER["load"]))
                if loads:
                    assert torch.load(path)["w"][0] == calls
                else:
                    with pytest.raises(RoutingError):
                        torch.load(path)
            check_model()
        while active:
            exit_at(exit_order.randrange(len(active)))
        check_model()  # nothing active: torch's function or the user's last assignment
        torch.save({"w": torch.ones(1)}, d / "last.pt")
        assert not entries(d / "last.pt") and torch.equal(torch.load(d / "last.pt")["w"], torch.ones(1))
    finally:
        for _, _, cm in reversed(active):
            cm.__exit__(None, None, None)
        _restore_torch_functions()


# ------------------------------------------------------------------- scope: tasks and threads


def test_a_task_created_inside_saving_and_run_after_it_is_not_routed_whatever_other_threads_do(tmp_path):
    """The issue's case: whether such a task was routed depended on whether an unrelated thread
    was inside saving() (which kept torch.save installed)."""
    inside, leave = threading.Event(), threading.Event()

    def other_thread():
        with memtree.saving():
            inside.set()
            leave.wait(120)

    t = threading.Thread(target=other_thread)
    t.start()
    try:
        assert inside.wait(120)

        async def main():
            gates = {"now.pt": asyncio.Event(), "late.pt": asyncio.Event()}

            async def later(name):
                await gates[name].wait()
                torch.save({"w": torch.ones(2)}, tmp_path / name)

            with memtree.saving():
                late = asyncio.create_task(later("late.pt"))
                now = asyncio.create_task(later("now.pt"))
                gates["now.pt"].set()
                await now  # runs while the block is active: routed
            gates["late.pt"].set()
            await late  # runs after it: not routed

        asyncio.run(main())
    finally:
        leave.set()
        t.join(120)
    assert entries(tmp_path / "now.pt") and not os.path.exists(tmp_path / "late.pt.memtree")
    assert torch.equal(torch.load(tmp_path / "late.pt")["w"], torch.ones(2))


def test_to_thread_inside_the_context_is_routed_while_it_is_active(tmp_path):
    async def main():
        with memtree.saving():
            await asyncio.to_thread(torch.save, {"w": torch.ones(2)}, tmp_path / "t.pt")

    asyncio.run(main())
    assert entries(tmp_path / "t.pt")


def _stress_worker(root, seed, errors):
    """An event loop of tasks entering and leaving saving()/loading() in random orders."""
    rng = random.Random(seed)

    async def task(n):
        open_cms = []
        for i in range(6):
            r = rng.random()
            if r < 0.35:
                kind = rng.choice(["save", "load"])
                cm = (memtree.saving if kind == "save" else memtree.loading)()
                cm.__enter__()
                open_cms.append((kind, cm))
            elif r < 0.6 and open_cms:
                kind, cm = open_cms.pop(rng.randrange(len(open_cms)))  # any order
                cm.__exit__(None, None, None)
            path = os.path.join(root, f"s{seed}-t{n}-{i}.pt")
            torch.save({"w": torch.full((4,), float(i))}, path)
            routed = any(k == "save" for k, _ in open_cms)
            assert os.path.isdir(path + ".memtree") == routed, path
            if routed and not any(k == "load" for k, _ in open_cms):
                with memtree.loading():
                    assert torch.load(path)["w"][0] == i
            else:
                assert torch.load(path)["w"][0] == i
            await asyncio.sleep(0)
        for _, cm in reversed(open_cms):
            cm.__exit__(None, None, None)

    async def main():
        await asyncio.gather(*(task(n) for n in range(4)))

    try:
        asyncio.run(main())
    except BaseException as err:  # noqa: BLE001
        errors.append(err)


def test_stress_threads_and_tasks_entering_and_leaving_in_random_orders(tmp_path):
    errors: list[BaseException] = []
    threads = [threading.Thread(target=_stress_worker, args=(str(tmp_path), s, errors)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert torch.save is REAL["save"] and torch.load is REAL["load"]
    assert torch.serialization.save is REAL["save"] and torch.serialization.load is REAL["load"]
    from memtree.routing import patch

    assert patch._COUNTS == {"save": 0, "load": 0}


# ----------------------------------------------------------------------- copies and owners


def _shared(tmp_path):
    return str(tmp_path / "trees")


@pytest.mark.parametrize("copy", ["cp", "os.replace", "hard link"])
def test_a_copy_beside_the_file_keeps_its_tree_in_a_shared_directory(tmp_path, copy):
    """The issue's case: with a shared path=, best.pt (a copy of last.pt) lost its tree at the
    next save of last.pt."""
    trees = _shared(tmp_path)
    save_routed({"w": torch.full((3,), 1.0)}, tmp_path / "last.pt", path=trees)
    {"cp": shutil.copy, "os.replace": os.replace, "hard link": os.link}[copy](tmp_path / "last.pt", tmp_path / "best.pt")
    for v in (2.0, 3.0):
        save_routed({"w": torch.full((3,), v)}, tmp_path / "last.pt", path=trees)
        assert load_routed(tmp_path / "best.pt", trees)["w"].tolist() == [1.0] * 3
        assert load_routed(tmp_path / "last.pt", trees)["w"].tolist() == [v] * 3
    assert len(os.listdir(trees)) == 2  # best.pt's tree and last.pt's newest: the others went
    os.remove(tmp_path / "best.pt")  # nothing references it any more: the next save deletes it
    save_routed({"w": torch.full((3,), 4.0)}, tmp_path / "last.pt", path=trees)
    assert len(os.listdir(trees)) == 1


def _resaver(target, trees, go, n):
    """A process that saves ``target`` ``n`` times once ``go`` is set (exit code 0: all saved)."""
    try:
        go.wait(120)
        for i in range(n):
            save_routed({"w": torch.full((64,), float(i + 10))}, target, path=trees)
    except BaseException:  # noqa: BLE001
        os._exit(1)
    os._exit(0)


def test_a_copy_loads_while_another_process_saves_the_original_again_and_again(tmp_path):
    trees = _shared(tmp_path)
    save_routed({"w": torch.ones(64)}, tmp_path / "last.pt", path=trees)
    shutil.copy(tmp_path / "last.pt", tmp_path / "best.pt")
    fork = __import__("multiprocessing").get_context("fork")
    go = fork.Event()
    saver = fork.Process(target=_resaver, args=(tmp_path / "last.pt", trees, go, 20))
    saver.start()
    go.set()
    loads = 0
    while saver.is_alive() or loads == 0:
        assert torch.equal(load_routed(tmp_path / "best.pt", trees)["w"], torch.ones(64))
        loads += 1
    saver.join(120)
    assert saver.exitcode == 0
    assert load_routed(tmp_path / "last.pt", trees)["w"][0] == 29.0
    assert len(os.listdir(trees)) == 2


def test_a_copy_of_a_legacy_format_file_keeps_its_tree_too(tmp_path):
    trees = _shared(tmp_path)
    with memtree.saving(path=trees):
        torch.save({"w": torch.ones(2)}, tmp_path / "last.pt", _use_new_zipfile_serialization=False)
    shutil.copy(tmp_path / "last.pt", tmp_path / "best.pt")
    save_routed({"w": torch.zeros(2)}, tmp_path / "last.pt", path=trees)
    assert load_routed(tmp_path / "best.pt", trees)["w"].tolist() == [1.0, 1.0]


def test_a_copy_saved_again_releases_the_tree_it_shared(tmp_path):
    trees = _shared(tmp_path)
    save_routed({"w": torch.ones(2)}, tmp_path / "last.pt", path=trees)
    shutil.copy(tmp_path / "last.pt", tmp_path / "best.pt")
    save_routed({"w": torch.zeros(2)}, tmp_path / "best.pt", path=trees)  # best.pt: its own tree now
    save_routed({"w": torch.full((2,), 2.0)}, tmp_path / "last.pt", path=trees)
    assert len(os.listdir(trees)) == 2
    assert load_routed(tmp_path / "best.pt", trees)["w"].tolist() == [0.0, 0.0]


def test_a_copy_in_another_directory_fails_clearly_naming_both_paths(tmp_path):
    trees = _shared(tmp_path)
    save_routed({"w": torch.ones(2)}, tmp_path / "last.pt", path=trees)
    os.mkdir(tmp_path / "archive")
    shutil.copy(tmp_path / "last.pt", tmp_path / "archive" / "best.pt")
    assert load_routed(tmp_path / "archive" / "best.pt", trees)["w"].tolist() == [1.0, 1.0]
    (old,) = os.listdir(trees)
    save_routed({"w": torch.zeros(2)}, tmp_path / "last.pt", path=trees)
    with pytest.raises(NotAMemtreeError) as err:
        load_routed(tmp_path / "archive" / "best.pt", trees)
    message = str(err.value)
    assert str(tmp_path / "archive" / "best.pt") in message and os.path.join(trees, old) in message
    assert "saved under another name" in message


def test_a_copy_without_its_default_tree_directory_says_where_the_tree_is(tmp_path):
    save_routed({"w": torch.ones(2)}, tmp_path / "a.pt")
    shutil.copy(tmp_path / "a.pt", tmp_path / "b.pt")
    with pytest.raises(NotAMemtreeError) as err:
        load_routed(tmp_path / "b.pt")
    (entry,) = entries(tmp_path / "a.pt")
    message = str(err.value)
    assert str(tmp_path / "b.pt.memtree" / entry) in message and str(tmp_path / "a.pt.memtree" / entry) in message
    shutil.copytree(tmp_path / "a.pt.memtree", tmp_path / "b.pt.memtree")  # the pair, copied
    assert load_routed(tmp_path / "b.pt")["w"].tolist() == [1.0, 1.0]


def test_a_fifo_or_a_huge_file_beside_the_target_does_not_hang_the_save(tmp_path):
    trees = _shared(tmp_path)
    os.mkfifo(tmp_path / "pipe.pt")
    with open(tmp_path / "sparse.pt", "wb") as f:  # starts like a zip, then nothing
        f.write(b"PK\x03\x04")
        f.truncate(1 << 40)
    os.symlink(tmp_path / "pipe.pt", tmp_path / "link.pt")
    for v in range(3):
        save_routed({"w": torch.full((2,), float(v))}, tmp_path / "last.pt", path=trees)
    assert len(os.listdir(trees)) == 1


# --------------------------------------------------------------------------- durability


def _record_fsyncs(monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, **kw):
        events.append(("replace", os.fspath(dst)))
        return real_replace(src, dst, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_fsync_makes_new_directories_durable_before_the_commit(tmp_path, monkeypatch):
    """The issue's case: a new path= directory (and the file's .memtree directory) was never
    fsynced into its parent, so a power loss could keep the file and lose its tree."""
    (tmp_path / "run").mkdir()
    target = tmp_path / "run" / "c.pt"
    events = _record_fsyncs(monkeypatch)
    save_routed({"w": torch.ones(2)}, target, path=tmp_path / "new" / "trees", fsync=True)
    commit = events.index(("replace", str(target)))
    before = {p for e, p in events[:commit] if e == "fsync"}
    assert {str(tmp_path), str(tmp_path / "new"), str(tmp_path / "new" / "trees")} <= before
    after = [p for e, p in events[commit:] if e == "fsync"]
    assert after[:2] == [str(tmp_path / "run"), str(tmp_path)]  # the rename; the file's directory
    events.clear()
    save_routed({"w": torch.ones(2)}, tmp_path / "run" / "d.pt", fsync=True)  # the default directory
    commit = events.index(("replace", str(tmp_path / "run" / "d.pt")))
    assert ("fsync", str(tmp_path / "run")) in events[:commit]
    events.clear()
    save_routed({"w": torch.ones(2)}, tmp_path / "run" / "e.pt")  # fsync=False: none at all
    assert not [e for e in events if e[0] == "fsync"]


def test_a_new_checkpoint_root_is_fsynced_into_its_parent(tmp_path, monkeypatch):
    """The issue's other case: Checkpointer(root, fsync=True) created its root (and its parents)
    without making them durable, so a power loss could lose every step committed inside."""
    events = _record_fsyncs(monkeypatch)
    memtree.Checkpointer(tmp_path / "runs" / "exp", fsync=True)
    fsynced = [p for e, p in events if e == "fsync"]
    base = os.path.realpath(tmp_path)
    assert fsynced[:2] == [base, os.path.join(base, "runs")]
    events.clear()
    memtree.Checkpointer(tmp_path / "runs" / "other")  # fsync=False: none
    assert not events


# -------------------------------------------------------------------- hostile references


class _Evil:
    """Pickles as a call of the routing function with arguments of the test's choosing."""

    def __init__(self, *args):
        self.args = args

    def __reduce__(self):
        return (routing._routed_storage, self.args)


class _EvilTensor:
    """A tensor torch rebuilds over a routed storage, with a geometry of the test's choosing
    (``dtype``: through ``_rebuild_tensor_v3``, as torch saves the dtypes without a typed storage)."""

    def __init__(self, storage_args, size, stride, offset, dtype=None):
        self.storage_args, self.size, self.stride, self.offset, self.dtype = storage_args, size, stride, offset, dtype

    def __reduce__(self):
        args = (_Evil(*self.storage_args), self.offset, self.size, self.stride, False, OrderedDict())
        if self.dtype is None:
            return (torch._utils._rebuild_tensor_v2, args)
        return (torch._utils._rebuild_tensor_v3, (*args, self.dtype))


def _hostile(tmp_path, payload):
    """A routed save of a real tensor, then a file whose pickle also holds ``payload``."""
    save_routed({"w": torch.arange(4.0), "e": torch.empty(0)}, tmp_path / "c.pt")
    (entry,) = entries(tmp_path / "c.pt")
    REAL["save"]({"x": payload(entry)}, tmp_path / "c.pt")  # the tree stays, the pickle is replaced
    return entry


@pytest.mark.parametrize(
    "payload, match",
    [
        (lambda e: _Evil("../../etc", "0", "float32", "cpu"), "names the tree"),
        (lambda e: _Evil("/" + e, "0", "float32", "cpu"), "names the tree"),
        (lambda e: _Evil(e[:-1] + ("1" if e[-1] == "0" else "0"), "0", "float32", "cpu"), "does not exist"),
        (lambda e: _Evil(e, "../0", "float32", "cpu"), "no leaf"),
        (lambda e: _Evil(e, "7", "float32", "cpu"), "no leaf"),
        (lambda e: _Evil(e, 0, "float32", "cpu"), "no leaf"),
        (lambda e: _Evil(e, "0", "object", "cpu"), "dtype"),
        (lambda e: _Evil(e, "0", "float32", "xla:0"), "location"),
        (lambda e: _Evil(e, "0", "float32", None), "location"),
        (lambda e: [_Evil(e, "0", "float32", "cpu"), _Evil("0" * 12 + "-" + "1" * 16, "0", "float32", "cpu")], "two trees"),
    ],
)
@pytest.mark.parametrize("weights_only", [True, False])
def test_hostile_references_are_refused(tmp_path, payload, match, weights_only):
    _hostile(tmp_path, payload)
    before = snapshot(tmp_path)
    with pytest.raises((CheckpointFormatError, NotAMemtreeError), match=match):
        load_routed(tmp_path / "c.pt", weights_only=weights_only)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("key", ["0", "1"])  # a 16-byte leaf, and an empty one
def test_a_tensor_larger_than_its_routed_storage_is_refused_without_allocating(tmp_path, key):
    _hostile(tmp_path, lambda e: _EvilTensor((e, key, "float32", "cpu"), (1 << 40,), (1,), 0))
    with pytest.raises(CheckpointFormatError, match=r"size \(1099511627776,\).* does not fit the leaf"):
        load_routed(tmp_path / "c.pt", weights_only=True)


def test_an_offset_past_the_storage_is_refused(tmp_path):
    _hostile(tmp_path, lambda e: _EvilTensor((e, "0", "float32", "cpu"), (2,), (1,), 1 << 40))
    with pytest.raises(CheckpointFormatError, match="storage_offset 1099511627776"):
        load_routed(tmp_path / "c.pt", weights_only=True)


def test_a_damaged_leaf_is_refused_by_the_tree_loader(tmp_path):
    save_routed({"w": torch.arange(8.0)}, tmp_path / "c.pt")
    (entry,) = entries(tmp_path / "c.pt")
    with open(tmp_path / "c.pt.memtree" / entry / "0.memmap", "r+b") as f:
        f.truncate(10)
    with pytest.raises(memtree.LeafSizeError):
        load_routed(tmp_path / "c.pt")


LEAVES = {"0": torch.arange(6, dtype=torch.float32), "1": torch.empty(0), "2": torch.arange(3, dtype=torch.int8)}
_dims = st.integers(0, 3)
_ints = st.one_of(st.integers(-3, 12), st.sampled_from([1 << 40, (1 << 62) + 1, -(1 << 62)]))


@st.composite
def hostile_references(draw):
    n = draw(_dims)
    return (
        draw(st.sampled_from(sorted(LEAVES))),
        draw(st.sampled_from(["float32", "int8", "float64", "bool", "uint16", "float8_e4m3fn"])),
        tuple(draw(_ints) for _ in range(n)),
        tuple(draw(_ints) for _ in range(n)),
        draw(_ints),
        draw(st.booleans()),  # through _rebuild_tensor_v3 (a byte storage and the tensor's dtype)
    )


def _as_torch_would(leaf, dtype, size, stride, offset, v3):
    """What torch makes of the reference over the same bytes in memory (a storage that cannot grow)."""
    import numpy as np

    data = leaf.contiguous().view(torch.uint8).numpy().copy() if leaf.numel() else np.empty(0, np.uint8)
    storage = torch.from_numpy(data).untyped_storage()
    typed = torch.storage.TypedStorage(
        wrap_storage=storage, dtype=torch.uint8 if v3 else dtype_from_name(dtype), _internal=True
    )
    if v3:
        return torch._utils._rebuild_tensor_v3(typed, offset, size, stride, False, OrderedDict(), dtype_from_name(dtype))
    return torch._utils._rebuild_tensor_v2(typed, offset, size, stride, False, OrderedDict())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ref=hostile_references(), weights_only=st.booleans())
def test_property_a_hostile_reference_loads_what_torch_would_or_raises_a_typed_error(tmp_path_factory, ref, weights_only):
    """Every reference geometry: the load equals torch's own result on the same bytes, or raises
    CheckpointFormatError naming the file, the leaf and the geometry, never torch's RuntimeError."""
    d = tmp_path_factory.mktemp("ref")
    key, dtype, size, stride, offset, v3 = ref
    save_routed(dict(LEAVES), d / "c.pt")
    (entry,) = entries(d / "c.pt")
    leaf = memtree.load_memmap(d / "c.pt.memtree" / entry, mode="r")[key]
    storage_args = (entry, key, "uint8" if v3 else dtype, "cpu")
    REAL["save"]({"x": _EvilTensor(storage_args, size, stride, offset, dtype_from_name(dtype) if v3 else None)}, d / "c.pt")
    try:
        expected = _as_torch_would(leaf, dtype, size, stride, offset, v3)
    except Exception:  # noqa: BLE001
        expected = None
    if expected is None:
        with pytest.raises(CheckpointFormatError, match="does not fit the leaf") as err:
            load_routed(d / "c.pt", weights_only=weights_only)
        assert str(d / "c.pt") in str(err.value) and repr(size) in str(err.value)
    else:
        got = load_routed(d / "c.pt", weights_only=weights_only)["x"]
        assert (got.dtype, got.shape, got.stride(), got.storage_offset()) == (
            expected.dtype, expected.shape, expected.stride(), expected.storage_offset()
        )
        if got.numel() <= 1 << 16:  # (a huge size over stride 0 is a valid view of a few bytes)
            assert raw_bytes(got) == raw_bytes(expected)


def _write_hostile_tree(tmp_path, contents):
    """A routed pair whose tree is replaced by a valid memtree tree of ``contents``."""
    save_routed({"w": torch.arange(4.0)}, tmp_path / "c.pt")
    (entry,) = entries(tmp_path / "c.pt")
    path = tmp_path / "c.pt.memtree" / entry
    shutil.rmtree(path)
    memtree.TensorTree(contents).memmap(path)
    return path


@pytest.mark.parametrize(
    "contents, match",
    [
        ({"0": torch.arange(2.0)}, "does not fit the leaf"),  # short: the meta.json agrees with it
        ({"0": torch.empty(0)}, "does not fit the leaf"),  # empty
        ({"0": torch.arange(8, dtype=torch.int8)}, "does not fit the leaf"),  # bytes of another dtype
        ({"0": torch.arange(16.0).view(4, 4)}, "routed saves write flat leaves"),
        ({"0": torch.arange(8.0)[::2].contiguous().view(2, 2).t()}, "routed saves write flat leaves"),
        ({"0": {"x": torch.arange(4.0)}}, "no leaf"),  # a sub-tree where a leaf should be
        ({"0": "text"}, "no leaf"),  # a non-tensor value
        ({"1": torch.arange(4.0)}, "no leaf"),
    ],
)
@pytest.mark.parametrize("weights_only", [True, False])
def test_a_hostile_but_valid_tree_is_refused_by_name(tmp_path, contents, match, weights_only):
    """The issue's case: short or empty leaves made torch.load raise torch's raw RuntimeError."""
    tree = _write_hostile_tree(tmp_path, contents)
    before = snapshot(tmp_path)
    with pytest.raises(CheckpointFormatError, match=match) as err:
        load_routed(tmp_path / "c.pt", weights_only=weights_only)
    assert str(tmp_path / "c.pt") in str(err.value)
    assert snapshot(tmp_path) == before


def _outside_tree(tmp_path):
    """A valid routed-shaped tree outside the checkpoint's directory (what a link could reach)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    memtree.TensorTree({"0": torch.full((4,), 7.0)}).memmap(outside / "tree")
    return outside / "tree"


def _link_entry(tmp_path):
    tree = _write_hostile_tree(tmp_path, {"0": torch.arange(4.0)})
    shutil.rmtree(tree)
    os.symlink(_outside_tree(tmp_path), tree)


def _link_directory(tmp_path):
    tree = _write_hostile_tree(tmp_path, {"0": torch.arange(4.0)})
    outside = _outside_tree(tmp_path)
    os.rename(outside, outside.parent / tree.name)
    shutil.rmtree(tmp_path / "c.pt.memtree")
    os.symlink(outside.parent, tmp_path / "c.pt.memtree")


def _link_leaf(tmp_path):
    tree = _write_hostile_tree(tmp_path, {"0": torch.arange(4.0)})
    outside = _outside_tree(tmp_path)
    os.remove(tree / "0.memmap")
    os.symlink(outside / "0.memmap", tree / "0.memmap")


def _fifo(where):
    def make(tmp_path):
        tree = _write_hostile_tree(tmp_path, {"0": torch.arange(4.0)})
        path = {"leaf": tree / "0.memmap", "meta": tree / "meta.json", "entry": tree}[where]
        shutil.rmtree(path) if path.is_dir() else os.remove(path)
        os.mkfifo(path)

    return make


def _file_entry(tmp_path):
    tree = _write_hostile_tree(tmp_path, {"0": torch.arange(4.0)})
    shutil.rmtree(tree)
    tree.write_bytes(b"\0" * 16)


@pytest.mark.parametrize(
    "make",
    [_link_entry, _link_directory, _link_leaf, _fifo("leaf"), _fifo("meta"), _fifo("entry"), _file_entry],
    ids=["linked entry", "linked .memtree directory", "linked leaf", "FIFO leaf", "FIFO meta.json", "FIFO entry", "file entry"],
)
def test_links_fifos_and_files_in_a_routed_tree_are_refused(tmp_path, make):
    """The issue's case: a symlinked entry was followed out of the tree. Nothing outside is read
    (the outside tree holds 7s: they never come back) and the error names the path."""
    make(tmp_path)
    before = snapshot(tmp_path)
    with pytest.raises(MemtreeError) as err:
        load_routed(tmp_path / "c.pt", weights_only=True)
    assert isinstance(err.value, (UnsafePathError, CheckpointFormatError, memtree.MetaFormatError))
    assert str(tmp_path / "c.pt") in str(err.value)
    assert snapshot(tmp_path) == before


def test_a_link_in_a_directory_chosen_with_path_is_the_callers_and_is_followed(tmp_path):
    save_routed({"w": torch.arange(4.0)}, tmp_path / "c.pt", path=tmp_path / "real")
    os.symlink(tmp_path / "real", tmp_path / "alias")
    assert load_routed(tmp_path / "c.pt", tmp_path / "alias")["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_tree_swapped_for_a_link_while_it_is_opened_is_refused(tmp_path, monkeypatch):
    from memtree.routing import load

    tree = _write_hostile_tree(tmp_path, {"0": torch.arange(4.0)})
    outside = _outside_tree(tmp_path)
    real = load.open_tree

    def swapped(path, *a, **kw):  # between memtree's checks and the tree's opening
        os.rename(tree, tmp_path / "moved")
        os.symlink(outside, tree)
        return real(path, *a, **kw)

    monkeypatch.setattr(load, "open_tree", swapped)
    with pytest.raises(UnsafePathError, match="replaced while it was opened"):
        load_routed(tmp_path / "c.pt")


def test_a_linked_default_directory_is_not_written_through(tmp_path):
    """A save whose <file>.memtree is a link (planted, or left) would write and delete trees in
    the directory it points to."""
    victim = tmp_path / "victim"
    victim.mkdir()
    save_routed({"w": torch.ones(2)}, victim / "c.pt")  # a tree that a save through the link would delete
    os.rename(victim / "c.pt.memtree", victim / "trees")
    os.symlink(victim / "trees", tmp_path / "c.pt.memtree")
    before = snapshot(victim)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        save_routed({"w": torch.zeros(2)}, tmp_path / "c.pt")
    assert snapshot(victim) == before and not os.path.exists(tmp_path / "c.pt")


@pytest.mark.parametrize("weights_only", [True, False])
def test_a_reference_geometry_that_is_no_geometry_is_a_typed_error(tmp_path, weights_only):
    """Offsets and sizes of the wrong type reach torch's rebuild as they are."""
    _hostile(tmp_path, lambda e: _EvilTensor((e, "0", "float32", "cpu"), (2,), (1,), "3"))
    with pytest.raises(CheckpointFormatError, match="storage_offset '3'"):
        load_routed(tmp_path / "c.pt", weights_only=weights_only)


@pytest.mark.parametrize("key", [["0"], {"k": 1}, None, b"0"])
def test_an_unhashable_or_odd_key_is_a_typed_error(tmp_path, key):
    _hostile(tmp_path, lambda e: _EvilTensor((e, key, "float32", "cpu"), (2,), (1,), 0))
    with pytest.raises(CheckpointFormatError, match="no leaf"):
        load_routed(tmp_path / "c.pt", weights_only=False)

