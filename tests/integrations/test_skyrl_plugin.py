"""raas as SkyRL's generator (skyrl-train 0.3.1), called by SkyRL's own trainer code
(tests/integrations/skyrl_driver.py, in SkyRL's environment): the training input SkyRL builds from
``RaasGenerator``'s output must equal raas's trajectories token for token (ids, loss mask, logprobs,
reward), the inference server SkyRL was configured with must be the one raas used, each step's turns must
carry its ``global_step``, and a sample raas filtered must leave a row with no loss and no advantage."""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
from pathlib import Path

import pandas as pd
import pytest

from tests.integrations.conftest import REPO, Stack, lookup_instances, multi_turn

pytestmark = pytest.mark.e2e

OVERLAY = REPO / ".venv" / "skyrl-overlay"
PROMPTS, N = 4, 2


def total(reward: float | list[float]) -> float:
    """A sample's reward, per sample or per token (SkyRL turns the first into the second in place)."""
    return float(sum(reward)) if isinstance(reward, list) else float(reward)


def skyrl_env(raas_url: str, home: Path) -> dict[str, str]:
    if not (OVERLAY / "skyrl_train").is_dir():
        pytest.fail(f"SkyRL is not installed: run `make install` ({OVERLAY} is missing)")
    env = dict(os.environ)
    home.mkdir(exist_ok=True)  # its own: Ray and the trainers keep state under $HOME
    env.update(
        HOME=str(home), PYTHONPATH=f"{OVERLAY}{os.pathsep}{REPO}", RAAS_URL=raas_url, HYDRA_FULL_ERROR="1"
    )
    return env


async def test_skyrls_own_trainer_builds_its_batch_from_raas_trajectories_exactly(
    stack: Stack, hf_model_dir: Path, tmp_path: Path
) -> None:
    await stack.reset_servers()
    instances = lookup_instances(PROMPTS + 1)
    rows = [
        {
            "prompt": [{"role": "user", "content": str(inst["instance_id"])}],
            "env_class": "raas",
            "raas_instance": json.dumps(inst),
            "raas_case": "tight" if i == PROMPTS else "",
        }
        for i, inst in enumerate(instances)
    ]
    data = tmp_path / "train.parquet"
    pd.DataFrame(rows).to_parquet(data)
    out = tmp_path / "skyrl.json"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(REPO / "tests" / "integrations" / "skyrl_driver.py"),
        str(out),
        str(hf_model_dir),
        str(data),
        stack.llama_address,
        env=skyrl_env(stack.url, tmp_path / "home"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    log, _ = await proc.communicate()
    assert proc.returncode == 0, log.decode(errors="replace")[-6000:]
    got = json.loads(out.read_text())
    # the server SkyRL's config named (its remote engine's URL) is the one raas used, stamped with the step
    assert got["registered"] == [[stack.llama_url.rstrip("/")], "2"]
    first, second, tight = got["steps"]
    multi = 0
    for step in (first, second):
        jobs = step["jobs"]
        assert len(jobs) == len(step["generator_output"]["response_ids"])
        R = step["response_length"]
        for i, job_id in enumerate(jobs):
            r = await stack.result(job_id)
            assert not r.filter and r.reward is not None
            tt = r.token_trajectory
            p, n = len(tt.prompt_ids), len(tt.response_ids)
            seq = [t for t, a in zip(step["sequences"][i], step["attention_mask"][i], strict=True) if a]
            assert seq == tt.prompt_ids + tt.response_ids  # SkyRL's sequence, token for token
            width = len(step["sequences"][i])
            assert step["attention_mask"][i][width - R - p : width - R] == [1] * p  # prompt left-padded
            assert step["loss_mask"][i] == [float(m) for m in tt.loss_mask] + [0.0] * (R - n)
            want = [
                lp if (lp is not None and m) else 0.0 for lp, m in zip(tt.logprobs, tt.loss_mask, strict=True)
            ]
            assert all(
                math.isclose(a, b, abs_tol=1e-6)
                for a, b in zip(step["rollout_logprobs"][i][:n], want, strict=True)
            )
            assert total(step["generator_output"]["rewards"][i]) == pytest.approx(r.reward)
            assert {t.weight_version for t in r.turns} == {step["version"]}
            multi += multi_turn(tt.loss_mask)
        # SkyRL's GRPO over its uids: advantages on the loss tokens equal (r - mean) / (std + eps)
        by_uid: dict[str, list[int]] = {}
        for i, uid in enumerate(step["uids"][: len(jobs)]):
            by_uid.setdefault(uid, []).append(i)
        for rows_of in by_uid.values():
            rewards = [total(step["generator_output"]["rewards"][i]) for i in rows_of]
            mean = sum(rewards) / len(rewards) if len(rewards) > 1 else 0.0
            std = (
                math.sqrt(sum((x - mean) ** 2 for x in rewards) / (len(rewards) - 1))
                if len(rewards) > 1
                else 1.0
            )
            for i, reward in zip(rows_of, rewards, strict=True):
                got_adv = [
                    a for a, m in zip(step["advantages"][i], step["response_mask"][i], strict=True) if m
                ]
                assert got_adv == pytest.approx([(reward - mean) / (std + 1e-6)] * len(got_adv), abs=1e-5)

    # raas filtered both samples of the tight prompt (each resubmitted once): rows with no loss, no advantage
    assert len(tight["jobs"]) == N and all(j.endswith(".1") for j in tight["jobs"])
    for i, job_id in enumerate(tight["jobs"]):
        for attempt in (job_id[:-1] + "0", job_id):
            r = await stack.result(attempt)
            assert r.filter and r.reward is None
        assert not any(tight["loss_mask"][i]) and not any(tight["advantages"][i])
        assert tight["generator_output"]["stop_reasons"][i] == "raas_unusable"
    assert tight["generator_output"]["rollout_metrics"]["raas/unusable"] == N

    # a group with one filtered sample, under grpo_norm_by_std=false: the usable samples' advantages are
    # exactly r - mean(usable rewards) (1 and 0: +0.5, -0.5); the filtered row has none
    mixed = got["mixed"]
    adv = [
        [a for a, m in zip(row, mask, strict=True) if m]
        for row, mask in zip(mixed["advantages"], mixed["loss_mask"], strict=True)
    ]
    assert adv[0] == pytest.approx([0.5, 0.5]) and adv[1] == pytest.approx([-0.5, -0.5]) and adv[2] == []
    assert not any(mixed["advantages"][2])

    # The untrained model calls the tool in about half of its rollouts: none in 10 would most likely mean
    # the prompt or the parser broke.
    assert multi > 0
