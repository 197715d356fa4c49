"""Incremental saves: ``WriteOptions.link_from`` hard-links unchanged leaves from a previous tree."""

from __future__ import annotations

import errno
import os

import pytest
import torch

import memtree
from memtree import InvalidArgumentError, verify_tree
from memtree.format.level import Level
from memtree.store.primitives import durability
from memtree.store.writing import linking
from memtree.store.reading.options import WriteOptions
from memtree.store.writing.write import WriteStats, write_tree
from treeutil import raw_bytes


def _state(seed: int = 0) -> Level:
    g = torch.Generator().manual_seed(seed)
    return Level((), {
        "w": torch.randn(64, 32, generator=g),
        "b": torch.randn(32, generator=g),
        "opt": Level((), {"m": torch.randn(64, 32, generator=g), "step": torch.tensor(seed)}),
        "lr": 0.1,
    })


def _save(path, level, stats=None, **kw) -> WriteStats:
    stats = stats if stats is not None else WriteStats()
    write_tree(path, level, WriteOptions.of(**kw), stats=stats)
    return stats


def _ino(path) -> int:
    return os.stat(path).st_ino


def test_unchanged_leaves_are_linked_changed_ones_written(tmp_path):
    old, new = tmp_path / "1", tmp_path / "2"
    _save(old, _state(0))
    level = _state(0)
    level.entries["opt"].entries["step"] = torch.tensor(1)  # one leaf changes
    stats = _save(new, level, link_from=old)
    assert (stats.files_linked, stats.files_written) == (3, 1)
    assert stats.bytes_linked == (64 * 32 * 2 + 32) * 4
    assert stats.bytes_written == 8 and stats.link_fallbacks == 0 and stats.link_error is None
    for rel in ("w.memmap", "b.memmap", "opt/m.memmap"):
        assert _ino(old / rel) == _ino(new / rel)
    assert _ino(old / "opt/step.memmap") != _ino(new / "opt/step.memmap")
    assert verify_tree(new).ok and verify_tree(old).ok
    loaded = memtree.load_memmap(new, verify=True)
    assert int(loaded["opt", "step"]) == 1
    assert raw_bytes(loaded["w"]) == raw_bytes(level.entries["w"])


def test_new_tree_is_standalone(tmp_path):
    old, new = tmp_path / "1", tmp_path / "2"
    _save(old, _state(3))
    _save(new, _state(3), link_from=old)
    import shutil

    shutil.rmtree(old)
    loaded = memtree.load_memmap(new, verify=True, mode="r")
    assert raw_bytes(loaded["opt", "m"]) == raw_bytes(_state(3).entries["opt"].entries["m"])


def test_only_same_dtype_shape_and_algorithm_are_linked(tmp_path):
    old = tmp_path / "1"
    _save(old, Level((), {"a": torch.zeros(4), "b": torch.zeros(4), "c": torch.zeros(4)}), checksum="crc32")
    level = Level((), {"a": torch.zeros(4, dtype=torch.int32), "b": torch.zeros(2, 2), "c": torch.zeros(4)})
    assert _save(tmp_path / "2", level, link_from=old, checksum="crc32").files_linked == 1
    # another algorithm: nothing is compared, nothing linked
    assert _save(tmp_path / "3", level, link_from=old, checksum="sha256").files_linked == 0


def test_growable_leaves_are_never_linked(tmp_path):
    old = tmp_path / "1"
    buf = memtree.TensorTree({"x": torch.zeros(2, 3)}, batch_size=[2]).memmap(old)
    buf.append_({"x": torch.ones(3)})  # capacity now recorded, checksum dropped
    stats = _save(tmp_path / "2", Level((3,), {"x": memtree.load_memmap(old)["x"].clone()}), link_from=old)
    assert stats.files_linked == 0 and stats.files_written == 1


def test_corrupted_old_leaf_is_written_not_linked(tmp_path):
    old, new = tmp_path / "1", tmp_path / "2"
    _save(old, _state(0))
    with open(old / "w.memmap", "r+b") as f:  # damage that keeps size and checksum field
        f.seek(5)
        byte = f.read(1)
        f.seek(5)
        f.write(bytes([byte[0] ^ 1]))
    stats = _save(new, _state(0), link_from=old)
    assert stats.files_linked == 3 and stats.link_fallbacks == 1
    assert _ino(new / "w.memmap") != _ino(old / "w.memmap")
    assert verify_tree(new).ok
    assert [p.key for p in verify_tree(old).problems] == [("w",)]


