"""Scripted-policy helpers shared by agent and task tests: Hermes tool-call text, scripted completions
with distinct logprobs, and an LLMContext that routes through the real balancer to the scripted server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from tests.doubles.scripted_llm import Completion, ScriptedLLM, replay

from raas.agent.config import AgentConfig
from raas.agent.context import LLMContext
from raas.core.jobs import Job
from raas.llm.balancer import LLMBalancer
from raas.llm.tokenizer import ChatTokenizer

EOS = 2  # <|im_end|> in SmolLM2's vocabulary


def tool_call(name: str, **arguments: Any) -> str:
    """An assistant message calling one tool in the Hermes format the SmolLM2 setup uses."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def completions(tok: ChatTokenizer, texts: Sequence[str], *, logprob_base: float = -0.5) -> list[Completion]:
    """One scripted completion per text, ending in EOS, with distinct logprobs so mix-ups show."""
    out = []
    for i, text in enumerate(texts):
        c = Completion.of_text(text, encode=tok.encode, eos_id=EOS)
        c.logprobs = [logprob_base - 0.001 * (i * 1000 + j) for j in range(len(c.token_ids))]
        out.append(c)
    return out


@asynccontextmanager
async def scripted_policy(
    tok: ChatTokenizer,
    texts: Sequence[str],
    agent: AgentConfig | None = None,
    weight_version: str | None = None,
) -> AsyncIterator[tuple[ScriptedLLM, LLMContext, list[Completion]]]:
    """A scripted server replaying ``texts`` and an LLMContext routing to it through a real balancer."""
    script = completions(tok, texts)
    async with ScriptedLLM(replay(script)) as server:
        balancer = LLMBalancer(health_interval_s=0)
        balancer.add(server.url, weight_version=weight_version)
        try:
            yield server, LLMContext(balancer=balancer, tokenizer=tok, agent=agent or AgentConfig()), script
        finally:
            await balancer.aclose()


def make_job(instance: dict[str, Any] | None = None, **sampling: Any) -> Job:
    inst = instance or {"data_source": "math", "problem": "What is 6 times 7?", "answer": "42"}
    return Job(job_id="job-1", instance=inst, trajectory_id="traj-1", sampling_params=sampling)
