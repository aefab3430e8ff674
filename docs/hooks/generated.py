"""MkDocs hook: tables computed from the code, so the pages cannot drift from it. A page asks for one with
an HTML comment marker (invisible where the Markdown is read as it is, e.g. on GitHub):

- ``<!-- raas:error-kinds -->``: every ``raas.errors.ErrorKind`` and what it does to a rollout.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, get_args

from mkdocs.config.defaults import MkDocsConfig

MARKER = "<!-- raas:error-kinds -->"


def error_kinds_table() -> str:
    from raas.errors import ErrorKind, is_infrastructure

    rows = ["| kind | infrastructure | in a rollout |", "|---|---|---|"]
    for kind in get_args(ErrorKind):
        if is_infrastructure(kind):
            rows.append(f"| `{kind}` | yes | ends it: the job fails and is filtered, never a reward |")
        else:
            rows.append(f"| `{kind}` | no | a tool call failing this way is the call's observation |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, *, config: MkDocsConfig, **kwargs: Any) -> str:
    if MARKER not in markdown:
        return markdown
    src = str(Path(config.config_file_path).resolve().parent / "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    return markdown.replace(MARKER, error_kinds_table())
