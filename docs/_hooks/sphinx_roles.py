"""MkDocs hook: the docstrings' Sphinx roles (``:class:`~spotguard.Run```) shown as plain code.

The code's docstrings are written for Sphinx-style readers; mkdocstrings renders them as Markdown,
which would print the role itself (``:class:Run``). This drops the role, and for ``~a.b.C`` keeps
only ``C``, as Sphinx does; a reStructuredText ``::`` before a code block becomes ``:`` (or
nothing, alone on its line).
"""

from __future__ import annotations

import re

ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|data|exc|obj|const):<code>(~?)([^<]*)</code>")


def _plain(match: re.Match) -> str:
    name = match.group(2)
    return f"<code>{name.rsplit('.', 1)[-1] if match.group(1) else name}</code>"


def on_page_content(html: str, page, config, files) -> str:
    """Drop the Sphinx roles and literal-block markers from the rendered page."""
    html = html.replace("<p>::</p>", "").replace("::</p>", ":</p>")
    return ROLE.sub(_plain, html)