def test_trusting_recorded_sha256_checksums_still_refuses_a_file_changed_after_its_meta(tmp_path):
    old = tmp_path / "1"
    _save(old, _state(0), checksum="sha256")
    st = os.stat(old / "meta.json")
    os.utime(old / "b.memmap", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    stats = _save(tmp_path / "2", _state(0), link_from=old, link_verify=False, checksum="sha256")
    assert stats.files_linked == 3 and stats.link_fallbacks == 1


def test_trusting_a_sha256_checksum_reads_no_old_byte(tmp_path, monkeypatch):
    old = tmp_path / "1"
    _save(old, _state(0), checksum="sha256")
    monkeypatch.setattr(linking, "equal_bytes", lambda *a: pytest.fail("compared bytes it may trust"))
    assert _save(tmp_path / "2", _state(0), link_from=old, link_verify=False, checksum="sha256").files_linked == 4


@pytest.mark.parametrize("algorithm", ["crc32", "crc32c", "xxh3"])
def test_link_verify_false_never_trusts_a_checksum_that_can_be_forged(tmp_path, algorithm):
    """Without verify, a non-cryptographic checksum still decides nothing alone: the bytes are
    compared (a file rewritten with other bytes and its old mtime is not linked)."""
    old = tmp_path / "1"
    _save(old, _state(0), checksum=algorithm)
    path = old / "b.memmap"
    st = os.stat(path)
    path.write_bytes(raw_bytes(torch.zeros(32)))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # looks untouched since its meta.json
    stats = _save(tmp_path / "2", _state(0), link_from=old, link_verify=False, checksum=algorithm)
    assert (stats.files_linked, stats.link_fallbacks) == (3, 1)
    assert raw_bytes(memtree.load_memmap(tmp_path / "2", verify=True)["b"]) == raw_bytes(_state(0).entries["b"])


def test_symlinked_leaf_in_old_tree_is_not_followed(tmp_path):
    old, outside = tmp_path / "1", tmp_path / "outside.bin"
    _save(old, _state(0))
    os.replace(old / "w.memmap", outside)
    os.symlink(outside, old / "w.memmap")
    stats = _save(tmp_path / "2", _state(0), link_from=old)
    assert stats.link_fallbacks == 1
    assert not os.path.islink(tmp_path / "2" / "w.memmap")
    assert os.stat(outside).st_nlink == 1


def test_symlinked_level_in_old_tree_links_nothing(tmp_path):
    old, other = tmp_path / "1", tmp_path / "elsewhere"
    _save(old, _state(0))
    os.rename(old / "opt", other)
    os.symlink(other, old / "opt")
    stats = _save(tmp_path / "2", _state(0), link_from=old)
    assert stats.files_linked == 0 and stats.files_written == 4
    assert "symbolic link" in stats.link_error
    assert os.stat(other / "m.memmap").st_nlink == 1


def test_unreadable_link_from_writes_everything(tmp_path):
    stats = _save(tmp_path / "2", _state(0), link_from=tmp_path / "missing")
    assert stats.files_written == 4 and stats.files_linked == 0 and "does not exist" in stats.link_error


def test_old_file_swapped_between_check_and_link_is_unlinked(tmp_path, monkeypatch):
    old, new = tmp_path / "1", tmp_path / "2"
    _save(old, _state(0))
    real = linking.LinkSource._holds

    def swap(self, fd, st, o, data, lease):
        ok = real(self, fd, st, o, data, lease)
        if o.meta.key == "w":  # an attacker replaces the checked file by another one
            os.unlink(old / "w.memmap")
            with open(old / "w.memmap", "wb") as f:
                f.write(b"\0" * (64 * 32 * 4))
        return ok

    monkeypatch.setattr(linking.LinkSource, "_holds", swap)
    stats = _save(new, _state(0), link_from=old)
    assert stats.link_fallbacks == 1 and stats.files_linked == 3
    assert raw_bytes(memtree.load_memmap(new, verify=True)["w"]) == raw_bytes(_state(0).entries["w"])


@pytest.mark.parametrize("code", [errno.EXDEV, errno.EPERM, errno.EMLINK])
def test_any_link_failure_falls_back_to_writing(tmp_path, monkeypatch, code):
    old = tmp_path / "1"
    _save(old, _state(0))

    def refuse(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(linking.os, "link", refuse)
    stats = _save(tmp_path / "2", _state(0), link_from=old, num_threads=4)
    assert stats.files_written == 4 and stats.link_fallbacks == 4
    assert verify_tree(tmp_path / "2").ok


def test_link_count_limit_writes_instead(tmp_path, monkeypatch):
    old = tmp_path / "1"
    _save(old, _state(0))
    monkeypatch.setattr(linking, "MAX_LINKS", 2)
    assert _save(tmp_path / "2", _state(0), link_from=old).files_linked == 4
    stats = _save(tmp_path / "3", _state(0), link_from=old)  # each file now has 2 links
    assert stats.files_linked == 0 and stats.link_fallbacks == 4


def test_link_from_itself_when_overwriting(tmp_path):
    d = tmp_path / "t"
    _save(d, _state(0))
    level = _state(0)
    level.entries["b"] = torch.zeros(32)
    stats = _save(d, level, link_from=d)
    assert stats.files_linked == 3 and stats.files_written == 1
    loaded = memtree.load_memmap(d, verify=True)
    assert raw_bytes(loaded["b"]) == raw_bytes(torch.zeros(32))
    assert verify_tree(d).ok


def test_growth_of_a_linked_tree_leaves_the_other_tree_alone(tmp_path):
    old, new = tmp_path / "1", tmp_path / "2"
    memtree.TensorTree({"x": torch.arange(6.0).reshape(3, 2)}, batch_size=[3]).memmap(old)
    before = (old / "x.memmap").read_bytes()
    write_tree(new, Level((3,), {"x": torch.arange(6.0).reshape(3, 2)}), WriteOptions.of(link_from=old))
    assert _ino(old / "x.memmap") == _ino(new / "x.memmap")
    grown = memtree.load_memmap(new)
    grown.append_({"x": torch.ones(2)})
    assert (old / "x.memmap").read_bytes() == before and verify_tree(old).ok
    assert verify_tree(new).ok and len(memtree.load_memmap(new)) == 4


def test_file_range_leaves_are_hashed_and_linked(tmp_path):
    from memtree.interop.lazy import LazyLeaf
    from memtree.store.primitives.files import FileRange

    data = torch.arange(100.0)
    raw = tmp_path / "raw.bin"
    raw.write_bytes(b"pad!" + raw_bytes(data) + b"tail")
    _save(tmp_path / "1", Level((), {"w": data}))
    fd = os.open(raw, os.O_RDONLY)
    try:
        leaf = LazyLeaf((100,), torch.float32, lambda: data.clone(), lambda: FileRange(fd, 4, 400, "raw"))
        stats = _save(tmp_path / "2", Level((), {"w": leaf}), link_from=tmp_path / "1")
        assert stats.files_linked == 1
        other = LazyLeaf((100,), torch.float32, lambda: data.clone(), lambda: FileRange(fd, 0, 400, "raw"))
        stats = _save(tmp_path / "3", Level((), {"w": other}), link_from=tmp_path / "1")
        assert stats.files_written == 1 and verify_tree(tmp_path / "3").ok
    finally:
        os.close(fd)


def test_options_are_checked(tmp_path):
    with pytest.raises(InvalidArgumentError, match="link_from"):
        WriteOptions.of(link_from=tmp_path, checksum=None)
    with pytest.raises(InvalidArgumentError, match="link_from"):
        WriteOptions.of(link_from=tmp_path, like=True)
    with pytest.raises(InvalidArgumentError, match="link_from"):
        WriteOptions.of(link_from=3)
    with pytest.raises(InvalidArgumentError, match="link_verify"):
        WriteOptions.of(link_from=tmp_path, link_verify="yes")


def test_old_tree_removed_while_linking_writes_the_rest(tmp_path, monkeypatch):
    import shutil

    old, new = tmp_path / "1", tmp_path / "2"
    _save(old, _state(0))
    real = linking.LinkSource._holds
    calls = []

    def remove_then_check(self, fd, st, o, data, lease):
        calls.append(o.meta.key)
        if len(calls) == 1:
            shutil.rmtree(old)  # the previous checkpoint is deleted (retention) mid-save
        return real(self, fd, st, o, data, lease)

    monkeypatch.setattr(linking.LinkSource, "_holds", remove_then_check)
    stats = _save(new, _state(0), link_from=old)
    assert stats.files_linked + stats.files_written == 4 and stats.files_written >= 3
    loaded = memtree.load_memmap(new, verify=True)
    assert raw_bytes(loaded["opt", "m"]) == raw_bytes(_state(0).entries["opt"].entries["m"])


def test_fsync_flushes_linked_files_too(tmp_path, monkeypatch):
    old = tmp_path / "1"
    _save(old, _state(0))
    monkeypatch.setattr(durability, "syncfs_refusal", lambda fd: "per-file fsync (this test)")
    synced = []
    real = os.fsync
    monkeypatch.setattr(linking.os, "fsync", lambda fd: synced.append(os.fstat(fd).st_ino) or real(fd))
    stats = _save(tmp_path / "2", _state(0), link_from=old, fsync=True)
    assert stats.files_linked == 4
    assert {os.stat(p).st_ino for p in old.rglob("*.memmap")} <= set(synced)  # (os.fsync is global)


def test_batched_durability_covers_linked_files(tmp_path, monkeypatch):
    """Where one syncfs makes a durable write (memtree.store.durability), it covers the linked
    old files too: the old tree may have been written without fsync, and syncfs flushes every
    dirty page of the filesystem; no file is fsynced one by one."""
    old = tmp_path / "1"
    _save(old, _state(0))
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        if durability.syncfs_refusal(fd) is not None:
            pytest.skip(f"no batched durability here: {durability.syncfs_refusal(fd)}")
    finally:
        os.close(fd)
    calls = []
    real_syncfs, real_fsync = durability._syncfs, os.fsync
    monkeypatch.setattr(durability, "_syncfs", lambda fd: calls.append("syncfs") or real_syncfs(fd))
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd))
    stats = _save(tmp_path / "2", _state(0), link_from=old, fsync=True)
    assert stats.files_linked == 4
    assert calls == ["syncfs", str(tmp_path)]  # then the parent, after the publish


