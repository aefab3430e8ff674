"""raas as TRL's ``rollout_func``: the conversion on hand-built results (unit), and two real GRPO steps of
TRL 1.16.0 on the CPU against a real service whose llama.cpp serves the policy being trained (e2e): TRL must
train on exactly raas's sampled tokens, with raas's logprobs, mask and rewards; the weights must move, and
the second step's rollouts must come from the weights pushed to llama-server after the first."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest

from raas.cli.inprocess import service_in_process
from raas.errors import RaasError
from raas.llm.models import default_gguf_path, default_tokenizer_dir, prepare_tokenizer
from raas.pipeline.config import ServiceConfig
from raas.tasks.datasets import load_dataset
from raas.trainer.rollout import FailurePolicy
from raas.trainer.sync import SyncRolloutClient
from raas.trainer.trl_rollout import (
    RaasRolloutFunc,
    RaasWeightSyncCallback,
    groups_to_trl,
    instance_index,
    prompt_key,
    raas_reward,
    sampling_params_from,
)
from raas.trainer.types import ErrorInfo, Group, JobResult
from tests.trainer.test_grpo import result

if TYPE_CHECKING:
    from raas.learn.llama_sync import LlamaWeightSync

PAD = 2
CPU_GRPO: dict[str, Any] = {
    "temperature": 1.0,
    "learning_rate": 1e-5,
    "beta": 0.0,
    "use_cpu": True,
    "bf16": False,
    "fp16": False,
    "report_to": "none",
    "save_strategy": "no",
    "logging_steps": 1,
    "disable_tqdm": True,
    "dataloader_num_workers": 0,
    "seed": 0,
}
"""``GRPOConfig`` settings of the TRL tests' small, seeded CPU runs."""


def group(gid: str, results: dict[int, JobResult], size: int, failures: list[JobResult] = ()) -> Group:  # type: ignore[assignment]
    g = Group(group_id=gid, instance={"data_source": "x"}, size=size)
    g.results.update(results)  # insertion order deliberately left as given
    g.failures.extend(failures)
    return g


def failed(job_id: str, kind: str) -> JobResult:
    return JobResult(
        job_id=job_id, status="failed", filter=True, error=ErrorInfo(stage="run", kind=kind, message="boom")
    )


@pytest.mark.unit
def test_rows_follow_trls_order_group_by_group_in_trajectory_order() -> None:
    g0 = group(
        "g0",
        {
            2: result("g0.2", 1.0, [1, 5], [([30, 31], "0")]),
            0: result("g0.0", 0.0, [1, 5], [([10], "0")]),
            1: result("g0.1", 1.0, [1, 5], [([20, 21, 22], "0")]),
        },
        3,
    )
    g1 = group("g1", {i: result(f"g1.{i}", 0.5, [1, 6], [([40 + i], "0")]) for i in range(3)}, 3)
    out = groups_to_trl([g0, g1], 3, pad_id=PAD)
    assert out["raas_job_id"] == ["g0.0", "g0.1", "g0.2", "g1.0", "g1.1", "g1.2"]
    assert out["prompt_ids"] == [[1, 5]] * 3 + [[1, 6]] * 3
    assert out["completion_ids"] == [[10], [20, 21, 22], [30, 31], [40], [41], [42]]
    assert out["raas_reward"] == [0.0, 1.0, 1.0, 0.5, 0.5, 0.5]
    assert out["logprobs"][1] == [-0.5, -0.5, -0.5] and out["env_mask"][1] == [1, 1, 1]
    assert out["raas_weight_version"] == ["0"] * 6
    # every column has one value per row, as TRL's extra-field merge expects
    assert {len(v) for v in out.values()} == {6}


@pytest.mark.unit
def test_multi_turn_completion_is_the_whole_response_and_env_mask_marks_the_sampled_tokens() -> None:
    r = result("m", 1.0, [1, 2], [([5, 6], "0"), ([7], "1")], obs=[3, 3, 3])
    r.token_trajectory.logprobs[1] = None  # the server reported none for this sampled token
    out = groups_to_trl([group("g", {0: r, 1: result("o", 0.0, [1, 2], [([8], "0")])}, 2)], 2, pad_id=PAD)
    assert out["completion_ids"][0] == [5, 6, 3, 3, 3, 7]
    assert out["env_mask"][0] == [1, 1, 0, 0, 0, 1]
    sampled = [t for t, m in zip(out["completion_ids"][0], out["env_mask"][0], strict=True) if m]
    assert sampled == [t for turn in r.turns for t in turn.output_ids]
    # None stays None: TRL turns it into NaN (no importance-sampling correction), never a made-up 0.0
    assert out["logprobs"][0] == [-0.5, None, 0.0, 0.0, 0.0, -0.5]
    assert out["raas_weight_version"][0] == "0"  # the oldest turn's version


