"""Remote trees and the whole-tree hash: ``upload`` writes a valid ``tree_hash``; a remote
``load_memmap(url, verify=True)`` and ``memtree verify URL`` check it as local loads do.

Over fsspec's ``memory://`` and ``file://`` filesystems and the in-test HTTP server
(``tests/remote_server.py``).
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

import fsspec  # noqa: E402
import remote_server  # noqa: E402

import memtree  # noqa: E402
from memtree import TensorTree  # noqa: E402
from memtree.cli.main import main  # noqa: E402
from memtree.remote import upload  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _tree() -> TensorTree:
    g = torch.Generator().manual_seed(1)
    return TensorTree({
        "w": torch.randn(40, 3, generator=g),
        "sub": {"b": torch.arange(7, dtype=torch.int16), "cfg": memtree.NonTensor({"lr": 0.5})},
        "obj": memtree.NonTensor({1, 2}),  # a set: pickled, and covered by the hash
    })


def _meta(fs, url: str, rel: str = "meta.json") -> dict:
    return json.loads(fs.cat(f"{url}/{rel}"))


def _tamper_cfg(fs, url: str) -> None:
    """Change a JSON value of a sub-level consistently: every leaf still matches its checksum."""
    doc = _meta(fs, url, "sub/meta.json")
    (entry,) = [e for e in doc["entries"] if e["key"] == "cfg"]
    entry["value"] = {"lr": 5.0}
    fs.pipe_file(f"{url}/sub/meta.json", json.dumps(doc, separators=(",", ":")).encode())


@pytest.fixture(params=["memory", "file"])
def url(request, tmp_path):
    """Where to upload: an in-memory fsspec URL, or a ``file://`` URL (which memtree's readers
    take as the local directory it names, mapped: ``store.reading.storage.local_path``)."""
    if request.param == "memory":
        base = "memory://memtree-tree-hash/" + request.node.name.replace("[", "-").replace("]", "")
        yield base
        fs = fsspec.filesystem("memory")
        if fs.exists(base):
            fs.rm(base, recursive=True)
    else:
        yield f"file://{tmp_path}/remote"


@pytest.mark.parametrize("checksum", ["crc32", "sha256"])
def test_uploaded_tree_hash_is_the_one_a_local_writer_would_check(url, tmp_path, checksum):
    tree = _tree()
    upload(tree, url, allow_pickle=True, checksum=checksum)
    fs, path = fsspec.core.url_to_fs(url)
    root = _meta(fs, path)
    assert root["version"] == 2 and root["tree_hash"].startswith(f"{checksum}:")
    # a local copy of the uploaded objects passes the local check, and the remote one too
    fs.get(path, str(tmp_path / "copy"), recursive=True)
    local = memtree.load_memmap(str(tmp_path / "copy"), verify=True, allow_pickle=True)
    remote = memtree.load_memmap(url, verify=True, allow_pickle=True)
    for got in (local, remote):
        assert torch.equal(got["w"], tree["w"]) and got["obj"] == {1, 2} and got["sub", "cfg"] == {"lr": 0.5}
    report = memtree.verify_tree(url)
    assert report.ok and report.tree_hash == "ok"
    assert main(["verify", url]) == 0


def test_a_consistent_edit_of_a_meta_json_fails_verify_true_and_memtree_verify(url, capsys):
    upload(_tree(), url, allow_pickle=True)
    fs, path = fsspec.core.url_to_fs(url)
    _tamper_cfg(fs, path)
    assert memtree.load_memmap(url, allow_pickle=True)["sub", "cfg"] == {"lr": 5.0}  # no check asked
    with pytest.raises(memtree.IntegrityError, match="tree_hash"):
        memtree.load_memmap(url, verify=True, allow_pickle=True)
    with pytest.raises(memtree.IntegrityError, match="tree_hash"):  # a selection elsewhere: every level counts
        memtree.load_memmap(url, keys=["w"], verify=True)
    report = memtree.verify_tree(url)
    assert not report.ok and report.tree_hash == "mismatch"
    capsys.readouterr()
    assert main(["verify", "--json", url]) == 1
    assert json.loads(capsys.readouterr().out)["tree_hash"] == "mismatch"


def test_a_changed_pickle_fails_the_tree_hash(url):
    upload(_tree(), url, allow_pickle=True)
    fs, path = fsspec.core.url_to_fs(url)
    (name,) = [e["file"] for e in _meta(fs, path)["entries"] if e["kind"] == "pickle"]
    import pickle

    fs.pipe_file(f"{path}/{name}", pickle.dumps({1, 2, 3}))
    with pytest.raises(memtree.IntegrityError, match="tree_hash"):
        memtree.load_memmap(url, verify=True, allow_pickle=True)


def test_upload_without_checksums_writes_no_tree_hash(url):
    upload(TensorTree({"x": torch.ones(3)}), url, checksum=None)
    fs, path = fsspec.core.url_to_fs(url)
    assert "tree_hash" not in _meta(fs, path)
    assert memtree.load_memmap(url, verify=True)["x"].tolist() == [1.0, 1.0, 1.0]


def test_replacing_upload_gets_a_new_valid_hash(url):
    upload(_tree(), url, allow_pickle=True)
    fs, path = fsspec.core.url_to_fs(url)
    first = _meta(fs, path)["tree_hash"]
    upload(TensorTree({"x": torch.zeros(2)}), url, existsok=True)
    assert _meta(fs, path)["tree_hash"] != first
    assert memtree.verify_tree(url).tree_hash == "ok"


@pytest.fixture(scope="module")
def server():
    srv, _ = remote_server.start()
    yield srv
    remote_server.stop(srv)


def test_http_verify_checks_the_tree_hash_and_cache_hits_stay_loadable(server, tmp_path):
    server.reset()
    server.files.clear()
    tree = _tree()
    tree.memmap(str(tmp_path / "src"), allow_pickle=True)
    server.publish(str(tmp_path / "src"), "t")
    url = f"{server.url}/t"
    cache = str(tmp_path / "cache")
    got = memtree.load_memmap(url, verify=True, allow_pickle=True, cache_dir=cache, keys=["w", "obj"])
    assert torch.equal(got["w"], tree["w"])
    # the cache entry (a selection, its own meta.json files) is reused with verify=True
    again = memtree.load_memmap(url, verify=True, allow_pickle=True, cache_dir=cache, keys=["w", "obj"])
    assert torch.equal(again["w"], tree["w"])
    assert main(["verify", url]) == 0
    doc = json.loads(server.files["/t/sub/meta.json"])
    for e in doc["entries"]:
        if e["key"] == "cfg":
            e["value"] = {"lr": 9}
    server.files["/t/sub/meta.json"] = json.dumps(doc, separators=(",", ":")).encode()
    with pytest.raises(memtree.IntegrityError, match="tree_hash"):
        memtree.load_memmap(url, verify=True, allow_pickle=True)
    assert main(["verify", url]) == 1
