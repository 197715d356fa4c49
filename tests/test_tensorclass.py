"""@tensorclass: dataclass records that behave like a TensorTree and round-trip as their class."""

import dataclasses
import pickle
import sys

import orjson
import pytest
import torch

import memtree
from memtree.format.schema import TYPE_NAME_MAX, is_type_name, parse_level


@memtree.tensorclass
class Obs:
    pixels: torch.Tensor
    position: torch.Tensor


@memtree.tensorclass(name="tests.Transition")
class Transition:
    obs: Obs
    action: torch.Tensor
    reward: torch.Tensor
    source: str = "sim"
    info: dict = dataclasses.field(default_factory=dict)

    def total_reward(self) -> torch.Tensor:
        return self.reward.sum()


@memtree.tensorclass(name="tests.Episode")
class Episode(Transition):
    """A tensorclass inheriting another one: adds a field, keeps the methods."""

    done: torch.Tensor = None

    def total_reward(self) -> torch.Tensor:
        return super().total_reward() * 2


def make_transition(n: int = 4) -> Transition:
    g = torch.Generator().manual_seed(n)
    obs = Obs(
        pixels=torch.randint(0, 255, (n, 3, 4, 4), dtype=torch.uint8, generator=g),
        position=torch.randn(n, 2, generator=g, dtype=torch.float64),
        batch_size=[n],
    )
    return Transition(
        obs, torch.randint(0, 5, (n,), generator=g), torch.randn(n, generator=g).to(torch.bfloat16),
        info={"run": 3, "tags": ["a", "b"]}, batch_size=[n],
    )


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    )


def assert_same(a: memtree.TensorTree, b: memtree.TensorTree) -> None:
    """Same classes at every level, same keys, bit-identical tensors, equal non-tensor values."""
    assert type(a) is type(b)
    assert a.batch_size == b.batch_size
    assert list(a.keys()) == list(b.keys())
    for key in a.keys():
        x, y = a[key], b[key]
        if isinstance(x, memtree.TensorTree):
            assert_same(x, y)
        elif isinstance(x, torch.Tensor):
            assert bits_equal(x, y), key
        else:
            assert x == y, key


# ------------------------------------------------------------------------------ construction


def test_fields_are_tree_keys_and_attributes():
    t = make_transition()
    assert isinstance(t, memtree.TensorTree)
    assert list(t.keys()) == ["obs", "action", "reward", "source", "info"]
    assert t.action is t["action"]
    assert t.obs.pixels is t["obs", "pixels"]
    assert t.source == "sim" and t.info == {"run": 3, "tags": ["a", "b"]}
    assert [f.name for f in dataclasses.fields(Transition)] == ["obs", "action", "reward", "source", "info"]


def test_positional_keyword_and_default_values():
    obs = Obs(torch.zeros(2, 1), torch.zeros(2, 2), batch_size=[2])
    a = Transition(obs, torch.zeros(2), reward=torch.ones(2), batch_size=[2])
    assert a.source == "sim" and a.info == {}
    b = Transition(obs, torch.zeros(2), torch.ones(2), batch_size=[2])
    assert b.info is not a.info  # default_factory: one dict per instance


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((), {"action": torch.zeros(2), "reward": torch.zeros(2)}, "missing a value for field 'obs'"),
        ((1, 2, 3, 4, 5, 6), {}, "takes 5 field values by position"),
        ((), {"obs": 1, "action": 1, "reward": 1, "rewards": 2}, "has no init field 'rewards'"),
        ((1,), {"obs": 1, "action": 1, "reward": 1}, "got two values for 'obs'"),
    ],
)
def test_wrong_arguments_raise_tensorclass_error(args, kwargs, match):
    with pytest.raises(memtree.TensorclassError, match=match):
        Transition(*args, **kwargs)


