"""Hostile ``torch.save`` pickles: cycles, shared structures (DAGs), deep nesting, object and
byte bombs, compressed bombs and zip entries whose sizes lie.

Every reader (``open_checkpoint``, ``convert``, ``load_into_module``) must refuse such a file
with a ``MemtreeError`` that names the file (and the limit, with how to raise it), in bounded
time and memory, or read correctly a file that is only big, not hostile. The files are built by
hand: the pickle from raw opcodes (or Python's pickler with a stand-in for a tensor), the archive
with ``zipfile``. Time and memory are checked in child processes: an address-space limit
(``RLIMIT_AS``) a few hundred MiB above what the child uses once torch is imported, a wall-clock
timeout, and the growth of the peak RSS during each call.

Each class of problem also has a generated suite (``test_generated_*``, one child process each,
case counts in their parameters) and the scanner, the walker and the reader have hypothesis
properties (``test_property_*``), the mutation fuzz running in a child process too.
"""

from __future__ import annotations

import itertools
import json
import os
import pickle
import re
import struct
import subprocess
import sys
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memtree
from memtree.cli import main

REPO = Path(__file__).resolve().parent.parent
MiB = 2**20

# -- pickles by hand (protocol 2 opcodes) --------------------------------------------------------
PROTO = b"\x80\x02"
EMPTY_DICT, EMPTY_LIST, EMPTY_TUPLE, MARK = b"}", b"]", b")", b"("
APPEND, APPENDS, SETITEM, LIST, TUPLE, TUPLE1, TUPLE2 = b"a", b"e", b"s", b"l", b"t", b"\x85", b"\x86"
NONE, POP, DUP, REDUCE, BUILD = b"N", b"0", b"2", b"R", b"b"


def ustr(text: str) -> bytes:
    """BINUNICODE: a str."""
    data = text.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def put(index: int) -> bytes:
    return b"r" + struct.pack("<I", index)


def get(index: int) -> bytes:
    return b"j" + struct.pack("<I", index)


def glob(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def under(key: str, value: bytes) -> bytes:
    """A whole pickle: ``{key: <value>}``."""
    return PROTO + EMPTY_DICT + ustr(key) + value + SETITEM + b"."


def nested(depth: int, kind: str) -> bytes:
    """A value nested ``depth`` deep: lists, dicts or tuples, built without recursion."""
    if kind == "list":
        return EMPTY_LIST * depth + APPEND * (depth - 1)
    if kind == "dict":
        return (EMPTY_DICT + ustr("k")) * (depth - 1) + EMPTY_DICT + SETITEM * (depth - 1)
    return EMPTY_TUPLE + TUPLE1 * depth


# -- pickles of Python objects that hold stand-in tensors -----------------------------------------
_STORAGE = object()
STORAGE_BYTES = struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)


class Tensor4:
    """Pickled as a float32 tensor of 4 elements (storage ``0`` of the archive), with
    ``metadata`` (the 7th argument of ``_rebuild_tensor_v2``: ``{"conj": True}``...) if given;
    ``complex``: as a complex64 tensor of 2 elements (the same 16 bytes)."""

    def __init__(self, metadata: Any = None, complex: bool = False, layout: Any = None) -> None:
        self.metadata = metadata
        self.complex = complex
        self.layout = layout  # (size, stride) instead of the whole storage


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, tuple) and obj and obj[0] is _STORAGE:
            kind, numel = (torch.ComplexFloatStorage, 2) if obj[1] else (torch.FloatStorage, 4)
            return ("storage", kind, "0", "cpu", numel)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Tensor4):
            n = 2 if obj.complex else 4
            size, stride = obj.layout or ((n,), (1,))
            args: tuple[Any, ...] = ((_STORAGE, obj.complex), 0, size, stride, False, OrderedDict())
            return torch._utils._rebuild_tensor_v2, args + ((obj.metadata,) if obj.metadata is not None else ())
        return NotImplemented


def dumps(obj: Any, protocol: int = 2) -> bytes:
    import io

    buf = io.BytesIO()
    _Pickler(buf, protocol=protocol).dump(obj)
    return buf.getvalue()


def write_ckpt(
    path: Path,
    data_pkl: bytes | None,
    *,
    compress: int = zipfile.ZIP_STORED,
    stream: tuple[bytes, bytes, int] | None = None,
    byteorder: bytes | tuple[bytes, int] = b"little",
) -> Path:
    """A torch.save-like archive: ``data.pkl`` (given, or ``stream``: ``(head, chunk, n)``,
    ``head`` then ``chunk`` ``n`` times, deflated on the fly), ``byteorder`` (or ``(chunk, n)``
    deflated) and storage ``0``."""
    with zipfile.ZipFile(path, "w") as zf:
        info = zipfile.ZipInfo("archive/data.pkl")
        info.compress_type = zipfile.ZIP_DEFLATED if stream is not None else compress
        with zf.open(info, "w") as f:
            if stream is not None:
                f.write(stream[0])
                for _ in range(stream[2]):
                    f.write(stream[1])
            else:
                f.write(data_pkl)
        order = zipfile.ZipInfo("archive/byteorder")
        if isinstance(byteorder, tuple):
            order.compress_type = zipfile.ZIP_DEFLATED
            with zf.open(order, "w") as f:
                for _ in range(byteorder[1]):
                    f.write(byteorder[0])
        else:
            zf.writestr(order, byteorder)
        zf.writestr("archive/data/0", STORAGE_BYTES)
        zf.writestr("archive/version", "3\n")  # what torch.load needs besides
    return path


def lie(path: Path, name: str, *, size: int | None = None, crc: int | None = None) -> None:
    """Make the zip's local and central headers of ``name`` declare another size or CRC-32."""
    data = bytearray(path.read_bytes())
    encoded = name.encode()
    for signature, crc_at, size_at, name_at in ((b"PK\x03\x04", 14, 22, 30), (b"PK\x01\x02", 16, 24, 46)):
        at = data.find(signature)
        while at >= 0 and data[at + name_at : at + name_at + len(encoded)] != encoded:
            at = data.find(signature, at + 1)
        assert at >= 0, (name, signature)
        if size is not None:
            data[at + size_at : at + size_at + 4] = struct.pack("<I", size)
        if crc is not None:
            data[at + crc_at : at + crc_at + 4] = struct.pack("<I", crc)
    path.write_bytes(bytes(data))