# ---------------------------------------------------------------------------------------------
# equality decided by the bytes, not by a checksum that can be matched on purpose


def _forge_tail(checksum, prefix: bytes, target: int) -> bytes:
    """``prefix`` and 4 bytes whose CRC (``checksum``: crc32 or crc32c, affine over GF(2) in
    the last 4 bytes) is ``target``."""
    base = checksum(prefix + bytes(4))
    pivots: dict[int, tuple[int, int]] = {}  # highest bit -> (column, which input bits)
    for i in range(32):
        col, mask = checksum(prefix + (1 << i).to_bytes(4, "little")) ^ base, 1 << i
        for bit in range(31, -1, -1):
            if (col >> bit) & 1:
                if bit not in pivots:
                    pivots[bit] = (col, mask)
                    break
                col, mask = col ^ pivots[bit][0], mask ^ pivots[bit][1]
    want, mask = target ^ base, 0
    for bit in range(31, -1, -1):
        if (want >> bit) & 1:
            want, mask = want ^ pivots[bit][0], mask ^ pivots[bit][1]
    return prefix + mask.to_bytes(4, "little")


def _collision(algorithm: str) -> tuple[bytes, bytes]:
    """Two different contents with the same ``algorithm`` checksum."""
    g = torch.Generator().manual_seed(7)
    noise = lambda n: bytes(torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).tolist())  # noqa: E731
    if algorithm == "xxh3":
        # XXH3_64 of 17..128 bytes adds mix16B(input[0:16], secret[0:16]); the product it folds is
        # 0 when input[0:8] equals the default secret's first 8 bytes, whatever input[8:16] is
        head = bytes([0xB8, 0xFE, 0x6C, 0x39, 0x23, 0xA4, 0x4B, 0xBE])
        tail = noise(16)
        return head + noise(8) + tail, head + noise(8) + tail
    if algorithm == "crc32":
        import zlib

        fn = zlib.crc32
    else:
        crc32c = pytest.importorskip("crc32c", reason="crc32c is an optional package")
        fn = crc32c.crc32c
    first = noise(60) + bytes(4)
    return first, _forge_tail(fn, noise(60), fn(first))


