"""Group-shared INIT for SWE through the full service, in real bwrap and apptainer sandboxes.

Eight samples of one instance (one GRPO group): the repository is prepared once (one ``prepare_repo``,
in the first sample's sandbox), the other seven start from private copies of it. The first sample to run
attacks its copy (writes, deletes, commits, plants a file, rewrites git config); every other sample, all
running after it (one RUN worker, the attacker first), sees the pristine repository. The layer is gone
once the group has started, and the store's directory once the service stops. A preparation that fails
fails every sample of the group as infrastructure (filtered, no reward) without repeating it.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

import pytest
from tests.agent.scripted import tool_call
from tests.conftest import unavailable
from tests.doubles.scripted_llm import ScriptedLLM

from raas.agent.config import AgentConfig
from raas.core.jobs import JobRequest
from raas.errors import RaasError
from raas.llm.models import prepare_tokenizer
from raas.llm.tokenizer import ChatTokenizer
from raas.pipeline.config import ServiceConfig
from raas.pipeline.service import RolloutService
from raas.sandbox import SandboxManager
from raas.tasks.registry import HandlerRegistry
from raas.tasks.swe import handler as swe_handler
from raas.tasks.swe.build import BuildOptions, build
from raas.tasks.swe.config import SweConfig
from raas.tasks.swe.packages import FAST_PACKAGES
from raas.tasks.swe.records import SweRecord
from raas.tasks.swe.replay import ScriptBook

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

SMALL_SET = {"packages": list(FAST_PACKAGES), "per_package": 4, "seed": 0, "jobs": 2}
GROUP = 8


class SharingSwe(swe_handler.SweHandler):
    """The SWE handler with ``share_init`` on (off by default)."""

    name = "swebench"
    config = SweConfig(share_init=True)


def registry() -> HandlerRegistry:
    handlers = HandlerRegistry()
    handlers.register(SharingSwe, replace=True)
    return handlers


@pytest.fixture(scope="module")
async def record(backend_available: dict[str, str | None]) -> SweRecord:
    if backend_available.get("bwrap"):
        unavailable(str(backend_available["bwrap"]))
    try:
        records, _ = await build(BuildOptions(**SMALL_SET))  # type: ignore[arg-type]
    except RaasError as e:
        if os.geteuid() != 0 and e.kind == "sandbox_start_failed":
            unavailable(f"the SWE small set is not built and this user cannot build it: {e.message}")
        raise
    return records[0]


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(prepare_tokenizer())


@pytest.fixture
def count_preparations(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every ``prepare_repo`` the handler runs (the real one; only counted)."""
    calls: list[str] = []
    real = swe_handler.prepare_repo

    async def counted(sb: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("stage", ""))
        return await real(sb, *args, **kwargs)

    monkeypatch.setattr(swe_handler, "prepare_repo", counted)
    return calls


def buggy_file(r: SweRecord) -> str:
    m = re.search(r"^diff --git a/(\S+) b/", r.patch, re.M)
    assert m
    return m.group(1)


def service_config(tmp_path: Path, backend: str, llm_url: str, **extra: Any) -> ServiceConfig:
    return ServiceConfig(
        state_dir=tmp_path / "svc",
        sandbox={"backend": backend},
        llm_servers=[llm_url],
        tokenizer_dir=prepare_tokenizer(),
        agent=AgentConfig(max_turns=6, max_tokens_per_turn=4096, context_budget=32768),
        init_workers=2,
        run_workers=1,
        eval_workers=2,
        default_timeout_s=600,
        shutdown_grace_s=0.0,
        **extra,
    )


async def run_group(
    svc: RolloutService, r: SweRecord, book: ScriptBook, scripts: list[list[str]], group: str
) -> list[Any]:
    requests = [
        JobRequest(
            job_id=f"{group}.{i}",
            instance={**r.model_dump(mode="json"), "group_id": group},
            sampling_params=book.add(f"{group}.{i}", calls),
            priority=10 if i == 0 else 0,  # the attacker goes first through every stage
        )
        for i, calls in enumerate(scripts)
    ]
    await svc.submit_many(requests)
    return [await svc.wait(q.job_id, 600) for q in requests]


def observations(result: Any) -> str:
    return "\n".join(m.content for m in result.messages if m.role == "tool")


