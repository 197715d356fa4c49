"""The command line beyond memtree directories, and without torch where it can.

* ``memtree info DIR`` and ``import memtree`` import no torch (fresh interpreters: the point is
  the process), and every public name still loads (``from memtree import X``, ``memtree.X``);
* ``memtree info`` on a ``torch.save`` file, a safetensors file, shard indexes and a model
  directory, a tensordict directory, a checkpoint root and URLs (a ``memory://`` tree and the
  in-test HTTP server of ``tests/remote_server.py``); hostile inputs: a pickle that would run a
  command (it is refused, never run), a truncated safetensors header, a server answering garbage;
* ``memtree verify`` on URLs (clean, a flipped byte, a short object, garbage);
* ``--json`` on every command, errors as ``{"error": ...}``, the exit codes; the progress bar of
  a remote download (never on ``--json``).
"""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import torch

import memtree
from memtree import TensorTree
from memtree.cli import main
from memtree.cli.main import COMMANDS

REPO = Path(__file__).resolve().parent.parent


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=env)


def cli_json(*argv: str, code: int = 0) -> dict[str, Any]:
    out = io.StringIO()
    with redirect_stdout(out):
        assert main([*argv, "--json"]) == code, out.getvalue()
    doc = json.loads(out.getvalue())
    assert isinstance(doc, dict)
    return doc


@pytest.fixture
def tree_dir(tmp_path: Path) -> Path:
    d = tmp_path / "tree"
    TensorTree({"w": torch.arange(6.0).reshape(2, 3), "opt": {"step": torch.tensor(3), "lr": 0.1}}).memmap(
        d, checksum="crc32"
    )
    return d


# -- no torch -----------------------------------------------------------------------------------


