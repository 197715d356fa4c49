"""``repr(tree)`` (compact, truncated with a summary for huge trees) and ``tree._repr_html_()``
(notebooks: collapsible, escaped, with the files of memory-mapped leaves)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from memtree import NonTensor, TensorTree, load_memmap


def big_tree(n_layers: int = 1000, per_layer: int = 20) -> TensorTree:
    return TensorTree({f"layer{i}": {f"w{j}": torch.zeros(2) for j in range(per_layer)} for i in range(n_layers)})


def balanced(html: str) -> bool:
    return all(html.count(f"<{tag}") == html.count(f"</{tag}>") for tag in ("details", "summary", "ul", "li", "div"))


# ------------------------------------------------------------------------------------ text


def test_repr_lists_one_line_per_entry_with_dtype_shape_and_location(tmp_path: Path) -> None:
    tree = TensorTree({"obs": torch.zeros(4, 3), "info": {"step": torch.arange(4)}, "name": "run"}, batch_size=[4])
    tree.memmap(tmp_path / "t")
    assert repr(tree).splitlines() == [
        "TensorTree(batch_size=[4])",
        "  obs: float32[4, 3] cpu",
        "  info: TensorTree(batch_size=[4])",
        "    step: int64[4] cpu",
        "  name: 'run'",
    ]
    lines = repr(load_memmap(tmp_path / "t", mode="r")).splitlines()
    assert lines[1] == "  obs: float32[4, 3] cpu memmap, read-only"
    assert repr(load_memmap(tmp_path / "t")).splitlines()[3] == "    step: int64[4] cpu memmap"


def test_repr_marks_anonymous_shared_memory_leaves() -> None:
    tree = TensorTree({"a": torch.ones(2)}).memmap()
    assert repr(tree).splitlines()[1] == "  a: float32[2] cpu shared memory"


def test_repr_of_20000_leaves_is_truncated_with_an_exact_summary() -> None:
    tree = big_tree()
    lines = repr(tree).splitlines()
    assert len(lines) == 1 + TensorTree._repr_max_lines + 1
    shown = lines[1:-1]
    n_trees = sum(line.endswith("TensorTree(batch_size=[])") for line in shown)
    n_tensors = len(shown) - n_trees
    assert lines[-1] == (
        f"  … and {20000 - n_tensors:,} tensors, {1000 - n_trees:,} sub-trees "
        f"({(20000 - n_tensors) * 8 / 1024:,.1f} KiB of tensors) not shown; "
        "tree.keys(include_nested=True) lists every key"
    )


def test_repr_is_not_truncated_at_exactly_the_limit() -> None:
    tree = TensorTree({f"k{i}": torch.zeros(1) for i in range(TensorTree._repr_max_lines)})
    lines = repr(tree).splitlines()
    assert len(lines) == 1 + TensorTree._repr_max_lines
    assert "not shown" not in lines[-1]


def test_repr_truncates_large_non_tensor_values() -> None:
    tree = TensorTree({"ids": list(range(1_000_000)), "text": "x" * 100_000, "cfg": NonTensor({"a": [1] * 100})})
    lines = repr(tree).splitlines()
    assert all(len(line) < 100 for line in lines), lines
    assert lines[1].startswith("  ids: [0, 1, 2, 3, 4, 5, ...")


def test_repr_shows_keys_with_control_characters_escaped_on_one_line() -> None:
    lines = repr(TensorTree({"a\nb": torch.zeros(1), "tab\there": 1})).splitlines()
    assert lines[1:] == ["  'a\\nb': float32[1] cpu", "  'tab\\there': 1"]


def test_repr_shows_device_and_lock() -> None:
    tree = TensorTree({"a": torch.zeros(1)}, device="cpu").lock_()
    assert repr(tree).splitlines()[0] == "TensorTree(batch_size=[], device=cpu, locked)"


# ------------------------------------------------------------------------------------ html


def test_html_nests_sub_trees_in_details_with_dtypes_shapes_and_files(tmp_path: Path) -> None:
    tree = TensorTree({"obs": torch.zeros(4, 3), "info": {"step": torch.arange(4)}, "name": "run"}, batch_size=[4])
    tree = tree.memmap(tmp_path / "t")
    html = tree._repr_html_()
    assert balanced(html)
    assert html.count("<details") == 2  # the root and the sub-tree "info"
    assert "<code>obs</code>: float32[4, 3] cpu memmap" in html
    assert f'title="{tmp_path / "t" / "info" / "step.memmap"}"' in html
    assert ">info/step.memmap</span>" in html  # relative to the common directory...
    assert f"files in <code>{tmp_path / 't'}</code>" in html  # ...named once at the top
    assert "<code>name</code>: &#x27;run&#x27;" in html
    assert "3 tensors" not in html and "2 tensors, 80 B" in html


def test_html_escapes_keys_values_and_paths(tmp_path: Path) -> None:
    evil = "<script>alert(1)</script>"
    tree = TensorTree({evil: torch.zeros(1), "sub": {"v": evil}, "x&y": torch.zeros(1)})
    tree = tree.memmap(tmp_path / "a<b>")
    html = tree._repr_html_()
    assert "<script>" not in html and "a<b>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "x&amp;y" in html and "a&lt;b&gt;" in html
    assert balanced(html)


def test_html_of_small_trees_starts_expanded_and_of_large_ones_collapsed() -> None:
    small = TensorTree({"a": {"b": torch.zeros(1)}})._repr_html_()
    assert "<details open><summary><code>a</code>" in small
    large = TensorTree({f"s{i}": {"b": torch.zeros(1)} for i in range(40)})._repr_html_()
    assert re.search(r"<details><summary><code>s0</code>", large)
    assert large.startswith('<div class="memtree-repr"') and "<details open><summary><b>TensorTree" in large


def test_html_of_20000_leaves_is_capped_and_stays_well_formed() -> None:
    html = big_tree()._repr_html_()
    assert balanced(html)
    assert html.count("<li") == TensorTree._repr_html_max_rows + 1
    assert "20,000 tensors, 156.2 KiB" in html
    assert "not shown; tree.keys(include_nested=True) lists every key" in html


@pytest.mark.parametrize("cap", [1, 2, 3, 4, 5])
def test_html_truncation_inside_nested_levels_keeps_tags_balanced(cap: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TensorTree, "_repr_html_max_rows", cap)
    tree = TensorTree({"a": {"b": {"c": torch.zeros(1), "d": torch.zeros(1)}, "e": 1}, "f": torch.zeros(2)})
    html = tree._repr_html_()
    assert balanced(html)
    assert html.count("<li") == cap + 1  # the shown entries plus the summary line
    assert "not shown" in html


def test_html_of_an_empty_tree() -> None:
    html = TensorTree()._repr_html_()
    assert balanced(html) and "0 tensors, 0 B" in html


def test_repr_names_tensor_subclasses_and_html_shows_offloaded_files(tmp_path: Path) -> None:
    import memtree
    from torch import nn

    memtree.TensorTree.from_module(nn.Linear(4, 2)).memmap(tmp_path / "lin")
    with memtree.empty_init():
        lazy = nn.Linear(4, 2)
    memtree.offload(lazy, tmp_path / "lin")
    tree = TensorTree.from_module(lazy)
    assert repr(tree).splitlines()[1] == "  weight: float32[2, 4] OffloadedTensor, cpu"
    html = tree._repr_html_()
    assert f'title="{tmp_path / "lin" / "weight.memmap"}"' in html and ">weight.memmap</span>" in html
    plain = TensorTree.from_module(nn.Linear(4, 2))  # nn.Parameter leaves print as plain tensors
    assert repr(plain).splitlines()[1] == "  weight: float32[2, 4] cpu"


def test_repr_and_html_name_tensorclass_levels() -> None:
    import memtree

    @memtree.tensorclass(name="test_repr.Pair")
    class Pair:
        a: torch.Tensor
        b: torch.Tensor

    tree = TensorTree({"pair": Pair(torch.zeros(2), torch.ones(2), batch_size=[2])}, batch_size=[2])
    assert repr(tree).splitlines()[1] == "  pair: Pair(batch_size=[2])"
    assert "<code>pair</code>: Pair batch_size=[2] (2 keys)" in tree._repr_html_()
    assert repr(tree["pair"]).splitlines()[0] == "Pair(batch_size=[2])"
