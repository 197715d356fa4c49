"""The examples of the guide pages run: every ```` ```pycon ```` block of a page, in order, as one
doctest session, in a fresh directory (the page's files land there); on the pages written as
scripts, every ```` ```python ```` block, in order, as one script (its ``assert`` lines are the
checks)."""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = ["guide/numpy.md", "guide/routing.md", "guide/training.md", "guide/checkpoints.md", "guide/subclasses.md"]
#: Pages whose examples need an optional package (a test dependency): skipped without it.
NEEDS = {"guide/subclasses.md": "torchao"}
SCRIPT_PAGES = ["guide/models.md", "guide/datasets.md"]
BLOCK = re.compile(r"^```pycon\n(.*?)^```$", re.M | re.S)
SCRIPT_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.M | re.S)


def run_page(page: Path) -> doctest.TestResults:
    blocks = BLOCK.findall(page.read_text())
    assert blocks, f"{page} has no ```pycon blocks"
    test = doctest.DocTestParser().get_doctest("\n".join(blocks), {}, page.name, str(page), 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test)
    return runner.summarize(verbose=False)


@pytest.mark.parametrize("page", PAGES)
def test_the_examples_of_the_page_run(page, tmp_path, monkeypatch, capsys):
    if page in NEEDS:
        pytest.importorskip(NEEDS[page])
    monkeypatch.chdir(tmp_path)
    results = run_page(DOCS / page)
    report = capsys.readouterr().out
    assert results.attempted > 5, report
    assert results.failed == 0, report


@pytest.mark.parametrize("page", SCRIPT_PAGES)
def test_the_code_blocks_of_the_page_run_as_one_script(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = SCRIPT_BLOCK.findall((DOCS / page).read_text())
    assert len(blocks) > 5, f"{page} has too few ```python blocks"
    for block in blocks:
        if "transformers" in block:
            pytest.importorskip("transformers")
    code = compile("\n".join(blocks), str(DOCS / page), "exec", dont_inherit=True)  # not this file's __future__
    exec(code, {"__name__": "__doc_page__"})


def test_a_wrong_example_fails(tmp_path, monkeypatch, capsys):
    """The runner itself: a page whose output differs is reported as failed."""
    monkeypatch.chdir(tmp_path)
    page = tmp_path / "bad.md"
    page.write_text("```pycon\n>>> 1 + 1\n3\n\n```\n")
    assert run_page(page).failed == 1