@pytest.mark.parametrize("backend", ["bwrap", "apptainer"])
async def test_a_group_prepares_once_and_samples_stay_private(
    backend: str,
    backend_available: dict[str, str | None],
    record: SweRecord,
    tok: ChatTokenizer,
    sandbox_manager: SandboxManager,
    tmp_path: Path,
    count_preparations: list[str],
) -> None:
    if backend_available.get(backend):
        unavailable(str(backend_available[backend]))
    r, path = record, buggy_file(record)
    pristine = hashlib.md5((Path(r.image) / "testbed" / path).read_bytes()).hexdigest()
    attack = (
        f"cd /testbed && echo EVIL >> {path} && git ls-files | grep -v '^{path}$' | head -3 | xargs rm -f && "
        "echo planted > planted.txt && "
        "git -c user.name=x -c user.email=x@x commit -qam evil && git config core.bare true; "
        "chmod 000 setup.py 2>/dev/null; echo ATTACKED"
    )
    look = (
        f"cd /testbed && git status --porcelain; git rev-parse HEAD; md5sum {path}; "
        "test -e planted.txt && echo PLANTED || echo NOT_PLANTED; "
        "git config core.bare"
    )
    scripts = [[tool_call("bash", command=attack)]] + [[tool_call("bash", command=look)]] * (GROUP - 1)
    book = ScriptBook(tok)
    async with ScriptedLLM(book) as llm:
        svc = RolloutService(
            service_config(tmp_path, backend, llm.url), sandbox_manager=sandbox_manager, handlers=registry()
        )
        async with svc:
            store = svc.layers.layer_store
            assert store is not None
            results = await run_group(svc, r, book, scripts, "grp-a")
            assert store.keys() == [], "the layer outlived the group's last start"
            assert not any(store.dir.iterdir())
            stats = dict(store.stats)
        assert not store.dir.exists(), "the service stop left the layer store's directory"
    for res in results:
        assert res is not None and res.status == "completed", (res.job_id, res.error)
    # INIT prepared once; each EVAL (a fresh sandbox from the image) still prepares its own.
    assert count_preparations.count("init") == 1, "the repository was prepared more than once for one group"
    assert stats["prepared"] == 1 and stats["shared"] == GROUP - 1
    assert "ATTACKED" in observations(results[0])
    for res in results[1:]:
        seen = observations(res)
        assert seen.splitlines()[0] == r.base_commit, seen  # `git status --porcelain` printed nothing
        assert pristine in seen and "NOT_PLANTED" in seen and "EVIL" not in seen, seen
        assert "true" not in seen.split(), seen  # git config of the attacker's copy stayed there
        assert res.artifacts["outcome"] == "empty_patch" and res.reward == 0.0


@pytest.mark.parametrize("backend", ["bwrap"])
async def test_a_failed_shared_preparation_is_infrastructure_for_the_group(
    backend: str,
    backend_available: dict[str, str | None],
    record: SweRecord,
    tok: ChatTokenizer,
    sandbox_manager: SandboxManager,
    tmp_path: Path,
    count_preparations: list[str],
) -> None:
    if backend_available.get(backend):
        unavailable(str(backend_available[backend]))
    broken = record.model_copy(update={"base_commit": "0" * 40})  # not in the image's repository
    book = ScriptBook(tok)
    async with ScriptedLLM(book) as llm:
        async with RolloutService(
            service_config(tmp_path, backend, llm.url), sandbox_manager=sandbox_manager, handlers=registry()
        ) as svc:
            results = await run_group(svc, broken, book, [[]] * GROUP, "grp-b")
            store = svc.layers.layer_store
            assert store is not None and store.keys() == []
    assert count_preparations == ["init"], "the failed preparation was repeated"
    assert len(sandbox_manager.started_ids) == 1, "samples started sandboxes for a group that had failed"
    for res in results:
        assert res is not None and res.status == "failed" and res.filter is True and res.reward is None
        assert (
            res.error is not None and res.error.kind == "sandbox_start_failed" and res.error.stage == "init"
        )
    shared_errors = [res for res in results if "group shares failed" in res.error.message]  # type: ignore[union-attr]
    assert len(shared_errors) == GROUP - 1
    assert all("not a git repository with commit" in res.error.message for res in results)  # type: ignore[union-attr]
