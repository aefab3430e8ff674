"""Handler lookup: built-ins, runtime registration and third-party entry points, per registry."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from raas.core.trajectory import EvalOutput, RunOutput
from raas.errors import RaasError
from raas.tasks.base import Env, Job, JobSandboxes, LLMContext, TaskHandler
from raas.tasks.math import MathHandler
from raas.tasks.registry import HandlerRegistry

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
    registry = HandlerRegistry()
    assert isinstance(registry.get("math"), MathHandler)
    assert registry.get("math") is registry.get("math")
    assert "math" in registry.names()


@pytest.mark.parametrize("source", ["nope", ""])
def test_unknown_is_bad_request(source: str) -> None:
    with pytest.raises(RaasError) as e:
        HandlerRegistry().get(source)
    assert e.value.kind == "bad_request"


def test_register_and_unregister() -> None:
    registry = HandlerRegistry()
    registry.register(Echo)
    assert isinstance(registry.get("echo-test"), Echo)
    with pytest.raises(RaasError):
        registry.register(MathHandler, "echo-test")
    registry.unregister("echo-test")
    with pytest.raises(RaasError):
        registry.get("echo-test")


def test_registries_are_independent() -> None:
    """What one registry (one service's) registers, another never sees or loses."""
    one, two = HandlerRegistry(), HandlerRegistry()
    one.register(Echo)
    two.register(MathHandler, "echo-test")
    assert isinstance(one.get("echo-test"), Echo) and isinstance(two.get("echo-test"), MathHandler)
    assert one.get("math") is not two.get("math")  # each has its own instances
    with pytest.raises(RaasError):
        HandlerRegistry().get("echo-test")
    bare = HandlerRegistry(builtins=False, entry_points=False)
    assert bare.names() == []


@pytest.mark.parametrize(
    ("target", "why"),
    [
        ("no_colon", "module:Class"),
        ("raas.nowhere:X", "cannot load"),
        ("raas.tasks.math:NOPE", "cannot load"),
        ("raas.tasks.math:last_boxed", "not a TaskHandler"),
    ],
)
def test_bad_handler_targets_are_bad_requests(target: str, why: str) -> None:
    with pytest.raises(RaasError) as e:
        HandlerRegistry().register_target("x", target)
    assert e.value.kind == "bad_request" and why in e.value.message


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
    yield tmp_path
    sys.path.remove(str(tmp_path))
    sys.modules.pop("raas_plugin_demo", None)


def test_entry_point_plugins(plugin_dist: Path) -> None:
    registry = HandlerRegistry()
    h = registry.get("demo")
    assert type(h).__name__ == "Demo"
    assert "demo" in registry.names()
    for broken in ("bogus", "missing"):
        with pytest.raises(RaasError) as e:
            registry.get(broken)
        assert e.value.kind == "bad_request"
        assert "unavailable" in e.value.message
    registry.register(Echo, "demo", replace=True)  # an explicit registration wins over a plug-in
    registry.rescan()
    assert isinstance(registry.get("demo"), Echo)
    assert "demo" not in HandlerRegistry(entry_points=False).names()


class Warming(Echo):
    name = "warming-test"
    calls = 0

    @classmethod
    def warm_up(cls) -> None:
        cls.calls += 1


class BrokenWarmUp(Echo):
    name = "broken-warm-up-test"

    @classmethod
    def warm_up(cls) -> None:
        raise RuntimeError("no")


def test_warm_up_runs_when_asked_never_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building a registry (which happens at import time in some programs, e.g. under pytest collection)
    starts no background import: one racing the importer's own AST parsing fails on CPython 3.11.7."""
    from raas.tasks.swe.handler import SweHandler

    swe_calls: list[str] = []
    monkeypatch.setattr(SweHandler, "warm_up", classmethod(lambda cls: swe_calls.append(cls.name)))
    registry = HandlerRegistry(entry_points=False)
    assert swe_calls == []
    registry.register(BrokenWarmUp)
    registry.warm_up()  # the broken hook is logged, not raised
    # once per hook, though it answers to several names and swe-mini's handler inherits it
    assert swe_calls == ["swebench"]


async def test_a_starting_service_warms_its_handlers_up(tmp_path: Path) -> None:
    from raas.pipeline.config import ServiceConfig
    from raas.pipeline.service import RolloutService

    registry = HandlerRegistry(builtins=False, entry_points=False)
    registry.register(Warming)
    Warming.calls = 0
    service = RolloutService(ServiceConfig(state_dir=tmp_path / "svc"), handlers=registry)
    assert Warming.calls == 0
    async with service:
        assert Warming.calls == 1
