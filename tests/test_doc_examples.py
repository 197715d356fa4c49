"""Every page of the documentation runs as written: the README and every page of docs/ with code
(index, getting-started, comparison, every guide page) runs its ```` ```python ```` blocks as
script and its ```` ```pycon ```` blocks as doctest sessions, all in page order and in one
namespace, as one script per page, in a fresh working directory (the page's files land there).

The blocks that do not run are marked by their fence and listed here with the reason
(:data:`NOT_RUN`): a fence this file does not know fails the test, so no block is skipped
silently. A page whose examples need an optional package (a test extra) is skipped, with its name
as reason, where that package is not installed (:data:`NEEDS`). The pages made of pieces of a tutorial include them as mkdocs does (a
``--8<-- "tutorials/07_lightning.py:fit"`` line is that section of the file, without a section
the whole file), starting with the
tutorial's ``setup`` section, and run with ``MEMTREE_TUTORIAL_FAST=1``.
"""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = ["README.md", "docs/index.md", "docs/getting-started.md", "docs/comparison.md"] + sorted(
    str(p.relative_to(REPO)) for p in (REPO / "docs" / "guide").glob("*.md")
)
#: The fences that are run: ```python as script, ```pycon as a doctest session.
RUN = ("python", "pycon")
#: The fences that are not run, and why.
NOT_RUN = {
    "bash": "shell commands (installing, running a script or the benchmarks)",
    "console": "a shell session of the `memtree` command (tests/test_cli*.py run the command)",
    "text": "not code: a directory listing, a printed repr, a signature",
    "py": "Python that cannot run here: it names a server the page does not start",
}
#: Pages whose blocks another test runs as one script, and where (not in one process here).
RUN_ELSEWHERE = {
    "docs/guide/distributed.md": "tests/test_dist.py runs its blocks as one script on 2 ranks, as torchrun starts them",
}
#: Pages whose examples need an optional package (a test extra): skipped without it.
NEEDS = {
    "docs/guide/subclasses.md": ["torchao"],
    "docs/guide/encryption.md": ["cryptography"],
    "docs/guide/training.md": ["cryptography"],
    "docs/guide/interop.md": ["tensordict", "transformers"],
    "docs/guide/remote.md": ["fsspec"],
    "docs/guide/transformers.md": ["transformers", "accelerate"],
    "docs/guide/lightning.md": ["lightning"],
    "docs/guide/torchrl.md": ["torchrl"],
}
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```$", re.M | re.S)
#: A snippet of a tutorial (pymdownx.snippets, as mkdocs.yml configures it): ``--8<-- "file:section"``.
SNIPPET = re.compile(r'^--8<-- "([^":]+)(?::(\w+))?"$', re.M)


def _section(match: re.Match[str]) -> str:
    """The whole file, or its lines between ``# --8<-- [start:NAME]`` and ``# --8<-- [end:NAME]``."""
    text = (REPO / match.group(1)).read_text()
    if match.group(2) is None:
        return text
    start, end = f"# --8<-- [start:{match.group(2)}]\n", f"# --8<-- [end:{match.group(2)}]\n"
    assert start in text and end in text, f"{match.group(1)} has no section {match.group(2)!r}"
    return text[text.index(start) + len(start) : text.index(end)]


def blocks(page: Path) -> list[tuple[str, str, int]]:
    """The fenced blocks of a page: (fence language, code, line of the fence)."""
    text = page.read_text()
    return [
        (m.group(1), SNIPPET.sub(_section, m.group(2)), text.count("\n", 0, m.start()) + 1)
        for m in FENCE.finditer(text)
    ]


def run_page(page: Path) -> tuple[int, str]:
    """Run the page's ```python and ```pycon blocks in order in one namespace; returns how many
    blocks ran and the doctest report (empty when every session matched)."""
    namespace: dict[str, object] = {"__name__": "__doc_page__"}
    report: list[str] = []
    ran = 0
    for lang, code, line in blocks(page):
        if lang == "python":
            source = "\n" * line + code  # tracebacks name the page's own line
            exec(compile(source, str(page), "exec", dont_inherit=True), namespace)
        elif lang == "pycon":
            test = doctest.DocTestParser().get_doctest(code, namespace, page.name, str(page), line)
            runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
            runner.run(test, out=report.append, clear_globs=False)
            namespace = test.globs  # the DocTest ran in a copy of the namespace
            if runner.failures:
                return ran, "".join(report)
        else:
            continue
        ran += 1
    return ran, "".join(report)


@pytest.mark.parametrize("page", PAGES)
def test_every_fence_of_the_page_is_run_or_listed_as_not_run(page):
    unknown = [(lang, line) for lang, _, line in blocks(REPO / page) if lang not in RUN and lang not in NOT_RUN]
    assert not unknown, f"{page}: fences {unknown} are neither run nor listed in NOT_RUN with a reason"


@pytest.mark.parametrize(
    "page", [p for p in PAGES if p not in RUN_ELSEWHERE and any(lang in RUN for lang, _, _ in blocks(REPO / p))]
)
def test_the_code_blocks_of_the_page_run_in_order_as_one_script(page, tmp_path, monkeypatch):
    for module in NEEDS.get(page, []):
        pytest.importorskip(module, reason=f"{page} needs the optional package {module}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MEMTREE_TUTORIAL_FAST", "1")  # the tutorials' small run, on the pages made of them
    ran, report = run_page(REPO / page)
    assert ran > 0
    assert not report, report


def test_a_wrong_example_fails(tmp_path):
    """The runner itself: a session whose output differs is reported, a failing script raises."""
    page = tmp_path / "bad.md"
    page.write_text("```pycon\n>>> 1 + 1\n3\n\n```\n")
    assert "Expected:\n    3\nGot:\n    2" in run_page(page)[1]
    page.write_text("```python\nx = 1\n```\n\n```python\nassert x == 2\n```\n")
    with pytest.raises(AssertionError):
        run_page(page)


def test_the_blocks_of_a_page_share_one_namespace_in_page_order(tmp_path):
    page = tmp_path / "ok.md"
    page.write_text("```python\nx = 1\n```\n\n```pycon\n>>> x + 1\n2\n\n```\n\n```text\nnot run\n```\n")
    assert run_page(page) == (2, "")


def test_a_snippet_line_is_the_section_of_the_tutorial_it_names():
    code = "".join(code for _, code, _ in blocks(REPO / "docs/guide/lightning.md"))
    assert "--8<--" not in code and "MemtreeCheckpointIO" in code and "work = tempfile.mkdtemp" in code


@pytest.mark.parametrize("page", sorted(RUN_ELSEWHERE))
def test_a_page_run_elsewhere_is_run_by_the_test_it_names(page):
    test_file = RUN_ELSEWHERE[page].split()[0]
    assert page in PAGES and Path(page).name in (REPO / test_file).read_text()