def test_leaves_must_match_batch_size():
    with pytest.raises(memtree.BatchSizeError, match="pixels"):
        Obs(torch.zeros(3, 1), torch.zeros(2, 2), batch_size=[2])


def test_post_init_runs_after_fields_are_set():
    @memtree.tensorclass(name="tests.Scaled")
    class Scaled:
        x: torch.Tensor

        def __post_init__(self):
            self.x = self.x * 10

    assert Scaled(torch.ones(2), batch_size=[2]).x.tolist() == [10.0, 10.0]


def test_methods_properties_and_zero_argument_super_work():
    n = 3
    obs = Obs(torch.zeros(n, 1), torch.zeros(n, 2), batch_size=[n])
    e = Episode(obs, torch.zeros(n), torch.ones(n), done=torch.zeros(n, dtype=torch.bool), batch_size=[n])
    assert e.total_reward().item() == 6.0
    assert isinstance(e, Transition) and type(e[0]) is Episode


def test_non_tensor_fields_stay_values():
    t = make_transition()
    t.source = "real"
    t.info = {"nested": {"deep": [1, 2]}}  # a dict field stays one value, not a sub-tree
    assert t.info == {"nested": {"deep": [1, 2]}} and not isinstance(t["info"], memtree.TensorTree)
    t.info = None
    assert t.info is None


def test_unset_field_raises_attribute_error():
    t = make_transition().exclude("reward")
    with pytest.raises(AttributeError, match="reward"):
        t.reward


# ----------------------------------------------------------------------------- behaves like a tree


@pytest.mark.parametrize(
    "index", [1, slice(1, 3), torch.tensor([3, 0]), torch.tensor([True, False, True, False])],
    ids=["int", "slice", "idx", "mask"],
)
def test_indexing_keeps_classes(index):
    t = make_transition()
    part = t[index]
    assert type(part) is Transition and type(part.obs) is Obs
    assert torch.equal(part.obs.pixels, t.obs.pixels[index])
    assert part.source == "sim"


def test_stack_cat_to_clone_keep_classes():
    t = make_transition()
    records = [t[i] for i in range(4)]
    stacked = memtree.stack(records)
    assert_same(stacked, t)
    assert_same(memtree.cat([t[:1], t[1:]]), t)
    moved = t.to(torch.float32)
    assert type(moved) is Transition and moved.obs.position.dtype == torch.float32
    assert_same(t.clone(), t)


def test_equality_gives_the_class_of_bools():
    t = make_transition()
    eq = t == t.clone()
    assert type(eq) is Transition and eq.all()
    other = t.clone()
    other.obs.position[2] += 1
    assert not (t == other).all()


def test_stack_refuses_differing_non_tensor_fields():
    a, b = make_transition()[0], make_transition()[1]
    b.source = "real"
    with pytest.raises(ValueError, match="source"):
        memtree.stack([a, b])


# --------------------------------------------------------------------------------------- on disk


def test_round_trip_nested_tensorclasses_keeps_classes_at_every_depth(tmp_path):
    tree = memtree.TensorTree(
        {"train": make_transition(4), "plain": {"deeper": make_transition(4), "w": torch.arange(4)}},
        batch_size=[4],
    )
    tree.memmap(tmp_path / "t")
    loaded = memtree.load_memmap(tmp_path / "t")
    assert_same(loaded, tree)
    assert type(loaded["plain"]) is memtree.TensorTree
    assert type(loaded["plain", "deeper", "obs"]) is Obs
    assert loaded.is_memmap()
    types = {
        p.parent.relative_to(tmp_path / "t").as_posix(): orjson.loads(p.read_bytes())["type"]
        for p in (tmp_path / "t").rglob("meta.json")
    }
    assert types == {
        ".": "TensorTree",
        "train": "tests.Transition",
        "train/obs": "Obs",
        "plain": "TensorTree",
        "plain/deeper": "tests.Transition",
        "plain/deeper/obs": "Obs",
    }


