"""MkDocs hook: raas's docstrings cite code with Sphinx roles (``:class:`~raas.x.Y```); mkdocstrings renders
them as the role's name followed by code. The rendered pages show the code alone, with ``~`` (Sphinx's "last
component only") applied, so the API reference reads as prose."""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):<code>(~?)([^<]*)</code>")


def strip_roles(html: str) -> str:
    """``:class:<code>~a.b.C</code>`` -> ``<code>C</code>``; without ``~`` the full name stays."""
    return ROLE.sub(
        lambda m: f"<code>{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}</code>", html
    )


def on_page_content(html: str, **kwargs: Any) -> str:
    return strip_roles(html)
