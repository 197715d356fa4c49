"""``memtree diff`` and ``memtree du``, including trees hard-linked by ``link_from``."""

from __future__ import annotations

import json
import os

import pytest
import torch

import memtree
from memtree.cli.diff import diff_trees
from memtree.cli.du import disk_usage
from memtree.cli.main import main
from memtree.format.level import Level
from memtree.store.reading.options import WriteOptions
from memtree.store.writing.write import write_tree


def _level(w: torch.Tensor, **extra) -> Level:
    return Level((), {"model": Level((), {"w": w, "b": torch.arange(8.0)}), "step": 1, **extra})


def _run(capsys, *argv) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


# -- diff ------------------------------------------------------------------------------------------


def test_diff_identical_and_changed_from_checksums_alone(tmp_path, capsys):
    write_tree(tmp_path / "a", _level(torch.zeros(256)))
    write_tree(tmp_path / "b", _level(torch.zeros(256)))
    write_tree(tmp_path / "c", _level(torch.ones(256), lr=0.1))
    report = diff_trees(tmp_path / "a", tmp_path / "b")
    assert report.identical and report.same == 4 and report.bytes_read == 0
    report = diff_trees(tmp_path / "a", tmp_path / "c")
    assert [(c["key"], c["what"]) for c in report.changed] == [(["model", "w"], ["data"])]
    assert report.only_in_b == [["lr"]] and report.only_in_a == [] and report.bytes_read == 0
    code, out = _run(capsys, "diff", str(tmp_path / "a"), str(tmp_path / "c"))
    assert code == 1 and "changed    model/w  data" in out and "only in B  lr" in out
    code, out = _run(capsys, "diff", "--json", str(tmp_path / "a"), str(tmp_path / "b"))
    assert code == 0 and json.loads(out)["identical"] is True


def test_diff_dtype_shape_value_kind_and_subtrees(tmp_path):
    write_tree(tmp_path / "a", Level((), {
        "d": torch.zeros(4), "s": torch.zeros(4), "v": {"lr": 1}, "k": torch.zeros(1),
        "gone": Level((), {"x": torch.ones(1), "y": torch.ones(1)}), "t": Level((), {"z": 1}),
    }))
    write_tree(tmp_path / "b", Level((), {
        "d": torch.zeros(4, dtype=torch.int32), "s": torch.zeros(2, 2), "v": {"lr": 2}, "k": "text",
        "t": torch.zeros(1),
    }))
    report = diff_trees(tmp_path / "a", tmp_path / "b")
    changed = {tuple(c["key"]): c["what"] for c in report.changed}
    assert changed == {("d",): ["dtype"], ("s",): ["shape"], ("v",): ["value"], ("k",): ["kind"], ("t",): ["kind"]}
    assert report.only_in_a == [["gone"]] and report.only_in_b == []


def test_diff_reads_data_when_checksums_cannot_decide(tmp_path):
    write_tree(tmp_path / "none", _level(torch.zeros(256)), WriteOptions.of(checksum=None))
    write_tree(tmp_path / "crc", _level(torch.zeros(256)), WriteOptions.of(checksum="crc32"))
    write_tree(tmp_path / "sha", _level(torch.ones(256)), WriteOptions.of(checksum="sha256"))
    report = diff_trees(tmp_path / "none", tmp_path / "crc")  # one side's algorithm: B's sums, A read
    assert report.identical and report.bytes_read == 256 * 4 + 8 * 4
    report = diff_trees(tmp_path / "crc", tmp_path / "sha")
    assert [c["key"] for c in report.changed] == [["model", "w"]]
    assert report.bytes_read == 256 * 4 + 8 * 4
    report = diff_trees(tmp_path / "none", tmp_path / "none")
    assert report.identical and report.bytes_read == 0  # the same files: no read


