"""``memtree.verify_tree`` accepts exactly the directories ``load_memmap`` loads.

Property (hypothesis): for generated trees, in memtree's layout (written by ``memmap``) and in
tensordict's (written by hand as tensordict's ``memmap`` lays it out), after any damage (leaf
files truncated, extended, flipped, deleted, turned into links or directories; ``meta.json``
files cut, deleted, fields set to edge values: zero-element shapes with huge dims, other dtypes,
JSON nested around the limit, repeated fields), ``load_memmap(..., lazy=False)`` loads the
directory if and only if ``verify_tree(..., checksums=False)`` finds no problem, and
``load_memmap(..., verify=True)`` if and only if ``verify_tree`` with checksums does. Neither
raises anything but a ``MemtreeError``, and neither changes a byte on disk.

The loader's policies are taken out of the comparison, as ``verify`` checks the files, not the
process: ``unknown_classes="tree"`` (a level stored as an unregistered ``@tensorclass``) and
``allow_pickle=True`` (the generated trees hold no pickle to run).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import memtree
from memtree import NonTensor, TensorTree
from memtree.format.values import MAX_JSON_DEPTH

TD_TYPE = "<class 'tensordict._td.TensorDict'>"
NTD_TYPE = "<class 'tensordict.tensorclass.NonTensorData'>"
DTYPES = [torch.bool, torch.uint8, torch.int16, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.complex64, torch.float8_e5m2]
KINDS = {"checksum", "size", "missing", "unsafe", "meta", "version", "limit", "structure", "not-a-tree",
         "not-committed", "io", "pickle", "dtype", "tree-hash", "stale"}


def nested(depth: int, inner: Any = 1) -> Any:
    for i in range(depth):
        inner = [inner] if i % 2 else {"k": inner}
    return inner


INTS = st.integers(-(2**63), 2**64 - 1)  # what JSON holds exactly
JSON_VALUES = st.one_of(
    st.none(), st.booleans(), INTS, st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=5),
    st.lists(INTS, max_size=3),
    st.dictionaries(st.sampled_from(["a", "b", "key"]), INTS, max_size=2),
    st.sampled_from([MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH]).map(nested),
)


def _tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    n = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return raw.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)


@st.composite
def contents(draw: Any, batch: tuple[int, ...], depth: int = 0) -> list[tuple[str, str, Any]]:
    """A level's entries: ``(key, kind, value)``, kind ``tensor``, ``json`` or ``tree``."""
    out = []
    for i in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["tensor", "tensor", "json", "tree"] if depth < 2 else ["tensor", "json"]))
        key = draw(st.sampled_from([f"{kind[0]}{i}", f"{kind[0]}/{i}", f"{kind[0]} {i}"]))
        if kind == "tensor":
            extra = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
            out.append((key, kind, _tensor(batch + extra, draw(st.sampled_from(DTYPES)), draw(st.integers(0, 99)))))
        elif kind == "json":
            out.append((key, kind, draw(JSON_VALUES)))
        else:
            out.append((key, kind, draw(contents(batch, depth + 1))))
    return out


def write_memtree(root: Path, batch: tuple[int, ...], entries: list, checksum: str | None) -> None:
    def build(items: list) -> dict:
        return {k: build(v) if kind == "tree" else NonTensor(v) if kind == "json" else v for k, kind, v in items}

    TensorTree(build(entries), batch_size=batch).memmap(root, checksum=checksum)


def write_tensordict(root: Path, batch: tuple[int, ...], entries: list, quirks: int) -> None:
    """The layout tensordict's ``memmap`` writes (see memtree/store/foreign/tensordict.py), with its quirks
    now and then: a zero-element leaf without a file, a leaf file longer than needed, a value only
    in a pickle sidecar (memtree never runs it)."""
    root.mkdir(parents=True)
    meta: dict[str, Any] = {}
    for i, (key, kind, value) in enumerate(entries):
        name = key.replace("%", "%25").replace("/", "%2F").replace(" ", "%20")
        quirk = (quirks >> (2 * i)) & 3
        if kind == "tensor":
            meta[key] = {"device": "cpu", "shape": list(value.shape), "dtype": str(value.dtype), "is_nested": False}
            data = value.reshape(-1).view(torch.uint8).numpy().tobytes() if value.numel() else b""
            if not (quirk == 1 and not data):
                (root / f"{name}.memmap").write_bytes(data + (b"\0" * 8 if quirk == 2 else b""))
        elif kind == "json":
            meta[key] = {"type": "NonTensorData"}
            (root / name).mkdir()
            doc: dict[str, Any] = {"_type": NTD_TYPE, "_metadata": None, "_is_non_tensor": True}
            if quirk == 3:
                (root / name / "other.pickle").write_bytes(b"\x80\x04N.")  # pickle of None
            else:
                doc["data"] = value
            (root / name / "meta.json").write_text(json.dumps(doc))
        else:
            meta[key] = {"type": "TensorDict"}
            write_tensordict(root / name, batch, value, quirks >> 8)
    meta.update({"shape": list(batch), "device": "cpu", "_type": TD_TYPE})
    (root / "meta.json").write_text(json.dumps(meta))


