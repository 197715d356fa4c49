"""Links, locks and descriptors: the hostile-input suite of memtree's *writes*.

A write, a growth or a recovery writes into a few existing files in place: the writer lock (its
journal), the leaf files a growth lengthens, the leaf files recovery cuts back. Each is planted
here as every kind of thing a hostile or careless directory can hold at that name (a hard link to
a file elsewhere, a symbolic link to a file outside or to nowhere, a FIFO, a directory), for every
operation that reaches it. The properties: memtree raises a ``MemtreeError`` (``UnsafePathError``
where the name is not a plain file) or works around the link, never hangs, and never changes a
byte outside the tree (nor the tree, when it refuses). Also here: the layout check of the root
``meta.json`` uses the loader's safe opener, and loads, growth and recovery of a 200-level,
20,000-leaf tree work under ``RLIMIT_NOFILE`` 64.

The reader side of links (loads of hostile trees) is in test_bad_input.py and test_fuzz_load.py.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import stat
import tempfile
from pathlib import Path

import orjson
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memtree
from memtree import TensorTree
from memtree.store.primitives.commit import JOURNAL_BYTES
from memtree.store.writing.recovery import GROWTH_JOURNAL
from memtree.store.foreign.tensordict import is_tensordict_dir

FORK = mp.get_context("fork")
OUTSIDE_BYTES = b"precious bytes outside the tree\n" * 64


def buffer(path: Path, n: int = 3, nested: bool = False) -> TensorTree:
    src = {"obs": torch.arange(n * 3, dtype=torch.float32).reshape(n, 3), "step": torch.arange(n)}
    if nested:
        src["next"] = {"obs": -torch.arange(n * 3, dtype=torch.float32).reshape(n, 3)}
    return TensorTree(src, batch_size=[n]).memmap(path)


def item(i: int, nested: bool = False) -> dict:
    out = {"obs": torch.full((3,), float(i)), "step": torch.tensor(i)}
    if nested:
        out["next"] = {"obs": torch.full((3,), -float(i))}
    return out


def files_under(root: Path) -> dict:
    """Every entry under root, without following links: kind and, for files, inode and bytes."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            st_ = os.lstat(p)
            rel = os.path.relpath(p, root)
            if stat.S_ISLNK(st_.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISREG(st_.st_mode):  # bytes of small files; size and mtime of others
                content = Path(p).read_bytes() if st_.st_size < (1 << 20) else st_.st_mtime_ns
                out[rel] = ("file", st_.st_ino, st_.st_size, content)
            else:
                out[rel] = (stat.S_IFMT(st_.st_mode),)
    return out


def _child(conn, fn, args):
    try:
        result = ("ok", fn(*args))
    except BaseException as e:  # report everything; the parent decides
        result = ("raise", type(e).__name__, isinstance(e, memtree.MemtreeError), str(e))
    conn.send(result)
    conn.close()


def in_child(fn, *args, timeout: float = 120):
    """fn(*args) in a forked process: its result, or ("raise", name, is_memtree, message).

    Fails the test if the child hangs (a FIFO opened for writing without O_NONBLOCK blocks
    forever) or dies from a signal.
    """
    recv, send = FORK.Pipe(duplex=False)
    p = FORK.Process(target=_child, args=(send, fn, args))
    p.start()
    send.close()
    if not recv.poll(timeout):
        p.kill()
        p.join()
        pytest.fail(f"the child did not answer within {timeout} s: it hangs")
    result = recv.recv()
    p.join(timeout)
    assert p.exitcode == 0, f"the child died with exit code {p.exitcode}"
    return result


# ----------------------------------------------------------------------------- the planted objects


def plant(path: Path, kind: str, outside: Path) -> None:
    """Make ``path`` a ``kind``: a hard link to or a symbolic link to ``outside`` (a file with
    OUTSIDE_BYTES), a symbolic link to a missing file next to it, a FIFO, or a directory."""
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "hard link":
        os.link(outside, path)
    elif kind == "symlink":
        path.symlink_to(outside)
    elif kind == "dangling symlink":
        path.symlink_to(outside.parent / "never-created")
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()


PLANTED = ["hard link", "symlink", "dangling symlink", "fifo", "directory"]


@pytest.fixture
def place(tmp_path):
    """(parent of the tree, the tree's prefix, a directory outside with one precious file)."""
    parent, outside = tmp_path / "parent", tmp_path / "outside"
    parent.mkdir()
    outside.mkdir()
    (outside / "precious").write_bytes(OUTSIDE_BYTES)
    return parent, parent / "buf", outside


# ----------------------------------------------------------------------------- the writer lock


def _write_new(prefix):
    TensorTree({"x": torch.ones(2)}, batch_size=[2]).memmap(prefix)


def _overwrite(prefix):
    TensorTree({"x": torch.ones(2)}, batch_size=[2]).memmap(prefix, existsok=True)


def _memmap_like(prefix):
    TensorTree({"x": torch.ones(2)}, batch_size=[2]).memmap_like(prefix, existsok=True)


def _append(prefix):
    memtree.load_memmap(prefix).append_(item(7))


def _shrink(prefix):
    memtree.load_memmap(prefix).resize_(1)


LOCK_TAKERS = {"write new": _write_new, "overwrite": _overwrite, "memmap_like": _memmap_like,
               "append_": _append, "resize_ down": _shrink}


@pytest.mark.parametrize("kind", PLANTED)
@pytest.mark.parametrize("operation", list(LOCK_TAKERS))
def test_a_lock_file_that_is_not_a_plain_single_link_file_is_refused_untouched(place, kind, operation):
    parent, prefix, outside = place
    if operation != "write new":
        buffer(prefix)
    lock = parent / ".buf.memtree.lock"
    plant(lock, kind, outside / "precious")
    before_tree, before_outside = files_under(parent), files_under(outside)
    answer = in_child(LOCK_TAKERS[operation], str(prefix))
    assert answer[:3] == ("raise", "UnsafePathError", True), answer
    assert str(lock) in answer[3] and "remove it" in answer[3]
    assert files_under(outside) == before_outside  # no journal written through the link
    assert files_under(parent) == before_tree  # the tree (or its absence) and the planted lock
    if kind != "directory":
        os.unlink(lock)
    else:
        lock.rmdir()
    LOCK_TAKERS[operation](str(prefix))  # once removed, the operation works
    assert memtree.load_memmap(prefix, lazy=False) is not None


@pytest.mark.parametrize("kind", PLANTED)
def test_recover_skips_a_destination_whose_lock_file_is_planted(place, kind):
    parent, prefix, outside = place
    buffer(prefix)
    staging = parent / (".buf.memtree-tmp-" + "0" * 32)
    staging.mkdir()
    lock = parent / ".buf.memtree.lock"
    plant(lock, kind, outside / "precious")
    before = files_under(outside)
    actions = in_child(memtree.recover, str(parent))
    assert actions[0] == "ok", actions
    assert [a for a in actions[1] if "buf" in a] == [
        next(a for a in actions[1] if a.startswith(f"skipped {prefix}: the lock file"))
    ]
    assert staging.is_dir() and files_under(outside) == before


def test_a_lock_file_with_a_second_name_inside_the_parent_is_refused_too(place):
    parent, prefix, _ = place
    buffer(prefix)
    lock = parent / ".buf.memtree.lock"
    lock.write_bytes(b"")
    os.link(lock, parent / "another-name")
    with pytest.raises(memtree.UnsafePathError, match="2 hard links"):
        _append(prefix)
    assert (parent / "another-name").read_bytes() == b""


# ----------------------------------------------------------------------------- leaf files a growth writes


GROWTHS = {
    "append within capacity": lambda t: t.append_(item(9, "next" in t.keys())),
    "extend past capacity": lambda t: t.extend_(memtree.cat([t[:1].clone()] * 5)),
    "resize up": lambda t: t.resize_(20),
    "resize down": lambda t: t.resize_(1),
}


def _grow(prefix, growth):
    tree = memtree.load_memmap(prefix)
    GROWTHS[growth](tree)


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
@pytest.mark.parametrize("growth", list(GROWTHS))
def test_a_leaf_file_that_became_a_link_fifo_or_directory_stops_the_growth(place, kind, growth):
    parent, prefix, outside = place
    tree = buffer(prefix)
    tree.append_(item(3))  # capacity 6: free rows for "append within capacity"
    size = (prefix / "obs.memmap").stat().st_size
    (outside / "precious").write_bytes(OUTSIDE_BYTES[:size])  # same size: the size check passes
    tree = memtree.load_memmap(prefix, lazy=False)  # the tree in memory matches the meta.json
    plant(prefix / "obs.memmap", kind, outside / "precious")
    before_tree, before_outside = files_under(parent), files_under(outside)
    answer = in_child(lambda: GROWTHS[growth](tree))
    assert answer[:3] == ("raise", "UnsafePathError", True), answer
    assert "obs.memmap" in answer[3]
    assert files_under(outside) == before_outside
    assert files_under(parent) == before_tree  # nothing committed, no staging left


def _model_rows(values: list[int], nested: bool) -> dict:
    v = torch.tensor(values, dtype=torch.float32)
    rows = {"obs": v[:, None].expand(len(values), 3).contiguous(), "step": v.to(torch.int64)}
    if nested:
        rows["next"] = {"obs": -rows["obs"]}
    return rows


_LINK_OPS = st.one_of(
    st.tuples(st.just("link"), st.sampled_from(["obs.memmap", "step.memmap", "next/obs.memmap"])),
    st.tuples(st.just("extend"), st.integers(1, 6)),
    st.tuples(st.just("resize"), st.integers(0, 12)),
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nested=st.booleans(), ops=st.lists(_LINK_OPS, min_size=1, max_size=12))
def test_growth_never_changes_a_file_that_shares_a_leaf_files_bytes(nested, ops):
    """Hard links to leaf files planted at any point of any growth sequence keep their bytes
    (and sizes) for good, while the tree follows the model."""
    with tempfile.TemporaryDirectory() as tmp:
        d, outside = Path(tmp) / "buf", Path(tmp) / "outside"
        outside.mkdir()
        model = [1, 2]
        tree = TensorTree(_model_rows(model, nested), batch_size=[2]).memmap(d)
        links: dict[Path, bytes] = {}
        fresh = 10
        for op, arg in ops:
            if op == "link":
                if arg.startswith("next/") and not nested:
                    continue
                other = outside / f"{len(links)}"
                os.link(d / arg, other)
                links[other] = other.read_bytes()
            elif op == "extend":
                new = list(range(fresh, fresh + arg))
                fresh += arg
                tree.extend_(_model_rows(new, nested))
                model += new
            else:
                tree.resize_(arg)
                model = model[:arg] + [0] * max(0, arg - len(model))
            assert {p: p.read_bytes() for p in links} == links
            expected = TensorTree(_model_rows(model, nested), batch_size=[len(model)])
            assert (tree == expected).all() and (memtree.load_memmap(d) == expected).all()


# ----------------------------------------------------------------------------- leaf files recovery cuts back


@pytest.mark.parametrize("kind", ["hard link", "symlink", "fifo"])
def test_recovery_never_cuts_back_a_file_reached_through_a_link(place, kind):
    parent, prefix, outside = place
    buffer(prefix)
    precious = outside / "precious"  # longer than obs.memmap: what an interrupted growth leaves
    assert precious.stat().st_size > (prefix / "obs.memmap").stat().st_size
    plant(prefix / "obs.memmap", kind, precious)
    journal = orjson.dumps({GROWTH_JOURNAL: "f" * 32}).ljust(JOURNAL_BYTES)
    (parent / ".buf.memtree.lock").write_bytes(journal)  # a growth that never committed
    before = files_under(outside)
    actions = in_child(memtree.recover, str(parent))
    assert actions[0] == "ok", actions
    assert not any(a.startswith("cut ") for a in actions[1]), actions
    if kind == "hard link":
        assert any(a.startswith(f"left {prefix / 'obs.memmap'} alone") for a in actions[1]), actions
    assert files_under(outside) == before


def test_recovery_still_cuts_back_a_plain_leaf_file(place):
    parent, prefix, _ = place
    buffer(prefix)
    size = (prefix / "obs.memmap").stat().st_size
    with open(prefix / "obs.memmap", "ab") as f:
        f.write(bytes(size))
    (parent / ".buf.memtree.lock").write_bytes(orjson.dumps({GROWTH_JOURNAL: "f" * 32}).ljust(JOURNAL_BYTES))
    actions = memtree.recover(parent)
    assert any(a.startswith(f"cut {prefix / 'obs.memmap'} back") for a in actions), actions
    assert (prefix / "obs.memmap").stat().st_size == size
    assert memtree.load_memmap(prefix, lazy=False)["step"].tolist() == [0, 1, 2]


# ----------------------------------------------------------------------------- the layout check


TENSORDICT_META = (b'{"x": {"dtype": "torch.int32", "shape": [2], "device": "cpu", "is_nested": false}, '
                   b'"shape": [2], "device": "cpu", "_type": "<class \'tensordict._td.TensorDict\'>"}')


@pytest.mark.parametrize("kind", ["symlink to a tensordict meta.json", "symlink to a memtree meta.json",
                                  "dangling symlink", "fifo", "directory", "sparse 1 GiB"])
def test_the_layout_check_reads_the_root_meta_json_like_the_loader(tmp_path, kind):
    prefix, outside = tmp_path / "t", tmp_path / "outside"
    prefix.mkdir()
    outside.mkdir()
    (prefix / "x.memmap").write_bytes(torch.tensor([1, 2], dtype=torch.int32).numpy().tobytes())
    meta = prefix / "meta.json"
    if kind.startswith("symlink"):
        memtree.TensorTree({"y": torch.ones(1)}).memmap(outside / "memtree")
        target = outside / "memtree" / "meta.json"
        if "tensordict" in kind:
            target = outside / "meta.json"
            target.write_bytes(TENSORDICT_META)
        meta.symlink_to(target)
    elif kind == "sparse 1 GiB":
        meta.write_bytes(TENSORDICT_META)
        os.truncate(meta, 1 << 30)
    else:
        plant(meta, kind, outside / "nothing")
    before = files_under(tmp_path)
    assert in_child(is_tensordict_dir, str(prefix)) == ("ok", False)  # never raises, never hangs
    answer = in_child(lambda: memtree.load_memmap(prefix, lazy=False))
    assert answer[0] == "raise" and answer[2], answer  # the loader names the problem
    assert files_under(tmp_path) == before


def test_the_layout_check_still_finds_a_tensordict_directory(tmp_path):
    (tmp_path / "meta.json").write_bytes(TENSORDICT_META)
    (tmp_path / "x.memmap").write_bytes(torch.tensor([1, 2], dtype=torch.int32).numpy().tobytes())
    assert is_tensordict_dir(tmp_path)
    assert memtree.load_memmap(tmp_path)["x"].tolist() == [1, 2]


# ----------------------------------------------------------------------------- descriptors


def big_tree() -> TensorTree:
    """200 levels and 20,000 leaves: 160 sub-trees under the root, and a chain 40 levels deep,
    each level with 100 leaves (leaf j of level i holds [i, j])."""
    def level(i: int) -> dict:
        return {f"l{j}": torch.tensor([[i, j]], dtype=torch.int32) for j in range(100)}

    src = {f"w{i}": level(i) for i in range(160)}
    node = src
    for i in range(160, 200):
        node["c"] = level(i)
        node = node["c"]
    return TensorTree(src, batch_size=[1])


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("links") / "big"
    big_tree().memmap(path, pack_below=0)  # a file per leaf: 20,000 files (the case of the test)
    return path


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _under_64_descriptors(path: str) -> dict:
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    base = _open_fds()
    out = {}
    tree = memtree.load_memmap(path)
    tree.keys()  # the root's 161 sub-levels are pending: at most 64 // 8 hold their directory
    out["held"] = _open_fds() - base
    total = 0
    for key in tree.keys(include_nested=True, leaves_only=True):
        total += int(tree[key].sum())
    out["lazy sum"] = total
    out["eager leaves"] = len(memtree.load_memmap(path, lazy=False).keys(include_nested=True, leaves_only=True))
    del tree
    # a growth of the deepest leaf that never committed: recovery walks all 200 levels
    deepest = os.path.join(path, *["c"] * 40, "l99.memmap")
    os.truncate(deepest, 16)
    journal = orjson.dumps({GROWTH_JOURNAL: "f" * 32}).ljust(JOURNAL_BYTES)
    Path(os.path.dirname(path), ".big.memtree.lock").write_bytes(journal)
    out["recover"] = memtree.recover(os.path.dirname(path))
    out["deepest"] = os.path.getsize(deepest)
    out["left open"] = _open_fds() - base
    return out


def test_a_200_level_20000_leaf_tree_loads_and_recovers_under_64_descriptors(big):
    answer = in_child(_under_64_descriptors, str(big), timeout=300)
    assert answer[0] == "ok", answer
    out = answer[1]
    assert out["held"] <= 1 + 8
    assert out["lazy sum"] == sum(i + j for i in range(200) for j in range(100))
    assert out["eager leaves"] == 20_000
    assert [a.split(" back")[0] for a in out["recover"]] == [f"cut {big}{'/c' * 40}/l99.memmap"]
    assert out["deepest"] == 8
    assert out["left open"] <= 1  # at most a root descriptor still waiting for the GC
    assert sorted(os.listdir(big.parent)) == ["big"]


def _deep_chain(path: str) -> tuple:
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    tree = memtree.load_memmap(path)
    leaf = tree[("c",) * 200 + ("x",)]
    tree.append_(tree[0].clone())  # 201 leaves on 201 levels: each file opened on its own
    tree.resize_(1)  # 201 new generations
    tree.append_(tree[0].clone())
    return int(leaf.sum()), len(memtree.load_memmap(path, lazy=False))


def test_a_chain_of_200_levels_grows_and_shrinks_under_64_descriptors(tmp_path):
    src: dict = {"x": torch.ones(1, 2)}
    for i in range(200):
        src = {"c": src, "x": torch.full((1, 2), float(i))}
    TensorTree(src, batch_size=[1]).memmap(tmp_path / "deep")
    assert in_child(_deep_chain, str(tmp_path / "deep"), timeout=300) == ("ok", (2, 2))
    loaded = memtree.load_memmap(tmp_path / "deep")
    assert loaded[("c",) * 200 + ("x",)].tolist() == [[1.0, 1.0]] * 2
    assert loaded[("c",) * 10 + ("x",)].tolist() == [[189.0, 189.0]] * 2
    # (shutil.rmtree, which deletes the replaced directory of a commit, needs one descriptor per
    # level: under 64 descriptors it leaves a 200-level old copy behind for memtree.recover())
