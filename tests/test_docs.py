"""The documentation: the MkDocs site builds strictly (every link, anchor and page in the nav checked, the
HTTP reference generated from the app), and the README stays a short front page that starts with the two
set-up commands CI and users rely on."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250
SETUP_BLOCK = [
    "```bash",
    "make run    # fresh machine: install everything, then run the built-in math job end to end "
    "(embedded CPU model, bwrap sandboxes)",
    "make test   # fresh machine: install everything, then run the test suite",
    "```",
]

pytestmark = pytest.mark.unit


def test_readme_is_short_and_starts_with_the_setup_commands() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move details to docs/"
    assert lines[0].startswith("# raas"), lines[0]
    assert lines[1] == ""
    assert lines[2:6] == SETUP_BLOCK


def test_readme_links_point_at_existing_files() -> None:
    import re

    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert targets, "the README links to the documentation"
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_site_builds_strictly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mkdocs.commands.build import build
    from mkdocs.config import load_config
    from mkdocs.exceptions import Abort

    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the hook puts src/ first; undone after the test
    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    handler = Collect()
    logging.getLogger("mkdocs").addHandler(handler)
    try:
        config = load_config(str(ROOT / "mkdocs.yml"), strict=True, site_dir=str(tmp_path / "site"))
        try:
            build(config)
        except Abort as e:
            pytest.fail(f"mkdocs build --strict failed: {e}; warnings: {warnings}")
    finally:
        logging.getLogger("mkdocs").removeHandler(handler)
    assert not warnings, warnings
    site = tmp_path / "site"
    # The generated HTTP reference holds the app's real routes and schemas.
    reference = (site / "reference" / "openapi.html").read_text()
    for route in ("POST /v1/jobs", "GET /v1/jobs/{job_id}/result", "POST /process", "GET /healthz"):
        assert route in reference, route
    assert 'id="jobresult"' in reference and 'id="errorbody"' in reference
    # mkdocstrings rendered the Python API from the source.
    trainer = (site / "reference" / "python" / "trainer.html").read_text()
    assert "RolloutClient" in trainer
    assert ":class:<code>" not in trainer, "Sphinx roles are shown as code alone (docs/hooks/docstrings.py)"
    assert "TaskHandler" in (site / "reference" / "python" / "tasks.html").read_text()
    # The error-kinds table is computed from raas.errors: one row per kind.
    from typing import get_args

    from raas.errors import ErrorKind

    concepts = (site / "concepts.html").read_text()
    assert all(f"<td><code>{kind}</code></td>" in concepts for kind in get_args(ErrorKind))
    # Offline: the theme loads no web fonts and the pages reference nothing on a CDN.
    index = (site / "index.html").read_text()
    assert "fonts.googleapis.com" not in index and "fonts.gstatic.com" not in index
    assert os.path.exists(site / "img" / "learning_addition-async.png")