# -- damage --------------------------------------------------------------------------------------
FIELD_NAMES = ["shape", "dtype", "file", "dir", "key", "kind", "value", "data", "capacity", "checksum",
               "batch_size", "type", "_type", "is_nested", "x"]
FIELD_VALUES = st.one_of(
    st.sampled_from([0, 1, 2, -1, 2**63, 2**64 - 1, None, True, "", "x.memmap", "float32", "torch.int64",
                     "object", "tensor", "json", "tree", "TensorDict", TD_TYPE, NTD_TYPE, "crc32:00000000"]),
    st.lists(st.sampled_from([0, 0, 1, 2, 3, 2**31, 2**61, 2**62, 2**63 - 1, 2**63, 2**64 - 1]), max_size=4),
    st.sampled_from([MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, 300, 1000]).map("@deep:{}@".format),
    JSON_VALUES,
)
DAMAGE = ["truncate_leaf", "extend_leaf", "flip_leaf", "delete_leaf", "leaf_to_link", "leaf_to_dir",
          "delete_meta", "delete_dir", "cut_meta", "set_field", "add_field", "repeat_field", "stray_file"]
_DEEP = re.compile(rb'"@deep:(\d+)@"')


def _paths(v: Any, path: tuple = ()) -> list[tuple]:
    """Every position in a JSON document (a field of an object, an item of a list)."""
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
    out = []
    for k, x in items:
        out += [path + (k,)] + _paths(x, path + (k,))
    return out


def _objects(v: Any, path: tuple = ()) -> list[tuple]:
    out = [path] if isinstance(v, dict) else []
    return out + [p for p in _paths(v, path) if isinstance(_at(v, p[len(path):]), dict)]


def _at(doc: Any, path: tuple) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def _dump(doc: Any, canonical: bool) -> bytes:
    try:
        data = orjson.dumps(doc) if canonical else json.dumps(doc).encode()
    except TypeError:  # an int orjson cannot write
        data = json.dumps(doc).encode()
    return _DEEP.sub(lambda m: b"[" * int(m[1]) + b"]" * int(m[1]), data)


def damage(root: Path, kind: str, a: int, b: int, value: Any, name: str) -> None:
    leaves = sorted(p for p in root.rglob("*.memmap") if p.is_file() and not p.is_symlink())
    metas = sorted(root.rglob("meta.json"))
    dirs = sorted(p for p in root.rglob("*") if p.is_dir() and not p.is_symlink())
    event(f"damage: {kind}")
    if kind.endswith("_leaf") or kind.startswith("leaf_"):
        if not leaves:
            return
        leaf = leaves[a % len(leaves)]
        size = leaf.stat().st_size
        if kind == "truncate_leaf" and size:
            os.truncate(leaf, b % size)
        elif kind == "extend_leaf":
            with open(leaf, "ab") as f:
                f.write(b"\x01" * (b % 16 + 1))
        elif kind == "flip_leaf" and size:
            data = bytearray(leaf.read_bytes())
            data[b % size] ^= 1 << (a % 8)
            leaf.write_bytes(bytes(data))
        elif kind in ("delete_leaf", "leaf_to_link", "leaf_to_dir"):
            data = leaf.read_bytes()
            leaf.unlink()
            if kind == "leaf_to_link":  # to a copy outside the tree: same bytes, still refused
                outside = root.parent / f"outside-{a}"
                outside.write_bytes(data)
                leaf.symlink_to(outside)
            elif kind == "leaf_to_dir":
                leaf.mkdir()
    elif kind in ("delete_meta", "cut_meta", "set_field", "add_field", "repeat_field") and not metas:
        return
    elif kind == "delete_meta":
        metas[a % len(metas)].unlink()
    elif kind == "delete_dir" and dirs:
        shutil.rmtree(dirs[a % len(dirs)])
    elif kind == "stray_file":  # names no meta.json lists: ignored by both
        stray = root / f"stray{b % 4}.memmap"
        if not os.path.lexists(stray):
            stray.write_bytes(b"\0" * (b % 9))
        (root / ".hidden").mkdir(exist_ok=True)
    elif kind in ("cut_meta", "set_field", "add_field", "repeat_field"):
        meta = metas[a % len(metas)]
        data = meta.read_bytes()
        if kind == "cut_meta":
            meta.write_bytes(data[: b % max(len(data), 1)])
            return
        try:
            doc = json.loads(data)
        except ValueError:  # damaged by an earlier step
            return
        if kind == "set_field":
            paths = _paths(doc)
            if paths:
                path = paths[b % len(paths)]
                _at(doc, path[:-1])[path[-1]] = value
            meta.write_bytes(_dump(doc, canonical=bool(b & 1)))
            return
        objects = _objects(doc)
        obj = _at(doc, objects[b % len(objects)])
        if kind == "add_field":
            obj[name] = value
            meta.write_bytes(_dump(doc, canonical=bool(b & 1)))
            return
        if not obj:
            return
        repeated = list(obj)[a % len(obj)]
        obj["@repeat@"] = value  # after the original: the repeated field wins in orjson
        meta.write_bytes(_dump(doc, canonical=bool(b & 1)).replace(b'"@repeat@"', json.dumps(repeated).encode()))


