"""Imports only point down: every import statement in src/raas (module level, inside functions, under
``TYPE_CHECKING``, relative, and ``importlib.import_module("raas...")`` with a literal name) is checked
against the layer order, lowest first:

    raas.errors, raas.core  →  raas.toolserver  →  raas.sandbox, raas.llm  →  raas.agent  →  raas.gateway
    →  raas.tasks  →  raas.pipeline  →  raas.api  →  raas.cluster  →  raas.learn  →  raas.cli

``raas.toolserver`` runs inside sandboxes and imports nothing from raas; ``raas.trainer`` is an HTTP client
and imports only ``raas.errors`` and ``raas.core`` (``raas.integrations``, the plugins for other trainers,
also ``raas.trainer``); packages on the same tier (``sandbox``, ``llm``) do not
import each other.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SRC = Path(__file__).resolve().parents[1] / "src"

TIERS: list[set[str]] = [
    {"errors"},
    {"core"},
    {"toolserver"},
    {"sandbox", "llm"},
    {"agent"},
    {"gateway"},  # the agent gateway: the harness handler (tasks) and the service (pipeline, api) use it
    {"tasks"},
    {"pipeline"},
    {"api"},
    {"cluster"},
    {"trainer"},
    {"integrations"},  # raas inside other trainers (verl, SkyRL, AReaL): clients of the HTTP API too
    {"learn"},  # the reference trainer: owns a model and its inference server, samples through raas
    {"cli"},
]
ONLY: dict[str, set[str]] = {
    "toolserver": set(),  # the image's python3 runs it with nothing else from raas on its path
    "trainer": {"errors", "core"},  # a client of the HTTP API, installable without the service
    "integrations": {"errors", "core", "trainer"},  # runs in the other trainer's environment
}


def allowed(package: str) -> set[str]:
    """The raas packages ``package`` may import (besides itself)."""
    if package == "":  # raas/__init__.py
        return set()
    if package in ONLY:
        return ONLY[package]
    for i, tier in enumerate(TIERS):
        if package in tier:
            below = set().union(*TIERS[:i])
            return below - {"trainer"} if package not in ("learn", "cli") else below
    raise AssertionError(f"raas.{package} is in no layer: add it to TIERS in {__file__}")


def package_of(module: str) -> str:
    """``raas.agent.loop`` -> ``agent``; ``raas.errors`` -> ``errors``; ``raas`` -> ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imported_modules(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[int, str]]:
    """Every module an import in ``tree`` names, absolute, with its line."""
    here = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "raas":  # from raas import errors -> raas.errors
                for alias in node.names:
                    yield node.lineno, f"raas.{alias.name}"
            else:
                yield node.lineno, target
        elif isinstance(node, ast.Call) and node.args:
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            arg = node.args[0]
            if name in ("import_module", "__import__") and isinstance(arg, ast.Constant):
                if isinstance(arg.value, str):
                    yield node.lineno, arg.value


def violations_in(source: str, module: str, *, is_package: bool = False, path: str = "") -> list[str]:
    """The imports in ``source`` (the text of ``module``) that point at a layer it may not import."""
    own = package_of(module)
    ok = allowed(own) | {own}
    found = []
    for line, target in imported_modules(ast.parse(source), module, is_package):
        if target != "raas" and not target.startswith("raas."):
            continue
        other = package_of(target)
        if other not in ok:
            found.append(f"{path or module}:{line}: raas.{own or '__init__'} imports {target}")
    return found


def walk(root: Path) -> Iterator[tuple[Path, str, bool]]:
    """``(file, module name, is package)`` for every module under ``root/raas``."""
    for path in sorted((root / "raas").rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = list(rel.parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        yield path, ".".join(parts), is_package


def violations(root: Path) -> list[str]:
    found = []
    for path, module, is_package in walk(root):
        found += violations_in(path.read_text(), module, is_package=is_package, path=str(path))
    return found


def test_no_package_imports_one_above_it() -> None:
    modules = list(walk(SRC))
    assert len(modules) > 50, "the walk found too few modules to mean anything"
    assert violations(SRC) == []


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("raas.agent.loop", "from raas.pipeline import metrics\n"),
        ("raas.agent.loop", "def f():\n    import raas.tasks.base\n"),
        (
            "raas.agent.loop",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from raas.tasks import base\n",
        ),
        ("raas.agent.loop", "from ..tasks.base import Job\n"),
        ("raas.llm.balancer", "from raas import pipeline\n"),
        ("raas.llm.balancer", "from raas.sandbox import Sandbox\n"),  # same tier
        ("raas.sandbox.client", "import importlib\nimportlib.import_module('raas.api.app')\n"),
        ("raas.toolserver.bash", "from raas.errors import RaasError\n"),
        ("raas.trainer.client", "from raas.pipeline.config import ServiceConfig\n"),
        ("raas.core.jobs", "from raas.agent.config import AgentConfig\n"),
        ("raas.errors", "from raas.core import jobs\n"),
        ("raas.tasks.base", "from raas.api.app import serve\n"),
        ("raas.pipeline.service", "from raas.trainer.client import RaasClient\n"),
        ("raas.gateway.session", "from raas.tasks.base import Job\n"),
        ("raas.agent.loop", "from raas.gateway import Gateway\n"),
    ],
)
def test_a_planted_upward_import_is_caught(module: str, source: str) -> None:
    assert len(violations_in(source, module)) == 1


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("raas.tasks.math", "from raas.agent.loop import run_agent\nfrom raas.core.jobs import Job\n"),
        ("raas.toolserver.server", "from . import procs\nfrom .bash import BashTool\n"),
        ("raas.sandbox.client", "from raas.toolserver.protocol import encode\n"),
        ("raas.cli.serve", "from raas.api.app import serve\nfrom raas.trainer.client import RaasClient\n"),
        ("raas.agent.loop", "import json\nfrom raas.llm.types import SamplingParams\n"),
    ],
)
def test_a_downward_import_passes(module: str, source: str) -> None:
    assert violations_in(source, module) == []


def test_a_planted_tree_fails(tmp_path: Path) -> None:
    """The whole walk, on a copy of a tree with one upward import hidden in a function."""
    pkg = tmp_path / "raas"
    (pkg / "llm").mkdir(parents=True)
    (pkg / "api").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "llm" / "__init__.py").write_text("")
    (pkg / "api" / "__init__.py").write_text("from raas.llm import x\n")
    (pkg / "llm" / "x.py").write_text(
        "import os\n\n\ndef late():\n    from ..api import app\n    return app\n"
    )
    (found,) = violations(tmp_path)
    assert "raas/llm/x.py:5" in found and "raas.api" in found