@pytest.mark.parametrize("how", ["function", "classmethod", "tree_classmethod", "memmap", "memmap_"])
def test_tensorclass_root_comes_back_as_its_class(tmp_path, how):
    t = make_transition()
    d = tmp_path / "t"
    if how == "memmap":
        out = t.memmap(d)
    elif how == "memmap_":
        out = t.clone().memmap_(d)
    else:
        t.memmap(d)
        load = {"function": memtree.load_memmap, "classmethod": Transition.load_memmap,
                "tree_classmethod": memtree.TensorTree.load_memmap}[how]
        out = load(d)
    assert_same(out, t)
    assert out.obs.pixels.filename == str(d / "obs" / "pixels.memmap")


def test_subclass_round_trips_as_subclass(tmp_path):
    n = 2
    e = Episode(Obs(torch.ones(n, 1), torch.ones(n, 2), batch_size=[n]), torch.ones(n), torch.ones(n),
                done=torch.tensor([False, True]), batch_size=[n])
    e.memmap(tmp_path / "e")
    loaded = memtree.load_memmap(tmp_path / "e")
    assert_same(loaded, e)
    assert loaded.total_reward().item() == 4.0


def test_memmap_like_and_partial_load_keep_classes(tmp_path):
    t = make_transition()
    like = t.memmap_like(tmp_path / "t")
    assert type(like) is Transition and like.source == "sim"
    assert not like.obs.pixels.any()
    part = memtree.load_memmap(tmp_path / "t", keys=[("obs", "position")])
    assert type(part) is Transition and type(part.obs) is Obs
    assert list(part.obs.keys()) == ["position"]
    meta = memtree.load_memmap(tmp_path / "t", device="meta")
    assert type(meta.obs) is Obs and meta.obs.pixels.device.type == "meta"


def test_writes_through_fields_reach_the_files(tmp_path):
    t = make_transition().memmap(tmp_path / "t")
    t.reward[1] = 5.0
    t[2] = make_transition(1)[0]
    loaded = memtree.load_memmap(tmp_path / "t")
    assert loaded.reward[1].item() == 5.0
    assert_same(loaded[2], make_transition(1)[0])


def test_pickle_round_trip_keeps_class(tmp_path):
    t = make_transition().memmap(tmp_path / "t")
    back = pickle.loads(pickle.dumps(t))
    assert_same(back, t)


# ----------------------------------------------------------------------------------- unknown types


def _set_type(path, name):
    meta = orjson.loads(path.read_bytes())
    meta["type"] = name
    path.write_bytes(orjson.dumps(meta))


def test_unknown_class_is_a_clear_error_naming_the_key(tmp_path):
    tree = memtree.TensorTree({"step": make_transition()}, batch_size=[4])
    tree.memmap(tmp_path / "t")
    _set_type(tmp_path / "t" / "step" / "obs" / "meta.json", "elsewhere.Observation")
    with pytest.raises(memtree.UnknownClassError, match=r"\('step', 'obs'\).*'elsewhere.Observation'") as ei:
        memtree.load_memmap(tmp_path / "t", lazy=False)
    assert isinstance(ei.value, memtree.MetaFormatError)
    assert "unknown_classes='tree'" in str(ei.value)


def test_unknown_class_loads_as_plain_tree_when_asked(tmp_path):
    t = make_transition()
    t.memmap(tmp_path / "t")
    _set_type(tmp_path / "t" / "meta.json", "elsewhere.Step")
    loaded = memtree.load_memmap(tmp_path / "t", unknown_classes="tree")
    assert type(loaded) is memtree.TensorTree and type(loaded["obs"]) is Obs
    assert bits_equal(loaded["obs", "pixels"], t.obs.pixels)
    with pytest.raises(ValueError, match="unknown_classes"):
        memtree.load_memmap(tmp_path / "t", unknown_classes="import")