# -- bounded child processes ----------------------------------------------------------------------
_CHILD = r"""
import contextlib, json, resource, sys, time
import torch
import memtree
from memtree.cli import main
from memtree.interop import convert, open_checkpoint

torch.set_num_threads(1)
cases = json.load(open(sys.argv[1]))


def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def call(case):
    limits = contextlib.nullcontext()
    if case.get("limits"):
        from memtree.interop import pickle_limits
        limits = pickle_limits(**case["limits"])
    with limits:
        if case["call"] == "open":
            with open_checkpoint(case["file"]) as ckpt:
                return {"keys": list(ckpt)[:5], "values": sorted(ckpt.non_tensors)[:5]}
        if case["call"] == "convert":
            result = convert(case["file"], case["out"])
            return {"dropped": result.dropped, "tensors": result.tensors}
        result = memtree.load_into_module(torch.nn.Linear(2, 2), case["file"], strict=False)
        return {"missing": result.missing}


convert(sys.argv[2], sys.argv[3])  # warm: the code pages a conversion uses count in RSS too
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, (status("VmSize") + int(sys.argv[4]), hard))
for case in cases:
    exact = reset_peak()
    base = status("VmRSS")
    start = time.monotonic()
    try:
        out = {"ok": call(case)}
    except memtree.MemtreeError as err:
        out = {"error": type(err).__name__, "memtree": True, "message": str(err)[:4000]}
    except BaseException as err:
        out = {"error": type(err).__name__, "memtree": False, "message": str(err)[:400]}
    out["seconds"] = time.monotonic() - start
    out["growth"] = status("VmHWM") - base if exact else None
    print(json.dumps(out), flush=True)
"""


def run_bounded(
    tmp_path: Path, cases: list[dict[str, Any]], *, headroom: int = 384 * MiB, timeout: float = 300
) -> list[dict[str, Any]]:
    """Run each case (``{"call": "open" | "convert" | "load", "file": ..., "limits": ...}``) in
    one child process under ``RLIMIT_AS`` (its size after warming up, plus ``headroom``) and a
    timeout; the outcome of each, with its time and peak RSS growth."""
    for i, case in enumerate(cases):
        case.setdefault("out", str(tmp_path / f"out-{i}"))
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps(cases))
    warm = tmp_path / "warm.pt"
    torch.save({"w": torch.ones(2), "step": 1}, warm)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-c", _CHILD, str(spec), str(warm), str(tmp_path / "warm-out"), str(headroom)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        done = (err.stdout or b"").decode().count("\n") if isinstance(err.stdout, bytes) else 0
        pytest.fail(f"timed out after {timeout} s at case {done}: {cases[done]}")
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(cases), (
        f"the child died (rc {proc.returncode}) at case {len(results)}: "
        f"{cases[len(results)]}\n{proc.stderr[-2000:]}"
    )
    return results


def assert_refused(
    result: dict[str, Any], *fragments: str, seconds: float = 60, growth: int = 160 * MiB
) -> None:
    """A MemtreeError whose message has every fragment, quickly, without a memory spike."""
    assert result.get("memtree"), result
    for fragment in fragments:
        assert fragment in result["message"], (fragment, result["message"])
    assert result["seconds"] < seconds, result
    if result["growth"] is not None:
        assert result["growth"] < growth, result


READERS = ("open", "convert", "load")


def every_reader(path: Path, **extra: Any) -> list[dict[str, Any]]:
    return [{"call": call, "file": str(path), **extra} for call in READERS]


# -- 1. cycles, shared structures, nesting -------------------------------------------------------
def test_a_self_referencing_list_is_refused_by_every_reader(tmp_path: Path) -> None:
    plain, holding = [], [Tensor4()]
    plain.append(plain)
    holding.append(holding)
    a = write_ckpt(tmp_path / "cycle.pt", dumps({"w": Tensor4(), "a": plain}))
    b = write_ckpt(tmp_path / "cycle-tensor.pt", dumps({"a": holding}))
    results = run_bounded(tmp_path, every_reader(a) + every_reader(b), timeout=180)
    for result, index in zip(results, [0, 0, 0, 1, 1, 1]):
        assert_refused(result, "data.pkl", f"the list at a.{index} contains itself (it is also at a)")


def test_a_40_level_shared_structure_takes_linear_time(tmp_path: Path) -> None:
    def dag(leaf: Any) -> Any:
        for _ in range(40):
            leaf = [leaf, leaf]
        return leaf

    values = write_ckpt(tmp_path / "dag.pt", dumps({"w": Tensor4(), "a": dag(1)}))
    tensors = write_ckpt(tmp_path / "dag-tensor.pt", dumps({"a": dag(Tensor4())}))
    results = run_bounded(tmp_path, every_reader(values) + every_reader(tensors), timeout=180)
    opened, converted, loaded = results[:3]
    assert opened["ok"] == {"keys": ["w"], "values": ["a"]} and opened["seconds"] < 20
    assert converted["ok"] == {"dropped": ["a"], "tensors": 1} and converted["seconds"] < 20
    assert "ok" in loaded and loaded["seconds"] < 20
    for result in results[3:]:
        assert_refused(result, "shared", "max_objects", "pickle_limits", seconds=20)


def test_deep_nesting_gives_a_clear_error_not_a_recursion_error(tmp_path: Path) -> None:
    cases = []
    for kind in ("list", "dict", "tuple"):
        cases += every_reader(write_ckpt(tmp_path / f"{kind}.pt", under("a", nested(100_000, kind))))
    for result in run_bounded(tmp_path, cases, timeout=180):
        assert_refused(result, "max_depth", "100 levels deep", "pickle_limits(max_depth=")


def test_a_deep_tuple_as_a_dict_key_does_not_crash_the_interpreter(tmp_path: Path) -> None:
    # hashing a tuple nested ~100,000 deep overflows the C stack (SIGSEGV) in CPython
    key = nested(200_000, "tuple")
    path = write_ckpt(tmp_path / "key.pt", PROTO + EMPTY_DICT + key + NONE + SETITEM + b".")
    for result in run_bounded(tmp_path, every_reader(path), timeout=180):
        assert_refused(result, "tuples nest more than 100 levels")