def test_diff_of_hard_linked_checkpoints(tmp_path):
    write_tree(tmp_path / "1", _level(torch.zeros(256)), WriteOptions.of(checksum=None))
    write_tree(tmp_path / "2", _level(torch.zeros(256)), WriteOptions.of(checksum="crc32"))
    write_tree(tmp_path / "3", _level(torch.zeros(256)), WriteOptions.of(link_from=tmp_path / "2", checksum="crc32"))
    assert os.stat(tmp_path / "2" / "model" / "w.memmap").st_ino == os.stat(tmp_path / "3" / "model" / "w.memmap").st_ino
    report = diff_trees(tmp_path / "2", tmp_path / "3")
    assert report.identical and report.bytes_read == 0


def test_diff_after_growth_compares_data(tmp_path):
    buf = memtree.TensorTree({"x": torch.zeros(2, 3)}, batch_size=[2]).memmap(tmp_path / "a")
    memtree.TensorTree({"x": torch.zeros(3, 3)}, batch_size=[3]).memmap(tmp_path / "b")
    buf.append_({"x": torch.zeros(3)})  # capacity, no checksum
    report = diff_trees(tmp_path / "a", tmp_path / "b")
    assert report.identical and report.bytes_read == 36
    buf[2] = {"x": torch.ones(3)}
    assert [c["key"] for c in diff_trees(tmp_path / "a", tmp_path / "b").changed] == [["x"]]


def test_diff_of_100k_entries_is_linear(tmp_path, capsys):
    """100,000 entries in a few levels, 50,000 on each side only, values changed, a sub-tree on one
    side, a kind change; every count exact (a sub-tree on one side is listed once). Linear: seconds
    (under the suite's timeout even on a loaded machine); quadratic, as before: over ten minutes."""
    values = lambda lo, hi, bump=0: {f"k{i}": i + (bump if i % 2 == 0 else 0) for i in range(lo, hi)}  # noqa: E731
    a = Level((), {"shifted": Level((), values(0, 100_000)), "bumped": Level((), values(0, 1000)),
                   "gone": Level((), values(0, 100)), "kind": Level((), values(0, 10)), "w": torch.arange(4)})
    b = Level((), {"shifted": Level((), values(50_000, 150_000)), "bumped": Level((), values(0, 1000, bump=1)),
                   "new": Level((), values(0, 100)), "kind": torch.zeros(1), "w": torch.arange(4) + 1})
    write_tree(tmp_path / "a", a)
    write_tree(tmp_path / "b", b)
    code, out = _run(capsys, "diff", "--json", str(tmp_path / "a"), str(tmp_path / "b"))  # diff_trees, printed
    report = json.loads(out)
    assert code == 1 and not report["identical"]
    assert [(c["key"], c["what"]) for c in report["changed"][:1] + report["changed"][-1:]] == [
        (["kind"], ["kind"]), (["w"], ["data"])]
    assert len(report["changed"]) == 2 + 500  # kind, w, and every even value of "bumped"
    assert all(c["key"][0] == "bumped" and c["what"] == ["value"] for c in report["changed"][1:-1])
    by_str = lambda lo, hi: [["shifted", f"k{i}"] for i in sorted(range(lo, hi), key=str)]  # noqa: E731
    assert report["only_in_a"] == [["gone"]] + by_str(0, 50_000)
    assert report["only_in_b"] == [["new"]] + by_str(100_000, 150_000)
    assert report["same"] == 50_000 + 500 + 2 and report["bytes_read"] == 0  # + the levels bumped, shifted


def test_diff_refuses_what_is_not_a_tree(tmp_path, capsys):
    write_tree(tmp_path / "a", _level(torch.zeros(2)))
    code = main(["diff", str(tmp_path / "a"), str(tmp_path / "missing")])
    assert code == 1 and "does not exist" in capsys.readouterr().err


# -- du --------------------------------------------------------------------------------------------


