"""Attacks on encrypted trees: key misuse, one key for several trees (files moved between them),
and the load options an encrypted tree meets (keys=, device="meta", mmap=, mode=)."""

from __future__ import annotations

import shutil

import pytest
import torch

import memtree
from memtree import EncryptionKey

pytest.importorskip("cryptography")


def _tree(value=1.0):
    return memtree.TensorTree({"a": torch.full((3,), value), "b": {"c": torch.arange(4)}})


@pytest.mark.parametrize("bad", ["x" * 32, b"x" * 31, b"", b"x" * 33, 5, None, [0] * 32])
def test_an_encryption_key_of_the_wrong_type_or_length_is_refused(bad):
    with pytest.raises(memtree.InvalidArgumentError, match="32 bytes"):
        EncryptionKey(bad)


def test_a_key_made_from_a_bytearray_does_not_change_with_it(tmp_path):
    raw = bytearray(EncryptionKey.generate().to_bytes())
    key = EncryptionKey(raw)
    _tree().memmap(tmp_path / "t", encryption=key)
    raw[0] ^= 1
    assert torch.equal(memtree.load_memmap(tmp_path / "t", encryption=key)["a"], torch.ones(3))


@pytest.mark.parametrize("bad", [b"x" * 32, "secret", 0])
def test_encryption_takes_only_an_encryption_key(tmp_path, bad):
    _tree().memmap(tmp_path / "t", encryption=EncryptionKey.generate())
    with pytest.raises(memtree.InvalidArgumentError, match="EncryptionKey"):
        memtree.load_memmap(tmp_path / "t", encryption=bad)


@pytest.mark.parametrize("source", ["other tree", "other leaf"])
def test_one_key_for_several_trees_a_moved_file_fails_authentication(tmp_path, source):
    key = EncryptionKey.generate()
    _tree(1.0).memmap(tmp_path / "t", encryption=key)
    _tree(2.0).memmap(tmp_path / "u", encryption=key)
    if source == "other tree":  # same key, same leaf path, another tree's nonce material
        shutil.copy(tmp_path / "u" / "a.memmap", tmp_path / "t" / "a.memmap")
    else:  # same tree, same size, another leaf
        _tree(1.0).memmap(tmp_path / "v", encryption=key)
        memtree.TensorTree({"a": torch.ones(3), "z": torch.ones(3)}).memmap(tmp_path / "w", encryption=key)
        shutil.copy(tmp_path / "w" / "z.memmap", tmp_path / "w" / "a.memmap")
        tmp_path = tmp_path / "w"
        with pytest.raises(memtree.DecryptionError, match="fails authentication"):
            memtree.load_memmap(tmp_path, encryption=key)
        return
    with pytest.raises(memtree.DecryptionError, match="fails authentication"):
        memtree.load_memmap(tmp_path / "t", encryption=key)
    assert torch.equal(memtree.load_memmap(tmp_path / "u", encryption=key)["a"], torch.full((3,), 2.0))


def test_load_options_on_an_encrypted_tree(tmp_path):
    key = EncryptionKey.generate()
    _tree().memmap(tmp_path / "t", encryption=key)
    part = memtree.load_memmap(tmp_path / "t", encryption=key, keys=[("b", "c")])
    assert list(part.keys()) == ["b"] and torch.equal(part["b", "c"], torch.arange(4))
    meta = memtree.load_memmap(tmp_path / "t", device="meta")  # names are not encrypted: no key needed
    assert meta["a"].is_meta and meta["b", "c"].shape == (4,)
    for kwargs in ({"mmap": True}, {"mode": "r+"}):  # documented: they do not apply, data is in memory
        got = memtree.load_memmap(tmp_path / "t", encryption=key, **kwargs)
        assert type(got["a"]) is torch.Tensor and torch.equal(got["a"], torch.ones(3))
        got["a"].add_(1)  # in memory only: the file is untouched
    assert torch.equal(memtree.load_memmap(tmp_path / "t", encryption=key)["a"], torch.ones(3))
    with pytest.raises(memtree.DecryptionError, match="another key"):
        memtree.load_memmap(tmp_path / "t", encryption=EncryptionKey.generate())