# -- the property --------------------------------------------------------------------------------
def snapshot(top: Path) -> dict[str, Any]:
    out = {}
    for p in sorted(top.rglob("*")):
        st_ = p.lstat()
        out[str(p)] = (st_.st_mode, st_.st_size, p.read_bytes() if p.is_file() and not p.is_symlink() else None)
    return out


def load_refusal(root: Path, **kw: Any) -> memtree.MemtreeError | None:
    try:
        memtree.load_memmap(root, lazy=False, unknown_classes="tree", allow_pickle=True, **kw)
    except memtree.MemtreeError as err:
        return err
    return None  # anything else propagates: the failure looked for


def assert_agreement(top: Path, root: Path) -> memtree.VerifyReport:
    """Load and verify agree on ``root`` (structure only, and with checksums); returns the full report."""
    before = snapshot(top)
    refused = load_refusal(root)
    report = memtree.verify_tree(root, checksums=False, progress=False)
    assert report.ok == (refused is None), (refused, report.problems)
    refused_verified = load_refusal(root, verify=True)
    full = memtree.verify_tree(root, progress=False)
    assert full.ok == (refused_verified is None), (refused_verified, full.problems)
    assert {p.kind for p in full.problems} <= KINDS
    assert snapshot(top) == before
    return full


DAMAGES = st.lists(  # meta.json edits drawn most: they have the most ways to go wrong
    st.tuples(st.sampled_from(DAMAGE + ["set_field"] * 4 + ["add_field", "repeat_field"] * 2),
              st.integers(0, 2**16), st.integers(0, 2**16), FIELD_VALUES, st.sampled_from(FIELD_NAMES)),
    max_size=3,
)
SETTINGS = settings(max_examples=300, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
BATCHES = st.sampled_from([(), (2,), (0,), (2, 0), (1, 3)])
#: ``(batch, entries)``: the batch size drawn first, then entries whose tensors start with it
#: (each example is a tree both layouts can hold; none is thrown away).
TREES = BATCHES.flatmap(lambda batch: st.tuples(st.just(batch), contents(batch)))


@SETTINGS
@example(tree=((4,), [("e", "tensor", torch.empty(4, 0, 2))]), checksum=None,
         damages=[("set_field", 0, 5, [4, 0, 2**63], "shape")])  # was: verify clean, load TypeError
@example(tree=((), [("j", "json", 1)]), checksum=None,
         damages=[("set_field", 0, 8, f"@deep:{MAX_JSON_DEPTH + 1}@", "value")])
@given(tree=TREES, checksum=st.sampled_from([None, "crc32"]), damages=DAMAGES)
def test_verify_agrees_with_load_on_memtree_directories(tree, checksum, damages) -> None:
    batch, entries = tree
    with tempfile.TemporaryDirectory() as tmp:
        top, root = Path(tmp), Path(tmp) / "tree"
        write_memtree(root, batch, entries, checksum)
        for d in damages:
            damage(root, *d)
        full = assert_agreement(top, root)
        event(f"{full.layout}: {'ok' if full.ok else 'refused'}")


@SETTINGS
@example(tree=((2,), [("e", "tensor", torch.empty(2, 0))]), quirks=0,
         damages=[("set_field", 0, 1, [2, 0, 2**64 - 1], "shape")])
@example(tree=((), [("j", "json", 1)]), quirks=0, damages=[])
@example(tree=((), [("j", "json", 1)]), quirks=3, damages=[])  # a pickle sidecar: refused
@given(tree=TREES, quirks=st.integers(0, 2**16 - 1), damages=DAMAGES)
def test_verify_agrees_with_load_on_tensordict_directories(tree, quirks, damages) -> None:
    batch, entries = tree
    with tempfile.TemporaryDirectory() as tmp:
        top, root = Path(tmp), Path(tmp) / "td"
        write_tensordict(root, batch, entries, quirks)
        for d in damages:
            damage(root, *d)
        full = assert_agreement(top, root)
        event(f"{full.layout}: {'ok' if full.ok else 'refused'}")


# -- tensordict directories: what verify reports ----------------------------------------------------
FIXTURE = Path(__file__).parent / "fixtures" / "tensordict_mmap_example"


def test_verify_checks_a_tensordict_directory_as_load_memmap_reads_it(tmp_path: Path) -> None:
    """Before, verify refused every tensordict directory ("not a memtree meta.json") while
    ``load_memmap`` and ``memtree info`` read it."""
    report = memtree.verify_tree(FIXTURE)
    assert report.ok and report.layout == "tensordict" and report.leaves == 2
    assert report.to_dict()["layout"] == "tensordict"
    root = tmp_path / "td"
    shutil.copytree(FIXTURE, root)
    leaves = sorted(root.rglob("*.memmap"))
    os.truncate(leaves[0], 1)
    leaves[1].unlink()
    (root / "nested" / "meta.json").write_bytes(b"{")  # hides the second leaf's level
    problems = memtree.verify_tree(root).problems
    assert [(p.kind, p.key) for p in problems] == [("meta", ("nested",))]
    with pytest.raises(memtree.MetaFormatError):
        memtree.load_memmap(root)


def test_verify_reports_every_damaged_tensordict_leaf_and_runs_no_pickle(tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    root = tmp_path / "td"
    entries = [("a", "tensor", torch.arange(4)), ("b/c", "tensor", torch.ones(4, 2)),
               ("sub", "tree", [("x", "tensor", torch.zeros(4, 3)), ("s", "json", "hi")]),
               ("obj", "json", None), ("deep", "json", 0)]
    write_tensordict(root, (4,), entries, quirks=3 << 6)  # "obj" only as a pickle sidecar
    (root / "obj" / "other.pickle").write_bytes(
        b"cbuiltins\nopen\n(" + repr(str(marker)).encode() + b"\nS'w'\ntR.")  # would create marker
    deep = json.loads((root / "deep" / "meta.json").read_text())
    (root / "deep" / "meta.json").write_bytes(
        json.dumps(deep).encode().replace(b'"data": 0', b'"data": ' + b"[" * 252 + b"]" * 252))
    os.truncate(root / "a.memmap", 31)
    (root / "sub" / "x.memmap").unlink()
    (root / "sub" / "x.memmap").symlink_to(root / "b%2Fc.memmap")
    report = memtree.verify_tree(root)
    got = {p.key: p.kind for p in report.problems}
    assert got == {("a",): "size", ("sub", "x"): "unsafe", ("obj",): "pickle", ("deep",): "limit"}
    assert report.leaves == 3 and not marker.exists()
    assert next(p for p in report.problems if p.key == ("a",)).path == str(root / "a.memmap")
    with pytest.raises(memtree.MemtreeError):
        memtree.load_memmap(root)
    assert not marker.exists()


@pytest.mark.parametrize("where", ["p.pickle", "sub/q.pickle"])
@pytest.mark.parametrize("kind", ["deleted", "symlink", "directory", "fifo", "other_pickle"])
def test_a_damaged_pickle_file_is_reported_and_refused_alike(tmp_path: Path, where: str, kind: str) -> None:
    """A pickle file (which the tree hash covers) deleted, replaced by something else, or by
    another pickle: ``verify_tree`` reports it and leaves the tree hash unchecked (it raised a
    ``KeyError`` for a missing pickle file), or reports the mismatch; the loader agrees."""
    root = tmp_path / "tree"
    tree = TensorTree({"a": torch.ones(2), "sub": {"b": torch.zeros(3)}})
    tree["p"] = {1, 2}  # not JSON: pickled
    tree["sub", "q"] = {3}
    tree.memmap(root, allow_pickle=True, checksum="crc32")
    assert memtree.verify_tree(root, progress=False).tree_hash == "ok"
    path = root / where
    path.unlink()
    if kind == "symlink":
        path.symlink_to(tmp_path / "elsewhere.pickle")
        (tmp_path / "elsewhere.pickle").write_bytes(pickle.dumps({1, 2}))
    elif kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "other_pickle":
        path.write_bytes(pickle.dumps({9}))
    report = assert_agreement(tmp_path, root)
    expected = {"deleted": "missing", "symlink": "unsafe", "directory": "unsafe", "fifo": "unsafe",
                "other_pickle": "tree-hash"}[kind]
    assert [p.kind for p in report.problems] == [expected], report.problems
    assert report.tree_hash == ("mismatch" if kind == "other_pickle" else "unchecked")
    error, match = (memtree.IntegrityError, "tree_hash") if kind == "other_pickle" else (memtree.MemtreeError, where)
    with pytest.raises(error, match=match):
        memtree.load_memmap(root, verify=True, allow_pickle=True)
