"""``memtree.progress``: when a bar is shown (``progress=`` None/True/False, TTY, ``CI``), and
that nothing is printed or fails without tqdm."""

from __future__ import annotations

import io
import sys
from collections.abc import Callable

import pytest

from memtree.store.primitives import progress as progress_mod
from memtree.store.primitives.progress import Progress, progress_enabled, track


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


class ClosedStream(io.StringIO):
    def isatty(self) -> bool:
        raise ValueError("I/O operation on closed file")


@pytest.fixture
def tty(monkeypatch: pytest.MonkeyPatch) -> Callable[[], FakeTTY]:
    """Call it in the test body to get a terminal-like sys.stderr and no ``CI`` variable (pytest's
    capture would replace a sys.stderr patched by a fixture before the test runs)."""

    def install() -> FakeTTY:
        stream = FakeTTY()
        monkeypatch.setattr(sys, "stderr", stream)
        monkeypatch.delenv("CI", raising=False)
        return stream

    return install


@pytest.fixture
def no_tqdm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # `import tqdm...` now raises ImportError
    monkeypatch.setitem(sys.modules, "tqdm.std", None)


def test_forced_values_win(tty: Callable[[], FakeTTY], monkeypatch: pytest.MonkeyPatch) -> None:
    tty()
    monkeypatch.setenv("CI", "true")
    assert progress_enabled(True) is True
    monkeypatch.delenv("CI")
    assert progress_enabled(False) is False


def test_auto_shows_on_a_terminal_outside_ci(tty: Callable[[], FakeTTY]) -> None:
    tty()
    assert progress_enabled(None) is True


@pytest.mark.parametrize("value", ["true", "1", "yes", "GitHub Actions"])
def test_auto_is_silent_in_ci(tty: Callable[[], FakeTTY], monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    tty()
    monkeypatch.setenv("CI", value)
    assert progress_enabled(None) is False


@pytest.mark.parametrize("value", ["", "0", "false", "False"])
def test_ci_set_to_a_false_value_does_not_count(
    tty: Callable[[], FakeTTY], monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    tty()
    monkeypatch.setenv("CI", value)
    assert progress_enabled(None) is True


def test_auto_is_silent_when_stderr_is_not_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert progress_enabled(None) is False


def test_auto_is_silent_when_stderr_is_closed_or_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setattr(sys, "stderr", ClosedStream())
    assert progress_enabled(None) is False
    monkeypatch.setattr(sys, "stderr", None)  # pythonw, some daemons
    assert progress_enabled(None) is False


def test_forced_bar_draws_on_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tqdm")
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    with Progress(total=4, desc="copying", unit="leaf", progress=True) as bar:
        assert bar.active
        bar.update(3)
        bar.update()
    assert not bar.active
    out = err.getvalue()
    assert "copying:" in out and "/4" in out and "leaf/s" in out


def test_track_takes_the_total_from_len(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tqdm")
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    assert list(track(["a", "b", "c"], desc="items", progress=True)) == ["a", "b", "c"]
    assert "items:" in err.getvalue() and "/3" in err.getvalue()


def test_auto_bar_on_a_terminal_waits_before_drawing(
    tty: Callable[[], FakeTTY], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("tqdm")
    monkeypatch.setattr(progress_mod, "AUTO_DELAY", 3600.0)  # no operation here lasts an hour
    stream = tty()
    with Progress(total=10, desc="quick", progress=None) as bar:
        assert bar.active
        bar.update(10)
    assert stream.getvalue() == ""  # finished within the delay: never drawn


def test_disabled_bar_prints_nothing(tty: Callable[[], FakeTTY]) -> None:
    stream = tty()
    with Progress(total=2, desc="x", progress=False) as bar:
        bar.update(2)
        assert not bar.active
    assert list(track(range(5), progress=False)) == [0, 1, 2, 3, 4]
    assert stream.getvalue() == ""


def test_without_tqdm_everything_works_silently(tty: Callable[[], FakeTTY], no_tqdm: None) -> None:
    stream = tty()
    with Progress(total=3, desc="x", progress=True) as bar:
        assert not bar.active
        bar.update(3)
    assert list(track(iter(range(4)), desc="y", progress=True)) == [0, 1, 2, 3]
    assert stream.getvalue() == ""


def test_track_closes_its_bar_when_the_loop_stops_early(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tqdm")
    bars: list[Progress] = []
    real_init = Progress.__init__

    def init(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        real_init(self, *args, **kwargs)
        bars.append(self)

    monkeypatch.setattr(Progress, "__init__", init)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    gen = track(range(100), progress=True)
    assert next(gen) == 0
    assert bars[0].active
    gen.close()
    assert not bars[0].active


def test_memmap_and_verify_draw_a_bar_only_when_asked(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tqdm")
    import torch

    import memtree

    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    tree = memtree.TensorTree({"a": torch.ones(1000), "b": {"c": torch.zeros(10)}})
    tree.memmap(tmp_path / "quiet", progress=False)
    memtree.verify_tree(tmp_path / "quiet", progress=False)
    assert err.getvalue() == ""
    tree.memmap(tmp_path / "t", num_threads=2, progress=True)
    assert "memmap:" in err.getvalue() and "B/s" in err.getvalue()
    before = len(err.getvalue())
    report = memtree.verify_tree(tmp_path / "t", progress=True)  # checksums by default: bytes hashed
    assert report.ok and "verify:" in err.getvalue()[before:] and "B/s" in err.getvalue()[before:]
    tree.memmap(tmp_path / "plain", checksum=None, progress=False)
    before = len(err.getvalue())
    report = memtree.verify_tree(tmp_path / "plain", progress=True)  # nothing to hash: leaves checked
    assert report.ok and "verify:" in err.getvalue()[before:] and "leaf" in err.getvalue()[before:]
