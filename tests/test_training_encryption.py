"""``memtree.Checkpointer(root, encryption=key)``: encrypted steps, saved blocking or in the
background, restored with the key; the wrong key, no key, or a key for a root of plain steps
raise ``DecryptionError`` when the root is opened, before anything is written; encrypted steps
are always written whole (no hard links). The attacks on encrypted roots (steps copied or
renamed, hostile root records) are in ``test_attack_checkpointer.py``.

The write path is the unencrypted one (``write_tree``'s staging directory and atomic commit,
with ``WriteOptions(encryption=key)``), so the kill -9 tests of ``test_training_kill.py`` cover
it; the crypto itself is tested in ``test_encryption.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("cryptography")

import memtree  # noqa: E402
from memtree.errors import DecryptionError, IntegrityError, InvalidArgumentError  # noqa: E402

MARK = torch.arange(4096, dtype=torch.int64) * 7919 + 0x5EC2E7  # easy to find in a file


def _model_and_state() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    model(torch.randn(2, 8)).sum().backward()
    optim.step()
    state = {"model": model.state_dict(), "optim": optim.state_dict(), "mark": MARK, "epoch": 3}
    return model, optim, state


def _assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert type(b) is dict and list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b and type(a) is type(b)


def _files_below(path: str) -> dict[str, bytes]:
    out = {}
    for d, _, names in os.walk(path):
        for n in names:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.join(d, n)] = f.read()
    return out


@pytest.mark.parametrize("blocking", [True, False])
def test_encrypted_steps_round_trip_bit_exact_with_their_types(tmp_path, blocking):
    key = memtree.EncryptionKey.generate()
    model, optim, state = _model_and_state()
    ckpt = memtree.Checkpointer(tmp_path, keep_last=2, encryption=key)
    for step in (1, 2, 3):
        out = ckpt.save(step, state, blocking=blocking)
        if not blocking:
            assert out.result(timeout=300) == ckpt.path(step)
    ckpt.wait()
    assert ckpt.steps() == [2, 3] and ckpt.latest() == 3
    assert ckpt.last_stats is not None and ckpt.last_stats.files_linked == 0  # always whole
    _assert_same(state, ckpt.restore())
    _assert_same(state, memtree.Checkpointer(tmp_path, encryption=key).restore(2))
    # on disk: ciphertext only, and every meta.json says so
    files = _files_below(ckpt.path(3))
    assert not any(MARK.numpy().tobytes()[:64] in data for data in files.values())
    metas = [data for name, data in files.items() if name.endswith("meta.json")]
    assert metas and all(b'"aes-256-gcm"' in m for m in metas)
    assert memtree.verify_tree(ckpt.path(3)).ok  # checksums of the ciphertext, no key needed
    # into live objects
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    back = ckpt.restore(into={"model": fresh})
    assert back["model"] is fresh and all(torch.equal(p, q) for p, q in zip(fresh.parameters(), model.parameters()))


def test_the_wrong_key_no_key_or_a_key_for_plain_steps_is_refused_when_the_root_is_opened(tmp_path):
    """Checked before anything is written: nothing of another key, or plain, enters the root,
    and no retention of such a checkpointer deletes the steps the right key reads."""
    key = memtree.EncryptionKey.generate()
    _, _, state = _model_and_state()
    memtree.Checkpointer(tmp_path / "enc", keep_last=1, encryption=key).save(5, state)
    before = _files_below(tmp_path / "enc")
    with pytest.raises(DecryptionError, match="another key.*nothing was written"):
        memtree.Checkpointer(tmp_path / "enc", keep_last=1, encryption=memtree.EncryptionKey.generate())
    with pytest.raises(DecryptionError, match="encrypted checkpoint root.*Pass the key"):
        memtree.Checkpointer(tmp_path / "enc", keep_last=1)
    assert _files_below(tmp_path / "enc") == before
    memtree.Checkpointer(tmp_path / "plain").save(5, state)
    with pytest.raises(DecryptionError, match=r"plain \(unencrypted\) steps \[5\]"):
        memtree.Checkpointer(tmp_path / "plain", encryption=key)
    assert os.listdir(tmp_path / "plain") == ["5"]
    _assert_same(state, memtree.Checkpointer(tmp_path / "enc", encryption=key).restore())


def test_a_changed_byte_of_an_encrypted_step_is_refused_on_restore(tmp_path):
    key = memtree.EncryptionKey.generate()
    ckpt = memtree.Checkpointer(tmp_path, encryption=key)
    ckpt.save(1, {"mark": MARK})
    leaf = next(p for p in _files_below(ckpt.path(1)) if p.endswith(".memmap"))
    with open(leaf, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(IntegrityError, match="checksum"):  # the ciphertext's checksum, first
        ckpt.restore()
    with pytest.raises(DecryptionError, match="fails authentication"):  # and its tag, without it
        ckpt.restore(verify=False)


def test_encryption_is_always_full_saves_and_incremental_true_is_refused(tmp_path):
    key = memtree.EncryptionKey.generate()
    with pytest.raises(InvalidArgumentError, match="incremental=True cannot be combined with encryption"):
        memtree.Checkpointer(tmp_path, encryption=key, incremental=True)
    ckpt = memtree.Checkpointer(tmp_path, encryption=key)
    assert ckpt.incremental is False and memtree.Checkpointer(tmp_path / "plain").incremental is True
    assert memtree.Checkpointer(tmp_path, encryption=key, incremental=False).incremental is False
    state = {"frozen": torch.randn(256, 256)}
    ckpt.save(1, state)
    ckpt.save(2, state)
    assert ckpt.last_stats.files_linked == 0 and ckpt.last_stats.bytes_written >= 256 * 256 * 4
    assert os.stat(os.path.join(ckpt.path(2), "frozen.memmap")).st_nlink == 1
    assert sorted(os.listdir(tmp_path)) == [".memtree-root.json", "1", "2", "plain"]
    assert key.to_bytes().hex() not in repr(ckpt) and "encryption=EncryptionKey(<hidden>)" in repr(ckpt)
    for bad in ("secret", b"x" * 32, 1):
        with pytest.raises(InvalidArgumentError, match="EncryptionKey"):
            memtree.Checkpointer(tmp_path, encryption=bad)


def test_the_root_record_and_the_step_keys_are_as_the_format_says(tmp_path):
    """docs/format.md, "Checkpoint roots": the record's fields, and step N's key derived from
    the key, the root id and N (so that its key_check binds both)."""
    import orjson

    from memtree.format.schema import parse_level
    from memtree.store.primitives.crypto import derive_key, key_fingerprint, key_matches

    key = memtree.EncryptionKey.generate()
    ckpt = memtree.Checkpointer(tmp_path, encryption=key)
    ckpt.save(7, {"w": torch.ones(3)})
    record = orjson.loads((tmp_path / ".memtree-root.json").read_bytes())
    assert list(record) == ["format", "version", "root_id", "encryption"]
    assert (record["format"], record["version"], list(record["encryption"])) == (
        "memtree-checkpoints", 1, ["algorithm", "key_check"])
    root_id = bytes.fromhex(record["root_id"])
    assert len(root_id) == 16 and record["encryption"]["algorithm"] == "aes-256-gcm"
    assert record["encryption"]["key_check"] == key_fingerprint(key, root_id)
    step_meta = parse_level((tmp_path / "7" / "meta.json").read_bytes(), "7/meta.json").encryption
    assert key_matches(derive_key(key, root_id, "checkpoint step 7"), step_meta)
    for other in (derive_key(key, root_id, "checkpoint step 8"), key,
                  derive_key(key, os.urandom(16), "checkpoint step 7")):
        assert not key_matches(other, step_meta)