@pytest.mark.unit
def test_missing_samples_raise_by_default_and_never_become_a_zero_reward() -> None:
    ok = {0: result("a", 1.0, [1, 9], [([5], "0")]), 2: result("c", 0.0, [1, 9], [([6], "0")])}
    g = group("g", ok, 3, failures=[failed("b.2", "sandbox_dead")])
    with pytest.raises(RaasError) as err:
        groups_to_trl([g], 3, pad_id=PAD)
    assert err.value.kind == "unavailable" and "sandbox_dead" in err.value.message
    out = groups_to_trl([g], 3, pad_id=PAD, on_missing="mask")
    assert out["raas_job_id"] == ["a", "c", None]
    assert out["raas_reward"] == [1.0, 0.0, None]
    assert out["completion_ids"][2] == [PAD] and out["env_mask"][2] == [0]  # nothing to learn from
    assert out["prompt_ids"][2] == [1, 9]
    assert raas_reward(["x", "y", "z"], raas_reward=out["raas_reward"]) == [1.0, 0.0, None]


@pytest.mark.unit
def test_a_filtered_result_inside_a_group_is_not_used_even_with_a_reward() -> None:
    fake_zero = result("z", 0.0, [1], [([5], "0")], filtered=True)
    g = group("g", {0: fake_zero, 1: result("ok", 1.0, [1], [([6], "0")])}, 2)
    out = groups_to_trl([g], 2, pad_id=PAD, on_missing="mask")
    assert out["raas_job_id"] == ["ok", None] and out["raas_reward"] == [1.0, None]
    empty = group("e", {}, 2)
    empty.dropped = True
    assert groups_to_trl([empty], 2, pad_id=PAD, on_missing="mask")["prompt_ids"] == [[PAD], [PAD]]


@pytest.mark.unit
def test_refills_count_and_extra_samples_are_cut_to_num_generations() -> None:
    g = group("g", {0: result("a", 1.0, [1], [([5], "0")]), 4: result("r", 0.0, [1], [([6], "0")])}, 2)
    assert groups_to_trl([g], 2, pad_id=PAD)["raas_job_id"] == ["a", "r"]
    g.results[1] = result("b", 0.0, [1], [([7], "0")])
    assert groups_to_trl([g], 2, pad_id=PAD)["raas_job_id"] == ["a", "b"]


@pytest.mark.unit
def test_what_trl_cannot_take_faithfully_is_refused_or_masked() -> None:
    seg = result("s", 1.0, [1], [([5], "0")])
    seg.segments = [seg.token_trajectory, seg.token_trajectory]
    with pytest.raises(RaasError, match="segments") as err:
        groups_to_trl([group("g", {0: seg}, 1)], 1, pad_id=PAD)
    assert err.value.kind == "bad_request"
    # a usable sample with no response tokens keeps its reward (it is in the baseline) on a masked pad
    empty = result("e", 0.0, [1, 4], [([], "0")])
    out = groups_to_trl([group("g", {0: empty}, 1)], 1, pad_id=PAD)
    assert out["completion_ids"] == [[PAD]] and out["env_mask"] == [[0]] and out["raas_reward"] == [0.0]
    with pytest.raises(RaasError, match="on_missing"):
        groups_to_trl([], 1, pad_id=PAD, on_missing="zero")  # type: ignore[arg-type]
    with pytest.raises(RaasError, match="raas_reward"):
        raas_reward(["a"], other=[1.0])


@pytest.mark.unit
def test_instance_index_keys_and_conflicts() -> None:
    rows = [{"problem": "1+1?", "answer": "2", "data_source": "math_final"}]
    index = instance_index(rows, dict, prompt_column="problem")
    assert index == {"1+1?": rows[0]}
    chat = [{"role": "user", "content": "hi"}]
    assert prompt_key(chat) == '[{"content": "hi", "role": "user"}]'
    assert (
        instance_index([{"prompt": chat, "data_source": "x"}], dict)[prompt_key(chat)]["data_source"] == "x"
    )
    with pytest.raises(RaasError, match="two different instances"):
        instance_index([*rows, {**rows[0], "answer": "3"}], dict, prompt_column="problem")
    with pytest.raises(RaasError, match="data_source"):
        instance_index([{"prompt": "p"}], dict)
    with pytest.raises(RaasError, match="no 'prompt' column"):
        instance_index([{"q": "p"}], dict)


