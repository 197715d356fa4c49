"""Hypothesis fuzzer of the loader, every load in a child process (RELIABILITY §7 "Fuzz target").

A valid tree written by memtree (three levels, checksums) is damaged in 1-3 ways: meta.json
bytes (truncate at any offset, insert, overwrite), meta.json fields (dtype, shape, version, file
names, checksum, batch_size... set to hostile or huge values, or deleted), leaf files (truncate,
extend, resize to any size, flip a byte, delete, replace by a symlink to a same-sized file outside
the tree, to /dev/zero, by a FIFO or a directory), sub-directories and meta.json files (symlinks
outside or in a loop, FIFO, sparse 17 MiB), and nesting deeper than the limit. A long-lived forked
worker loads the result and touches every byte of every leaf. The properties:

* the worker never dies (no SIGBUS/SIGSEGV) and never hangs (60 s per load);
* a load either raises a MemtreeError or returns exactly what the files on disk hold: the keys of
  every level, json values, tensors with the dtypes and shapes that meta.json records (ints and
  strings, nothing that merely compares equal), bytes equal to the leaf file's, mapped from that
  very file, which is a regular file (no link followed, nor a linked directory) of exactly its
  recorded size (or ``capacity`` rows); no other exception type;
* ``verify_tree`` agrees: ``load_memmap(verify=True)`` fails exactly when it reports a problem
  (except refusals by policy: a pickled value without ``allow_pickle``, an unregistered class);
* nothing on disk changes (bytes, sizes, mtimes, link targets), inside or outside the tree.

About 2,500 examples in CI (about half of them single mutations of one kind: truncated meta.json,
overwritten bytes, one field with or without a resized leaf, a resized leaf); the soak variant
multiplies them:
``MEMTREE_FUZZ_SCALE=40 pytest tests/test_fuzz_load.py`` (``benchmarks/soak_faults.py`` does that).
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import shutil
import stat
import time
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.control import _current_build_context
from hypothesis import strategies as st

import memtree
from memtree import TensorTree
from treeutil import snapshot

pytestmark = [pytest.mark.timeout(600), pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")]

FORK = mp.get_context("fork")
SCALE = float(os.environ.get("MEMTREE_FUZZ_SCALE", "1"))
LOAD_TIMEOUT = 60.0  # a hang, not a slow machine: a load takes milliseconds

METAS = ["meta.json", "nested/meta.json", "nested/deeper/meta.json"]
DIRS = ["nested", "nested/deeper"]
LEAVES = ["obs.memmap", "act.memmap", "c32.memmap", "nested/x.memmap", "nested/empty.memmap",
          "nested/deeper/mask.memmap", "nested/deeper/f8.memmap"]
#: Refusals by the reader's policy, not damage: verify_tree rightly finds nothing wrong on disk.
POLICY_REFUSALS = {"PickleNotAllowedError", "UnknownClassError"}
KWARGS = [{}, {"mode": "r"}, {"mmap": False}, {"verify": True}, {"verify": True, "mmap": False}]


# ----------------------------------------------------------------------------- the tree and the worker


def build_pristine(root: Path) -> None:
    g = torch.Generator().manual_seed(0)
    tree = TensorTree(
        {
            "obs": torch.randn(3, 4, generator=g),
            "act": torch.randint(-9, 9, (3,), generator=g),
            "c32": torch.randn(3, 2, dtype=torch.complex64, generator=g).to(torch.complex32),
            "nested": {
                "x": torch.randn(3, 5, generator=g).to(torch.bfloat16),
                "empty": torch.zeros(3, 0, dtype=torch.int16),
                "deeper": {
                    "mask": torch.rand(3, generator=g) > 0.5,
                    "f8": torch.randn(3, 2, generator=g).to(torch.float8_e5m2),
                    "note": {"lr": 0.5, "tags": ["a", "b"]},
                },
            },
            "name": "pristine",
        },
        batch_size=[3],
    )
    tree.memmap(root / "tree", checksum="crc32")
    outside = root / "outside"
    outside.mkdir()
    (outside / "decoy.memmap").write_bytes((root / "tree" / "obs.memmap").read_bytes())
    (root / "x.memmap").write_bytes((root / "tree" / "act.memmap").read_bytes())  # for "../x.memmap"
    (outside / "meta.json").write_bytes((root / "tree" / "nested" / "meta.json").read_bytes())
    shutil.copytree(root / "tree" / "nested", outside / "nested")


def _touch_all(tree, prefix=()):
    """{key: ("tree",) | ("tensor", dtype, shape, crc32 of every byte, mapped file) | ("value", v)}."""
    out = {}
    for k in tree.keys():
        v = tree[k]
        if isinstance(v, TensorTree):
            out[prefix + (k,)] = ("tree",)
            out.update(_touch_all(v, prefix + (k,)))
        elif isinstance(v, torch.Tensor):
            data = v.as_subclass(torch.Tensor).contiguous().reshape(-1).view(torch.uint8).numpy()
            out[prefix + (k,)] = ("tensor", str(v.dtype).replace("torch.", ""), list(v.shape), zlib.crc32(data),
                                  getattr(v, "filename", None))
        else:
            out[prefix + (k,)] = ("value", v)
    return out


def _load(path: str, kw: dict) -> tuple:
    try:
        tree = memtree.load_memmap(path, **kw)
        result: tuple = ("loaded", _touch_all(tree))
    except memtree.MemtreeError as e:
        result = ("refused", type(e).__name__, str(e)[:300])
    except Exception as e:  # the bug this fuzzer looks for
        result = ("crash", type(e).__name__, repr(e)[:500])
    try:
        report = memtree.verify_tree(path)
        kinds = sorted({p.kind for p in report.problems})
    except Exception as e:
        kinds = [f"verify crashed: {type(e).__name__}: {e!r:.300}"]
    return result + (kinds,)


def _worker(conn) -> None:
    while True:
        msg = conn.recv()
        if msg is None:
            return
        conn.send(_load(*msg))


class Worker:
    def __init__(self) -> None:
        self.proc = None
        self.conn = None

    def start(self) -> None:
        self.conn, child = FORK.Pipe()
        self.proc = FORK.Process(target=_worker, args=(child,), daemon=True)
        self.proc.start()
        child.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.conn.send(None)
            self.proc.join(10)
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()

    def load(self, path: Path, kw: dict) -> tuple:
        if self.proc is None or not self.proc.is_alive():
            self.start()
        self.conn.send((str(path), kw))
        if not self.conn.poll(LOAD_TIMEOUT):
            self.proc.kill()
            self.proc.join()
            self.proc = None
            raise AssertionError(f"load of {path} with {kw} hung for {LOAD_TIMEOUT} s")
        try:
            return self.conn.recv()
        except EOFError:
            self.proc.join(10)
            code = self.proc.exitcode
            self.proc = None
            raise AssertionError(f"the loading process died (exit code {code}, negative = signal) on {path} with {kw}")


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    w.start()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fuzz") / "pristine"
    root.mkdir()
    build_pristine(root)
    return root


# ----------------------------------------------------------------------------- snapshots and checks


def event(name: str) -> None:
    """hypothesis.event when inside a hypothesis test (statistics), nothing otherwise."""
    if _current_build_context.value is not None:
        import hypothesis

        hypothesis.event(name)


def expected_leaves(tree: Path) -> dict:
    """What a successful load must return, from the files on disk: the loader accepted every
    level it returned, so each is a real directory whose meta.json is a regular file following the
    schema (plain json is enough to read it), and each leaf a regular file of its recorded size."""
    out = {}

    def walk(d: Path, prefix: tuple):
        assert stat.S_ISDIR(os.lstat(d).st_mode), f"{d} was loaded, but it is not a directory (or a link)"
        assert _plain_file(d / "meta.json"), f"{d / 'meta.json'} was loaded, but it is not a regular file"
        meta = json.loads((d / "meta.json").read_bytes())
        for e in meta["entries"]:
            key = prefix + (e["key"],)
            if e["kind"] == "tensor":
                shape, dtype = e["shape"], e["dtype"]
                assert type(shape) is list and all(type(x) is int and x >= 0 for x in shape), (key, shape)
                assert type(dtype) is str, (key, dtype)
                itemsize = getattr(torch, dtype).itemsize
                nbytes = math.prod(shape) * itemsize
                if "capacity" in e:  # a growable leaf's file holds capacity rows, the tensor the first ones
                    capacity = e["capacity"]
                    assert shape and type(capacity) is int and capacity >= shape[0], (key, capacity)
                    nbytes_file = capacity * math.prod(shape[1:]) * itemsize
                else:
                    nbytes_file = nbytes
                path = d / e["file"]
                assert _plain_file(path), f"{path} was loaded, but it is not a regular file (or a link)"
                assert os.path.getsize(path) == nbytes_file, (key, os.path.getsize(path), nbytes_file)
                data = path.read_bytes()[:nbytes]
                out[key] = ("tensor", dtype, shape, zlib.crc32(data), e.get("checksum"), path)
            elif e["kind"] == "tree":
                out[key] = ("tree",)
                walk(d / e["dir"], key)
            elif e["kind"] == "json":
                out[key] = ("value", e["value"])
            else:  # pickle: never loaded here (no allow_pickle)
                out[key] = ("kind", e["kind"])

    walk(tree, ())
    return out


def check(worker: Worker, work: Path, kw: dict) -> None:
    tree = work / "tree"
    if any(_plain_file(tree / m) and b"/etc" in (tree / m).read_bytes() for m in METAS):
        kw = {**kw, "mode": "r"}  # we run as root: never let a broken loader open a system file to write
    before = snapshot(work)
    result = worker.load(tree, kw)
    assert snapshot(work) == before, "a load changed files on disk"
    kinds = result[-1]
    assert not any(k.startswith("verify crashed") for k in kinds), kinds
    if result[0] == "crash":
        raise AssertionError(f"non-memtree exception {result[1]}: {result[2]}")
    if result[0] == "refused":
        event(f"refused: {result[1]}")
        if result[1] not in POLICY_REFUSALS:
            assert kinds, f"load refused ({result[1]}: {result[2]}) but verify_tree found nothing"
        return
    event("loaded")
    got = result[1]
    want = expected_leaves(tree)
    assert set(got) == set(want)
    for key, g in got.items():
        w = want[key]
        if g[0] != "tensor":
            assert g == w, key
            continue
        _, dtype, shape, crc, filename = g
        _, w_dtype, w_shape, w_crc, w_checksum, w_path = w
        assert (dtype, shape, crc) == (w_dtype, w_shape, w_crc), key  # exactly the file's bytes
        if filename is not None:
            assert os.path.samefile(filename, w_path), (key, filename)  # mapped from that very file
        if kw.get("verify") and type(w_checksum) is str and w_checksum.startswith("crc32:"):
            assert w_checksum == f"crc32:{crc:08x}", key
    if kw.get("verify"):
        assert kinds == [], f"load(verify=True) succeeded but verify_tree reports {kinds}"
    else:  # what only verify=True checks: leaf checksums, the tree hash over the meta.json files
        assert set(kinds) <= {"checksum", "tree-hash"}, kinds


def _image(root: Path) -> list[tuple[str, bytes | int | None]]:
    """(relative path, None for a directory, the bytes of a regular file, else the file type) of
    everything under root, parents first; links are not followed."""
    out: list[tuple[str, bytes | int | None]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for n in sorted(dirnames + filenames):
            p = os.path.join(dirpath, n)
            mode = os.lstat(p).st_mode
            data = None if stat.S_ISDIR(mode) else Path(p).read_bytes() if stat.S_ISREG(mode) else stat.S_IFMT(mode)
            out.append((os.path.relpath(p, root), data))
    return out


_IMAGES: dict[Path, list[tuple[str, bytes | int | None]]] = {}


def fresh_copy(pristine: Path) -> Path:
    """``<pristine>/../work``, holding exactly what the pristine directory holds. It is one
    directory reset in place: what a mutation left is removed or rewritten (the pristine files are
    cached in memory). A new copy per example cost about 40 ms, mostly rmdir and truncation (ext4
    mounted with ``discard``), more than the load."""
    image = _IMAGES.get(pristine)
    if image is None:
        image = _IMAGES[pristine] = _image(pristine)
        assert all(data is None or isinstance(data, bytes) for _, data in image)
    want = dict(image)
    work = pristine.parent / "work"
    work.mkdir(exist_ok=True)
    for dirpath, dirnames, filenames in os.walk(work, topdown=False):  # children before parents
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            rel, mode = os.path.relpath(p, work), os.lstat(p).st_mode
            if rel in want and (stat.S_ISDIR(mode) if want[rel] is None else stat.S_ISREG(mode)):
                continue
            (os.rmdir if stat.S_ISDIR(mode) else os.unlink)(p)
    for rel, data in image:
        p = work / rel
        if data is None:
            os.makedirs(p, exist_ok=True)
        else:
            if not p.exists() or p.read_bytes() != data:  # only what changed: a truncating open is slow too
                p.write_bytes(data)
            # and its times, even where the bytes are the same (a mutation that rewrote a file
            # with its own bytes): a leaf newer than its meta.json is reported stale, not damaged
            times = (pristine / rel).stat()
            if p.stat().st_mtime_ns != times.st_mtime_ns:
                os.utime(p, ns=(times.st_atime_ns, times.st_mtime_ns))
    assert _image(work) == image, "the work directory was not reset to the pristine state"
    assert all(
        (work / rel).stat().st_mtime_ns == (pristine / rel).stat().st_mtime_ns for rel, data in image if data is not None
    ), "the work directory's files do not have the pristine files' times"
    return work


# ----------------------------------------------------------------------------- mutations


HUGE = [2**31, 2**32, 2**62, 2**62 + 1, 2**63 - 1, 2**63, 2**64, 2**64 + 1, 10**30, -1, -(2**63), 1e308, 1.5, float("inf")]
NAMES = ["../outside/decoy.memmap", "../x.memmap", "/dev/zero", "/etc/passwd", "../../../../../../etc/passwd", "..",
         ".", "", "a/b.memmap", "nested/x.memmap", "x" * 300 + ".memmap", "obs.memmap", "act.memmap", "nested",
         "meta.json", "%2E%2E.memmap", "a\x00.memmap", ".hidden.memmap", "OBS.memmap", "decoy.memmap", "a.pickle",
         "../outside", "deeper", "c32.memmap"]
DTYPES = ["bool", "uint8", "int16", "int64", "float32", "float64", "bfloat16", "complex32", "complex128",
          "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "object", "torch.float32", "float", "Tensor", "<f4", "",
          "float128", "qint8"]
CHECKSUMS = ["crc32:00000000", "crc32:ffffffff", "crc32:0", "sha256:" + "0" * 64, "md5:" + "0" * 32, "crc32",
             "CRC32:00000000", "crc32:GGGGGGGG", ""]
SCALARS = st.one_of(
    st.sampled_from(HUGE), st.sampled_from(NAMES), st.sampled_from(DTYPES), st.sampled_from(CHECKSUMS),
    st.integers(min_value=-3, max_value=8), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(), st.text(max_size=8),
    st.sampled_from(["memtree", "TensorTree", "little", "big", "tensor", "tree", "json", "pickle", 1, 2, 0]),
)
VALUES = st.one_of(
    SCALARS,
    st.lists(st.one_of(st.integers(min_value=0, max_value=6), st.sampled_from(HUGE)), max_size=4),
    st.lists(st.one_of(st.integers(min_value=-5, max_value=2**65), st.floats(), st.booleans(), st.none()), max_size=5),
    st.lists(SCALARS, max_size=3),
    st.dictionaries(st.sampled_from(["key", "kind", "file", "dir", "dtype", "shape", "value"]), SCALARS, max_size=3),
)
TOP_FIELDS = ["format", "version", "type", "byteorder", "batch_size", "entries", "save_id", "extra"]
ENTRY_FIELDS = ["key", "kind", "file", "dir", "dtype", "shape", "capacity", "checksum", "value", "path"]


def _set_meta(path: Path, doc) -> None:
    path.write_bytes(json.dumps(doc, allow_nan=True).encode("utf-8", "surrogatepass"))


def _plain_file(path: Path) -> bool:
    """A regular file that is not a link (``Path.is_file`` follows links)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _replace(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


meta_bytes = st.tuples(
    st.just("meta_bytes"), st.sampled_from(METAS), st.sampled_from(["truncate", "insert", "overwrite", "append"]),
    st.integers(min_value=0, max_value=2000), st.binary(min_size=1, max_size=6),
)
meta_field = st.tuples(
    st.just("meta_field"), st.sampled_from(METAS),
    st.one_of(
        st.tuples(st.just("top"), st.sampled_from(TOP_FIELDS), st.just(0)),
        st.tuples(st.just("entry"), st.sampled_from(ENTRY_FIELDS), st.integers(min_value=0, max_value=5)),
        st.tuples(st.just("shape"), st.just("shape"), st.integers(min_value=0, max_value=5)),
    ),
    st.sampled_from(["set", "set", "set", "delete"]), VALUES,
)
leaf_file = st.tuples(
    st.just("leaf"), st.sampled_from(LEAVES),
    st.sampled_from(["truncate", "extend", "resize", "flip", "flip", "delete", "link_decoy", "link_zero",
                     "link_dangling", "link_dir", "fifo", "dir"]),
    st.integers(min_value=0, max_value=80),
)
leaf_resize = st.tuples(st.just("leaf"), st.sampled_from(LEAVES), st.just("resize"), st.integers(min_value=0, max_value=80))
dir_or_meta = st.tuples(
    st.just("path"), st.sampled_from(DIRS + METAS),
    st.sampled_from(["link_outside", "link_root", "link_loop", "fifo", "delete", "sparse_17mib", "dir"]),
    st.just(0),
)
MUTATION = st.one_of(meta_bytes, meta_field, leaf_file, dir_or_meta)


def apply(work: Path, mutation) -> None:
    kind = mutation[0]
    tree = work / "tree"
    if kind == "meta_bytes":
        _, which, op, pos, data = mutation
        p = tree / which
        if not _plain_file(p):
            return
        b = p.read_bytes()
        if op == "truncate":
            b = b[: pos % max(len(b), 1)]  # always shorter (an empty file stays empty)
        elif op == "insert":
            pos %= len(b) + 1
            b = b[:pos] + data + b[pos:]
        elif op == "overwrite":
            pos %= len(b) + 1
            b = b[:pos] + data + b[pos + len(data):]
        else:
            b = b + data
        p.write_bytes(b)
    elif kind == "meta_field":
        _, which, (where, name, index), action, value = mutation
        p = tree / which
        if not _plain_file(p):  # an earlier mutation made it a FIFO, a link...: reading could block
            return
        try:
            doc = json.loads(p.read_bytes())
        except (OSError, ValueError):
            return
        if not isinstance(doc, dict):
            return
        if where == "top":
            target = doc
        else:
            entries = doc.get("entries")
            if not isinstance(entries, list) or not entries or not isinstance(entries[index % len(entries)], dict):
                return
            target = entries[index % len(entries)]
            if where == "shape":
                shape = target.get("shape")
                if not isinstance(shape, list) or not shape:
                    target["shape"] = [value]
                elif action == "delete":
                    shape.pop(index % len(shape))
                else:
                    shape[index % len(shape)] = value
                _set_meta(p, doc)
                return
        if action == "delete":
            target.pop(name, None)
        else:
            target[name] = value
        _set_meta(p, doc)
    elif kind == "leaf":
        _, rel, op, n = mutation
        p = tree / rel
        if not _plain_file(p):
            return
        if op == "truncate":
            os.truncate(p, min(n, max(p.stat().st_size - 1, 0)))
        elif op == "extend":
            os.truncate(p, p.stat().st_size + n + 1)
        elif op == "resize":  # exactly n bytes, grown with non-zero bytes
            b = p.read_bytes()[:n]
            p.write_bytes(b + bytes((i * 31 + 7) % 256 for i in range(n - len(b))))
        elif op == "flip":  # damage (bit rot): the file's modification time stays as it was
            b = bytearray(p.read_bytes())
            if b:
                times = p.stat()
                b[n % len(b)] ^= 1 << (n % 8)
                p.write_bytes(bytes(b))
                os.utime(p, ns=(times.st_atime_ns, times.st_mtime_ns))
        else:
            _replace(p)
            if op == "link_decoy":
                os.symlink(work / "outside" / "decoy.memmap", p)
            elif op == "link_zero":
                os.symlink("/dev/zero", p)
            elif op == "link_dangling":
                os.symlink(work / "nowhere", p)
            elif op == "link_dir":
                os.symlink(work / "outside", p)
            elif op == "fifo":
                os.mkfifo(p)
            elif op == "dir":
                p.mkdir()
    elif kind == "path":
        _, rel, op, _ = mutation
        p = tree / rel
        if not (p.exists() or p.is_symlink()):
            return
        is_dir = rel in DIRS
        _replace(p)
        if op == "link_outside":
            os.symlink(work / "outside" / ("nested" if is_dir else "meta.json"), p)
        elif op == "link_root":
            os.symlink("/", p)
        elif op == "link_loop":
            os.symlink(p.name, p)
        elif op == "fifo":
            os.mkfifo(p)
        elif op == "sparse_17mib":
            with open(p, "wb") as f:
                f.truncate(17 << 20)
        elif op == "dir":
            p.mkdir()
    elif kind == "deep":
        _, depth, _, _ = mutation
        d = tree / "nested" / "deeper"
        base = json.loads((tree / "meta.json").read_bytes())
        for _ in range(depth):
            level = {k: base[k] for k in ("format", "version", "type", "byteorder", "batch_size") if k in base}
            level["entries"] = [{"key": "z", "kind": "tree", "dir": "z"}]
            _set_meta(d / "meta.json", level)
            d = d / "z"
            d.mkdir()
        _set_meta(d / "meta.json", {k: base[k] for k in ("format", "version", "type", "byteorder", "batch_size")
                                    if k in base} | {"entries": []})


def fuzz(examples: int):
    return settings(max_examples=max(1, int(examples * SCALE)), deadline=None, database=None,
                    phases=[Phase.generate, Phase.shrink],
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def _run(worker, pristine, mutations, kw):
    work = fresh_copy(pristine)
    for m in mutations:
        apply(work, m)
    check(worker, work, kw)


# ----------------------------------------------------------------------------- the fuzz tests


def test_pristine_tree_loads_and_verifies(worker, pristine):
    _run(worker, pristine, [], {"verify": True})
    assert memtree.verify_tree(pristine / "tree").checksummed == 7


@pytest.mark.slow
@fuzz(200)
@given(mutations=st.lists(MUTATION, min_size=1, max_size=3), kw=st.sampled_from(KWARGS))
def test_fuzz_any_damage(worker, pristine, mutations, kw):
    _run(worker, pristine, mutations, kw)


@pytest.mark.slow
@fuzz(150)
@given(mutations=st.lists(st.one_of(meta_field, meta_bytes), min_size=1, max_size=3), kw=st.sampled_from(KWARGS))
def test_fuzz_meta_json(worker, pristine, mutations, kw):
    _run(worker, pristine, mutations, kw)


@pytest.mark.slow
@fuzz(150)
@given(mutations=st.lists(st.one_of(leaf_file, dir_or_meta), min_size=1, max_size=3), kw=st.sampled_from(KWARGS))
def test_fuzz_files_and_links(worker, pristine, mutations, kw):
    _run(worker, pristine, mutations, kw)


@pytest.mark.slow
@fuzz(500)
@given(which=st.sampled_from(METAS), cut=st.integers(min_value=0, max_value=2000), kw=st.sampled_from(KWARGS))
def test_fuzz_truncated_meta(worker, pristine, which, cut, kw):
    _run(worker, pristine, [("meta_bytes", which, "truncate", cut, b"")], kw)


overwrite_byte = st.tuples(st.just("meta_bytes"), st.sampled_from(METAS), st.just("overwrite"),
                           st.integers(min_value=0, max_value=2000), st.binary(min_size=1, max_size=1))


@pytest.mark.slow
@fuzz(500)
@given(edits=st.lists(overwrite_byte, min_size=1, max_size=4), kw=st.sampled_from(KWARGS))
def test_fuzz_random_bytes_in_meta(worker, pristine, edits, kw):
    _run(worker, pristine, edits, kw)


@pytest.mark.slow
@fuzz(500)
@given(field=meta_field, resize=st.one_of(st.none(), leaf_resize), kw=st.sampled_from(KWARGS))
def test_fuzz_meta_fields(worker, pristine, field, resize, kw):
    """One field changed or deleted, and now and then a leaf of another size (that field may be its
    shape or dtype)."""
    _run(worker, pristine, [field] if resize is None else [field, resize], kw)


@pytest.mark.slow
@fuzz(500)
@given(resize=leaf_resize, kw=st.sampled_from(KWARGS))
def test_fuzz_leaf_sizes(worker, pristine, resize, kw):
    _run(worker, pristine, [resize], kw)


def rehash(tree: Path) -> None:
    """Record the root's tree_hash again after a deliberate edit: the tree as a writer would have
    committed it (the tests below are about other checks than integrity)."""
    import dataclasses

    from memtree.format.schema import dump_level
    from memtree.store.reading.integrity import tree_hash
    from memtree.store.reading.read import open_dir, walk_levels

    metas = {}
    fd = open_dir(str(tree), str(tree), None)
    try:
        walk_levels(fd, str(tree), lambda dirs, where, dir_fd, meta: metas.__setitem__("/".join(dirs), meta))
    finally:
        os.close(fd)
    root = metas[""]
    algorithm = root.tree_hash.partition(":")[0]
    (tree / "meta.json").write_bytes(dump_level(dataclasses.replace(root, tree_hash=tree_hash(algorithm, metas, {}))))


@pytest.mark.parametrize("value", ["Unregistered", "pkg.Record"])
def test_unregistered_class_is_a_policy_refusal_not_damage(worker, pristine, value):
    work = fresh_copy(pristine)
    apply(work, ("meta_field", "nested/meta.json", ("top", "type", 0), "set", value))
    rehash(work / "tree")
    r = worker.load(work / "tree", {"verify": True})
    assert r[0] == "refused" and r[1] == "UnknownClassError" and r[-1] == [], r
    check(worker, work, {})


@pytest.mark.parametrize("depth", [254, 255])
def test_nesting_deeper_than_the_limit(worker, pristine, depth):
    """The root is depth 0 and nested/deeper depth 2: 254 more levels reach the limit (256)."""
    work = fresh_copy(pristine)
    apply(work, ("deep", depth, "", 0))
    if depth <= 254:
        rehash(work / "tree")
    r = worker.load(work / "tree", {})
    if depth <= 254:
        assert r[0] == "loaded" and r[-1] == [], r
    else:
        assert r[0] == "refused" and r[1] == "LimitError" and r[-1] == ["limit"], r


@pytest.mark.parametrize("leaf", LEAVES)
def test_every_single_bit_flip_is_caught_by_verify(worker, pristine, leaf):
    """Not random: a flip in each leaf (except the empty one) fails verify=True, loads without."""
    work = fresh_copy(pristine)
    apply(work, ("leaf", leaf, "flip", 3))
    r = worker.load(work / "tree", {"verify": True})
    if leaf == "nested/empty.memmap":
        assert r[0] == "loaded" and r[-1] == []
    else:
        assert r[0] == "refused" and r[1] == "IntegrityError" and r[-1] == ["checksum"], r
        assert worker.load(work / "tree", {})[0] == "loaded"


def test_the_reset_restores_times_of_files_rewritten_with_their_own_bytes(pristine):
    """A mutation that rewrites a leaf with the bytes it had (``resize`` to its own size) leaves
    it newer than its meta.json; the next example's reset must give it the pristine time back,
    or that example's bit flip is reported ``stale`` instead of ``checksum`` (a flaky failure of
    test_every_single_bit_flip_is_caught_by_verify, depending on the examples run before it)."""
    leaf = "nested/deeper/mask.memmap"
    work = fresh_copy(pristine)
    before = (work / "tree" / leaf).stat().st_mtime_ns
    time.sleep(0.05)  # a clock tick: the rewrite is strictly later
    apply(work, ("leaf", leaf, "resize", (work / "tree" / leaf).stat().st_size))
    assert (work / "tree" / leaf).stat().st_mtime_ns > before
    work = fresh_copy(pristine)
    assert (work / "tree" / leaf).stat().st_mtime_ns == before


def _edit_shape_and_rewrite_leaf(work: Path, leaf_delta_ns: int) -> None:
    """The case test_fuzz_meta_fields once reported ``stale`` (then passed on a rerun): the root
    meta.json edited so that ``obs`` is [3, 5], then ``obs.memmap`` rewritten to that size with
    other bytes. Its times are set explicitly: the leaf ``leaf_delta_ns`` after the meta.json (the
    fuzzer's two writes fall in one clock tick, or in two)."""
    meta = work / "tree" / "meta.json"
    doc = json.loads(meta.read_bytes())
    (entry,) = [e for e in doc["entries"] if e["key"] == "obs"]
    entry["shape"] = [3, 5]
    _set_meta(meta, doc)
    apply(work, ("leaf", "obs.memmap", "resize", 3 * 5 * 4))
    base = meta.stat().st_mtime_ns
    os.utime(meta, ns=(base, base))
    os.utime(work / "tree" / "obs.memmap", ns=(base + leaf_delta_ns, base + leaf_delta_ns))


@pytest.mark.parametrize("leaf_delta_ns", [-1_000_000_000, 0, 1, 1_000_000_000])
@pytest.mark.parametrize("kw", KWARGS, ids=str)
def test_a_leaf_written_after_an_edited_meta_json_is_damage_whatever_the_times(worker, pristine, leaf_delta_ns, kw):
    """A leaf newer than its meta.json is only *stale* (written in place) while the meta.json files
    are the ones the tree hash records; here the meta.json was edited, so the leaf's mismatch is
    damage at any file times (was: ``stale`` when the leaf's time was later, which made the fuzzer
    flaky, and named damage as a write in place)."""
    work = fresh_copy(pristine)
    _edit_shape_and_rewrite_leaf(work, leaf_delta_ns)
    assert sorted({p.kind for p in memtree.verify_tree(work / "tree").problems}) == ["checksum", "tree-hash"]
    check(worker, work, kw)


@pytest.mark.parametrize("leaf_delta_ns", [0, 1, 1_000_000_000])
def test_a_leaf_written_in_place_is_stale_only_when_newer_than_its_intact_meta_json(tmp_path, leaf_delta_ns):
    """The other side: the meta.json files intact (tree hash ``ok``), a leaf written through a
    ``mode="r+"`` mapping is ``stale`` when its time is later than its meta.json's, ``checksum``
    (damage: the conservative reading) at the same time."""
    prefix = tmp_path / "t"
    TensorTree({"w": torch.zeros(4)}).memmap(prefix, checksum="crc32")
    memtree.load_memmap(prefix, mode="r+")["w"][1] = 5.0
    base = (prefix / "meta.json").stat().st_mtime_ns
    os.utime(prefix / "w.memmap", ns=(base + leaf_delta_ns, base + leaf_delta_ns))
    report = memtree.verify_tree(prefix)
    assert report.tree_hash == "ok"
    assert [p.kind for p in report.problems] == ["stale" if leaf_delta_ns > 0 else "checksum"]
    with pytest.raises(memtree.IntegrityError, match="is stale" if leaf_delta_ns > 0 else "is damaged"):
        memtree.load_memmap(prefix, verify=True)
