"""The examples of the guide pages run: every ```` ```pycon ```` block of a page, in order, as one
doctest session, in a fresh directory (the page's files land there)."""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = ["guide/numpy.md", "guide/routing.md", "guide/checkpoints.md"]
BLOCK = re.compile(r"^```pycon\n(.*?)^```$", re.M | re.S)


def run_page(page: Path) -> doctest.TestResults:
    blocks = BLOCK.findall(page.read_text())
    assert blocks, f"{page} has no ```pycon blocks"
    test = doctest.DocTestParser().get_doctest("\n".join(blocks), {}, page.name, str(page), 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test)
    return runner.summarize(verbose=False)


@pytest.mark.parametrize("page", PAGES)
def test_the_examples_of_the_page_run(page, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    results = run_page(DOCS / page)
    report = capsys.readouterr().out
    assert results.attempted > 5, report
    assert results.failed == 0, report


def test_a_wrong_example_fails(tmp_path, monkeypatch, capsys):
    """The runner itself: a page whose output differs is reported as failed."""
    monkeypatch.chdir(tmp_path)
    page = tmp_path / "bad.md"
    page.write_text("```pycon\n>>> 1 + 1\n3\n\n```\n")
    assert run_page(page).failed == 1
