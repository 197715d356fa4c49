"""Writing tensordict's memmap layout (``convert --format tensordict``, ``save_tensordict``), read
back by the real ``tensordict.TensorDict.load_memmap``; and tensordict ``@tensorclass`` levels
read as memtree ``@tensorclass`` objects of the registered name."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memtree
from memtree.cli import main
from memtree.format.dtypes import DTYPE_NAMES, dtype_from_name
from memtree.format.level import Level
from memtree.format.values import NonTensor
from memtree.interop import save_tensordict
from memtree.store.foreign.tensordict_write import TENSORDICT_DTYPES, write_tensordict_dir
from treeutil import random_tensor
from treeutil import raw_bytes as as_bytes

tensordict = pytest.importorskip("tensordict")
from tensordict import NonTensorData, TensorDict  # noqa: E402


@tensordict.tensorclass
class TDStep:
    """A tensordict tensorclass; tensordict imports it by name (test_tensordict_write.TDStep)."""

    obs: torch.Tensor
    reward: torch.Tensor
    note: str = "none"


@memtree.tensorclass(name="TDStep")
class MemStep:
    """The memtree tensorclass registered under the tensordict class's name."""

    obs: torch.Tensor
    reward: torch.Tensor
    note: str = "none"


@memtree.tensorclass(name="tests.MemOnly")
class MemOnly:
    x: torch.Tensor


#: Every dtype tensordict's loader reads.
DTYPES = [dt for name in DTYPE_NAMES if (dt := dtype_from_name(name)) is not None and str(dt) in TENSORDICT_DTYPES]


def td_leaves(td, prefix=()):
    """{key path: tensor or value} of a loaded TensorDict (tensorclasses entered)."""
    out = {}
    for key in td.keys():
        value = td.get(key)
        path = prefix + (key,)
        if isinstance(value, NonTensorData):
            out[path] = value.data
        elif isinstance(value, torch.Tensor):
            out[path] = value
        else:
            out.update(td_leaves(value, path))
    return out


def mt_leaves(tree, prefix=()):
    out = {}
    for key, value in tree.items():
        path = prefix + (key,)
        if isinstance(value, memtree.TensorTree):
            out.update(mt_leaves(value, path))
        else:
            out[path] = value
    return out


def assert_same(td_values: dict, mt_values: dict) -> None:
    assert td_values.keys() == mt_values.keys()
    for path, expected in mt_values.items():
        got = td_values[path]
        if isinstance(expected, torch.Tensor):
            assert got.dtype == expected.dtype and got.shape == expected.shape, path
            assert as_bytes(got) == as_bytes(expected), path
        else:
            assert got == expected and type(got) is type(expected), path


def rich_tree() -> memtree.TensorTree:
    tree = memtree.TensorTree(
        {f"d_{str(dt)[6:]}": random_tensor((3, 2), dt, i) for i, dt in enumerate(DTYPES)},
        batch_size=[3],
    )
    tree["nested", "x"] = torch.arange(3.0)
    tree["nested", "deeper", "m"] = torch.tensor([[True, False], [False, True], [True, True]])
    tree["nested", "deeper", "bf"] = torch.randn(3, 4).to(torch.bfloat16)
    tree["empty"] = torch.zeros(3, 0)
    tree["a/b c%"] = torch.ones(3, dtype=torch.int8)
    tree["scalar0d_holder", "s"] = torch.zeros(3)
    tree["text"] = "hello"
    tree["count"] = 7
    tree["ratio"] = 0.25
    tree["flag"] = True
    tree["nothing"] = None
    tree["ids"] = [1, 2, 3]
    tree["cfg"] = memtree.NonTensor({"lr": 0.1, "layers": [1, 2], "name": "x"})
    return tree


def test_every_dtype_nested_levels_and_values_load_bit_exact_in_tensordict(tmp_path: Path) -> None:
    tree = rich_tree()
    tree.memmap(tmp_path / "mt")
    result = memtree.convert(tmp_path / "mt", tmp_path / "td", format="tensordict")
    assert result.destination == "tensordict" and result.tensors == len(DTYPES) + 6
    assert not result.dropped and not result.altered
    td = TensorDict.load_memmap(tmp_path / "td")
    assert td.batch_size == torch.Size([3]) and td["nested"].batch_size == torch.Size([3])
    assert_same(td_leaves(td), mt_leaves(tree))
    # tensordict's own quirk: no file for a zero-element leaf; keys percent-encoded
    assert not (tmp_path / "td" / "empty.memmap").exists()
    assert (tmp_path / "td" / "a%2Fb%20c%25.memmap").exists()
    # and memtree reads its own output back the same
    assert_same(mt_leaves(memtree.load_memmap(tmp_path / "td")), mt_leaves(tree))