def test_loading_never_imports_a_module_named_in_a_file(tmp_path, monkeypatch):
    module_dir = tmp_path / "mods"
    module_dir.mkdir()
    (module_dir / "memtree_probe_mod.py").write_text("raise SystemExit('imported!')\n")
    monkeypatch.syspath_prepend(str(module_dir))
    t = make_transition()
    t.memmap(tmp_path / "t")
    _set_type(tmp_path / "t" / "meta.json", "memtree_probe_mod.Step")
    with pytest.raises(memtree.UnknownClassError):
        memtree.load_memmap(tmp_path / "t")
    assert "memtree_probe_mod" not in sys.modules


@pytest.mark.parametrize(
    "name", ["__main__.X", "<class '__main__.X'>", "pkg._impl.X", "a..b", "1abc", "a/b", "", "é", "x" * 201]
)
def test_type_that_is_no_class_name_is_a_format_error(tmp_path, name):
    t = memtree.TensorTree({"a": torch.zeros(2)}, batch_size=[2])
    t.memmap(tmp_path / "t")
    _set_type(tmp_path / "t" / "meta.json", name)
    with pytest.raises(memtree.MetaFormatError) as ei:
        memtree.load_memmap(tmp_path / "t")
    assert not isinstance(ei.value, memtree.UnknownClassError)
    assert str(tmp_path / "t" / "meta.json") in str(ei.value)


def test_type_name_rules():
    assert is_type_name("TensorTree") and is_type_name("rl.agents.Step_2")
    assert is_type_name("a" * TYPE_NAME_MAX)
    assert not is_type_name("a" * (TYPE_NAME_MAX + 1)) and not is_type_name("a.") and not is_type_name(5)
    meta = {"format": "memtree", "version": 1, "type": "rl.Step", "byteorder": "little",
            "batch_size": [], "entries": []}
    assert parse_level(orjson.dumps(meta), "m").type == "rl.Step"


# ------------------------------------------------------------------------------------ registry


def test_taken_name_is_refused():
    with pytest.raises(memtree.TensorclassError, match="already registered.*Transition"):
        @memtree.tensorclass(name="tests.Transition")
        class Other:
            x: torch.Tensor


def test_redefining_the_same_class_takes_the_name_over(tmp_path):
    def define(scale):
        @memtree.tensorclass
        class Reloaded:
            x: torch.Tensor

            def scaled(self):
                return self.x * scale

        return Reloaded

    first, second = define(1), define(2)
    assert first.__tensorclass_name__ == "test_redefining_the_same_class_takes_the_name_over.define.Reloaded"
    second(torch.ones(1), batch_size=[1]).memmap(tmp_path / "r")
    assert memtree.load_memmap(tmp_path / "r").scaled().item() == 2.0


@pytest.mark.parametrize("name", ["TensorTree", "memtree.Thing", "bad name", "_private"])
def test_reserved_or_invalid_names_are_refused(name):
    with pytest.raises(memtree.TensorclassError, match=repr(name)):
        @memtree.tensorclass(name=name)
        class Named:
            x: torch.Tensor


@pytest.mark.parametrize("field", ["keys", "batch_size", "to", "_data", "_secret"])
def test_field_names_that_hide_tree_attributes_are_refused(field):
    with pytest.raises(memtree.TensorclassError, match=field):
        cls = type("BadField", (), {"__annotations__": {field: torch.Tensor}})
        memtree.tensorclass(name="tests.BadField")(cls)


def test_own_init_or_slots_are_refused():
    with pytest.raises(memtree.TensorclassError, match="__post_init__"):
        @memtree.tensorclass(name="tests.WithInit")
        class WithInit:
            x: torch.Tensor

            def __init__(self):
                pass

    with pytest.raises(memtree.TensorclassError, match="__slots__"):
        @memtree.tensorclass(name="tests.WithSlots")
        class WithSlots:
            __slots__ = ("x",)
            x: torch.Tensor