def test_du_of_a_checkpoint_root_with_links(tmp_path, capsys):
    root = tmp_path / "ckpt"
    w = torch.zeros(64 * 1024)  # 256 KiB, shared by every step
    for step in (10, 20, 30):
        link = root / str(step - 10) if step > 10 else None
        level = _level(w, step_value=torch.full((1024,), float(step)))
        write_tree(root / str(step), level, WriteOptions.of(link_from=link) if link else None)
    (root / ".ckpt.memtree.lock").write_bytes(b"")  # ignored
    (root / "notes").mkdir()  # not a step: ignored
    (root / "notes" / "big").write_bytes(b"x" * 100_000)
    r = disk_usage(root)
    assert r.kind == "checkpoints" and [s.name for s in r.steps] == ["10", "20", "30"]
    w_bytes, b_bytes = 256 * 1024, 32
    assert r.linked_bytes == 2 * (w_bytes + b_bytes)
    assert r.apparent_bytes - r.unique_bytes == r.linked_bytes
    assert r.steps[0].shared_bytes == w_bytes + b_bytes
    assert all(s.exclusive_bytes < w_bytes for s in r.steps)
    assert r.allocated_bytes < r.apparent_bytes - w_bytes  # the shared leaf is stored once
    assert r.outside_links_bytes == 0
    code, out = _run(capsys, "du", "--json", str(root))
    assert code == 0 and json.loads(out)["linked_bytes"] == r.linked_bytes
    code, out = _run(capsys, "du", str(root))
    assert code == 0 and "3 steps" in out and "step 20:" in out
    # one step alone: its linked files have names outside it
    one = disk_usage(root / "20")
    assert one.kind == "tree" and one.linked_bytes == 0 and one.outside_links_bytes == w_bytes + b_bytes
    assert one.steps[0].exclusive_bytes < w_bytes


def test_du_of_a_sparse_tree_and_of_junk(tmp_path, capsys):
    memtree.TensorTree({"x": torch.zeros(1 << 20, dtype=torch.uint8)}).memmap_like(tmp_path / "t")
    r = disk_usage(tmp_path / "t")
    assert r.apparent_bytes > 1 << 20 and r.allocated_bytes < 1 << 20
    os.symlink("/", tmp_path / "t" / "escape")  # never followed
    assert disk_usage(tmp_path / "t").apparent_bytes == r.apparent_bytes
    (tmp_path / "empty").mkdir()
    assert main(["du", str(tmp_path / "empty")]) == 1
    assert "neither a memtree tree" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name, is_step",
    [("0", True), ("12", True), ("012", False), ("1a", False), ("٣", False), ("-1", False),
     (str(2**63 - 1), True), (str(2**63), False)],  # Checkpointer's steps: the same rule
)
def test_du_step_names(tmp_path, name, is_step):
    write_tree(tmp_path / name, _level(torch.zeros(2)))
    if is_step:
        assert [s.name for s in disk_usage(tmp_path).steps] == [name]
    else:
        with pytest.raises(memtree.NotAMemtreeError):
            disk_usage(tmp_path)


def test_regular_files_counts_each_name_follows_no_link(tmp_path):
    from memtree.errors import StorageError
    from memtree.store.primitives.files import regular_files

    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f").write_bytes(b"x" * 10)
    os.link(tmp_path / "a" / "b" / "f", tmp_path / "a" / "g")  # one file, two names
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "big").write_bytes(b"y" * 1000)
    os.symlink(tmp_path / "outside", tmp_path / "a" / "dirlink")
    os.symlink(tmp_path / "outside" / "big", tmp_path / "a" / "filelink")
    found = regular_files(tmp_path / "a")
    assert sorted(st.st_size for st in found) == [10, 10]
    assert len({(st.st_dev, st.st_ino) for st in found}) == 1 and all(st.st_nlink == 2 for st in found)
    with pytest.raises(StorageError, match="walking"):
        regular_files(tmp_path / "missing")