#: A directory tensordict 0.15.3 wrote (``tests/fixtures/README.md``): the layout memtree writes.
FIXTURE_0153 = Path(__file__).parent / "fixtures" / "tensordict_0153_memmap"
#: The fields tensordict >= 0.15.1 adds to a TensorDict level's meta.json, after ``_type``.
FORMAT_FIELDS = {"_format_version": 1, "_class": "tensordict:TensorDict"}
#: The order of a NonTensorData level's fields in 0.15.3 (0.14 puts ``_is_non_tensor`` first).
NON_TENSOR_ORDER = ("_type", "data", "_metadata", "_is_non_tensor")
LEVELS = ("meta.json", "sub/meta.json", "t/meta.json")


def as_written_by_0_15_3(meta: dict) -> dict:
    """A meta.json of an older tensordict as 0.15.3 writes it (unchanged from a 0.15.3 one)."""
    if "_format_version" in meta:
        return meta
    if "TensorDict" in meta["_type"]:
        return meta | FORMAT_FIELDS
    assert "NonTensorData" in meta["_type"] and set(meta) == set(NON_TENSOR_ORDER), meta
    return {k: meta[k] for k in NON_TENSOR_ORDER}


def fixture_data() -> TensorDict:
    return TensorDict(
        {"a": torch.ones(2, 3), "sub": {"b": torch.zeros(2, dtype=torch.bfloat16)},
         "t": NonTensorData("hi", batch_size=[2])},
        batch_size=[2],
    )


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_meta_json_matches_what_tensordict_0_15_3_writes(tmp_path: Path) -> None:
    """memtree writes the layout of tensordict 0.15.3, field for field and in its order."""
    save_tensordict(memtree.load_memmap(FIXTURE_0153), tmp_path / "ours")
    for rel in LEVELS:
        theirs, ours = read_json(FIXTURE_0153 / rel), read_json(tmp_path / "ours" / rel)
        assert ours == theirs and list(ours) == list(theirs), rel
    for rel in ("a.memmap", "sub/b.memmap"):
        assert (tmp_path / "ours" / rel).read_bytes() == (FIXTURE_0153 / rel).read_bytes()


def test_meta_json_matches_what_the_installed_tensordict_writes(tmp_path: Path) -> None:
    """Against the tensordict installed (torchrl 0.14 pins 0.14.x): every field it writes is
    written with the same value; the differences are exactly 0.15.3's (two format fields on
    TensorDict levels, a NonTensorData's field order); it loads memtree's output as its own."""
    data = fixture_data()
    data.memmap(tmp_path / "theirs")
    save_tensordict(memtree.load_memmap(tmp_path / "theirs"), tmp_path / "ours")
    for rel in LEVELS:
        theirs = as_written_by_0_15_3(read_json(tmp_path / "theirs" / rel))
        ours = read_json(tmp_path / "ours" / rel)
        assert ours == theirs and list(ours) == list(theirs), rel
    for rel in ("a.memmap", "sub/b.memmap"):
        assert (tmp_path / "ours" / rel).read_bytes() == (tmp_path / "theirs" / rel).read_bytes()
    loaded = TensorDict.load_memmap(tmp_path / "ours")
    assert loaded["t"] == "hi" and loaded.batch_size == data.batch_size
    assert as_bytes(loaded["a"]) == as_bytes(data["a"]) and as_bytes(loaded["sub", "b"]) == as_bytes(data["sub", "b"])


def test_a_directory_tensordict_0_15_3_wrote_loads_bit_exactly() -> None:
    tree = memtree.load_memmap(FIXTURE_0153, mode="r")
    data = fixture_data()
    assert tree.batch_size == torch.Size([2]) and tree["t"] == "hi"
    assert as_bytes(tree["a"]) == as_bytes(data["a"]) and as_bytes(tree["sub", "b"]) == as_bytes(data["sub", "b"])


def test_tensordict_tensorclass_survives_a_conversion(tmp_path: Path) -> None:
    step = TDStep(obs=torch.randn(4, 2), reward=torch.arange(4.0), note="sim", batch_size=[4])
    TensorDict({"s": step, "w": torch.ones(4)}, batch_size=[4]).memmap(tmp_path / "src")
    result = memtree.convert(tmp_path / "src", tmp_path / "td", format="tensordict", dtype="bfloat16")
    assert not result.altered
    loaded = TensorDict.load_memmap(tmp_path / "td")
    assert type(loaded["s"]) is TDStep and loaded["s"].note == "sim"
    assert as_bytes(loaded["s"].obs) == as_bytes(step.obs.to(torch.bfloat16))
    assert loaded["s"].batch_size == torch.Size([4])


