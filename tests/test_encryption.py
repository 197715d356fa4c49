"""Encryption at rest (``memmap(..., encryption=key)``, ``load_memmap(..., encryption=key)``).

Round trips are bit-exact for every dtype, empty and 0-dim leaves, chunk-boundary sizes, nested
trees and non-tensor values; every damage class (bit flips anywhere, chunk swaps, truncation,
leaf files swapped between keys or trees, levels moved, entries removed, a wrong or missing key)
is a :class:`memtree.DecryptionError` (an ``IntegrityError``), never a tree with other data.
Writers use 4 KiB chunks here (``CHUNK_BYTES`` patched) so that small leaves span many chunks.
"""

from __future__ import annotations

import json

import base64
import dataclasses
import os
import shutil
import subprocess
import sys
import textwrap
import threading

import orjson
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memtree
from memtree.format.dtypes import DTYPE_NAMES
from memtree.format.schema import LeafMeta, parse_level, sealed_nbytes
from memtree.store.primitives import crypto
from memtree.store.reading.options import WriteOptions
from treeutil import fingerprint, random_tensor, snapshot

CHUNK = 4096
DTYPES = [getattr(torch, n) for n in DTYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(crypto, "CHUNK_BYTES", CHUNK)


@pytest.fixture(scope="module")
def key() -> memtree.EncryptionKey:
    return memtree.EncryptionKey.generate()


def sample_tree() -> memtree.TensorTree:
    return memtree.TensorTree(
        {
            "big": random_tensor((3 * CHUNK // 4 + 1,), torch.float32, seed=1),  # 4 chunks, the last of 4 bytes
            "twin_a": random_tensor((CHUNK,), torch.uint8, seed=2),
            "twin_b": random_tensor((CHUNK,), torch.uint8, seed=3),
            "empty": torch.empty(0, 3),
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "cfg": {"lr": 0.1, "name": "run", "steps": [1, 2, 3]},
            "sub": {"w": random_tensor((5, 7), torch.bfloat16, seed=4), "deep": {"x": torch.arange(9)}},
        }
    )


def write(tree: memtree.TensorTree, path: str, key: memtree.EncryptionKey, **kw: object) -> memtree.TensorTree:
    return tree.memmap(path, encryption=key, **kw)


# -- round trips --------------------------------------------------------------------------------


def test_every_dtype_round_trips_bit_exactly(tmp_path, key) -> None:
    leaves = {}
    for i, dt in enumerate(DTYPES):
        leaves[str(dt).removeprefix("torch.")] = {
            "v": random_tensor((CHUNK // dt.itemsize + 3,), dt, seed=i),  # two chunks
            "zero_dim": random_tensor((), dt, seed=100 + i),
            "empty": torch.empty(0, 2, dtype=dt),
        }
    tree = memtree.TensorTree(leaves)
    written = write(tree, str(tmp_path / "t"), key, num_threads=2)
    assert fingerprint(written) == fingerprint(tree)
    loaded = memtree.load_memmap(tmp_path / "t", encryption=key)
    assert fingerprint(loaded) == fingerprint(tree)
    assert not loaded.is_memmap()  # decrypted into memory, never mapped


@pytest.mark.parametrize("nbytes", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 3 * CHUNK - 1, 5 * CHUNK + 7])
def test_chunk_boundary_sizes(tmp_path, key, nbytes: int) -> None:
    tree = memtree.TensorTree({"x": random_tensor((nbytes,), torch.uint8, seed=nbytes)})
    write(tree, str(tmp_path / "t"), key)
    size = os.path.getsize(tmp_path / "t" / "x.memmap")
    assert size == sealed_nbytes(nbytes, CHUNK) == nbytes + 16 * max(1, -(-nbytes // CHUNK))
    assert fingerprint(memtree.load_memmap(tmp_path / "t", encryption=key)) == fingerprint(tree)


def test_nested_tree_values_batch_sizes_and_selection(tmp_path, key) -> None:
    tree = memtree.TensorTree(
        {"obs": {"img": random_tensor((4, 3, 8), torch.uint8, seed=5)}, "r": torch.arange(4.0), "tag": "x"},
        batch_size=[4],
    )
    write(tree, str(tmp_path / "t"), key, checksum="sha256")
    loaded = memtree.load_memmap(tmp_path / "t", encryption=key)
    assert loaded.batch_size == torch.Size([4]) and loaded["tag"] == "x"
    assert fingerprint(loaded) == fingerprint(tree)
    part = memtree.load_memmap(tmp_path / "t", encryption=key, keys=[("obs", "img")])
    assert part.keys(include_nested=True, leaves_only=True) == [("obs", "img")]
    assert torch.equal(part["obs", "img"], tree["obs", "img"])


def test_leaves_lying_in_another_file_are_read_and_encrypted(tmp_path, key) -> None:
    """A checkpoint's tensor (a LazyLeaf with a file range) is read chunk by chunk from its
    file, encrypted, and a source that ends early is a clear error."""
    from memtree.format.level import Level
    from memtree.interop.lazy import LazyLeaf
    from memtree.store.primitives.files import FileRange
    from memtree.store.writing.write import write_tree

    data = random_tensor((3 * CHUNK + 5,), torch.uint8, seed=9)
    src = tmp_path / "src.bin"
    src.write_bytes(b"xx" + data.numpy().tobytes())
    fd = os.open(src, os.O_RDONLY)
    try:
        def lazy(nbytes: int) -> LazyLeaf:
            return LazyLeaf(data.shape, data.dtype, data.clone, lambda: FileRange(fd, 2, nbytes, "tensor of src.bin"))

        write_tree(tmp_path / "t", Level((), {"x": lazy(data.nbytes)}), WriteOptions.of(encryption=key))
        os.truncate(src, data.nbytes)  # now 2 bytes short
        with pytest.raises(memtree.StorageError, match="ends before"):
            write_tree(tmp_path / "u", Level((), {"x": lazy(data.nbytes)}), WriteOptions.of(encryption=key))
    finally:
        os.close(fd)
    assert torch.equal(memtree.load_memmap(tmp_path / "t", encryption=key)["x"], data)
    assert not os.path.exists(tmp_path / "u")


def test_chunks_are_sealed_and_opened_by_the_pool(tmp_path, key, monkeypatch) -> None:
    """Leaves of several chunks go through the pool of threads (also on a 1-CPU machine, with
    the pool size forced here); a failing chunk in the middle stops the leaf cleanly."""
    monkeypatch.setattr(crypto, "_workers", lambda: 4)
    monkeypatch.setattr(crypto, "_POOL", None)
    threads: set[str] = set()
    aad = crypto._LeafSeal.aad

    def spy(self: crypto._LeafSeal, i: int) -> bytes:
        threads.add(threading.current_thread().name)
        return aad(self, i)

    monkeypatch.setattr(crypto._LeafSeal, "aad", spy)
    tree = memtree.TensorTree({"x": random_tensor((40 * CHUNK + 1,), torch.uint8, seed=11)})
    write(tree, str(tmp_path / "t"), key, checksum="sha256")
    assert fingerprint(memtree.load_memmap(tmp_path / "t", encryption=key)) == fingerprint(tree)
    assert threads and all(name.startswith("memtree-crypto") for name in threads)
    assert memtree.verify_tree(tmp_path / "t").ok  # the checksum hashed the chunks in order
    path = tmp_path / "t" / "x.memmap"
    data = bytearray(path.read_bytes())
    data[20 * (CHUNK + 16) + 5] ^= 4
    path.write_bytes(data)
    with pytest.raises(memtree.DecryptionError, match="chunk 20 of 41"):
        memtree.load_memmap(tmp_path / "t", encryption=key)


def test_plaintext_never_on_disk_and_metadata_readable_without_key(tmp_path, key) -> None:
    marker = bytes(range(256)) * 64
    tree = memtree.TensorTree({"secret": torch.frombuffer(bytearray(marker), dtype=torch.uint8)})
    write(tree, str(tmp_path / "t"), key)
    data = (tmp_path / "t" / "secret.memmap").read_bytes()
    assert marker[:64] not in data and key.to_bytes() not in data
    meta = (tmp_path / "t" / "meta.json").read_bytes()
    assert key.to_bytes().hex().encode() not in meta and b'"secret"' in meta
    structure = memtree.load_memmap(tmp_path / "t", device="meta")  # no key: names, shapes, dtypes
    assert structure["secret"].shape == (len(marker),) and structure["secret"].is_meta


def test_each_write_draws_fresh_nonce_material(tmp_path, key) -> None:
    tree = memtree.TensorTree({"x": torch.zeros(100)})
    write(tree, str(tmp_path / "a"), key)
    write(tree, str(tmp_path / "b"), key)
    salts = [orjson.loads((tmp_path / d / "meta.json").read_bytes())["encryption"]["salt"] for d in "ab"]
    assert salts[0] != salts[1]
    assert (tmp_path / "a" / "x.memmap").read_bytes() != (tmp_path / "b" / "x.memmap").read_bytes()


def test_memmap_returns_the_tree_in_memory_and_overwrites_both_ways(tmp_path, key) -> None:
    tree = sample_tree()
    out = write(tree, str(tmp_path / "t"), key)
    assert not out.is_memmap() and fingerprint(out) == fingerprint(tree)
    tree.memmap(tmp_path / "t")  # a plain tree replaces the encrypted one
    assert fingerprint(memtree.load_memmap(tmp_path / "t")) == fingerprint(tree)
    write(tree, str(tmp_path / "t"), key)  # and back
    assert fingerprint(memtree.load_memmap(tmp_path / "t", encryption=key)) == fingerprint(tree)


def test_the_tree_hash_of_an_encrypted_tree(tmp_path, key) -> None:
    """Plain names: the root's tree_hash covers every meta.json (the root's mac covers the hash),
    checked by verify without the key and by verify=True loads; sealed names record none."""
    write(sample_tree(), str(tmp_path / "t"), key)
    report = memtree.verify_tree(tmp_path / "t")
    assert report.ok and report.tree_hash == "ok"
    assert memtree.load_memmap(tmp_path / "t", encryption=key, verify=True)["big"].shape == sample_tree()["big"].shape
    meta = tmp_path / "t" / "sub" / "meta.json"
    doc = json.loads(meta.read_bytes())
    doc["mac"] = "0" * 64  # a child level damaged: the key would catch it, the hash does without
    meta.write_bytes(json.dumps(doc, separators=(",", ":")).encode())
    assert [p.kind for p in memtree.verify_tree(tmp_path / "t").problems] == ["tree-hash"]
    write(sample_tree(), str(tmp_path / "n"), key, encrypt_names=True)
    report = memtree.verify_tree(tmp_path / "n")
    assert report.ok and report.tree_hash == "absent"
    assert memtree.load_memmap(tmp_path / "n", encryption=key, verify=True)["big"].shape == sample_tree()["big"].shape


def test_checksums_cover_the_ciphertext(tmp_path, key) -> None:
    write(sample_tree(), str(tmp_path / "t"), key, checksum="crc32")
    report = memtree.verify_tree(tmp_path / "t")  # no key needed
    assert report.ok and report.checksummed == 7
    path = tmp_path / "t" / "big.memmap"
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(data)
    assert [p.kind for p in memtree.verify_tree(tmp_path / "t").problems] == ["checksum"]
    with pytest.raises(memtree.IntegrityError, match="checksum"):
        memtree.load_memmap(tmp_path / "t", encryption=key, verify=True)
    with pytest.raises(memtree.DecryptionError, match="fails authentication"):
        memtree.load_memmap(tmp_path / "t", encryption=key)


# -- keys -----------------------------------------------------------------------------------------


def test_wrong_key_missing_key_and_key_for_a_plain_tree(tmp_path, key) -> None:
    write(sample_tree(), str(tmp_path / "t"), key)
    before = snapshot(tmp_path / "t")
    with pytest.raises(memtree.DecryptionError, match="another key"):
        memtree.load_memmap(tmp_path / "t", encryption=memtree.EncryptionKey.generate())
    with pytest.raises(memtree.DecryptionError, match="is encrypted"):
        memtree.load_memmap(tmp_path / "t")
    with pytest.raises(memtree.DecryptionError, match="is encrypted"):
        memtree.load_memmap(tmp_path / "t", mmap=False)
    sample_tree().memmap(tmp_path / "plain")
    with pytest.raises(memtree.DecryptionError, match="not encrypted"):
        memtree.load_memmap(tmp_path / "plain", encryption=key)
    assert issubclass(memtree.DecryptionError, memtree.IntegrityError)
    assert snapshot(tmp_path / "t") == before  # reading never writes


def test_key_object() -> None:
    key = memtree.EncryptionKey.generate()
    assert repr(key) == "EncryptionKey(<hidden>)" and key.to_bytes().hex() not in repr(key)
    assert memtree.EncryptionKey(key.to_bytes()) == key != memtree.EncryptionKey.generate()
    for bad in (b"short", bytes(33), "a" * 32, None):
        with pytest.raises(memtree.InvalidArgumentError, match="32 bytes"):
            memtree.EncryptionKey(bad)  # type: ignore[arg-type]


def test_refused_combinations(tmp_path, key) -> None:
    tree = memtree.TensorTree({"x": torch.zeros(2)}, batch_size=[2])
    with pytest.raises(memtree.InvalidArgumentError, match="memmap_like cannot encrypt"):
        WriteOptions.of(like=True, encryption=key)
    with pytest.raises(memtree.InvalidArgumentError, match="pickle"):
        tree.memmap(tmp_path / "p", encryption=key, allow_pickle=True)
    with pytest.raises(memtree.InvalidArgumentError, match="needs a prefix"):
        tree.memmap(None, encryption=key)
    with pytest.raises(memtree.InvalidArgumentError, match="EncryptionKey"):
        tree.memmap(tmp_path / "b", encryption=key.to_bytes())  # type: ignore[arg-type]
    with pytest.raises(memtree.InvalidArgumentError, match="EncryptionKey"):
        memtree.load_memmap(tmp_path / "b", encryption="secret")  # type: ignore[arg-type]
    assert not os.path.exists(tmp_path / "p") and not os.path.exists(tmp_path / "b")
    write(tree, str(tmp_path / "t"), key)
    loaded = memtree.load_memmap(tmp_path / "t", encryption=key)
    with pytest.raises(memtree.NotGrowableError, match="encrypted"):
        loaded.append_({"x": torch.ones(())})
    with pytest.raises(memtree.NotGrowableError, match="encrypted"):
        loaded.resize_(5)


def test_remote_trees_are_never_decrypted(tmp_path, key) -> None:
    pytest.importorskip("fsspec")
    from memtree.remote import upload

    upload(memtree.TensorTree({"x": torch.ones(2)}), "memory://enc/plain")
    with pytest.raises(memtree.InvalidArgumentError, match="local directory"):
        memtree.load_memmap("memory://enc/plain", encryption=key)
    write(memtree.TensorTree({"x": torch.ones(2)}), str(tmp_path / "t"), key)
    with pytest.raises(memtree.DecryptionError, match="is encrypted"):
        upload(str(tmp_path / "t"), "memory://enc/copy")


# -- damage: every class of change is an error, never other data ------------------------------


@pytest.fixture(scope="module")
def sealed(tmp_path_factory, key) -> tuple[str, dict[tuple[str, ...], object]]:
    path = str(tmp_path_factory.mktemp("sealed") / "t")
    mp = pytest.MonkeyPatch()
    mp.setattr(crypto, "CHUNK_BYTES", CHUNK)
    try:
        tree = sample_tree()
        write(tree, path, key)
    finally:
        mp.undo()
    return path, fingerprint(tree)


def _files(root: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_single_bit_flip_is_refused_or_harmless(sealed, key, data) -> None:
    """A flipped bit anywhere (ciphertext, tag, meta.json: nonce material, key check, mac, shapes,
    values) raises a MemtreeError, or (in meta.json, where a flip can spell the same value, such
    as ``1e-05`` as ``1E-05``) loads the same tree: never other data."""
    root, expected = sealed
    files = _files(root)
    path = data.draw(st.sampled_from(files))
    original = open(path, "rb").read()
    bit = data.draw(st.integers(0, 8 * len(original) - 1))
    damaged = bytearray(original)
    damaged[bit // 8] ^= 1 << (bit % 8)
    with open(path, "wb") as f:
        f.write(damaged)
    try:
        try:
            loaded = memtree.load_memmap(root, encryption=key)
        except memtree.MemtreeError as err:
            if path.endswith(".memmap"):  # the file is checked for its size, then authenticated
                assert isinstance(err, memtree.DecryptionError), err
            return
        assert path.endswith("meta.json") and fingerprint(loaded) == expected
    finally:
        with open(path, "wb") as f:
            f.write(original)


def _flip_and_load(path: str, root: str, key: memtree.EncryptionKey, offset: int) -> None:
    original = open(path, "rb").read()
    damaged = bytearray(original)
    damaged[offset] ^= 0x80
    open(path, "wb").write(damaged)
    try:
        with pytest.raises(memtree.DecryptionError):
            memtree.load_memmap(root, encryption=key)
    finally:
        open(path, "wb").write(original)


def test_flips_in_ciphertext_tag_and_nonce_material(sealed, key) -> None:
    root, _ = sealed
    leaf = os.path.join(root, "big.memmap")
    for offset in (0, CHUNK - 1, CHUNK, CHUNK + 15, CHUNK + 16, os.path.getsize(leaf) - 1):
        _flip_and_load(leaf, root, key, offset)  # data, the first tag, the second chunk, the last tag
    meta = open(os.path.join(root, "meta.json"), "rb").read()
    for field in (b'"salt":"', b'"key_check":"', b'"mac":"'):
        # 0x80 makes invalid UTF-8: flip a hex digit into another one instead
        at = meta.index(field) + len(field)
        original = meta
        digit = chr(meta[at])
        swapped = meta[:at] + ("0" if digit != "0" else "1").encode() + meta[at + 1 :]
        open(os.path.join(root, "meta.json"), "wb").write(swapped)
        try:
            with pytest.raises(memtree.DecryptionError):
                memtree.load_memmap(root, encryption=key)
        finally:
            open(os.path.join(root, "meta.json"), "wb").write(original)


def _copy(sealed_root: str, tmp_path) -> str:
    root = str(tmp_path / "t")
    shutil.copytree(sealed_root, root)
    return root


def test_chunks_swapped_or_dropped(sealed, key, tmp_path) -> None:
    root = _copy(sealed[0], tmp_path)
    leaf = os.path.join(root, "big.memmap")
    data = open(leaf, "rb").read()
    step = CHUNK + 16
    chunks = [data[i : i + step] for i in range(0, len(data), step)]
    assert len(chunks) == 4
    open(leaf, "wb").write(chunks[1] + chunks[0] + chunks[2] + chunks[3])
    with pytest.raises(memtree.DecryptionError, match=r"chunk 0 of 4"):
        memtree.load_memmap(root, encryption=key)
    open(leaf, "wb").write(b"".join(chunks[:3]))  # the last chunk dropped: refused by size first
    with pytest.raises(memtree.LeafSizeError):
        memtree.load_memmap(root, encryption=key)


def test_truncation_at_a_chunk_boundary_fails_authentication(sealed, key, tmp_path) -> None:
    """Below the size check and the meta.json mac: the chunks' associated data binds the total
    length and the last-chunk flag, so a leaf cut to fewer whole chunks (with a shape edited to
    match) still fails."""
    root = _copy(sealed[0], tmp_path)
    cipher = crypto.TreeCipher.open(key, _root_meta(root).encryption, root)
    entry = next(e for e in _root_meta(root).entries if e.key == "twin_a")
    data = open(os.path.join(root, "big.memmap"), "rb").read()
    cut = os.path.join(root, "cut.memmap")
    open(cut, "wb").write(data[: 2 * (CHUNK + 16)])
    shorter = LeafMeta("big", "big.memmap", torch.float32, (2 * CHUNK // 4,), chunk_bytes=CHUNK)
    fd = os.open(cut, os.O_RDONLY)
    try:
        with pytest.raises(memtree.DecryptionError, match="chunk 0 of 2"):
            cipher.read_leaf(fd, "big.memmap", shorter, cut, ("big",))
        with pytest.raises(memtree.DecryptionError):  # another leaf's identity: another key
            cipher.read_leaf(fd, "twin_a.memmap", entry, cut, ("twin_a",))
    finally:
        os.close(fd)


def _root_meta(root: str):
    with open(os.path.join(root, "meta.json"), "rb") as f:
        return parse_level(f.read(), root)


def test_leaf_files_swapped_between_keys(sealed, key, tmp_path) -> None:
    root = _copy(sealed[0], tmp_path)
    a, b = os.path.join(root, "twin_a.memmap"), os.path.join(root, "twin_b.memmap")
    os.rename(a, a + ".tmp")
    os.rename(b, a)
    os.rename(a + ".tmp", b)
    with pytest.raises(memtree.DecryptionError, match="twin_a"):
        memtree.load_memmap(root, encryption=key)


def test_files_and_levels_swapped_between_trees(sealed, key, tmp_path) -> None:
    """Two trees written with the same key and the same structure: each file, level or meta.json
    taken from the other tree is refused (each write has its own salt, hence its own keys)."""
    other = str(tmp_path / "other")
    write(sample_tree(), other, key)
    for rel in ("big.memmap", "sub/w.memmap", "sub/deep", "sub", "sub/meta.json", "meta.json"):
        root = str(tmp_path / rel.replace("/", "_"))
        shutil.copytree(sealed[0], root)
        target = os.path.join(root, rel)
        (shutil.rmtree if os.path.isdir(target) else os.remove)(target)
        (shutil.copytree if os.path.isdir(os.path.join(other, rel)) else shutil.copy)(os.path.join(other, rel), target)
        with pytest.raises(memtree.DecryptionError):
            memtree.load_memmap(root, encryption=key)
    # the whole tree is another valid tree, of course
    assert fingerprint(memtree.load_memmap(other, encryption=key)) == sealed[1]


def test_meta_json_edits_moves_and_removed_entries(sealed, key, tmp_path) -> None:
    root = _copy(sealed[0], tmp_path)
    sub = os.path.join(root, "sub", "meta.json")
    original = open(sub, "rb").read()
    doc = orjson.loads(original)
    edits = [
        {**doc, "entries": doc["entries"][:1]},  # an entry removed, the mac kept
        {**doc, "entries": [dict(doc["entries"][0], dtype="float16")]  + doc["entries"][1:]},  # retyped, same size
        {k: v for k, v in doc.items() if k not in ("encryption", "mac")},  # unsealed
    ]
    for edited in edits:
        open(sub, "wb").write(orjson.dumps(edited))
        with pytest.raises(memtree.DecryptionError):
            memtree.load_memmap(root, encryption=key)
    deep = open(os.path.join(root, "sub", "deep", "meta.json"), "rb").read()
    open(sub, "wb").write(deep)  # a level's (valid, sealed) meta.json moved to another level
    with pytest.raises(memtree.DecryptionError, match="moved"):
        memtree.load_memmap(root, encryption=key)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.pop("mac"), "come together"),
        (lambda d: d["encryption"].update(algorithm="aes-128-cbc"), "algorithm"),
        (lambda d: d["encryption"].update(chunk_bytes=16), "chunk_bytes"),
        (lambda d: d["encryption"].update(salt="00"), "salt"),
        (lambda d: d["encryption"].update(key_check="XY" * 16), "key_check"),
        (lambda d: d["encryption"].update(extra=1), "unknown field"),
        (lambda d: d["entries"][0].update(capacity=10**6), "cannot grow"),
        (lambda d: d["entries"].append({"key": "p", "kind": "pickle", "file": "p.pickle"}), "pickle"),
    ],
)
def test_schema_of_encrypted_levels(sealed, change, message) -> None:
    doc = orjson.loads(open(os.path.join(sealed[0], "meta.json"), "rb").read())
    change(doc)
    with pytest.raises(memtree.MetaFormatError, match=message):
        parse_level(orjson.dumps(doc), "meta.json")


# -- without the optional dependency ------------------------------------------------------------


def test_import_and_plain_trees_without_cryptography(tmp_path) -> None:
    script = textwrap.dedent(
        f"""
        import sys, importlib.abc
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "cryptography" or name.startswith("cryptography."):
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        import os, torch, memtree
        tree = memtree.TensorTree({{"x": torch.arange(3)}})
        tree.memmap({str(tmp_path / "plain")!r})
        assert memtree.load_memmap({str(tmp_path / "plain")!r})["x"].tolist() == [0, 1, 2]
        key = memtree.EncryptionKey.generate()
        try:
            tree.memmap({str(tmp_path / "enc")!r}, encryption=key)
        except memtree.MissingDependencyError as err:
            assert isinstance(err, ImportError) and "memtree[crypto]" in str(err), err
        else:
            raise AssertionError("no error")
        assert not os.path.exists({str(tmp_path / "enc")!r})
        assert "cryptography" not in sys.modules
        print("ok")
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# -- encrypted names ------------------------------------------------------------------------------

SECRET_NAMES = ("layer_secret", "weight_secret", "note_secret", "hidden_value")


@pytest.fixture(scope="module")
def sealed_names(tmp_path_factory, key) -> tuple[str, dict[tuple[str, ...], object]]:
    path = str(tmp_path_factory.mktemp("names") / "t")
    tree = memtree.TensorTree(
        {
            "layer_secret": {"weight_secret": random_tensor((3, CHUNK // 2 + 1), torch.float16, seed=7)},
            "note_secret": "hidden_value",
            "big": random_tensor((CHUNK + 3,), torch.uint8, seed=8),
            "e": torch.empty(0),
        },
    )
    mp = pytest.MonkeyPatch()
    mp.setattr(crypto, "CHUNK_BYTES", CHUNK)
    try:
        tree.memmap(path, encryption=key, encrypt_names=True, checksum="crc32")
    finally:
        mp.undo()
    return path, fingerprint(tree)


def test_encrypted_names_round_trip_and_hide_every_name(sealed_names, key) -> None:
    root, expected = sealed_names
    assert fingerprint(memtree.load_memmap(root, encryption=key)) == expected
    part = memtree.load_memmap(root, encryption=key, keys=[("layer_secret", "weight_secret")])
    assert part.keys(include_nested=True, leaves_only=True) == [("layer_secret", "weight_secret")]
    for path in [root, *_files(root)]:
        for name in SECRET_NAMES + ("float16", "big"):
            assert name not in os.path.relpath(path, os.path.dirname(root))
            if os.path.isfile(path):
                assert name.encode() not in open(path, "rb").read()
    with pytest.raises(memtree.DecryptionError, match="names included"):
        memtree.load_memmap(root, device="meta")  # no structure without the key either
    with pytest.raises(memtree.DecryptionError, match="another key"):
        memtree.load_memmap(root, encryption=memtree.EncryptionKey.generate())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_single_bit_flip_with_encrypted_names(sealed_names, key, data) -> None:
    root, expected = sealed_names
    path = data.draw(st.sampled_from(_files(root)))
    original = open(path, "rb").read()
    bit = data.draw(st.integers(0, 8 * len(original) - 1))
    damaged = bytearray(original)
    damaged[bit // 8] ^= 1 << (bit % 8)
    open(path, "wb").write(damaged)
    try:
        try:
            loaded = memtree.load_memmap(root, encryption=key)
        except memtree.MemtreeError as err:
            if path.endswith(".memmap"):
                assert isinstance(err, memtree.DecryptionError), err
            return
        assert path.endswith("meta.json") and fingerprint(loaded) == expected
    finally:
        open(path, "wb").write(original)


def test_sealed_entries_are_authenticated_beyond_the_mac(sealed_names, key, tmp_path) -> None:
    """A forged level whose mac is right (computed with the key) but whose sealed entries were
    changed still fails: the entries are AES-GCM sealed with the level's own key."""
    root = _copy(sealed_names[0], tmp_path)
    meta = _root_meta(root)
    cipher = crypto.TreeCipher.open(key, meta.encryption, root)
    blob = bytearray(base64.b64decode(meta.sealed))
    blob[0] ^= 1
    forged = dataclasses.replace(meta, sealed=base64.b64encode(bytes(blob)).decode(), mac=None)
    forged = dataclasses.replace(forged, mac=cipher._mac(forged, ""))
    with pytest.raises(memtree.DecryptionError, match="sealed entries"):
        cipher.reveal(forged, "", root)
    sub = next(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    moved = os.path.join(root, sub, "meta.json")
    open(moved, "wb").write(open(os.path.join(root, "meta.json"), "rb").read())  # root's level one down
    with pytest.raises(memtree.DecryptionError):
        memtree.load_memmap(root, encryption=key)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.pop("sealed"), "base64"),
        (lambda d: d.update(sealed="not base64!"), "base64"),
        (lambda d: d["entries"].append({"key": "j", "kind": "json", "value": 1}), "must be empty"),
        (lambda d: d.update(batch_size=[2]), "must be empty"),
        (lambda d: d["encryption"].update(names=False), "only in levels whose names"),
        (lambda d: d["encryption"].update(names=1), "true or false"),
        (lambda d: [d.pop("encryption"), d.pop("mac")], "only in encrypted levels"),
    ],
)
def test_schema_of_sealed_levels(sealed_names, change, message) -> None:
    doc = orjson.loads(open(os.path.join(sealed_names[0], "meta.json"), "rb").read())
    change(doc)
    with pytest.raises(memtree.MetaFormatError, match=message):
        parse_level(orjson.dumps(doc), "meta.json")


def test_encrypt_names_needs_a_key(tmp_path) -> None:
    with pytest.raises(memtree.InvalidArgumentError, match="needs encryption"):
        memtree.TensorTree({"x": torch.zeros(1)}).memmap(tmp_path / "t", encrypt_names=True)
