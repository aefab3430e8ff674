"""raas selected in verl 0.9.1 by configuration only, called by verl's own code (tests/integrations/
verl_driver.py, in verl's environment): the ``DataProto`` verl's ``AgentLoopWorker`` builds from the raas
agent loop must equal raas's trajectories token for token (ids, mask, logprobs, reward), a filtered sample
must be masked with no advantage, and verl's weight sync must pause raas and stamp the new version."""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
from pathlib import Path

import pandas as pd
import pytest

from raas.integrations.verl_data import verl_rows
from tests.integrations.conftest import REPO, Stack, dump, lookup_instances, multi_turn

pytestmark = pytest.mark.e2e

OVERLAY = REPO / ".venv" / "verl-overlay"
PROMPTS, N = 4, 2


def verl_env(raas_url: str, home: Path) -> dict[str, str]:
    if not (OVERLAY / "hydra").is_dir():
        pytest.fail(f"verl's agent-loop imports are not installed: run `make install` ({OVERLAY} is missing)")
    env = dict(os.environ)
    home.mkdir(exist_ok=True)  # its own: Ray and the trainers keep state under $HOME
    env.update(
        PYTHONPATH=f"{OVERLAY}{os.pathsep}{REPO}", RAAS_URL=raas_url, VERL_N=str(N), HYDRA_FULL_ERROR="1"
    )
    return env


async def test_verls_own_agent_loop_worker_batches_raas_trajectories_exactly(
    stack: Stack, hf_model_dir: Path, tmp_path: Path
) -> None:
    await stack.reset_servers()
    instances = lookup_instances(PROMPTS + 1)
    rows = verl_rows(instances)
    rows[-1]["agent_name"] = "raas_tight"  # its jobs run out of time: filtered by raas
    data = tmp_path / "train.parquet"
    pd.DataFrame(rows).to_parquet(data)
    loops = tmp_path / "agent_loops.yaml"
    loops.write_text(
        "- name: raas\n  _target_: raas.integrations.verl.RaasAgentLoop\n"
        "- name: raas_tight\n  _target_: raas.integrations.verl.RaasAgentLoop\n"
        "  job_timeout_s: 0.001\n  max_resubmits: 1\n"
    )
    out = tmp_path / "verl.json"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(REPO / "tests" / "integrations" / "verl_driver.py"),
        str(out),
        str(hf_model_dir),
        str(loops),
        str(data),
        stack.llama_address,
        env=verl_env(stack.url, tmp_path / "home"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    log, _ = await proc.communicate()
    assert proc.returncode == 0, log.decode(errors="replace")[-6000:]
    got = json.loads(out.read_text())
    P, R, pad = got["prompt_length"], got["response_length"], got["pad_token_id"]

    # verl's weight sync: raas held generation while the weights moved, and stamped each version
    assert got["paused_during_sync"] == [True, True] and got["paused_after_sleep"] is True
    servers = got["servers_after_sync"]["servers"]
    assert [(s["address"], s["weight_version"]) for s in servers] == [(stack.llama_url.rstrip("/"), "1")]

    first, second = got["first"], got["second"]
    assert len(first) == (PROMPTS + 1) * N and len(second) == N
    usable = 0
    turns_seen = False
    for step, batch in (("0", first), ("1", second)):
        for row in batch:
            result = await stack.result(row["raas_job_id"])
            if row["agent_name"] == "raas_tight":
                # filtered (resubmitted once, then given up): a row with nothing to train on, no advantage
                assert result.filter and result.reward is None, dump(result.model_dump())
                assert row["raas_usable"] is False and "filtered" in row["raas_unusable_reason"]
                assert row["raas_job_id"].endswith(".1")
                assert not any(row["response_mask"]) and not any(row["advantages"])
                continue
            usable += 1
            assert not result.filter and result.reward is not None, dump(result.model_dump())
            tt = result.token_trajectory
            n_p, n_r = len(tt.prompt_ids), len(tt.response_ids)
            assert row["prompts"] == [pad] * (P - n_p) + tt.prompt_ids  # left-padded, token for token
            assert row["responses"][:n_r] == tt.response_ids
            assert row["response_mask"] == tt.loss_mask + [0] * (R - n_r)
            assert row["attention_mask"] == [0] * (P - n_p) + [1] * (n_p + n_r) + [0] * (R - n_r)
            want_lp = [
                lp if (lp is not None and m) else 0.0 for lp, m in zip(tt.logprobs, tt.loss_mask, strict=True)
            ]
            assert all(
                math.isclose(a, b, abs_tol=1e-6)
                for a, b in zip(row["rollout_log_probs"][:n_r], want_lp, strict=True)
            )
            assert not any(row["rollout_log_probs"][n_r:])
            scores = [0.0] * R
            scores[max(n_r - 1, 0)] = result.reward
            assert row["rm_scores"] == pytest.approx(scores)
            assert set(row["raas_weight_versions"]) == {step}
            turns_seen |= multi_turn(tt.loss_mask)

    # raas_grpo: each group's baseline over its usable samples only (verl's default normalization by std)
    by_uid: dict[str, list[dict]] = {}
    for row in first:
        by_uid.setdefault(row["uid"], []).append(row)
    for members in by_uid.values():
        ok = [r for r in members if r["raas_usable"]]
        rewards = [sum(r["rm_scores"]) for r in ok]
        mean = sum(rewards) / len(rewards) if len(rewards) > 1 else 0.0
        std = (
            math.sqrt(sum((x - mean) ** 2 for x in rewards) / (len(rewards) - 1)) if len(rewards) > 1 else 1.0
        )
        for r, reward in zip(ok, rewards, strict=True):
            want = (reward - mean) / (std + 1e-6)
            assert [
                a for a, m in zip(r["advantages"], r["response_mask"], strict=True) if m
            ] == pytest.approx([want] * sum(r["response_mask"]), abs=1e-5)
    assert usable == PROMPTS * N + N
    # The untrained model calls the tool in about half of its rollouts (bench/lookup_task.py): none in 10
    # would most likely mean the prompt or the parser broke.
    assert turns_seen