def test_tensordict_tensorclass_loads_as_the_registered_memtree_tensorclass(tmp_path: Path) -> None:
    step = TDStep(obs=torch.randn(3, 2), reward=torch.arange(3.0), note="real", batch_size=[3])
    TensorDict({"s": step}, batch_size=[3]).memmap(tmp_path / "td")
    tree = memtree.load_memmap(tmp_path / "td")
    assert type(tree["s"]) is MemStep and type(tree) is memtree.TensorTree
    assert tree["s"].note == "real" and torch.equal(tree["s"].reward, step.reward)
    assert tree["s"][1:].obs.shape == (2, 2)
    # saved with memtree, it records the memtree class name
    tree.memmap(tmp_path / "mt", copy_existing=True)
    assert type(memtree.load_memmap(tmp_path / "mt")["s"]) is MemStep
    # a root-level tensorclass directory too
    step.memmap(tmp_path / "root")
    assert type(memtree.load_memmap(tmp_path / "root")) is MemStep


def test_an_unregistered_tensorclass_loads_as_a_plain_tree(tmp_path: Path) -> None:
    from memtree.tree.parts import registry

    saved = registry._CLASSES.pop("TDStep")
    try:
        TDStep(obs=torch.zeros(2, 1), reward=torch.zeros(2), batch_size=[2]).memmap(tmp_path / "td")
        tree = memtree.load_memmap(tmp_path / "td")
        assert type(tree) is memtree.TensorTree and tree["note"] == "none"
    finally:
        registry._CLASSES["TDStep"] = saved


def test_longest_registered_suffix_wins() -> None:
    from memtree.tree.parts.registry import class_for_foreign

    @memtree.tensorclass(name="test_tensordict_write.TDStep")
    class FullPath:
        obs: torch.Tensor

    assert class_for_foreign("<class 'test_tensordict_write.TDStep'>") is FullPath
    assert class_for_foreign("<class 'other.module.TDStep'>") is MemStep
    assert class_for_foreign("<class '__main__.Nothing'>") is None
    assert class_for_foreign("<class 'x.TensorTree'>") is None


def test_memtree_tensorclass_is_written_as_a_tensordict_and_reported(tmp_path: Path) -> None:
    tree = memtree.TensorTree({"m": MemOnly(x=torch.arange(2), batch_size=[2])}, batch_size=[2])
    tree.memmap(tmp_path / "mt")
    result = memtree.convert(tmp_path / "mt", tmp_path / "td", format="tensordict")
    assert result.altered == {"m": "@tensorclass tests.MemOnly -> TensorDict (tensordict cannot import memtree classes)"}
    assert TensorDict.load_memmap(tmp_path / "td")["m", "x"].tolist() == [0, 1]


def test_tensordict_class_becoming_a_plain_memtree_tree_is_reported(tmp_path: Path) -> None:
    TensorDict({"s": TDStep(obs=torch.zeros(1, 1), reward=torch.zeros(1), batch_size=[1])}, [1]).memmap(
        tmp_path / "td"
    )
    result = memtree.convert(tmp_path / "td", tmp_path / "mt")
    assert list(result.altered) == ["s"] and "TDStep" in result.altered["s"]


def test_keys_the_layout_cannot_hold_are_refused_before_writing(tmp_path: Path) -> None:
    for key in ("shape", "device", "_type"):
        with pytest.raises(memtree.InvalidKeyError, match=repr(key)):
            write_tensordict_dir(tmp_path / "td", Level((), {"sub": Level((), {key: torch.ones(1)})}))
        assert not (tmp_path / "td").exists()
    with pytest.raises(memtree.InvalidKeyError, match="255"):
        write_tensordict_dir(tmp_path / "td", Level((), {"%" * 90: torch.ones(1)}))
    assert os.listdir(tmp_path) == [] or all(p.endswith(".lock") for p in os.listdir(tmp_path))


