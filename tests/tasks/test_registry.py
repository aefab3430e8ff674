"""Handler lookup: built-ins, runtime registration and third-party entry points."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from raas.core.trajectory import EvalOutput, RunOutput
from raas.errors import RaasError
from raas.tasks import registry
from raas.tasks.base import Env, Job, JobSandboxes, LLMContext, TaskHandler
from raas.tasks.math import MathHandler

pytestmark = pytest.mark.unit


class Echo(TaskHandler):
    name = "echo-test"

    async def init(self, job: Job, sandboxes: JobSandboxes) -> Env:
        return Env(job=job, sandboxes=sandboxes)

    async def run(self, job: Job, env: Env, llm: LLMContext) -> RunOutput:
        return RunOutput(finish_reason="finish_tool")

    async def eval(self, job: Job, env: Env) -> EvalOutput:
        return EvalOutput(reward=1.0)


def test_builtin_math() -> None:
    assert isinstance(registry.get_handler("math"), MathHandler)
    assert registry.get_handler("math") is registry.get_handler("math")
    assert "math" in registry.list_handlers()


@pytest.mark.parametrize("source", ["nope", ""])
def test_unknown_is_bad_request(source: str) -> None:
    with pytest.raises(RaasError) as e:
        registry.get_handler(source)
    assert e.value.kind == "bad_request"


def test_register_and_unregister() -> None:
    registry.register(Echo)
    try:
        assert isinstance(registry.get_handler("echo-test"), Echo)
        with pytest.raises(RaasError):
            registry.register(MathHandler, "echo-test")
    finally:
        registry.unregister("echo-test")
    with pytest.raises(RaasError):
        registry.get_handler("echo-test")


@pytest.fixture
def plugin_dist(tmp_path: Path) -> Iterator[Path]:
    """An installed distribution (dist-info on sys.path) declaring ``raas.tasks`` entry points."""
    pkg = tmp_path / "raas_plugin_demo.py"
    pkg.write_text(
        "from raas.core.trajectory import EvalOutput, RunOutput\n"
        "from raas.tasks.base import Env, TaskHandler\n"
        "class Demo(TaskHandler):\n"
        "    name = 'demo'\n"
        "    async def init(self, job, sandboxes): return Env(job=job, sandboxes=sandboxes)\n"
        "    async def run(self, job, env, llm): return RunOutput()\n"
        "    async def eval(self, job, env): return EvalOutput(reward=None)\n"
        "NotAHandler = object\n"
    )
    info = tmp_path / "raas_plugin_demo-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: raas-plugin-demo\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[raas.tasks]\ndemo = raas_plugin_demo:Demo\nbogus = raas_plugin_demo:NotAHandler\n"
        "missing = raas_plugin_nowhere:X\n"
    )
    sys.path.insert(0, str(tmp_path))
    registry.rescan()
    yield tmp_path
    sys.path.remove(str(tmp_path))
    sys.modules.pop("raas_plugin_demo", None)
    for name in ("demo", "bogus", "missing"):
        registry.unregister(name)
    registry.rescan()


def test_entry_point_plugins(plugin_dist: Path) -> None:
    h = registry.get_handler("demo")
    assert type(h).__name__ == "Demo"
    assert "demo" in registry.list_handlers()
    for broken in ("bogus", "missing"):
        with pytest.raises(RaasError) as e:
            registry.get_handler(broken)
        assert e.value.kind == "bad_request"
        assert "unavailable" in e.value.message