@pytest.mark.parametrize("verify", [True, False], ids=["link_verify", "no_link_verify"])
@pytest.mark.parametrize("algorithm", ["xxh3", "crc32", "crc32c"])
def test_different_bytes_with_the_same_checksum_are_written_not_linked(tmp_path, algorithm, verify):
    from memtree.store.primitives.checksums import available_checksums, tensor_checksum

    if algorithm not in available_checksums():
        pytest.skip(f"{algorithm} needs its optional package (memtree[fast-checksums])")
    first, second = (torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in _collision(algorithm))
    assert raw_bytes(first) != raw_bytes(second)
    assert tensor_checksum(first, algorithm) == tensor_checksum(second, algorithm)  # a real collision
    old, new = tmp_path / "1", tmp_path / "2"
    _save(old, Level((), {"w": first}), checksum=algorithm)
    stats = _save(new, Level((), {"w": second}), link_from=old, checksum=algorithm, link_verify=verify)
    assert (stats.files_linked, stats.files_written, stats.link_fallbacks) == (0, 1, 1)
    assert raw_bytes(memtree.load_memmap(new, mode="r")["w"]) == raw_bytes(second)
    assert _ino(old / "w.memmap") != _ino(new / "w.memmap")
    assert verify_tree(new).ok and verify_tree(old).ok


def test_the_default_checksum_collision_through_a_checkpointer(tmp_path):
    from memtree.store.primitives.checksums import default_checksum

    first, second = (torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in _collision(default_checksum()))
    ckpt = memtree.Checkpointer(tmp_path)
    ckpt.save(1, {"w": first})
    ckpt.save(2, {"w": second})
    assert ckpt.last_stats.files_linked == 0
    assert raw_bytes(ckpt.restore(2)["w"]) == raw_bytes(second)
    assert raw_bytes(ckpt.restore(1)["w"]) == raw_bytes(first)