def test_float8_is_refused_with_the_cast_hint_and_the_cast_works(tmp_path: Path) -> None:
    tree = memtree.TensorTree({"f8": torch.ones(2).to(torch.float8_e4m3fn), "i": torch.ones(2, dtype=torch.int8)})
    tree.memmap(tmp_path / "mt")
    with pytest.raises(memtree.DtypeError, match="--dtype"):
        memtree.convert(tmp_path / "mt", tmp_path / "td", format="tensordict")
    assert not (tmp_path / "td").exists()
    memtree.convert(tmp_path / "mt", tmp_path / "td", format="tensordict", dtype="bfloat16")
    td = TensorDict.load_memmap(tmp_path / "td")
    assert td["f8"].dtype == torch.bfloat16 and td["f8"].tolist() == [1.0, 1.0] and td["i"].dtype == torch.int8


def test_values_the_layout_cannot_hold_are_dropped_and_reported(tmp_path: Path) -> None:
    result = write_tensordict_dir(
        tmp_path / "td", Level((), {"w": torch.ones(1), "nan": NonTensor(float("nan")), "ok": NonTensor(1)})
    )
    assert result.dropped == ["nan"] and result.tensors == 1
    assert "nan" not in TensorDict.load_memmap(tmp_path / "td").keys()


def test_existing_destinations(tmp_path: Path) -> None:
    tree = memtree.TensorTree({"w": torch.ones(2)})
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(memtree.DestinationExistsError):
        save_tensordict(tree, other)
    with pytest.raises(memtree.DestinationExistsError, match="not a memtree directory"):
        save_tensordict(tree, other, existsok=True)  # never replaces an arbitrary directory
    assert (other / "keep.txt").read_text() == "mine"
    save_tensordict(tree, tmp_path / "td")
    with pytest.raises(memtree.DestinationExistsError):
        save_tensordict(memtree.TensorTree({"v": torch.zeros(1)}), tmp_path / "td")
    save_tensordict(memtree.TensorTree({"v": torch.zeros(1)}), tmp_path / "td", existsok=True)
    assert list(TensorDict.load_memmap(tmp_path / "td").keys()) == ["v"]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["other", "td"]


def test_a_failure_mid_write_leaves_nothing(tmp_path: Path) -> None:
    def boom():
        raise OSError(5, "injected")

    from memtree.interop.lazy import LazyLeaf

    level = Level((), {"a": torch.ones(2), "b": LazyLeaf((2,), torch.float32, boom)})
    with pytest.raises(OSError):
        write_tensordict_dir(tmp_path / "td", level)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_cli_format_tensordict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save({"enc.w": torch.arange(4.0), "step": 3}, tmp_path / "c.pt")
    assert main(["convert", str(tmp_path / "c.pt"), str(tmp_path / "td"), "--format", "tensordict", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["destination"] == "tensordict" and out["tensors"] == 1 and out["bytes"] == 16
    td = TensorDict.load_memmap(tmp_path / "td")
    assert td["enc", "w"].tolist() == [0.0, 1.0, 2.0, 3.0] and td["step"] == 3


# -- random trees ---------------------------------------------------------------------------------
_KEYS = st.text(
    st.characters(codec="utf-8", exclude_characters="\0"), min_size=1, max_size=8
).filter(lambda k: k not in ("shape", "device", "_type", "_format_version", "_class", "_names"))
_VALUES = st.one_of(
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=5),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.none(),
    st.lists(st.integers(-5, 5), max_size=3),
)


@st.composite
def levels(draw, batch=(), depth=0):
    batch = tuple(batch) + tuple(draw(st.lists(st.integers(0, 3), max_size=1 if depth < 2 else 0)))
    entries = {}
    for key in draw(st.lists(_KEYS, max_size=4, unique_by=lambda k: k.casefold())):
        kind = draw(st.sampled_from(["tensor", "value", "level"] if depth < 2 else ["tensor", "value"]))
        if kind == "tensor":
            dtype = draw(st.sampled_from(DTYPES))
            shape = batch + tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
            entries[key] = random_tensor(shape, dtype, draw(st.integers(0, 2**16)))
        elif kind == "value":
            entries[key] = NonTensor(draw(_VALUES))
        else:
            entries[key] = draw(levels(batch, depth + 1))
    return Level(batch, entries)


def _level_leaves(level: Level, prefix=()):
    out = {}
    for key, value in level.entries.items():
        path = prefix + (key,)
        if isinstance(value, Level):
            out.update(_level_leaves(value, path))
        else:
            out[path] = value.data if isinstance(value, NonTensor) else value
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(level=levels())
def test_random_trees_round_trip_through_the_real_tensordict(tmp_path_factory, level: Level) -> None:
    d = tmp_path_factory.mktemp("td") / "out"
    write_tensordict_dir(d, level)
    td = TensorDict.load_memmap(d)
    assert td.batch_size == torch.Size(level.batch_size)
    assert_same(td_leaves(td), _level_leaves(level))
