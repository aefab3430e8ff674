"""raas as AReaL 1.0.4's rollout workflow, called by AReaL's own engine and workflow executor
(tests/integrations/areal_driver.py, in AReaL's environment): the batch AReaL assembles must equal raas's
trajectories token for token (ids, loss mask, logprobs, per-token versions, reward), raas must have been
given the engine's server and version, and a sample raas filtered must be rejected (not in the batch)."""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
from pathlib import Path

import pytest

from raas.core.jobs import JobResult
from tests.integrations.conftest import REPO, Stack, lookup_instances, multi_turn

pytestmark = pytest.mark.e2e

OVERLAY = REPO / ".venv" / "areal-overlay"
PROMPTS, GROUP = 4, 2


def areal_env(raas_url: str, home: Path) -> dict[str, str]:
    if not (OVERLAY / "areal").is_dir():
        pytest.fail(f"AReaL is not installed: run `make install` ({OVERLAY} is missing)")
    env = dict(os.environ)
    home.mkdir(exist_ok=True)  # its own: Ray and the trainers keep state under $HOME
    env.update(
        HOME=str(home),
        PYTHONPATH=f"{OVERLAY}{os.pathsep}{REPO}",
        RAAS_URL=raas_url,
        AREAL_GROUP_SIZE=str(GROUP),
    )
    return env


async def test_areals_own_executor_batches_raas_trajectories_exactly(stack: Stack, tmp_path: Path) -> None:
    await stack.reset_servers()
    instances = lookup_instances(PROMPTS + 1)
    items = {
        "train": [
            {"raas_instance": json.dumps(inst), "raas_group_id": f"areal-g{i}"}
            for i, inst in enumerate(instances[:PROMPTS])
        ],
        "filtered": [{"raas_instance": json.dumps(instances[-1])}],  # its group named by the workflow
    }
    data = tmp_path / "items.json"
    data.write_text(json.dumps(items))
    out = tmp_path / "areal.json"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(REPO / "tests" / "integrations" / "areal_driver.py"),
        str(out),
        str(data),
        stack.llama_address,
        env=areal_env(stack.url, tmp_path / "home"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    log, _ = await proc.communicate()
    assert proc.returncode == 0, log.decode(errors="replace")[-6000:]
    got = json.loads(out.read_text())

    # every job raas ran for this test (the workflow records them); two samples may be the same tokens
    jobs: list[JobResult] = []
    tight: list[JobResult] = []
    for job_id in got["jobs"]:
        r = await stack.result(job_id)
        (jobs if job_id.startswith("areal-g") else tight).append(r)
    assert len(jobs) == PROMPTS * GROUP + 1

    def take(ids: tuple[int, ...]) -> JobResult:
        """The raas job whose tokens a row holds (each job is one row, once)."""
        for k, r in enumerate(jobs):
            if tuple(r.token_trajectory.prompt_ids + r.token_trajectory.response_ids) == ids:
                return jobs.pop(k)
        raise AssertionError(f"a row is no raas trajectory: {ids[:20]}...")

    def check(batch: dict, version: int) -> int:
        seen_multi = 0
        for i, attn in enumerate(batch["attention_mask"]):
            n = sum(attn)
            r = take(tuple(batch["input_ids"][i][:n]))
            assert not r.filter and r.reward is not None
            tt = r.token_trajectory
            p = len(tt.prompt_ids)
            assert batch["loss_mask"][i][:n] == [0] * p + tt.loss_mask and not any(batch["loss_mask"][i][n:])
            want = [0.0] * p + [
                lp if (lp is not None and m) else 0.0 for lp, m in zip(tt.logprobs, tt.loss_mask, strict=True)
            ]
            assert all(
                math.isclose(a, b, abs_tol=1e-6) for a, b in zip(batch["logprobs"][i][:n], want, strict=True)
            )
            versions = batch["versions"][i][:n]
            assert versions == [-1] * p + [version if m else -1 for m in tt.loss_mask]
            assert {t.weight_version for t in r.turns} == {str(version)}
            assert batch["rewards"][i] == pytest.approx(r.reward)
            seen_multi += multi_turn(tt.loss_mask)
        return seen_multi

    first, second = got["first"], got["second"]
    assert got["meta"]["n_trajs"] == PROMPTS and got["first_groups"] == [GROUP] * PROMPTS
    assert len(first["input_ids"]) == PROMPTS * GROUP and len(second["input_ids"]) == 1
    multi = check(first, 0) + check(second, 1)
    assert not jobs, f"raas ran jobs AReaL did not batch: {[r.job_id for r in jobs.values()]}"

    # raas filtered both attempts of the tight sample; AReaL rejected it
    assert got["rejected_batch"] == 0
    (last,) = tight
    assert last.job_id.endswith(".1")  # resubmitted once, then given up
    first_try = await stack.result(last.job_id[:-1] + "0")
    assert all(r.filter and r.reward is None for r in (first_try, last))

    # The untrained model calls the tool in about half of its rollouts: none in 9 would most likely mean
    # the prompt or the parser broke.
    assert multi > 0
