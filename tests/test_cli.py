"""The ``memtree`` command line: exit codes (0 ok, 1 failure, 2 usage), one-line errors without
tracebacks, ``info`` text and ``--json`` output, and help for every registered command.

End-to-end behaviour runs ``python -m memtree`` (and the ``memtree`` console script) in a
subprocess; help texts and text rendering details run in-process through ``cli.main``.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import memtree
from memtree import NonTensor, TensorTree
from memtree.cli import main as cli_main
from memtree.cli.main import COMMANDS as COMMAND_MODULES

COMMANDS = [importlib.import_module(f"memtree.cli.{m}") for m in COMMAND_MODULES.values()]
from memtree.store.primitives.checksums import default_checksum, tensor_checksum

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args: str, exe: list[str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        (exe or [sys.executable, "-m", "memtree"]) + list(args),
        capture_output=True, text=True, timeout=180, env=env, cwd=cwd,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("memtree: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert proc.stdout == ""


@pytest.fixture
def sample(tmp_path: Path) -> Path:
    tree = TensorTree(
        {
            "obs": torch.zeros(4, 3),
            "nested": {"x": torch.arange(4), "deep": {"b": torch.zeros(4, 2, dtype=torch.bfloat16)}},
            "name": "hello",
        },
        batch_size=[4],
    )
    tree.memmap(tmp_path / "ckpt")
    return tmp_path / "ckpt"


# ------------------------------------------------------------------------------------ info


@pytest.mark.slow
def test_info_prints_keys_dtypes_shapes_sizes_totals_and_version(sample: Path) -> None:
    proc = run_cli("info", str(sample))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    out = proc.stdout
    assert "memtree format v2" in out.splitlines()[0]
    assert "batch_size [4]" in out.splitlines()[0]
    for fragment in ("obs", "float32", "[4, 3]", "48 B", "nested/", "x", "int64", "32 B",
                     "deep/", "bfloat16", "[4, 2]", "16 B", "name", '"hello"'):
        assert fragment in out, fragment
    assert "3 tensors (96 B) in 3 levels, 1 JSON value" in out


def test_info_json_is_parseable_and_matches_the_tree(sample: Path) -> None:
    proc = run_cli("info", str(sample), "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["format"] == "memtree" and info["version"] == 2
    assert info["path"] == str(sample.resolve())
    assert info["batch_size"] == [4]
    by_key = {tuple(e["key"]): e for e in info["entries"]}
    assert list(by_key) == [("obs",), ("nested",), ("nested", "x"), ("nested", "deep"),
                            ("nested", "deep", "b"), ("name",)]
    assert by_key[("obs",)] == {"key": ["obs"], "kind": "tensor", "dtype": "float32", "shape": [4, 3],
                                "nbytes": 48, "file": "obs.memmap",
                                "checksum": tensor_checksum(torch.zeros(4, 3), default_checksum())}
    assert by_key[("nested", "deep")]["kind"] == "tree"
    assert by_key[("nested", "deep")]["batch_size"] == [4]
    assert by_key[("name",)] == {"key": ["name"], "kind": "json", "value": "hello"}
    for e in info["entries"]:
        if e["kind"] == "tensor":  # the recorded file exists and has the reported size
            assert (sample / e["file"]).stat().st_size == e["nbytes"]
    t = info["totals"]
    assert (t["tensors"], t["bytes"], t["levels"], t["json_values"]) == (3, 96, 3, 1)
    assert t["dtypes"] == {"bfloat16": {"tensors": 1, "bytes": 16}, "float32": {"tensors": 1, "bytes": 48},
                           "int64": {"tensors": 1, "bytes": 32}}


def test_info_of_a_missing_directory_is_one_line_exit_1(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "tree"
    proc = run_cli("info", str(missing))
    assert_one_line_error(proc, str(missing), "does not exist")


def test_info_of_a_directory_that_is_not_a_memtree(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "stray.txt").write_text("x")
    assert cli_main(["info", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert_one_line_error(subprocess.CompletedProcess([], 1, captured.out, captured.err),
                          str(tmp_path), "meta.json", "not a memtree directory")


@pytest.mark.parametrize("damage", ["garbage_root_meta", "future_version", "missing_subtree_meta"])
def test_info_of_a_corrupt_directory_names_the_file_and_exits_1(
    sample: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if damage == "garbage_root_meta":
        bad = sample / "meta.json"
        bad.write_bytes(b'{"format": "memtree", "version": 1, "entr')
        expected = [str(bad), "not valid UTF-8 JSON"]
    elif damage == "future_version":
        bad = sample / "nested" / "meta.json"
        doc = json.loads(bad.read_bytes())
        doc["version"] = 99
        bad.write_text(json.dumps(doc))
        expected = [str(bad), "version 99", "upgrade memtree"]
    else:
        bad = sample / "nested" / "deep" / "meta.json"
        bad.unlink()
        expected = [str(bad), "missing"]
    if damage == "garbage_root_meta":  # end to end once; the other cases in-process (faster)
        assert_one_line_error(run_cli("info", str(sample)), *expected)
        return
    assert cli_main(["info", str(sample)]) == 1
    captured = capsys.readouterr()
    assert_one_line_error(subprocess.CompletedProcess([], 1, captured.out, captured.err), *expected)


def test_info_refuses_an_uncommitted_staging_directory(sample: Path, capsys: pytest.CaptureFixture[str]) -> None:
    staging = sample.parent / f".ckpt.memtree-tmp-{'ab' * 16}"
    shutil.copytree(sample, staging)
    assert cli_main(["info", str(staging)]) == 1
    captured = capsys.readouterr()
    assert_one_line_error(subprocess.CompletedProcess([], 1, captured.out, captured.err),
                          str(staging), "staging directory", "memtree.recover()")


def test_info_reads_no_leaf_file(sample: Path) -> None:
    (sample / "obs.memmap").unlink()  # damage only `verify` or `load_memmap` would notice
    (sample / "nested" / "x.memmap").write_bytes(b"short")
    out = io_main(["info", str(sample), "--json"])
    assert {tuple(e["key"]) for e in json.loads(out)["entries"]} >= {("obs",), ("nested", "x")}


class _Boom:
    """Unpickling this would create a marker file: info must never unpickle."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (open, (self.marker, "w"))


