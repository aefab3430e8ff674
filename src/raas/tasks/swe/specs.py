"""How a public SWE-bench record that names no test command is evaluated: SWE-bench's own conventions.

Records from SWE-bench 5 task repos carry their own ``eval_script`` and ``log_parser``; records in the
classic shape (the nine public fields only, as on the SWE-bench / SWE-Gym hubs) do not, and raas derives
them the way SWE-bench's harness did:

* the log parser from ``swebench.harness.log_parsers`` (``MAP_REPO_TO_PARSER_*``, by ``repo``), named by
  its key in ``PARSER_REGISTRY`` so the record carries it like any other;
* the test command: the repository's runner from SWE-bench's published per-repository specs (the table
  below; swebench 5 moved them into each task's ``eval.sh`` and no longer ships the table), followed by the
  *test directives*: the files ``test_patch`` touches, minus SWE-bench's ``NON_TEST_EXTS``, as Django
  module labels for ``django/django``;
* the environment: SWE-bench images keep the repository's environment in conda's ``testbed`` env, which
  the command activates when the image has it.

The image follows SWE-bench's naming convention (:func:`swebench_image_name`).
"""

from __future__ import annotations

import functools
import re
import shlex
from collections.abc import Callable
from typing import Any

from raas.errors import RaasError

TEST_PYTEST = "pytest --no-header -rA --tb=no -p no:cacheprovider"
TEST_PYTEST_RA = "pytest -rA"
TEST_ASTROPY = "pytest -rA -vv -o console_output_style=classic --tb=no"
TEST_DJANGO = "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1"
TEST_DJANGO_NO_PARALLEL = "./tests/runtests.py --verbosity 2"
TEST_SEABORN = "pytest --no-header -rA"
TEST_SPHINX = "tox --current-env -epy39 -v --"
TEST_SYMPY = "PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' bin/test -C --verbose"

REPO_TEST_CMD: dict[str, str] = {
    "astropy/astropy": TEST_ASTROPY,
    "django/django": TEST_DJANGO,
    "marshmallow-code/marshmallow": TEST_PYTEST,
    "matplotlib/matplotlib": TEST_PYTEST,
    "mwaskom/seaborn": TEST_SEABORN,
    "pallets/flask": TEST_PYTEST,
    "psf/requests": TEST_PYTEST,
    "pvlib/pvlib-python": TEST_PYTEST,
    "pydata/xarray": TEST_PYTEST,
    "pydicom/pydicom": TEST_PYTEST,
    "pylint-dev/astroid": TEST_PYTEST,
    "pylint-dev/pylint": TEST_PYTEST,
    "pytest-dev/pytest": TEST_PYTEST_RA,
    "pyvista/pyvista": TEST_PYTEST,
    "scikit-learn/scikit-learn": TEST_PYTEST,
    "sphinx-doc/sphinx": TEST_SPHINX,
    "sqlfluff/sqlfluff": TEST_PYTEST,
    "sympy/sympy": TEST_SYMPY,
}
"""The test runner per repository, as in SWE-bench's per-repository specs (the versions that differ are in
:data:`VERSION_TEST_CMD`)."""

VERSION_TEST_CMD: dict[tuple[str, str], str] = {("django/django", "1.9"): TEST_DJANGO_NO_PARALLEL}

CONDA_ACTIVATE = "if [ -f /opt/miniconda3/bin/activate ]; then . /opt/miniconda3/bin/activate && conda activate testbed; fi"
"""SWE-bench images install the repository into conda's ``testbed`` environment."""


def swebench_image_name(instance_id: str) -> str:
    """SWE-bench's image name for an instance: ``sweb.eval.x86_64.<id>:latest``, lower case, with ``__``
    written ``_1776_`` (registries refuse double underscores), as ``swebench.task.checks.expected_image``
    derives it."""
    return f"sweb.eval.x86_64.{instance_id}:latest".lower().replace("__", "_1776_")


@functools.cache
def _swebench_parsers() -> tuple[dict[str, Callable[..., Any]], dict[str, Callable[..., Any]], list[str]]:
    try:
        from swebench.harness import log_parsers
        from swebench.harness.constants import NON_TEST_EXTS
        from swebench.harness.log_parsers import c, go, java, javascript, php, python, ruby, rust
    except ImportError as e:  # pragma: no cover - depends on the install
        raise RaasError(
            f"SWE-bench records need the swebench package ({e}); install it with pip install 'raas[swe]'",
            kind="unavailable",
        ) from e
    by_repo: dict[str, Callable[..., Any]] = {}
    for module in (python, javascript, c, go, java, php, ruby, rust):
        for name, value in vars(module).items():
            if name.startswith("MAP_REPO_TO_PARSER") and isinstance(value, dict):
                by_repo.update(value)
    return dict(log_parsers.PARSER_REGISTRY), by_repo, list(NON_TEST_EXTS)


def parser_for_repo(repo: str) -> str | None:
    """The ``PARSER_REGISTRY`` name of SWE-bench's log parser for ``repo`` (None if SWE-bench has none)."""
    registry, by_repo, _ = _swebench_parsers()
    fn = by_repo.get(repo)
    if fn is None:
        return None
    # Several names may share one function (parse_log_xarray is parse_log_pytest): any of them grades alike.
    return next((name for name, f in registry.items() if f is fn), None)


def test_patch_files(test_patch: str) -> list[str]:
    """Paths a patch touches (the ``b/`` side of each ``diff --git`` header, old paths of deletions too)."""
    files: list[str] = []
    for a, b in re.findall(r"^diff --git a/(\S+) b/(\S+)$", test_patch, re.M):
        for path in (a, b):
            if path not in files:
                files.append(path)
    return files


def test_directives(repo: str, test_patch: str) -> list[str]:
    """SWE-bench's test directives: the test files ``test_patch`` changes (``b/`` paths), without
    non-test extensions; for Django, module labels (``tests/a/test_b.py`` → ``a.test_b``)."""
    _, _, non_test_exts = _swebench_parsers()
    directives = re.findall(r"^diff --git a/.* b/(.*)$", test_patch, re.M)
    directives = [d for d in directives if not any(d.endswith(ext) for ext in non_test_exts)]
    if repo == "django/django":
        out = []
        for d in directives:
            d = d[: -len(".py")] if d.endswith(".py") else d
            d = d[len("tests/") :] if d.startswith("tests/") else d
            out.append(d.replace("/", "."))
        directives = out
    return directives


def derive_test_cmd(repo: str, version: str, test_patch: str) -> str | None:
    """The test command SWE-bench's harness ran for a classic record, or None for an unknown repo."""
    runner = VERSION_TEST_CMD.get((repo, version)) or REPO_TEST_CMD.get(repo)
    if runner is None:
        return None
    directives = " ".join(shlex.quote(d) for d in test_directives(repo, test_patch))
    return f"{CONDA_ACTIVATE}; {runner} {directives}".rstrip()