# -- 2. object and byte bombs, compressed bombs, lying zip entries --------------------------------
def test_a_262_kb_compressed_pickle_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    # 255 MiB of "new empty list, append it" deflate to ~260 KB: about 10 GB once unpickled
    path = write_ckpt(
        tmp_path / "bomb.pt", None, stream=(PROTO + EMPTY_LIST, (EMPTY_LIST + APPEND) * (MiB // 2), 255)
    )
    assert path.stat().st_size < 400_000
    for result in run_bounded(tmp_path, every_reader(path), timeout=240):
        assert_refused(result, "max_objects", "10,000,000", str(path), "pickle_limits(max_objects=")


def test_operations_that_would_allocate_gigabytes_are_refused(tmp_path: Path) -> None:
    bombs = {  # name: (pickle, what the error says)
        "memo-index": (PROTO + EMPTY_LIST + put(0x7FFF_FFFF) + b".", "memo index"),  # 32 GB memo
        "binbytes8": (PROTO + b"\x8e" + struct.pack("<Q", 2**40) + b".", "declares"),
        "frame": (b"\x80\x04\x95" + struct.pack("<Q", 2**33) + NONE + b".", "truncated"),
        "stack-flood": (under("a", EMPTY_LIST + MARK + NONE * 60_000_000 + APPENDS), "max_objects"),
        # bytearray(n) allocates n bytes: torch.load(weights_only=True) would try 1 TB
        "bytearray-int": (under("a", glob("builtins", "bytearray") + _long(2**40) + TUPLE1 + REDUCE), "bytearray()"),
    }
    paths = {
        name: write_ckpt(tmp_path / f"{name}.pt", data, compress=zipfile.ZIP_DEFLATED)
        for name, (data, _) in bombs.items()
    }
    cases = [case for path in paths.values() for case in every_reader(path)]
    for i, result in enumerate(run_bounded(tmp_path, cases, timeout=240)):
        name = list(bombs)[i // 3]
        assert_refused(result, bombs[name][1], str(paths[name]))


def _long(n: int) -> bytes:
    """LONG1: an int of any size."""
    data = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(data)]) + data


def _copies(make: bytes, big: bytes, copies: int) -> bytes:
    """``{"a": [f(big), f(big), ...]}``: ``make`` builds one copy from ``big`` at memo 1."""
    return (
        PROTO + EMPTY_DICT + ustr("a") + big + put(1) + POP + EMPTY_LIST + MARK + make * copies
        + APPENDS + SETITEM + b"."
    )  # fmt: skip


_BIG_LIST = EMPTY_LIST + MARK + b"K\x01" * 1_000_000 + APPENDS  # a list of a million ints
_PAIRS = EMPTY_LIST + MARK + b"".join(b"M" + struct.pack("<H", i) + NONE + TUPLE2 for i in range(60_000)) + APPENDS
_STATE = EMPTY_DICT + MARK + b"".join(ustr(f"k{i}") + NONE for i in range(100_000)) + b"u"
CALL_BOMBS = {
    # each call copies a big object it refers to: a few bytes of pickle, megabytes of memory
    "torch.Size": _copies(glob("torch", "Size") + get(1) + TUPLE1 + REDUCE, _BIG_LIST, 5000),
    "OrderedDict": _copies(glob("collections", "OrderedDict") + get(1) + TUPLE1 + REDUCE, _PAIRS, 5000),
    "BUILD": _copies(glob("collections", "OrderedDict") + EMPTY_TUPLE + REDUCE + get(1) + BUILD, _STATE, 5000),
    "encode": _copies(
        glob("_codecs", "encode") + get(1) + ustr("latin1") + TUPLE2 + REDUCE, ustr("x" * 4 * MiB), 5000
    ),
    # the calls torch.load(weights_only=True) allows besides: set, Counter, bytearray
    "set": _copies(glob("builtins", "set") + get(1) + TUPLE1 + REDUCE, _BIG_LIST, 5000),
    "Counter": _copies(glob("collections", "Counter") + get(1) + TUPLE1 + REDUCE, _BIG_LIST, 5000),
    "bytearray": _copies(
        glob("builtins", "bytearray") + get(1) + TUPLE1 + REDUCE,
        glob("_codecs", "encode") + ustr("x" * 4 * MiB) + ustr("latin1") + TUPLE2 + REDUCE,
        5000,
    ),
}


@pytest.mark.parametrize(
    "names", [("torch.Size",), ("OrderedDict",), ("BUILD",), ("encode",), ("set", "Counter", "bytearray")], ids="-".join
)
def test_calls_that_multiply_a_big_object_are_charged(tmp_path: Path, names: tuple[str, ...]) -> None:
    small = {"max_bytes": 48 * MiB, "max_objects": 1_000_000}
    cases: list[dict[str, Any]] = []
    for name in names:  # one child for several: each starts in seconds
        path = write_ckpt(tmp_path / f"{name}.pt", CALL_BOMBS[name])
        cases += every_reader(path) + every_reader(path, limits=small)
    results = run_bounded(tmp_path, cases, headroom=1024 * MiB, timeout=300)
    for i, name in enumerate(names):
        field = "max_bytes" if name in ("encode", "bytearray") else "max_objects"
        path = tmp_path / f"{name}.pt"
        for result in results[6 * i : 6 * i + 3]:  # the defaults: ~400 MB of objects, or 256 MiB of bytes
            assert_refused(result, field, str(path), growth=640 * MiB)
        for result in results[6 * i + 3 : 6 * i + 6]:
            assert_refused(result, field, str(path), growth=100 * MiB)


def test_zip_entries_whose_sizes_lie_are_refused_in_bounded_memory(tmp_path: Path) -> None:
    stream = (PROTO + EMPTY_LIST, (NONE + APPEND) * (MiB // 2), 512)  # 512 MiB, deflated
    big = write_ckpt(tmp_path / "big.pt", None, stream=stream)
    small = tmp_path / "small.pt"
    small.write_bytes(big.read_bytes())
    lie(small, "archive/data.pkl", size=1000)  # says 1000 bytes
    lie(big, "archive/data.pkl", size=400 * MiB)  # says more than the limit, but less than it holds
    crc = write_ckpt(tmp_path / "crc.pt", under("a", NONE), compress=zipfile.ZIP_DEFLATED)
    lie(crc, "archive/data.pkl", crc=0x1234)
    order = write_ckpt(tmp_path / "order.pt", under("a", NONE), byteorder=(bytes(MiB), 512))
    results = run_bounded(
        tmp_path,
        every_reader(small) + every_reader(big) + every_reader(crc) + every_reader(order),
        timeout=300,
    )
    for result in results[:3]:
        assert_refused(result, "data.pkl")
    for result in results[3:6]:
        assert_refused(result, "declares 419,430,400 bytes", "max_bytes")
    for result in results[6:9]:
        assert_refused(result, "CRC")
    for result in results[9:]:
        assert_refused(result, "byteorder")


def test_limits_are_configurable_and_named_in_the_error(tmp_path: Path) -> None:
    from memtree.interop import PickleLimits, TorchSaveReader, pickle_limits

    path = tmp_path / "ok.pt"
    torch.save({f"w{i}": torch.full((2,), float(i)) for i in range(50)}, path)
    memtree.open_checkpoint(path).close()  # the default limits
    with pickle_limits(max_objects=100), pytest.raises(memtree.CheckpointFormatError) as err:
        memtree.open_checkpoint(path)
    message = str(err.value)
    assert str(path) in message and "PickleLimits.max_objects=100" in message
    assert "pickle_limits(max_objects=...)" in message and "--max-pickle-objects" in message
    with pickle_limits(max_objects=100), pytest.raises(memtree.CheckpointFormatError):
        memtree.load_into_module(torch.nn.Linear(2, 2), path, strict=False)
    reader = TorchSaveReader(path, limits=PickleLimits(max_objects=100_000))  # a parameter wins
    assert reader.read("w7").tolist() == [7.0, 7.0]
    with pytest.raises(memtree.CheckpointFormatError, match="max_bytes"):
        TorchSaveReader(path, limits=PickleLimits(max_bytes=1000))
    deep = write_ckpt(tmp_path / "deep.pt", under("a", nested(150, "list")))
    with pytest.raises(memtree.CheckpointFormatError, match="max_depth"):
        memtree.open_checkpoint(deep)
    with pickle_limits(max_depth=200):
        value, depth = memtree.open_checkpoint(deep).non_tensors["a"], 1
    while value:
        value, depth = value[0], depth + 1
    assert depth == 150
    with pytest.raises(ValueError, match="positive"):
        PickleLimits(max_depth=0)
    assert main(["convert", str(deep), str(tmp_path / "t"), "--max-pickle-depth", "200"]) == 0
    assert main(["convert", str(path), str(tmp_path / "u"), "--max-pickle-objects", "100"]) == 1
    assert not (tmp_path / "u").exists()


# -- 3. the calls torch.load(weights_only=True) allows, with hostile arguments -------------------
def _call(module: str, name: str, *args: bytes) -> bytes:
    """A call of ``module.name`` with the pickled ``args``."""
    return glob(module, name) + MARK + b"".join(args) + TUPLE + REDUCE


def _int(n: int) -> bytes:
    return b"J" + struct.pack("<i", n)


_F32 = glob("torch", "float32")
HOSTILE_CALLS = {  # name: (the value of "a", what the error says)
    "device-long-name": (_call("torch", "device", ustr("x" * 100)), "torch.device() called with"),
    "device-unknown": (_call("torch", "device", ustr("nonsense")), "unknown device"),
    "device-negative": (_call("torch", "device", ustr("cuda"), _int(-1)), "torch.device() called with"),
    "device-huge-index": (_call("torch", "device", ustr("cuda"), _long(2**40)), "torch.device() called with"),
    "device-int-type": (_call("torch", "device", _int(1)), "torch.device() called with"),
    "device-str-index": (_call("torch", "device", ustr("cuda"), ustr("1")), "torch.device() called with"),
    "device-no-args": (_call("torch", "device"), "malformed"),
    "bytearray-str": (_call("builtins", "bytearray", ustr("abc")), "bytearray() called with"),
    "bytearray-list": (_call("builtins", "bytearray", EMPTY_LIST), "bytearray() called with"),
    "set-int": (_call("builtins", "set", _int(5)), "set() is called with a int"),
    "set-unhashable": (_call("builtins", "set", EMPTY_LIST + EMPTY_LIST + APPEND), "malformed"),
    "set-two-args": (_call("builtins", "set", EMPTY_LIST, EMPTY_LIST), "set() called with 2 arguments"),
    "counter-str": (_call("collections", "Counter", ustr("abc")), "Counter() is called with a str"),
    "counter-state": (
        _call("collections", "Counter") + EMPTY_LIST + BUILD, "gives the Counter a list state"
    ),
    "layout-os": (_call("torch.serialization", "_get_layout", ustr("os.system")), "unknown layout"),
    "layout-int": (_call("torch.serialization", "_get_layout", _int(1)), "unknown layout"),
    "layout-missing": (_call("torch.serialization", "_get_layout", ustr("torch.nope")), "unknown layout"),
    "cpu-copy-of-int": (
        _call("torch._utils", "_rebuild_device_tensor_from_cpu_tensor", _int(5), _F32, ustr("xla"), b"\x89"),
        "wraps a int",
    ),
    "subclass-rebuilt-by-device": (
        _call("torch._tensor", "_rebuild_from_type_v2", glob("torch", "device"), glob("torch", "Tensor"),
              EMPTY_TUPLE, NONE),
        "rebuilt with",
    ),
    "qscheme-as-storage": (
        glob("torch._utils", "_rebuild_tensor_v2") + MARK + MARK + ustr("storage") + glob("torch", "per_tensor_affine")
        + ustr("0") + ustr("cpu") + b"K\x04" + TUPLE + b"Q" + b"K\x00" + EMPTY_TUPLE + EMPTY_TUPLE + b"\x89"
        + EMPTY_DICT + TUPLE + REDUCE,
        "storage type",
    ),
    "dtype-as-storage": (
        glob("torch._utils", "_rebuild_tensor_v2") + MARK + MARK + ustr("storage") + glob("torch", "uint3")
        + ustr("0") + ustr("cpu") + b"K\x04" + TUPLE + b"Q" + b"K\x00" + EMPTY_TUPLE + EMPTY_TUPLE + b"\x89"
        + EMPTY_DICT + TUPLE + REDUCE,
        "storage type",
    ),
    "v3-with-a-qscheme-dtype": (
        glob("torch._utils", "_rebuild_tensor_v3") + MARK + MARK + ustr("storage") + glob("torch.storage", "UntypedStorage")
        + ustr("0") + ustr("cpu") + b"K\x10" + TUPLE + b"Q" + b"K\x00" + EMPTY_TUPLE + EMPTY_TUPLE + b"\x89"
        + EMPTY_DICT + glob("torch", "per_tensor_affine") + TUPLE + REDUCE,
        "names the dtype",
    ),
}  # fmt: skip


def test_the_calls_weights_only_allows_refuse_hostile_arguments(tmp_path: Path) -> None:
    """Each call torch.load(weights_only=True) allows (and memtree with it: torch.device, set,
    bytearray, Counter, layouts, the tensor rebuilds) checks its arguments: a hostile one is a
    MemtreeError naming the file, never a crash, an allocation it asks for, or a wrong value."""
    for name, (value, fragment) in HOSTILE_CALLS.items():
        path = write_ckpt(tmp_path / f"{name}.pt", PROTO + EMPTY_DICT + ustr("a") + value + SETITEM + b".")
        for read in (
            lambda: memtree.open_checkpoint(path),
            lambda: memtree.convert(path, tmp_path / "out"),
            lambda: memtree.load_into_module(torch.nn.Linear(2, 2), path, strict=False),
        ):
            with pytest.raises(memtree.MemtreeError) as err:
                read()
            assert fragment in str(err.value) and str(path) in str(err.value), (name, str(err.value))
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("cls", ["OrderedDict", "Counter"])
@pytest.mark.parametrize("attribute", [NONE, b"K\x05", glob("torch", "device"), glob("builtins", "set")])
def test_attributes_a_build_sets_do_not_change_how_a_dict_is_walked(tmp_path: Path, cls: str, attribute: bytes) -> None:
    """A BUILD may set any attribute on an OrderedDict (a Counter), "items" and "keys" too, as
    torch.load(weights_only=True) allows: the walk uses dict's own methods, never the object's
    (an int there once escaped as a TypeError)."""
    state = EMPTY_DICT + MARK + b"".join(ustr(n) + attribute for n in ("items", "keys", "values")) + b"u"
    value = _call("collections", cls) + state + BUILD + ustr("k") + b"K\x01" + SETITEM
    path = write_ckpt(tmp_path / "attrs.pt", PROTO + EMPTY_DICT + ustr("a") + value + SETITEM + b".")
    assert torch.load(path, weights_only=True)["a"]["k"] == 1
    with memtree.open_checkpoint(path) as ckpt:
        assert ckpt.non_tensors == {"a.k": 1}
    assert memtree.convert(path, tmp_path / "out").dropped == []
    assert memtree.load_memmap(tmp_path / "out")["a", "k"] == 1


LAYOUTS = {  # (size, stride): the error's type and what it says
    "zero-element, 2**124 elements once zeros count as 1": (((0, 2**62, 2**62), (1, 1, 1)), memtree.DtypeError, "beyond 2**62 bytes"),
    "zero-element, an int64 dim": (((0, 2**63 - 1), (2**63 - 1, 1)), memtree.DtypeError, "beyond 2**62 bytes"),
    "a stride beyond int64": (((0,), (2**63,)), memtree.CheckpointFormatError, "malformed size"),
    "a dim beyond int64": (((2**64, 0), (1, 1)), memtree.CheckpointFormatError, "malformed size"),
    "past the storage": (((5,), (1,)), memtree.CheckpointFormatError, "reaches past the end"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_torch_cannot_make_or_memtree_cannot_hold_are_refused(tmp_path: Path, name: str) -> None:
    """Sizes and strides beyond int64, or a zero-element shape spanning more than the format's
    2**62 bytes once its zeros count as 1 (torch overflows computing its strides): a MemtreeError
    from every reader, never a TypeError or RuntimeError out of torch."""
    layout, error, fragment = LAYOUTS[name]
    path = write_ckpt(tmp_path / "l.pt", dumps({"ok": Tensor4(), "t": Tensor4(layout=layout)}))
    for read in (
        lambda: memtree.open_checkpoint(path)["t"],
        lambda: memtree.convert(path, tmp_path / "out"),
        lambda: memtree.load_into_module(torch.nn.Linear(2, 2), path, strict=False),
    ):
        with pytest.raises(error, match=re.escape(fragment)):
            read()
    assert not (tmp_path / "out").exists()


METADATA = {  # metadata: (the error's type and what it says, or the values torch.load gives)
    "conj-not-bool": ({"conj": "yes"}, False, memtree.CheckpointFormatError, "malformed metadata"),
    # torch.save writes set bits only; torch.load would set this one: neither reading is sure
    "conj-false": ({"conj": False}, True, memtree.CheckpointFormatError, "malformed metadata"),
    "conj-of-a-real-tensor": ({"conj": True}, False, memtree.CheckpointFormatError, "conjugate bit"),
    "a-list": ([("conj", True)], False, memtree.CheckpointFormatError, "malformed metadata"),
    "an-ordered-dict": (OrderedDict(neg=True), False, memtree.CheckpointFormatError, "malformed metadata"),
    "unknown-bit": ({"zero": True}, False, memtree.DtypeError, "does not know"),
    "an-int-key": ({1: True}, False, memtree.DtypeError, "does not know"),
}


@pytest.mark.parametrize("name", list(METADATA))
def test_tensor_metadata_memtree_cannot_apply_is_refused_by_key(tmp_path: Path, name: str) -> None:
    """A tensor's metadata (where torch.save records the conj and neg bits) is applied exactly
    or refused naming the key: never ignored, which would give the stored values instead."""
    metadata, complex_, error, fragment = METADATA[name]
    ok, bad = Tensor4(complex=complex_), Tensor4(metadata, complex_)
    path = write_ckpt(tmp_path / "m.pt", dumps({"ok": ok, "sub": {"t": bad}}))
    with pytest.raises(error, match=f"'sub.t' is .*{fragment}"):
        memtree.open_checkpoint(path)
    with pytest.raises(error, match="sub.t"):
        memtree.convert(path, tmp_path / "out")
    with pytest.raises(error, match="sub.t"):
        memtree.load_into_module(torch.nn.Linear(2, 2), path, strict=False)
    if error is memtree.DtypeError:  # not damage: memtree cannot read it, and may leave it out
        with memtree.open_checkpoint(path, skip_unsupported=True) as ckpt:
            assert list(ckpt) == ["ok"] and list(ckpt.skipped) == ["sub.t"]


@pytest.mark.parametrize("metadata", [{"neg": True}, {"conj": True}, {"conj": True, "neg": True}, {}])
def test_tensor_metadata_bits_are_applied(tmp_path: Path, metadata: dict[str, bool]) -> None:
    real = {k: v for k, v in metadata.items() if k != "conj"}  # a real tensor has no conj bit
    for name, tensor in (("complex", Tensor4(metadata, complex=True)), ("real", Tensor4(real))):
        path = write_ckpt(tmp_path / f"{name}.pt", dumps({"t": tensor}))
        ref = torch.load(path, weights_only=True)["t"]
        with memtree.open_checkpoint(path) as ckpt:
            assert torch.equal(ckpt["t"], ref) and torch.equal(ckpt.read("t", mmap=False), ref)
            assert (ckpt["t"].is_conj(), ckpt["t"].is_neg()) == (ref.is_conj(), ref.is_neg())
            assert ckpt["t"].is_neg() == metadata.get("neg", False)


# -- generated suites: each class of problem, many variants, one bounded child each ---------------
def _cycle(pattern: tuple[str, ...], tensor: bool) -> Any:
    """A cycle through containers of ``pattern`` (the first mutable): c0 -> c1 -> ... -> c0."""
    first: Any = [] if pattern[0] == "list" else {}
    child = first
    for kind in reversed(pattern[1:]):  # built from the end: a tuple needs its item first
        items = [Tensor4(), child] if tensor else [child]
        child = tuple(items) if kind == "tuple" else items if kind == "list" else dict(enumerate(items))
    if isinstance(first, list):
        first.extend([Tensor4(), child] if tensor else [child])
    else:
        first.update({"t": Tensor4(), "c": child} if tensor else {"c": child})
    return first


def _wrap(value: Any, depth: int) -> Any:
    for i in range(depth):
        value = {f"w{i}": value}
    return value


def cycle_variants() -> list[tuple[str, bytes]]:
    """320 cycles: through 1 to 4 lists, dicts or tuples (the first one mutable), holding a
    tensor or not, at the top or under 3 levels of dicts."""
    out = []
    for length in range(1, 5):
        for pattern in itertools.product(("list", "dict", "tuple"), repeat=length):
            if pattern[0] == "tuple":
                continue
            for tensor, depth in itertools.product((False, True), (0, 3)):
                obj = {"w": Tensor4(), "a": _wrap(_cycle(pattern, tensor), depth)}
                out.append((f"cycle-{'-'.join(pattern)}-t{int(tensor)}-d{depth}", dumps(obj)))
    return out


def dag_variants() -> list[tuple[str, bytes, bool]]:
    """90 shared structures (fan-out 2 to 4, 2**20 to 4**40 paths) of lists, tuples or dicts
    over a tensor, an int or a str: ``(name, pickle, holds a tensor)``."""
    out = []
    shapes = [(2, 20), (2, 30), (2, 40), (2, 64), (3, 13), (3, 40), (4, 10), (4, 20), (4, 40), (3, 60)]
    for (fan, depth), kind, leaf in itertools.product(shapes, ("list", "tuple", "dict"), ("t", 1, "s")):
        node: Any = Tensor4() if leaf == "t" else leaf
        for _ in range(depth):
            items = [node] * fan
            node = tuple(items) if kind == "tuple" else items if kind == "list" else dict(enumerate(items))
        obj = {"w": Tensor4(), "a": node}
        out.append((f"dag-{fan}^{depth}-{kind}-{leaf}", dumps(obj), leaf == "t"))
    return out


def depth_variants() -> list[tuple[str, bytes]]:
    """32 structures nested 101 to 200,000 deep (lists, dicts, tuples, lists in dicts), at a
    key or inside a list that holds a tensor."""
    out = []
    tensor = dumps({"w": Tensor4()})[2:-1]  # the ops of {"w": tensor} (no PROTO, no STOP)
    for depth in (101, 1_000, 30_000, 200_000):
        for kind in ("list", "dict", "tuple", "mixed"):
            if kind == "mixed":
                value = (EMPTY_LIST + EMPTY_DICT + ustr("k")) * (depth // 2) + NONE + (SETITEM + APPEND) * (depth // 2)
            else:
                value = nested(depth, kind)
            out.append((f"deep-{kind}-{depth}", under("a", value)))
            in_list = PROTO + EMPTY_DICT + ustr("a") + EMPTY_LIST + MARK + tensor + value + APPENDS + SETITEM + b"."
            out.append((f"deep-{kind}-{depth}-beside-a-tensor", in_list))
    return out


def _flood(head: bytes, op: bytes, count: int, tail: bytes) -> bytes:
    return PROTO + head + op * count + tail + b"."


def bomb_variants(count: int) -> list[tuple[str, bytes]]:
    """Operations repeated ``count`` times (lists, dicts, sets, tuples, marks, DUPs, GETs,
    PUTs, strings, ints), memo indices that skip ahead, declared lengths beyond the data, and
    calls that copy a big argument again and again."""
    a = EMPTY_DICT + ustr("a")
    out = [
        ("lists", _flood(a + EMPTY_LIST, EMPTY_LIST + APPEND, count, SETITEM)),
        ("dicts", _flood(a + EMPTY_LIST, EMPTY_DICT + APPEND, count, SETITEM)),
        ("sets", b"\x80\x04" + _flood(a + EMPTY_LIST, b"\x8f" + APPEND, count, SETITEM)[2:]),
        ("frozensets", b"\x80\x04" + _flood(a + EMPTY_LIST, MARK + b"\x91" + APPEND, count, SETITEM)[2:]),
        ("tuples", _flood(a + EMPTY_LIST, EMPTY_TUPLE + TUPLE1 + APPEND, count, SETITEM)),
        ("marks", _flood(a + EMPTY_LIST, MARK, count, SETITEM)),
        ("nones", _flood(a + EMPTY_LIST + MARK, NONE, count, APPENDS + SETITEM)),
        ("dups", _flood(a + EMPTY_LIST + NONE + MARK, DUP, count, APPENDS + SETITEM)),
        ("gets", _flood(a + EMPTY_LIST + NONE + b"q\x00" + MARK, b"h\x00", count, APPENDS + SETITEM)),
        ("puts", _flood(a + NONE, b"".join(put(i) for i in range(1000)), count // 1000, SETITEM)),
        ("strings", _flood(a + EMPTY_LIST + MARK, ustr("x"), count, APPENDS + SETITEM)),
        ("ints", _flood(a + EMPTY_LIST + MARK, b"J\x01\x02\x03\x04", count, APPENDS + SETITEM)),
    ]
    for index in (256 + 1, 2**16, 2**24, 2**31, 2**32 - 1):
        out.append((f"memo-{index}", PROTO + EMPTY_LIST + put(index) + b"."))
    out.append(("memo-text", b"(lp99999999999\n."))
    for name, op, width in (("binbytes8", b"\x8e", 8), ("binunicode8", b"\x8d", 8), ("bytearray8", b"\x96", 8),
                            ("binbytes", b"B", 4), ("binunicode", b"X", 4)):
        for length in (2**31 - 1, 2**32 - 1) if width == 4 else (2**33, 2**62):
            out.append((f"{name}-{length}", PROTO + op + length.to_bytes(width, "little") + b"."))
    out.append(("long4-negative", PROTO + b"\x8b" + struct.pack("<i", -5) + b"."))
    for name, make in CALL_BOMBS.items():
        out.append((f"calls-{name}", make))
    return out


def zip_variants(tmp_path: Path) -> list[tuple[str, Path]]:
    """Compressed bombs and zip entries that lie: deflated floods, declared sizes that are too
    small, too big or zero, a wrong CRC-32, other compression methods, a deflated byteorder."""
    out = []
    flood = (PROTO + EMPTY_LIST, (EMPTY_LIST + APPEND) * (MiB // 2), 64)
    for name, size, crc in (("deflated", None, None), ("size-small", 4096, None), ("size-zero", 0, None),
                            ("size-huge", 2**32 - 2, None), ("size-past-limit", 300 * MiB, None)):
        path = write_ckpt(tmp_path / f"zip-{name}.pt", None, stream=flood)
        if size is not None:
            lie(path, "archive/data.pkl", size=size)
        out.append((f"zip-{name}", path))
    crc = write_ckpt(tmp_path / "zip-crc.pt", under("a", NONE), compress=zipfile.ZIP_DEFLATED)
    lie(crc, "archive/data.pkl", crc=0xDEADBEEF)
    out.append(("zip-crc", crc))
    for method in (zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA):
        out.append((f"zip-method-{method}", write_ckpt(tmp_path / f"zip-m{method}.pt", under("a", NONE), compress=method)))
    for name, order in (("order-bomb", (bytes(MiB), 64)), ("order-big", b"little" * 100), ("order-big-endian", b"big")):
        out.append((f"zip-{name}", write_ckpt(tmp_path / f"zip-{name}.pt", under("a", NONE), byteorder=order)))
    truncated = write_ckpt(tmp_path / "zip-truncated-stream.pt", None, stream=flood)
    data = bytearray(truncated.read_bytes())
    start = data.find(b"archive/data.pkl") + len("archive/data.pkl") + 20
    data[start + 1000 : start + 2000] = bytes(1000)  # damage the deflate stream
    truncated.write_bytes(bytes(data))
    out.append(("zip-damaged-stream", truncated))
    return out


def _files(tmp_path: Path, variants: list[tuple[Any, ...]]) -> list[Path]:
    return [write_ckpt(tmp_path / f"{v[0]}.pt", v[1]) for v in variants]


def test_generated_cycles(tmp_path: Path) -> None:
    variants = cycle_variants()
    assert len(variants) == 320
    cases = [{"call": "open", "file": str(p)} for p in _files(tmp_path, variants)]
    cases += [{"call": c, "file": cases[i]["file"]} for i in range(0, 320, 16) for c in ("convert", "load")]
    for case, result in zip(cases, run_bounded(tmp_path, cases, timeout=600)):
        assert_refused(result, "contains itself", "cycle", seconds=10)


def test_generated_shared_structures(tmp_path: Path) -> None:
    variants = dag_variants()
    assert len(variants) == 90
    files = _files(tmp_path, variants)
    cases = [{"call": "open", "file": str(p)} for p in files]
    cases += [{"call": c, "file": str(p)} for p, v in zip(files, variants) if "^40" in v[0] for c in ("convert", "load")]
    by_file = {str(p): v for p, v in zip(files, variants)}
    for case, result in zip(cases, run_bounded(tmp_path, cases, timeout=600)):
        name, _, tensor = by_file[case["file"]]
        if tensor or "-dict-" in name:  # flattening repeats the shared parts: 2**20 entries or more
            assert_refused(result, "shared", seconds=10)
        elif case["call"] == "convert":  # the value, repeated 2**40 times or more, is dropped
            assert result["ok"] == {"dropped": ["a"], "tensors": 1} and result["seconds"] < 10, (name, result)
        else:  # one value, shared parts and all
            assert "ok" in result and result["seconds"] < 10, (name, result)
            assert case["call"] == "load" or result["ok"]["values"] == ["a"], (name, result)


def test_generated_deep_nesting(tmp_path: Path) -> None:
    variants = depth_variants()
    assert len(variants) == 32
    files = _files(tmp_path, variants)
    cases = [{"call": c, "file": str(p)} for p in files for c in (READERS if "-1000" in p.name else ("open",))]
    for result in run_bounded(tmp_path, cases, timeout=600):
        assert_refused(result, "max_depth", "100 levels deep", seconds=20)


def test_generated_object_and_byte_bombs(tmp_path: Path) -> None:
    # a low limit keeps each case fast (the scan stops after 200,000 objects); the defaults are
    # exercised by the tests above
    limits = {"max_objects": 200_000, "max_bytes": 8 * MiB}
    variants = bomb_variants(1_000_000)
    assert len(variants) == 36
    stored = _files(tmp_path, variants)
    deflated = [write_ckpt(tmp_path / f"{v[0]}-z.pt", v[1], compress=zipfile.ZIP_DEFLATED) for v in variants]
    cases = [{"call": "open", "file": str(p), "limits": limits} for p in stored + deflated]
    cases += [{"call": c, "file": str(p), "limits": limits} for p in stored[::4] for c in ("convert", "load")]
    for case, result in zip(cases, run_bounded(tmp_path, cases, timeout=600)):
        assert_refused(result, "data.pkl", seconds=20, growth=100 * MiB)
        message = result["message"]
        assert any(w in message for w in ("max_objects", "max_bytes", "memo index", "declares", "truncated")), (case, message)


def test_generated_compressed_bombs_and_lying_zips(tmp_path: Path) -> None:
    variants = zip_variants(tmp_path)
    assert len(variants) == 12
    limits = {"max_objects": 200_000}  # fast: the scan stops sooner (the defaults: tests above)
    cases = [{"call": c, "file": str(p), "limits": limits} for _, p in variants for c in READERS]
    expected = {
        "zip-deflated": "max_objects", "zip-size-small": "CRC", "zip-size-zero": "data.pkl",
        "zip-size-huge": "max_bytes", "zip-size-past-limit": "max_bytes", "zip-crc": "CRC",
        "zip-method-12": "compression method 12", "zip-method-14": "compression method 14",
        "zip-order-bomb": "byteorder", "zip-order-big": "byteorder", "zip-order-big-endian": "big-endian",
        "zip-damaged-stream": "data.pkl",
    }  # fmt: skip
    results = run_bounded(tmp_path, cases, timeout=600)
    for i, result in enumerate(results):
        name = variants[i // 3][0]
        assert_refused(result, expected[name], seconds=30)


# -- properties ----------------------------------------------------------------------------------
LEAVES = st.one_of(
    st.builds(Tensor4), st.integers(-5, 5), st.sampled_from(["x", "", "y.z"]), st.none(), st.floats(0, 1)
)


@st.composite
def graphs(draw: st.DrawFn) -> dict[str, Any]:
    """A dict of lists, tuples and dicts that share parts (each container's items are leaves or
    earlier containers), sometimes with extra edges that may close cycles."""
    nodes: list[Any] = []
    for kind in draw(st.lists(st.sampled_from(["list", "tuple", "dict", "int-dict"]), min_size=1, max_size=8)):
        pick = st.one_of(LEAVES, st.sampled_from(nodes)) if nodes else LEAVES
        items = draw(st.lists(pick, max_size=3))
        if kind in ("dict", "int-dict"):
            nodes.append({(i if kind == "int-dict" else f"k{i}"): v for i, v in enumerate(items)})
        else:
            nodes.append(tuple(items) if kind == "tuple" else items)
    mutable = [n for n in nodes if isinstance(n, (list, dict))]
    for _ in range(draw(st.integers(0, 2)) if mutable else 0):  # edges that may close a cycle
        source, target = draw(st.sampled_from(mutable)), draw(st.sampled_from(nodes))
        if isinstance(source, list):
            source.append(target)
        else:
            source[f"e{len(source)}"] = target
    keys = draw(st.lists(st.sampled_from(range(len(nodes))), min_size=1, max_size=3, unique=True))
    return {f"top{i}": nodes[i] for i in keys}


def reference(root: dict[str, Any], max_depth: int) -> tuple[str, Any]:
    """The flattening, by the definition (recursion, exponential in sharing): ``("entries",
    [(key, value)])``, or ``("cycle" | "depth", None)``."""
    def holds(value: Any, path: tuple[int, ...]) -> bool:
        if isinstance(value, Tensor4):
            return True
        if not isinstance(value, (dict, list, tuple)):
            return False
        if id(value) in path:
            raise LookupError("cycle")
        if len(path) + 1 > max_depth:  # the top-level dict is level 1
            raise LookupError("depth")
        items = value.values() if isinstance(value, dict) else value
        return any([holds(v, path + (id(value),)) for v in items])  # all: a deeper cycle counts

    def flat(value: Any, key: str, out: list[tuple[str, Any]]) -> None:
        if isinstance(value, Tensor4):
            out.append((key, value))
        elif isinstance(value, dict) and value:
            for k, v in value.items():
                flat(v, f"{key}.{k}", out)
        elif isinstance(value, (list, tuple)) and holds(value, ()):
            for i, v in enumerate(value):
                flat(v, f"{key}.{i}", out)
        else:
            out.append((key, value))

    try:
        holds(root, ())
        out: list[tuple[str, Any]] = []
        for k, v in root.items():
            flat(v, k, out)
        return "entries", out
    except LookupError as err:
        return str(err), None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(root=graphs(), max_depth=st.integers(3, 8))
def test_property_flattening_matches_its_definition(tmp_path_factory: Any, root: dict[str, Any], max_depth: int) -> None:
    from memtree.interop import pickle_limits

    path = write_ckpt(tmp_path_factory.mktemp("g") / "g.pt", dumps(root))
    kind, expected = reference(root, max_depth)
    with pickle_limits(max_depth=max_depth):
        if kind != "entries":
            with pytest.raises(memtree.CheckpointFormatError) as err:
                memtree.open_checkpoint(path)
            assert ("contains itself" in str(err.value)) or ("levels deep" in str(err.value)), err.value
            if kind == "cycle" and "levels deep" in str(err.value):
                assert reference(root, 10**6)[0] == "cycle"  # both: either may be found first
            return
        with memtree.open_checkpoint(path) as ckpt:
            tensors = [k for k, v in expected if isinstance(v, Tensor4)]
            assert list(ckpt) == tensors
            assert all(ckpt[k].tolist() == [1.0, 2.0, 3.0, 4.0] for k in tensors)
            assert ckpt.non_tensors == {k: v for k, v in expected if not isinstance(v, Tensor4)}


PICKLABLE = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(), st.binary()),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=3), inner, max_size=4),
        st.frozensets(st.integers(), max_size=3),
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(value=PICKLABLE, protocol=st.integers(0, 5), cuts=st.lists(st.integers(1, 64), max_size=20))
def test_property_the_scan_accepts_what_python_writes_fed_in_any_pieces(
    value: Any, protocol: int, cuts: list[int]
) -> None:
    from memtree.interop.pickle_guard import PickleLimits, PickleScanner

    data = pickle.dumps({"v": value}, protocol=protocol)
    whole = PickleScanner(PickleLimits(), "p")
    whole.feed(data, final=True)
    pieces, buf, at = PickleScanner(PickleLimits(), "p"), bytearray(), 0
    for cut in cuts:
        buf += data[at : at + cut]
        at += cut
        pieces.feed(buf)
    buf += data[at:]
    pieces.feed(buf, final=True)
    assert whole.done and pieces.done and whole.objects == pieces.objects > 0


_FUZZ = r"""
import io, json, random, sys, zipfile
import resource
from hypothesis import given, settings, strategies as st
import torch, memtree
from memtree.interop import pickle_limits

torch.set_num_threads(1)
base = open(sys.argv[1], "rb").read()
with zipfile.ZipFile(io.BytesIO(base)) as zf:
    entries = [(i, zf.read(i)) for i in zf.infolist()]
target = sys.argv[2]
escaped, outcomes = [], {}


def rezip(pkl):
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        for info, data in entries:
            zf.writestr(info, pkl if info.filename.endswith("data.pkl") else data)
    return out.getvalue()


PKL = next(d for i, d in entries if i.filename.endswith("data.pkl"))
edits = st.lists(st.tuples(st.sampled_from(["flip", "insert", "delete", "truncate", "repeat"]),
                           st.integers(0, 10**6), st.binary(min_size=1, max_size=8)), min_size=1, max_size=4)


@settings(max_examples=int(sys.argv[3]), deadline=None, database=None, derandomize=True)
@given(edits=edits, whole_zip=st.booleans())
def fuzz(edits, whole_zip):
    data = bytearray(base if whole_zip else PKL)
    for kind, at, blob in edits:
        at %= max(len(data), 1)
        if kind == "flip":
            data[at : at + len(blob)] = bytes(a ^ b for a, b in zip(data[at : at + len(blob)], blob))
        elif kind == "insert":
            data[at:at] = blob
        elif kind == "delete":
            del data[at : at + len(blob)]
        elif kind == "truncate":
            del data[at:]
        else:  # repeat a slice many times: floods of whatever operations it holds
            data[at:at] = bytes(data[at : at + len(blob)]) * 20_000
    with open(target, "wb") as f:
        f.write(bytes(data) if whole_zip else rezip(bytes(data)))
    try:
        with pickle_limits(max_objects=300_000, max_bytes=4 * 2**20, max_depth=50):
            with memtree.open_checkpoint(target) as ckpt:
                for key in ckpt:
                    ckpt.read(key, mmap=False)
        outcomes["read"] = outcomes.get("read", 0) + 1
    except memtree.MemtreeError as err:
        outcomes[type(err).__name__] = outcomes.get(type(err).__name__, 0) + 1
    except BaseException as err:
        escaped.append(f"{type(err).__name__}: {err}"[:300])
        raise


resource.setrlimit(resource.RLIMIT_AS, (8 * 2**30, resource.getrlimit(resource.RLIMIT_AS)[1]))
try:
    fuzz()
finally:
    print(json.dumps({"escaped": escaped, "outcomes": outcomes}))
"""


def test_property_mutated_checkpoints_raise_only_memtree_errors(tmp_path: Path) -> None:
    """400 mutations (bytes flipped, inserted, deleted, cut, or a slice repeated 20,000 times)
    of a checkpoint's pickle or of its whole zip, opened and read in a bounded child."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    base = tmp_path / "base.pt"
    views = {"conj": torch.ones(2, dtype=torch.complex64).conj(), "neg": torch._neg_view(torch.ones(3))}
    extras = {"seen": {1, 2}, "device": torch.device("cpu"), "raw": bytearray(b"ab"), "cfg": {"betas": (0.9, 0.99)}}
    torch.save({"model": model.state_dict(), "step": 3, "views": views, **extras}, base)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", _FUZZ, str(base), str(tmp_path / "mutant.pt"), "400"],
        capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["escaped"] == [] and sum(report["outcomes"].values()) == 400, report
    assert report["outcomes"].get("read", 0) > 0 and len(report["outcomes"]) > 2, report


def test_depth_counts_a_shared_container_at_its_deepest_place(tmp_path: Any) -> None:
    """A container analysed first at a shallow place and shared again deeper is as deep as its
    deepest place (found by the property test above: memoising by identity skipped the check)."""
    from memtree.interop import pickle_limits

    a: list[Any] = []
    b = [a]
    c = [b]
    path = write_ckpt(tmp_path / "g.pt", dumps({"top0": a, "top1": b, "top2": c}))
    with pickle_limits(max_depth=3):
        with pytest.raises(memtree.CheckpointFormatError, match="levels deep"):
            memtree.open_checkpoint(path)
    with pickle_limits(max_depth=4):
        with memtree.open_checkpoint(path) as ckpt:
            assert ckpt.non_tensors["top2"] == [[[]]]


@pytest.mark.parametrize(
    ("field", "value"),
    [("version", 64), ("compression", 99), ("flags", 1)],  # a zip 6.4 entry, an unknown method, encrypted
)
def test_zip_entries_that_zipfile_cannot_read_are_checkpoint_errors(tmp_path: Path, field: str, value: int) -> None:
    """zipfile raises NotImplementedError/RuntimeError for these: found escaping by the zip fuzzer."""
    path = tmp_path / "m.pt"
    torch.save({"w": torch.arange(4.0)}, path)
    data = bytearray(path.read_bytes())
    offset = {"version": 6, "flags": 8, "compression": 10}[field]  # in a central directory record
    for sig in (b"PK\x01\x02",):
        at = data.find(sig)
        while at != -1:
            name_len = struct.unpack_from("<H", data, at + 28)[0]
            if data[at + 46 : at + 46 + name_len].endswith(b"data.pkl"):
                struct.pack_into("<H", data, at + offset, value)
                if field != "version":  # the local header too, which zipfile.open compares
                    local = struct.unpack_from("<I", data, at + 42)[0]
                    struct.pack_into("<H", data, local + offset - 2, value)
            at = data.find(sig, at + 4)
    path.write_bytes(bytes(data))
    with pytest.raises(memtree.MemtreeError, match="m.pt"):
        memtree.open_checkpoint(path)
    with pytest.raises(memtree.MemtreeError):
        memtree.load_into_module(torch.nn.Linear(2, 2), path)
