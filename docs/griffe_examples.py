"""Griffe extension for this site: read memtree's ``Example:`` docstring sections as examples.

memtree's docstrings (Google style) head their doctests ``Example:``; griffe's Google parser
knows only the plural ``Examples:`` as a section and would render the singular as an admonition
of quoted text. This extension renames the heading before parsing, so the doctests render as
code. It changes nothing in the package itself.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE_HEADING = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Turn ``Example:`` headings into ``Examples:`` in every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE_HEADING.sub(r"\1Examples:", obj.docstring.value)