@pytest.mark.unit
def test_sampling_params_mirror_the_trainer_config() -> None:
    args = SimpleNamespace(
        temperature=0.7, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0, max_completion_length=16
    )
    assert sampling_params_from(args) == {
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "max_tokens": 16,
    }


@pytest.mark.unit
def test_prompts_must_come_in_runs_of_num_generations() -> None:
    trainer = SimpleNamespace(num_generations=2, num_generations_eval=2, model=SimpleNamespace(training=True))
    # The checks run before the client is used: no service is needed to see them refuse.
    func = RaasRolloutFunc(None, {"a": {"data_source": "x"}})  # type: ignore[arg-type]
    with pytest.raises(RaasError, match="groups of num_generations=2"):
        func(["a", "a", "a"], trainer)  # type: ignore[arg-type]
    with pytest.raises(RaasError, match="runs of 2 equal prompts"):
        func(["a", "b", "a", "b"], trainer)  # type: ignore[arg-type]
    with pytest.raises(RaasError) as err:
        func(["b", "b"], trainer)  # type: ignore[arg-type]
    assert err.value.kind == "not_found"


# -- two real GRPO steps of TRL against a real service ---------------------------------------------------


@pytest.fixture
def policy() -> Any:
    """SmolLM2-135M as TRL trains it: the shipped GGUF read by transformers (dequantized to float32), with
    the loader's quantization marker removed (Trainer refuses to train a model marked quantized)."""
    from raas.trainer.hf_weights import load_policy

    return load_policy(default_gguf_path()).train()


@pytest.fixture
async def served(policy: Any, tmp_path: Path) -> AsyncIterator[tuple[str, LlamaWeightSync]]:
    """A raas service whose llama-server serves ``policy``'s own weights (as an f16 GGUF) and is restarted
    with the trained ones at every weight sync."""
    from raas.learn.llama_sync import LlamaWeightSync

    async with LlamaWeightSync(
        policy, template=default_gguf_path(), parallel=4, ctx_per_slot=1024, workdir=tmp_path / "policy"
    ) as llama:
        config = ServiceConfig(
            state_dir=tmp_path / "svc",
            llm_servers=[llama.url],
            tokenizer_dir=prepare_tokenizer(),
            run_workers=4,
            shutdown_grace_s=0.0,
            default_timeout_s=240,
        )
        async with service_in_process(config) as url:
            yield url, llama


def _same_logprobs(trl_row: list[float], raas: list[float | None]) -> bool:
    """Equal as float32, with raas's None (no logprob reported) being TRL's NaN."""
    return len(trl_row) == len(raas) and all(
        math.isnan(t) if r is None else t == pytest.approx(r, abs=1e-6)
        for t, r in zip(trl_row, raas, strict=True)
    )


