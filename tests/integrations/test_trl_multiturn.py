"""TRL 1.16's GRPOTrainer with raas as its ``rollout_func`` where the existing TRL test does not go: a
multi-turn tool task (``env_mask`` with zeros on the tool observations), conversational prompts,
``steps_per_generation=2`` (one rollout for two optimizer steps) and evaluation with
``num_generations_eval``. The policy server is the scripted vLLM-protocol test double (what TRL trains on
must be raas's tokens whoever sampled them; a script makes every rollout call the bash tool, so every row
is multi-turn); the sandboxes, the service and TRL are real."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from raas.core.jobs import JobResult
from raas.llm.models import default_gguf_path, default_tokenizer_dir, prepare_tokenizer
from raas.llm.scripted import Completion, CompletionRequest, ScriptedLLM
from raas.llm.tokenizer import ChatTokenizer
from raas.trainer.rollout import FailurePolicy
from raas.trainer.sync import SyncRolloutClient
from raas.trainer.trl_rollout import RaasRolloutFunc, instance_index, raas_reward
from tests.agent.scripted import EOS, tool_call
from tests.integrations.conftest import Stack, lookup_instances, multi_turn
from tests.trainer.test_trl_rollout import CPU_GRPO

pytestmark = pytest.mark.e2e

G = 2  # num_generations and num_generations_eval


def lookup_policy(tok: ChatTokenizer) -> Any:
    """Turn 0 reads the file the question names; turn 1 says the number the tool printed."""

    def respond(req: CompletionRequest) -> Completion:
        text = tok.decode(req.prompt_ids)
        seen = re.findall(r"(\d{4})\n\[exit code 0\]", text.split("<|im_start|>user")[-1])
        if not seen:
            file = re.findall(r"secret number in (\S+)\?", text)[-1]
            reply = tool_call("bash", command=f"cat {file}")
        else:
            reply = seen[-1]
        c = Completion.of_text(reply, encode=tok.encode, eos_id=EOS)
        c.logprobs = [-0.25 - 0.001 * j for j in range(len(c.token_ids))]
        return c

    return respond


async def test_trl_trains_on_multi_turn_conversational_rollouts_across_generation_steps_and_evaluates(
    stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from raas.trainer.hf_weights import load_policy

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    await stack.reset_servers()
    tok = ChatTokenizer.from_pretrained(prepare_tokenizer())
    instances = lookup_instances(3)
    # conversational prompts: TRL hands rollout_func the messages; raas builds the task's own prompt
    rows = [
        {"prompt": [{"role": "user", "content": inst["instance_id"]}], "raas": inst} for inst in instances
    ]
    index = instance_index(rows, lambda r: r["raas"])
    train = Dataset.from_list([{"prompt": r["prompt"]} for r in rows[:2]])
    evals = Dataset.from_list([{"prompt": r["prompt"]} for r in rows[2:]])
    results: dict[str, JobResult] = {}
    calls: list[tuple[bool, list[Any], dict[str, list[Any]]]] = []
    batches: list[tuple[bool, dict[str, Any]]] = []
    policy = load_policy(default_gguf_path()).train()

    class RecordingGRPOTrainer(GRPOTrainer):  # type: ignore[misc]
        def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
            out = super()._generate_and_score_completions(inputs)
            batches.append(
                (
                    self.model.training,
                    {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in out.items()},
                )
            )
            return out

    async with ScriptedLLM(lookup_policy(tok)) as server:
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as c:
            r = await c.post("/v1/llm/servers", json={"address": server.url, "weight_version": "0"})
            assert r.status_code == 200, r.text
        client = await asyncio.to_thread(
            SyncRolloutClient,
            stack.url,
            policy=FailurePolicy(min_group_size=G, refill=True),
            on_result=lambda r: results.__setitem__(r.job_id, r),
        )
        trainer_box: list[Any] = []
        try:
            rollout = RaasRolloutFunc(
                client,
                index,
                on_output=lambda p, o: calls.append((trainer_box[0].model.training, list(p), o)),
            )
            args = GRPOConfig(
                output_dir=str(tmp_path / "trl"),
                max_steps=2,
                per_device_train_batch_size=G,
                steps_per_generation=2,  # one generation batch of 2 prompts x G, trained on in 2 steps
                gradient_accumulation_steps=1,
                num_generations=G,
                num_generations_eval=G,
                per_device_eval_batch_size=G,
                eval_strategy="steps",
                eval_steps=2,
                max_completion_length=256,
                **CPU_GRPO,
            )
            trainer = RecordingGRPOTrainer(
                model=policy,
                reward_funcs=[raas_reward],
                args=args,
                train_dataset=train,
                eval_dataset=evals,
                processing_class=AutoTokenizer.from_pretrained(str(default_tokenizer_dir())),
                rollout_func=rollout,
            )
            trainer_box.append(trainer)
            await asyncio.to_thread(trainer.train)
        finally:
            await asyncio.to_thread(client.close)

    # one rollout for the two training steps (steps_per_generation=2), one for the evaluation
    modes = [training for training, _, _ in calls]
    assert modes == [True, False], modes
    assert [len(p) for _, p, _ in calls] == [2 * G, G]
    assert [training for training, _ in batches] == [True, False]
    for (_, prompts, out), (_, batch) in zip(calls, batches, strict=True):
        assert all(isinstance(p, list) and p[0]["role"] == "user" for p in prompts)  # conversational
        for row, job in enumerate(out["raas_job_id"]):
            r = results[job]
            tt = r.token_trajectory
            assert r.instance_id == index[_key(prompts[row])]["instance_id"]
            c_mask = batch["completion_mask"][row] == 1
            assert batch["completion_ids"][row][c_mask].tolist() == tt.response_ids
            assert batch["prompt_ids"][row][batch["prompt_mask"][row] == 1].tolist() == tt.prompt_ids
            # TRL's loss mask on the completion is raas's: 1 on both sampled turns, 0 on the tool output
            loss_mask = (batch["completion_mask"][row] * batch["tool_mask"][row])[c_mask].tolist()
            assert loss_mask == tt.loss_mask and multi_turn(loss_mask) and 0 in loss_mask
            assert r.reward == 1.0  # the script reads the file and says its number


def _key(prompt: Any) -> str:
    from raas.trainer.trl_rollout import prompt_key

    return prompt_key(prompt)