def test_info_on_a_tree_imports_no_torch(tree_dir: Path) -> None:
    proc = run_python(
        "import sys\n"
        "from memtree.cli import main\n"
        f"code = main(['info', {str(tree_dir)!r}])\n"
        f"code2 = main(['info', {str(tree_dir)!r}, '--json'])\n"
        "print('EXIT', code, code2, 'torch' in sys.modules)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "EXIT 0 0 False", proc.stdout
    assert "float32" in proc.stdout and '"kind": "memtree"' in proc.stdout


def test_python_m_memtree_info_imports_no_torch(tree_dir: Path) -> None:
    """What ``python -m memtree info DIR`` imports, seen from inside that process."""
    proc = run_python(
        "import runpy, sys\n"
        f"sys.argv = ['memtree', 'info', {str(tree_dir)!r}]\n"
        "try:\n"
        "    runpy.run_module('memtree', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    print('EXIT', e.code, 'torch' in sys.modules)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "EXIT 0 False", proc.stdout


def test_import_memtree_is_lazy_and_every_public_name_loads() -> None:
    proc = run_python(
        "import sys, memtree\n"
        "print('torch' in sys.modules)\n"
        "assert set(memtree.__all__) <= set(dir(memtree))\n"
        "t = memtree.TensorTree({'x': memtree.NonTensor(1)})\n"
        "print('torch' in sys.modules, type(t).__name__)\n"
        "from memtree import load_memmap, verify_tree, MemtreeError, remote, dcp\n"
        "missing = [n for n in memtree.__all__ if getattr(memtree, n, None) is None]\n"
        "print(missing)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:3] == ["False", "True TensorTree", "[]"], proc.stdout


def test_lazy_names_are_the_defining_modules_objects() -> None:
    from memtree.store.verify import verify_tree
    from memtree.tree.tensortree import TensorTree as Defined

    assert memtree.TensorTree is Defined and memtree.verify_tree is verify_tree
    assert {n: getattr(memtree, n) for n in memtree.__all__}  # every name resolves
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        memtree.nope  # noqa: B018


def test_dtype_table_agrees_with_torch() -> None:
    from memtree.format.dtypes import DTYPE_ITEMSIZES, dtype_from_name

    for name, size in DTYPE_ITEMSIZES.items():
        dt = dtype_from_name(name)
        if dt is not None:
            assert dt.itemsize == size, name


# -- info on other sources ----------------------------------------------------------------------


def test_info_torch_save_file(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torch.save({"model": {"w": torch.ones(2, 3, dtype=torch.bfloat16)}, "epoch": 7}, path)
    doc = cli_json("info", str(path))
    assert doc["kind"] == "checkpoint" and doc["format"] == "torch" and doc["files"] == ["model.pt"]
    assert [(e["key"], e["kind"]) for e in doc["entries"]] == [(["model.w"], "tensor"), (["epoch"], "json")]
    assert doc["entries"][0] | {} == {"key": ["model.w"], "kind": "tensor", "dtype": "bfloat16", "shape": [2, 3],
                                      "nbytes": 12, "file": None, "checksum": None}
    assert doc["entries"][1]["value"] == 7 and doc["totals"]["bytes"] == 12


def test_info_torch_save_values_json_cannot_hold_are_labelled_by_their_type(tmp_path: Path) -> None:
    """Before, a set or a torch.device showed as ``json`` with its repr, as if JSON held it."""
    path = tmp_path / "cfg.pt"
    cfg = {1: (2, 3), "b": b"xy", "c": 1 + 2j, "sz": torch.Size([2]), "s": {4}, "dev": torch.device("cpu")}
    torch.save({"w": torch.ones(1), "cfg": cfg}, path)
    doc = cli_json("info", str(path))
    values = {e["key"][0]: (e["kind"], e.get("type"), e["value"]) for e in doc["entries"] if e["kind"] != "tensor"}
    assert values == {
        "cfg.1": ("json", None, [2, 3]),
        "cfg.b": ("value", "bytes", "b'xy'"),
        "cfg.c": ("value", "complex", "(1+2j)"),
        "cfg.sz": ("value", "torch.Size", "torch.Size([2])"),
        "cfg.s": ("value", "set", "{4}"),
        "cfg.dev": ("value", "torch.device", "device(type='cpu')"),
    }
    assert doc["totals"]["json_values"] == 1 and doc["totals"]["python_values"] == 5
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["info", str(path)]) == 0
    rows = {line.split()[1]: line.split(maxsplit=3)[2:] for line in out.getvalue().splitlines()[1:-1]}
    assert rows["cfg.s"] == ["set", "{4}"] and rows["cfg.dev"] == ["torch.device", "device(type='cpu')"]
    assert rows["cfg.1"] == ["json", "[2,3]"]
    assert "1 JSON value, 5 Python values" in out.getvalue()


def test_info_torch_save_with_a_malicious_pickle_refuses_and_runs_nothing(tmp_path: Path, capsys) -> None:
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "hook": Evil()}, path)
    assert main(["info", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("memtree: error: ") and str(path) in err and "system" in err
    doc = cli_json("info", str(path), code=1)
    assert doc["error"]["type"] == "UnsafePickleError"
    assert not marker.exists()


def test_info_safetensors_file_and_truncated_header(tmp_path: Path, capsys) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "m.safetensors"
    save_file({"a.w": torch.zeros(4, 4), "b": torch.ones(3, dtype=torch.int8)}, str(path), metadata={"k": "v"})
    doc = cli_json("info", str(path))
    assert doc["format"] == "safetensors" and doc["metadata"] == {"k": "v"}
    assert {tuple(e["key"]): (e["dtype"], e["shape"]) for e in doc["entries"]} == {
        ("a.w",): ("float32", [4, 4]), ("b",): ("int8", [3])}
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    for cut in (4, 8 + n // 2, 8 + n - 1):
        bad = tmp_path / f"cut{cut}.safetensors"
        bad.write_bytes(data[:cut])
        assert main(["info", str(bad)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("memtree: error: ") and str(bad) in err and "Traceback" not in err


def test_info_hf_index_and_model_directory(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model = tmp_path / "model"
    model.mkdir()
    save_file({"a": torch.ones(2)}, str(model / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.ones(3, dtype=torch.float16)}, str(model / "model-00002-of-00002.safetensors"))
    index = {"metadata": {"total_size": 14},
             "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    for source in (model, model / "model.safetensors.index.json"):
        doc = cli_json("info", str(source))
        assert doc["kind"] == "checkpoint" and doc["totals"] == {**doc["totals"], "tensors": 2, "bytes": 14}
        assert sorted(doc["files"]) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    bins = tmp_path / "bins"
    bins.mkdir()
    torch.save({"x": torch.ones(5)}, bins / "pytorch_model-1.bin")
    (bins / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"x": "pytorch_model-1.bin"}}))
    doc = cli_json("info", str(bins / "pytorch_model.bin.index.json"))
    assert doc["format"] == "torch" and [e["key"] for e in doc["entries"]] == [["x"]]
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["info", str(model)]) == 0
    assert "safetensors checkpoint in 2 files" in out.getvalue()


def test_info_tensordict_directory(tmp_path: Path) -> None:
    tensordict = pytest.importorskip("tensordict")
    td = tensordict.TensorDict({"obs": torch.zeros(4, 2), "nested": {"r": torch.ones(4)}}, batch_size=[4])
    td.memmap(str(tmp_path / "td"))
    doc = cli_json("info", str(tmp_path / "td"))
    assert doc["kind"] == "tensordict" and doc["batch_size"] == [4]
    assert {tuple(e["key"]) for e in doc["entries"] if e["kind"] == "tensor"} == {("obs",), ("nested", "r")}


def test_info_checkpoint_root(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    for step in (100, 20, 3):
        TensorTree({"w": torch.zeros(step)}).memmap(root / str(step))
    (root / "007").mkdir()  # padded: not a step
    (root / ".staging-300").mkdir()  # a staging directory: not a step
    (root / "LOCK").write_text("")
    (root / "400").mkdir()  # no meta.json: not a step (Checkpointer.steps()'s rule), listed as ignored
    doc = cli_json("info", str(root))
    assert doc["kind"] == "checkpoint-root" and doc["latest"] == 100
    assert [(s["step"], s["ok"], s["bytes"]) for s in doc["steps"]] == [
        (3, True, 12), (20, True, 80), (100, True, 400)]
    assert [i["name"] for i in doc["ignored"]] == ["400"] and "meta.json" in doc["ignored"][0]["reason"]
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["info", str(root)]) == 0
    text = out.getvalue()
    assert "checkpoint root, 3 steps, latest 100, 1 ignored" in text and "(latest)" in text and "ignored 400:" in text


def test_info_checkpoint_root_counts_what_hard_links_share(tmp_path: Path) -> None:
    from memtree.cli.du import disk_usage
    from memtree.store.reading.options import WriteOptions
    from memtree.store.writing.write import write_tree

    root = tmp_path / "ckpts"
    big = torch.arange(4096.0)
    write_tree(root / "1", memtree.format.level.Level((), {"w": big, "b": torch.zeros(4)}))
    write_tree(root / "2", memtree.format.level.Level((), {"w": big, "b": torch.ones(4)}),
               WriteOptions.of(link_from=root / "1"))
    doc = cli_json("info", str(root))
    du = disk_usage(root)
    assert doc["disk"] == {"apparent_bytes": du.apparent_bytes, "allocated_bytes": du.allocated_bytes,
                           "linked_bytes": du.linked_bytes}
    assert doc["disk"]["linked_bytes"] == big.numel() * 4  # w is one file with two names
    assert [s["disk"]["shared_bytes"] for s in doc["steps"]] == [big.numel() * 4] * 2
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["info", str(root)]) == 0
    assert "16.0 KiB shared by hard links between steps" in out.getvalue()


@pytest.mark.parametrize("sealed", [False, True])
def test_info_on_an_encrypted_tree_says_so_and_what_is_hidden(tmp_path: Path, sealed: bool) -> None:
    pytest.importorskip("cryptography")
    d = tmp_path / "enc"
    TensorTree({"w": torch.ones(8), "sub": {"b": torch.zeros(2)}}).memmap(
        d, encryption=memtree.EncryptionKey.generate(), encrypt_names=sealed)
    doc = cli_json("info", str(d))
    files = [f for _, _, names in os.walk(d) for f in names]
    enc = doc["encryption"]
    assert enc["algorithm"] == "aes-256-gcm" and enc["names_sealed"] is sealed
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["info", str(d)]) == 0
    text = out.getvalue()
    assert "encrypted (aes-256-gcm" in text
    if sealed:
        assert enc["hidden"]["files"] == len(files) == 4  # 2 meta.json, 2 leaves
        assert "names sealed" in text and "0 tensors" not in text and "4 files" in text
    else:
        assert enc["hidden"] is None and doc["totals"]["tensors"] == 2 and "2 tensors" in text
    TensorTree({"x": torch.ones(1)}).memmap(tmp_path / "plain")
    assert cli_json("info", str(tmp_path / "plain"))["encryption"] is None
    (tmp_path / "root").mkdir()
    os.rename(d, tmp_path / "root" / "7")  # the tree as a step of a checkpoint root
    (step,) = cli_json("info", str(tmp_path / "root"))["steps"]
    assert step["ok"] and step.get("sealed", False) is sealed
    assert (step["tensors"], step["bytes"]) == ((None, None) if sealed else (2, 40))


def test_info_of_something_else_is_a_clear_error(tmp_path: Path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    for source in (tmp_path / "empty", tmp_path / "notes.txt", tmp_path / "missing"):
        assert main(["info", str(source)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("memtree: error: ") and str(source) in err
        assert cli_json("info", str(source), code=1)["error"]["message"]


# -- fuzz: whatever the bytes, a clean exit 0 or 1 -------------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _exit_code(argv: list[str]) -> int:
    out, err = io.StringIO(), io.StringIO()
    from contextlib import redirect_stderr

    with redirect_stdout(out), redirect_stderr(err):
        code = main(argv)
    if code == 1 and "--json" not in argv:
        assert err.getvalue().startswith("memtree: error: ") and err.getvalue().count("\n") == 1
    return code


@FUZZ
@given(head=st.sampled_from([b"", b"PK\x03\x04", struct.pack("<Q", 30) + b'{"a":', b"\x80\x02"]),
       body=st.binary(max_size=300))
def test_fuzz_info_on_a_file_of_random_bytes(tmp_path: Path, head: bytes, body: bytes) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(head + body)
    assert _exit_code(["info", str(path)]) in (0, 1)
    assert _exit_code(["info", str(path), "--json"]) in (0, 1)


@FUZZ
@given(data=st.data())
def test_fuzz_info_and_verify_on_a_mutated_meta_json(tree_dir: Path, data: st.DataObject) -> None:
    meta = tree_dir / "opt" / "meta.json"
    original = meta.read_bytes()
    at = data.draw(st.integers(0, len(original) - 1))
    kind = data.draw(st.sampled_from(["flip", "cut", "insert"]))
    if kind == "flip":
        mutated = original[:at] + bytes([original[at] ^ data.draw(st.integers(1, 255))]) + original[at + 1:]
    elif kind == "cut":
        mutated = original[:at]
    else:
        mutated = original[:at] + data.draw(st.binary(min_size=1, max_size=8)) + original[at:]
    meta.write_bytes(mutated)
    try:
        assert _exit_code(["info", str(tree_dir), "--json"]) in (0, 1)
        assert _exit_code(["verify", str(tree_dir), "--json"]) in (0, 1)
    finally:
        meta.write_bytes(original)


# -- URLs ---------------------------------------------------------------------------------------

fsspec = pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")
import remote_server  # noqa: E402


@pytest.fixture(scope="module")
def server():
    srv, _ = remote_server.start()
    yield srv
    remote_server.stop(srv)


@pytest.fixture
def published(server, tree_dir: Path) -> str:
    server.reset()
    server.files.clear()
    server.publish(str(tree_dir), "t")
    return f"{server.url}/t"


def test_info_and_verify_of_a_url_equal_the_local_ones(published: str, tree_dir: Path) -> None:
    local, remote = cli_json("info", str(tree_dir)), cli_json("info", published)
    assert remote["path"] == published and remote["kind"] == "memtree"
    assert {k: v for k, v in remote.items() if k != "path"} == {k: v for k, v in local.items() if k != "path"}
    report = cli_json("verify", published)
    assert report["ok"] and report["leaves"] == 2 and report["checksummed"] == 2


def test_verify_url_finds_a_flipped_byte_and_a_short_object(server, published: str) -> None:
    leaf = "/t/w.memmap"
    data = bytearray(server.files[leaf])
    data[5] ^= 0x01
    server.files[leaf] = bytes(data)
    server.files["/t/opt/step.memmap"] = b"\0" * 3
    report = cli_json("verify", published, code=1)
    kinds = {tuple(p["key"]): p["kind"] for p in report["problems"]}
    assert kinds == {("w",): "checksum", ("opt", "step"): "size"}
    assert all(p["path"].startswith(published) for p in report["problems"])


@pytest.mark.parametrize("garbage", [b"<html>not found</html>", b'{"format": "memtree"}', b"\0" * 100])
def test_info_and_verify_of_a_url_answering_garbage(server, published: str, garbage: bytes, capsys) -> None:
    server.files["/t/meta.json"] = garbage
    assert main(["info", published]) == 1
    err = capsys.readouterr().err
    assert err.startswith("memtree: error: ") and "Traceback" not in err and "meta.json" in err
    report = cli_json("verify", published, code=1)
    assert report["problems"] and {p["kind"] for p in report["problems"]} <= {"meta", "version"}


def test_info_of_a_url_without_a_tree(server, published: str) -> None:
    doc = cli_json("info", f"{server.url}/nothing-here", code=1)
    assert doc["error"]["type"] in ("NotAMemtreeError", "NotCommittedError")


def test_memory_url_info(tree_dir: Path) -> None:
    from memtree.remote import upload

    upload(memtree.load_memmap(tree_dir), "memory://cli-sources/t")
    doc = cli_json("info", "memory://cli-sources/t")
    assert [e["key"] for e in doc["entries"]] == [["w"], ["opt"], ["opt", "lr"], ["opt", "step"]] or \
        [e["key"] for e in doc["entries"]] == [["w"], ["opt"], ["opt", "step"], ["opt", "lr"]]
    assert cli_json("verify", "memory://cli-sources/t")["ok"]


def test_remote_download_progress_bar(published: str, capsys) -> None:
    pytest.importorskip("tqdm")
    tree = memtree.load_memmap(published, progress=True)
    assert tree["w"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert "download" in capsys.readouterr().err
    memtree.load_memmap(published, progress=False)
    assert "download" not in capsys.readouterr().err


def test_verify_json_never_shows_a_progress_bar(published: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "memtree", "verify", published, "--json"],
                          capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["ok"] and proc.stderr == ""


# -- every command: --json and the exit codes ----------------------------------------------------


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_takes_json(name: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--help"])
    assert exit_info.value.code == 0
    assert "--json" in capsys.readouterr().out


def test_usage_error_is_exit_2(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["verify"])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit) as exit_info:
        main(["no-such-command"])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


# -- the first hour: verify/diff without torch, routed torch.save files, encrypted trees -----------


def test_verify_and_diff_of_trees_import_no_torch(tree_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    TensorTree({"w": torch.zeros(2, 3), "opt": {"step": torch.tensor(3), "lr": 0.1}}).memmap(other, checksum="crc32")
    proc = run_python(
        "import sys\n"
        "from memtree.cli import main\n"
        f"code = main(['verify', {str(tree_dir)!r}])\n"
        f"code2 = main(['diff', {str(tree_dir)!r}, {str(other)!r}])\n"
        "print('EXIT', code, code2, 'torch' in sys.modules)\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "EXIT 0 1 False", proc.stdout
    assert "OK " in proc.stdout and "1 changed" in proc.stdout


def test_info_describes_a_file_torch_save_wrote_under_memtree_saving(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    with memtree.saving():
        torch.save({"model": {"w": torch.ones(2, 3, dtype=torch.bfloat16)}, "epoch": 7}, path)
    doc = cli_json("info", str(path))
    assert doc["format"] == "torch" and doc["totals"]["tensors"] == 1
    [tensor] = [e for e in doc["entries"] if e["kind"] == "tensor"]
    assert tensor["key"] == ["model.w"] and tensor["dtype"] == "bfloat16" and tensor["shape"] == [2, 3]
    assert [e["value"] for e in doc["entries"] if e["kind"] == "json"] == [7]


def test_a_routed_file_read_outside_memtree_loading_names_the_way_to_load_it(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    with memtree.saving():
        torch.save({"w": torch.arange(4.0)}, path)
    with memtree.open_checkpoint(path) as ckpt:  # no UnsafePickleError: memtree's own reference
        assert ckpt.tensor_spec("w") == (torch.Size([4]), torch.float32)
        with pytest.raises(memtree.RoutingError, match=r"memtree\.saving\(\).*model\.pt\.memtree/.*memtree\.loading\(\)"):
            ckpt["w"]
    with memtree.loading():
        assert torch.equal(torch.load(path)["w"], torch.arange(4.0))


@pytest.mark.parametrize("sealed", [False, True])
def test_verify_of_an_encrypted_tree_without_its_key_says_what_was_not_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], sealed: bool
) -> None:
    pytest.importorskip("cryptography")
    d = tmp_path / "enc"
    key = memtree.EncryptionKey.generate()
    TensorTree({"w": torch.ones(3), "s": {"b": torch.zeros(2)}}).memmap(d, encryption=key, encrypt_names=sealed)
    doc = cli_json("verify", str(d))
    assert doc["ok"] and doc["encrypted"] and doc["sealed"] is sealed
    assert doc["leaves"] == (0 if sealed else 2)
    assert main(["verify", str(d)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("OK ")
    if sealed:
        assert "sealed names: without the key no key, sub-tree or leaf below the root is listed or checked" in line
    else:
        assert "nothing decrypted or authenticated without the key" in line
    assert "encryption=key, verify=True" in line
    plain = tmp_path / "plain"
    TensorTree({"w": torch.ones(3)}).memmap(plain)
    assert cli_json("verify", str(plain))["encrypted"] is False


@pytest.mark.parametrize(
    "args",
    [("../../etc", "0", "float32", "cpu"), ("a/b", "0", "float32", "cpu"), ("e", "../0", "float32", "cpu"),
     ("e", "0", "os.system", "cpu"), ("e", 0, "float32", "cpu"), ("e", "0", "float32", None)],
)
def test_a_hostile_routed_reference_is_refused_and_runs_nothing(tmp_path: Path, args: tuple[object, ...]) -> None:
    import memtree.routing

    class Reference:
        def __reduce__(self) -> tuple[object, ...]:
            return (memtree.routing._routed_storage, args)

    path = tmp_path / "hostile.pt"
    torch.save({"x": Reference(), "w": torch.ones(2)}, path)
    with pytest.raises(memtree.CheckpointFormatError, match="routed by memtree.saving"):
        memtree.open_checkpoint(path)
