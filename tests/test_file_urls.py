"""``file://`` URLs name local paths at every entry point that takes a tree location.

The rule is one function, :func:`memtree.store.reading.storage.local_path`: ``file:///abs/path`` (and
``file://localhost/abs/path``, fsspec's ``local:///abs/path``) is ``/abs/path``, as fsspec reads
it; a ``file://`` URL with a host or a relative path is refused naming the URL and the fix;
other URLs go to the remote reader where an entry point has one and are refused where it
writes or reads local files only (never a ``./s3:/...`` directory created by mistake).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import memtree
from memtree.cli.main import main
from memtree.errors import InvalidArgumentError
from memtree.store.reading.storage import is_url, local_path


@pytest.fixture(autouse=True)
def _in_empty_cwd(tmp_path, monkeypatch):
    """Run in an empty working directory: a URL taken as a relative path would show up there."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yield
    assert os.listdir(cwd) == [], "a URL was taken for a relative path"


def _tree(path) -> memtree.TensorTree:
    tree = memtree.TensorTree({"w": torch.arange(6.0).reshape(2, 3), "sub": {"b": torch.ones(3)}, "n": 1})
    tree.memmap(path)
    return tree


def _url(path) -> str:
    return "file://" + os.fspath(path)


def test_properties_have_no_wall_clock_deadline():
    """The property below takes the suite's Hypothesis profile (tests/conftest.py): an example that
    a loaded machine stalls past 250 ms must not fail it (FlakyFailure: "Unreliable test
    timings"); pytest-timeout bounds the whole test instead."""
    assert settings.default.deadline is None


@given(st.lists(st.text(st.characters(blacklist_characters="/\0"), min_size=1), min_size=0, max_size=4))
def test_a_file_url_is_the_absolute_path_after_it(parts):
    path = "/" + "/".join(parts)
    for url in ("file://" + path, "FILE://" + path, "file://localhost" + path, "local://" + path):
        assert local_path(url) == path
        assert not is_url(url)
    assert local_path(path) == path  # a path, even one with "://" further in, is left alone
    assert local_path("s3://bucket" + path) == "s3://bucket" + path


@pytest.mark.parametrize("url", ["file://data/tree", "file://host/data/tree", "file://", "file://server"])
def test_a_file_url_with_a_host_or_a_relative_path_is_refused(url):
    with pytest.raises(InvalidArgumentError, match="file:///absolute/path") as info:
        local_path(url)
    assert repr(url) in str(info.value)
    with pytest.raises(InvalidArgumentError, match="three slashes"):
        memtree.load_memmap(url)


def test_load_memmap_and_verify_read_a_file_url(tmp_path):
    tree = _tree(tmp_path / "t")
    for url in (_url(tmp_path / "t"), "file://localhost" + str(tmp_path / "t"), "local://" + str(tmp_path / "t")):
        loaded = memtree.load_memmap(url)
        assert (loaded == tree).all()
        assert loaded["w"].filename == str(tmp_path / "t" / "w.memmap")  # mapped: the local reader
        report = memtree.verify_tree(url)
        assert report.ok and report.path == str(tmp_path / "t") and report.leaves == 2
    part = memtree.load_memmap(_url(tmp_path / "t"), keys=[("sub", "b")], mmap=False)
    assert list(part.keys(include_nested=True, leaves_only=True)) == [("sub", "b")]


def test_writes_to_a_file_url_land_at_its_path(tmp_path):
    tree = memtree.TensorTree({"w": torch.randn(4, 2)})
    out = tree.memmap(_url(tmp_path / "a"))
    assert os.path.isfile(tmp_path / "a" / "meta.json") and out["w"].filename == str(tmp_path / "a" / "w.memmap")
    tree.memmap_like(_url(tmp_path / "b"))
    assert os.path.isfile(tmp_path / "b" / "w.memmap")
    memtree.save_safetensors(tree, _url(tmp_path / "m.safetensors"))
    assert torch.equal(memtree.open_checkpoint(tmp_path / "m.safetensors")["w"], tree["w"])
    memtree.save_tensordict(tree, _url(tmp_path / "td"))
    assert os.path.isfile(tmp_path / "td" / "meta.json")
    assert memtree.recover(_url(tmp_path / "a")) == []


@pytest.mark.parametrize("url", ["memory://bucket/t", "s3://bucket/t", "https://example.invalid/t"])
def test_writes_to_a_remote_url_are_refused_naming_the_fix(url):
    tree = memtree.TensorTree({"w": torch.ones(2)})
    with pytest.raises(InvalidArgumentError, match="memtree.remote.upload") as info:
        tree.memmap(url)
    assert repr(url) in str(info.value)
    for write in (lambda: tree.memmap_like(url), lambda: memtree.save_tensordict(tree, url),
                  lambda: memtree.save_safetensors(tree, url + ".safetensors"),
                  lambda: memtree.Checkpointer(url), lambda: memtree.recover(url)):
        with pytest.raises(InvalidArgumentError, match="remote URL"):
            write()


def test_checkpoint_files_modules_and_convert_take_file_urls(tmp_path):
    model = torch.nn.Linear(3, 2)
    torch.save(model.state_dict(), tmp_path / "m.pt")
    _ = memtree.TensorTree.from_module(model).memmap(tmp_path / "tree")
    ckpt = memtree.open_checkpoint(_url(tmp_path / "m.pt"))
    assert torch.equal(ckpt["weight"], model.weight.detach())
    for source in ("m.pt", "tree"):
        fresh = torch.nn.Linear(3, 2)
        result = memtree.load_into_module(fresh, _url(tmp_path / source))
        assert result.missing == [] and torch.equal(fresh.weight, model.weight)
    memtree.convert(_url(tmp_path / "m.pt"), _url(tmp_path / "conv"))
    assert torch.equal(memtree.load_memmap(tmp_path / "conv")["weight"], model.weight.detach())
    with pytest.raises(InvalidArgumentError, match="download it first"):
        memtree.open_checkpoint("s3://bucket/m.pt")


def test_checkpointer_root_given_as_a_file_url(tmp_path):
    ckpt = memtree.Checkpointer(_url(tmp_path / "ckpts"), keep_last=1)
    assert ckpt.root == str(tmp_path / "ckpts")
    ckpt.save(3, {"w": torch.ones(2)})
    assert os.path.isfile(tmp_path / "ckpts" / "3" / "meta.json")
    assert memtree.Checkpointer(_url(tmp_path / "ckpts")).latest() == 3


def test_the_cli_takes_file_urls(tmp_path, capsys):
    _tree(tmp_path / "a")
    _tree(tmp_path / "b")
    for argv in (["info", "--json"], ["verify", "--json"], ["du", "--json"]):
        assert main([*argv, _url(tmp_path / "a")]) == 0
        assert json.loads(capsys.readouterr().out)
    assert main(["diff", "--json", _url(tmp_path / "a"), _url(tmp_path / "b")]) == 0
    assert json.loads(capsys.readouterr().out)["identical"] is True
    assert main(["diff", _url(tmp_path / "a"), "s3://bucket/b"]) != 0
    assert "remote URL" in capsys.readouterr().err
