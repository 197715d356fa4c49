"""The documentation covers the public API: every name exported by ``memtree`` and
``memtree.interop`` has an entry in docs/api.md, and every page the site's nav names exists.

(``mkdocs build --strict`` itself runs in ``bash scripts/dev.sh test`` before pytest: it checks
links, anchors and docstrings; this file checks what it cannot: that nothing public is missing.)
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import memtree
import memtree.interop

REPO = Path(__file__).resolve().parent.parent
API = (REPO / "docs" / "api.md").read_text()
DOCUMENTED = set(re.findall(r"^::: (memtree[\w.]*)", API, re.M))


def _resolve(path: str) -> object:
    """The object at a dotted path: the longest importable module prefix, then attributes (so
    that ``memtree.recover.recover`` is the function in the module ``memtree.recover``)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(path)


def _documented(module: object, name: str) -> bool:
    """Some ``::: path`` of docs/api.md names this very object (under any of its import paths)."""
    obj = getattr(module, name)
    return any(p.rsplit(".", 1)[-1] == name and _resolve(p) is obj for p in DOCUMENTED)


def test_every_public_name_of_memtree_is_in_the_api_reference() -> None:
    errors = set(memtree.errors.__all__)
    missing = [n for n in memtree.__all__ if n not in errors and not _documented(memtree, n)]
    assert not missing, f"add `::: memtree.<name>` entries to docs/api.md for {missing}"
    assert "memtree.errors" in DOCUMENTED  # every error class, through its module


def test_every_public_name_of_memtree_interop_is_in_the_api_reference() -> None:
    missing = [n for n in memtree.interop.__all__ if not _documented(memtree.interop, n)]
    assert not missing, f"add `::: memtree.interop.<name>` entries to docs/api.md for {missing}"


def test_every_page_in_the_nav_exists() -> None:
    nav_pages = re.findall(r":\s*([\w/.-]+\.md)\s*$", (REPO / "mkdocs.yml").read_text(), re.M)
    assert "index.md" in nav_pages and "format.md" in nav_pages
    missing = [p for p in nav_pages if not (REPO / "docs" / p).is_file()]
    assert not missing, missing


def test_every_heading_of_the_format_page_cited_in_the_code_exists() -> None:
    """Docstrings and comments cite ``docs/format.md`` by heading (``"Version 2", "Encryption"``):
    each cited heading is a heading of the page, so a renamed section leaves no stale pointer."""
    headings = set(re.findall(r"^#+ +(.+?) *$", (REPO / "docs" / "format.md").read_text(), re.M))
    cited: dict[str, list[str]] = {}
    for path in sorted((REPO / "memtree").rglob("*.py")):
        # a citation may wrap: join the lines (and the "#:" of comment lines) first
        text = re.sub(r"\n\s*(?:#:?)?\s*", " ", path.read_text())
        for quoted in re.findall(r'docs/format\.md``?,?\s*((?:"[^"]+"(?:,\s*)?)+)', text):
            for heading in re.findall(r'"([^"]+)"', quoted):
                cited.setdefault(heading, []).append(path.name)
    assert "Encryption" in cited and "Version 2" in cited  # the pattern finds the citations
    stale = {h: files for h, files in cited.items() if h not in headings}
    assert not stale, f"docs/format.md has no heading named {stale}; cite the current heading"


def test_the_getting_started_table_lists_every_tutorial() -> None:
    table = (REPO / "docs" / "getting-started.md").read_text()
    missing = [p.name for p in sorted((REPO / "tutorials").glob("[0-9]*.py")) if f"| `{p.name}` |" not in table]
    assert not missing, f"add a row for {missing} to the tutorials table of docs/getting-started.md"