@pytest.mark.e2e
async def test_two_real_trl_grpo_steps_train_on_raas_tokens_logprobs_and_rewards(
    policy: Any, served: tuple[str, LlamaWeightSync], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    service_url, llama = served
    G, PROMPTS_PER_STEP = 4, 2
    problems = load_dataset(f"builtin:addition:{2 * PROMPTS_PER_STEP}")
    index = instance_index(problems, dict, prompt_column="problem")
    dataset = Dataset.from_list([{"prompt": p["problem"]} for p in problems])
    tokenizer = AutoTokenizer.from_pretrained(str(default_tokenizer_dir()))
    before = {name: p.detach().clone() for name, p in policy.named_parameters()}

    results: dict[str, JobResult] = {}  # every result raas delivered, straight from the client
    calls: list[tuple[list[Any], dict[str, list[Any]]]] = []
    rewards_seen: list[tuple[list[str], list[float | None]]] = []
    batches: list[dict[str, Any]] = []
    synced: list[int] = []
    loop = asyncio.get_running_loop()

    def recorded_reward(completions: list[Any], **kwargs: Any) -> list[float | None]:
        rewards = raas_reward(completions, **kwargs)
        rewards_seen.append((list(kwargs["raas_job_id"]), rewards))
        return rewards

    recorded_reward.__name__ = "raas_reward"

    def push_weights(trained: Any, step: int) -> None:
        """Runs inside raas's pause: export the trained weights, restart llama-server with them (on the
        test's loop, which owns the server process)."""
        assert trained is policy
        asyncio.run_coroutine_threadsafe(llama.write(), loop).result()
        asyncio.run_coroutine_threadsafe(llama.restart(), loop).result()
        synced.append(step)

    class RecordingGRPOTrainer(GRPOTrainer):  # type: ignore[misc]
        """Keeps the batch TRL builds from the rollout (before it shuffles it for the optimizer)."""

        def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
            out = super()._generate_and_score_completions(inputs)
            batches.append({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in out.items()})
            return out

    client = await asyncio.to_thread(
        SyncRolloutClient,
        service_url,
        policy=FailurePolicy(min_group_size=G, refill=True),
        on_result=lambda r: results.__setitem__(r.job_id, r),
    )
    try:
        rollout = RaasRolloutFunc(client, index, on_output=lambda p, o: calls.append((list(p), o)))
        args = GRPOConfig(
            output_dir=str(tmp_path / "trl"),
            max_steps=2,
            per_device_train_batch_size=G * PROMPTS_PER_STEP,
            gradient_accumulation_steps=1,
            num_generations=G,
            max_completion_length=16,
            **CPU_GRPO,
        )
        trainer = RecordingGRPOTrainer(
            model=policy,
            reward_funcs=[recorded_reward],
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            rollout_func=rollout,
            callbacks=[RaasWeightSyncCallback(client, push_weights)],
        )
        await asyncio.to_thread(trainer.train)
    finally:
        await asyncio.to_thread(client.close)

    # TRL called the rollout once per step with every prompt already repeated G times in a row.
    assert len(calls) == 2 and len(batches) == 2 and synced == [1, 2]
    for step, ((prompts, out), batch) in enumerate(zip(calls, batches, strict=True)):
        assert len(prompts) == G * PROMPTS_PER_STEP
        assert all(prompts[i] == prompts[i - i % G] for i in range(len(prompts)))
        jobs = out["raas_job_id"]
        assert None not in jobs and len(set(jobs)) == len(jobs)
        for row, job in enumerate(jobs):
            r = results[job]
            tt = r.token_trajectory
            assert r.instance_id == index[prompts[row]]["instance_id"]
            # the tokens TRL trained on are exactly raas's, the loss mask exactly raas's sampled tokens
            c_mask = batch["completion_mask"][row] == 1
            assert batch["completion_ids"][row][c_mask].tolist() == tt.response_ids
            assert batch["prompt_ids"][row][batch["prompt_mask"][row] == 1].tolist() == tt.prompt_ids
            loss_mask = (batch["completion_mask"][row] * batch["tool_mask"][row])[c_mask].tolist()
            assert loss_mask == tt.loss_mask
            sampled = [t for t, m in zip(tt.response_ids, tt.loss_mask, strict=True) if m]
            assert sampled == [t for turn in r.turns for t in turn.output_ids] and sampled
            assert _same_logprobs(batch["sampling_per_token_logps"][row][c_mask].tolist(), tt.logprobs)
            # sampled by the initial weights in step 0, by the weights pushed after step 1 in step 1
            assert {t.weight_version for t in r.turns} == {str(step)}
        # the reward TRL used is raas's verifier reward, row by row
        seen_jobs, seen = rewards_seen[step]
        assert seen_jobs == jobs and seen == [results[j].reward for j in jobs]
        assert set(seen) <= {0.0, 1.0}
        # GRPO advantages per group of G rows: zero without variance, else the sign of reward - mean
        adv = batch["advantages"].tolist()
        for start in range(0, len(jobs), G):
            rs = [float(x) for x in seen[start : start + G]]  # type: ignore[arg-type]
            mean = sum(rs) / G
            for a, rew in zip(adv[start : start + G], rs, strict=True):
                assert (a > 0) == (rew > mean) and (a < 0) == (rew < mean)
    informative = any(a != 0 for b in batches for a in b["advantages"].tolist())
    changed = [n for n, p in policy.named_parameters() if not torch.equal(before[n], p.detach())]
    # weight decay is 0: the weights move exactly when some group had a reward signal
    assert bool(changed) == informative