@pytest.mark.slow
def test_info_lists_pickled_values_without_unpickling_them(tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    tree = TensorTree({"w": torch.ones(2), "obj": NonTensor({1, 2, 3})})
    tree.memmap(tmp_path / "t", allow_pickle=True)
    (pickle_file,) = (tmp_path / "t").glob("*.pickle")
    pickle_file.write_bytes(pickle.dumps(_Boom(str(marker))))
    proc = run_cli("info", str(tmp_path / "t"))
    assert proc.returncode == 0, proc.stderr
    assert "pickle" in proc.stdout and pickle_file.name in proc.stdout
    assert "1 pickled value" in proc.stdout
    assert not marker.exists()


@pytest.mark.slow
def test_info_survives_a_closed_pipe(tmp_path: Path) -> None:
    TensorTree({f"k{i:04d}": torch.zeros(1) for i in range(1500)}).memmap(tmp_path / "t", num_threads=2)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    with subprocess.Popen([sys.executable, "-m", "memtree", "info", str(tmp_path / "t"), "--json"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline().strip() == b"{"  # like `| head -1`: read one line, hang up
        proc.stdout.close()
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=180) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def io_main(argv: list[str]) -> str:
    """Run ``cli.main`` in-process and return its standard output (asserting exit code 0)."""
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli_main(argv)
    assert code == 0
    return buf.getvalue()


def test_info_describes_a_tensordict_directory_like_load_memmap_reads_it() -> None:
    fixture = REPO / "tests" / "fixtures" / "tensordict_mmap_example"
    info = json.loads(io_main(["info", str(fixture), "--json"]))
    assert (info["format"], info["version"], info["batch_size"]) == ("tensordict", None, [2, 1])
    kinds = {tuple(e["key"]): (e["kind"], e.get("dtype"), e.get("shape")) for e in info["entries"]}
    assert kinds == {
        ("nested",): ("tree", None, None),
        ("nested", "int64"): ("tensor", "int64", [2, 1]),
        ("nested", "bfloat16"): ("tensor", "bfloat16", [2, 1]),
        ("nested", "string"): ("json", None, None),
    }
    assert info["totals"]["bytes"] == 2 * 8 + 2 * 2
    text = io_main(["info", str(fixture)])
    assert "tensordict directory" in text.splitlines()[0]


def test_verify_checks_a_tensordict_directory_like_load_memmap_reads_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`memtree verify` refused every tensordict directory that `info` and `load_memmap` read."""
    fixture = REPO / "tests" / "fixtures" / "tensordict_mmap_example"
    assert cli_main(["verify", str(fixture)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"OK {fixture} (tensordict directory): 2 leaves")
    assert json.loads(io_main(["verify", "--json", str(fixture)]))["layout"] == "tensordict"
    damaged = tmp_path / "td"
    shutil.copytree(fixture, damaged)
    os.truncate(damaged / "nested" / "int64.memmap", 3)
    assert cli_main(["verify", str(damaged)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"BAD {damaged / 'nested' / 'int64.memmap'} [key nested/int64] size: ")
    assert lines[-1].startswith(f"FAILED {damaged} (tensordict directory): 2 leaves") and "1 problem(s)" in lines[-1]


def test_info_shows_the_capacity_of_growable_leaves(tmp_path: Path) -> None:
    buf = TensorTree({"obs": torch.zeros(0, 4)}, batch_size=[0]).memmap(tmp_path / "buf")
    for _ in range(5):
        buf.append_({"obs": torch.ones(4)})
    info = json.loads(io_main(["info", str(tmp_path / "buf"), "--json"]))
    (leaf,) = info["entries"]
    assert (leaf["shape"], leaf["nbytes"]) == ([5, 4], 80)
    assert leaf["file_nbytes"] == leaf["capacity"] * 16 == (tmp_path / "buf" / leaf["file"]).stat().st_size
    assert leaf["capacity"] >= 5
    assert f"(file: {leaf['capacity']} rows" in io_main(["info", str(tmp_path / "buf")])


def test_info_shows_tensorclass_names(tmp_path: Path) -> None:
    @memtree.tensorclass(name="test_cli.Inner")
    class Inner:
        x: torch.Tensor

    TensorTree({"a": Inner(torch.zeros(3)), "b": torch.ones(2)}).memmap(tmp_path / "t")
    info = json.loads(io_main(["info", str(tmp_path / "t"), "--json"]))
    assert [(e["key"], e.get("type")) for e in info["entries"]] == [(["a"], "test_cli.Inner"), (["a", "x"], None), (["b"], None)]
    assert info["type"] == "TensorTree"
    assert "batch_size [] test_cli.Inner" in io_main(["info", str(tmp_path / "t")])


def test_info_depth_collapses_deeper_levels_but_totals_cover_everything(sample: Path) -> None:
    out = io_main(["info", str(sample), "--depth", "1"])
    assert "nested/" in out and "… 2 tensors, 48 B" in out
    assert "deep/" not in out and "[4, 2]" not in out
    assert "bfloat16 1 tensor (16 B)" in out  # the by-dtype totals still count it
    assert "3 tensors (96 B)" in out


def test_info_shows_odd_keys_on_one_line(tmp_path: Path) -> None:
    TensorTree({"line\nbreak": torch.zeros(1), "a/b": torch.zeros(1)}).memmap(tmp_path / "t")
    out = io_main(["info", str(tmp_path / "t")])
    assert "'line\\nbreak'" in out and "a/b" in out
    assert len(out.strip().splitlines()) == 1 + 2 + 1  # header, two leaves, totals


def test_format_bytes_uses_binary_units() -> None:
    from memtree.cli.output import format_bytes

    assert [format_bytes(n) for n in (0, 1023, 1024, 5 * 2**30 + 2**29)] == ["0 B", "1023 B", "1.0 KiB", "5.5 GiB"]


# ------------------------------------------------------------------------------ usage errors


@pytest.mark.parametrize(
    "argv",
    [[], ["info"], ["no-such-command"], ["info", "x", "--depth", "0"], ["info", "x", "--no-such-flag"]],
    ids=["no-command", "info-without-dir", "unknown-command", "bad-depth", "unknown-flag"],
)
def test_usage_errors_exit_2_with_usage_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert "usage: memtree" in captured.err and "error:" in captured.err
    assert captured.out == ""


def test_usage_error_end_to_end_exits_2_without_traceback() -> None:
    proc = run_cli("info", "some-dir", "--depth", "zero")
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "usage: memtree info" in proc.stderr and "--depth" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


# -------------------------------------------------------------------------------------- help


def test_top_level_help_lists_every_command() -> None:
    proc = run_cli("--help")
    assert proc.returncode == 0, proc.stderr
    for module in COMMANDS:
        assert module.NAME in proc.stdout, module.NAME


@pytest.mark.parametrize("module", COMMANDS, ids=[m.NAME for m in COMMANDS])
def test_every_command_has_help(module, capsys: pytest.CaptureFixture[str]) -> None:
    assert isinstance(module.HELP, str) and len(module.HELP) > 10
    with pytest.raises(SystemExit) as exit_info:
        cli_main([module.NAME, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: memtree {module.NAME}")
    assert " ".join(module.HELP.split()) in " ".join(out.split())


def test_console_script_runs_info(sample: Path) -> None:
    script = Path(sys.executable).with_name("memtree")
    if not script.exists():
        script_path = shutil.which("memtree")
        if script_path is None:
            pytest.skip("the memtree console script is not installed in this environment")
        script = Path(script_path)
    proc = run_cli("info", str(sample), "--json", exe=[str(script)])
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["totals"]["tensors"] == 3


def test_main_returns_1_for_library_errors_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["info", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("memtree: error: ") and err.count("\n") == 1


# ------------------------------------------------------------------- paths that are not UTF-8

#: A directory name of bytes that are not UTF-8 (Linux allows any bytes but "/" and NUL).
RAW = b"caf\xe9\xff"
SHOWN = "caf\\xe9\\xff"  # how every command prints it, in text and in JSON


@pytest.fixture
def raw_dir(tmp_path: Path) -> Path:
    """A directory whose name is not UTF-8, holding two trees, a torch.save file and a step root."""
    where = tmp_path / os.fsdecode(RAW)
    TensorTree({"w": torch.ones(4), "s": 1}).memmap(where / os.fsdecode(b"a\xff"))
    TensorTree({"w": torch.zeros(4), "s": 1}).memmap(where / "b")
    TensorTree({"w": torch.zeros(4)}).memmap(where / "root" / "10")
    torch.save({"w": torch.ones(2)}, where / os.fsdecode(b"m\xfe.pt"))
    return where


#: (argv, exit code, error, what the output shows): ``{d}`` is the directory above; ``error``: a
#: MemtreeError (a one-line error on standard error, ``{"error": ...}`` with ``--json``) rather
#: than a report. One case per command, and a missing path for each command that reads one.
RAW_CASES = {
    "info": (["info", "{d}/a\udcff"], 0, False, SHOWN + "/a\\xff"),
    "info-root": (["info", "{d}/root"], 0, False, SHOWN + "/root"),
    "verify": (["verify", "{d}/a\udcff"], 0, False, SHOWN + "/a\\xff"),
    "verify-damaged": (["verify", "{d}/b"], 1, False, SHOWN + "/b"),
    "du": (["du", "{d}/a\udcff"], 0, False, SHOWN + "/a\\xff"),
    "diff": (["diff", "{d}/a\udcff", "{d}/b"], 1, False, "w"),
    "convert": (["convert", "{d}/m\udcfe.pt", "{d}/out\udcff"], 0, False, "torch"),
    "convert-safetensors": (["convert", "{d}/m\udcfe.pt", "{d}/out\udcff.safetensors"], 0, False, "safetensors"),
    "convert-exists": (["convert", "{d}/m\udcfe.pt", "{d}/b"], 1, True, SHOWN + "/b already exists"),
    "info-missing": (["info", "{d}/gone\udcff"], 1, True, SHOWN + "/gone\\xff"),
    "verify-missing": (["verify", "{d}/gone\udcff"], 1, False, SHOWN + "/gone\\xff"),
    "du-missing": (["du", "{d}/gone\udcff"], 1, True, SHOWN + "/gone\\xff"),
    "diff-missing": (["diff", "{d}/b", "{d}/gone\udcff"], 1, True, SHOWN + "/gone\\xff"),
    "convert-missing": (["convert", "{d}/gone\udcff.pt", "{d}/x"], 1, True, SHOWN + "/gone\\xff.pt"),
}


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
@pytest.mark.parametrize("case", list(RAW_CASES))
def test_every_command_shows_a_path_that_is_not_utf8_escaped(
    raw_dir: Path, case: str, as_json: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    argv, code, error, shown = RAW_CASES[case]
    argv = [a.replace("{d}", str(raw_dir)) for a in argv] + (["--json"] if as_json else [])
    if case == "verify-damaged":
        (raw_dir / "b" / "w.memmap").write_bytes(b"\0" * 3)
    assert cli_main(argv) == code
    captured = capsys.readouterr()
    for stream in (captured.out, captured.err):
        stream.encode("utf-8")  # valid UTF-8: no lone surrogate reaches a stream
    if as_json:
        import orjson  # strict: refuses what is not UTF-8

        doc = orjson.loads(captured.out)
        assert ("error" in doc) == error and captured.err == ""
        assert shown in json.dumps(doc, ensure_ascii=False).replace("\\\\", "\\"), doc
    else:
        assert shown in (captured.err if error else captured.out), captured
        assert captured.err.startswith("memtree: error: ") if error else not captured.err


def test_demo_in_a_directory_that_is_not_utf8(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    work = str(tmp_path / os.fsdecode(RAW))
    assert cli_main(["demo", "--workdir", work, "--items", "8", "--json"]) == 0
    import orjson

    report = orjson.loads(capsys.readouterr().out)["report"]
    assert report[0] == f"memtree demo in {tmp_path}/{SHOWN}"
    assert cli_main(["demo", "--workdir", work, "--items", "8"]) == 0
    assert capsys.readouterr().out.startswith(f"memtree demo in {tmp_path}/{SHOWN}\n")


def test_a_path_that_is_not_utf8_end_to_end(raw_dir: Path) -> None:
    """The real streams of ``python -m memtree``: valid UTF-8, no traceback, the right exit code."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    tree = os.fsencode(raw_dir) + b"/a\xff"
    for argv, code in [(["info", tree], 0), (["info", tree + b"x", "--json"], 1)]:  # info: no torch import
        proc = subprocess.run([sys.executable, "-m", "memtree", *argv], capture_output=True, timeout=180, env=env)
        assert proc.returncode == code, proc.stderr
        out, err = proc.stdout.decode("utf-8"), proc.stderr.decode("utf-8")  # strict
        assert "Traceback" not in err
        if "--json" in argv:
            doc = json.loads(out)
            assert SHOWN + "/a\\xff" in (doc["path"] if code == 0 else doc["error"]["message"])
        else:
            assert SHOWN + "/a\\xff" in out + err
