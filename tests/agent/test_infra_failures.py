"""Infrastructure failures inside a rollout end it with a typed error (filtered by the pipeline) instead
of becoming something the policy reads: a hung sandbox, and a chat-tokenizer conversation whose tokens
drift from the recorded trajectory. Real local sandbox, real SmolLM2 tokenizer, scripted policy server."""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from typing import Any

import pytest
from tests.agent.scripted import make_job, scripted_policy, tool_call

from raas.agent.config import AgentConfig
from raas.agent.context import LLMContext
from raas.agent.loop import TokenMismatch, run_agent
from raas.agent.tools import ToolSet
from raas.errors import is_infrastructure
from raas.llm.tokenizer import ChatTokenizer, Conversation
from raas.sandbox import Sandbox

pytestmark = pytest.mark.integration

TOOLS = ToolSet(["bash", "finish"])


async def test_a_hung_sandbox_ends_the_rollout_instead_of_becoming_an_observation(
    tokenizer: ChatTokenizer, sandbox: Sandbox
) -> None:
    """The tool server stops answering (SIGSTOP): the host client's ``tool_timeout`` is fatal."""
    texts = [tool_call("bash", command="echo hi"), tool_call("finish", answer="1")]
    sandbox.tools.timeout_grace_s = 0.5  # how long the client waits beyond the command's own timeout
    server_pid = sandbox.server_info.pid
    os.kill(server_pid, signal.SIGSTOP)
    try:
        async with scripted_policy(tokenizer, texts, AgentConfig(tool_timeout_s=1.0)) as (server, llm, _):
            with pytest.raises(Exception) as err:
                await run_agent(make_job(), sandbox, llm, TOOLS, user_prompt="q")
    finally:
        os.kill(server_pid, signal.SIGCONT)
    assert getattr(err.value, "kind", None) == "tool_timeout", err.value
    assert is_infrastructure("tool_timeout")
    assert len(server.requests) == 1  # the policy never saw the timeout as an observation


class _Corrupting(Conversation):
    """A conversation that goes wrong after the first assistant turn, as a re-tokenizing or
    re-rendering bug would: ``where="assistant"`` duplicates a sampled token, ``where="messages"`` loses
    one while appending the tool result."""

    where = "assistant"

    def add_assistant(self, output_ids: Sequence[int], logprobs: Sequence[float | None] | None = None) -> Any:
        message = super().add_assistant(output_ids, logprobs)
        if self.where == "assistant" and len(self.turns) == 1:
            start = self.turns[0].sampled[0]
            self.ids.insert(start + 1, self.ids[start])
        return message

    def add_messages(self, messages: Sequence[Any], *, add_generation_prompt: bool = True) -> list[int]:
        ids = super().add_messages(messages, add_generation_prompt=add_generation_prompt)
        if self.where == "messages" and len(self.turns) == 1:
            del self.ids[self.turns[0].sampled[0] + 1]
        return ids


class _CorruptingTokenizer:
    """The real tokenizer, handing out :class:`_Corrupting` conversations."""

    def __init__(self, real: ChatTokenizer, where: str) -> None:
        self.real = real
        self.where = where

    def conversation(self, messages: Sequence[Any], *, tools: Any = None) -> Conversation:
        conv = _Corrupting(self.real, list(messages), tools=tools)
        conv.where = self.where
        return conv


@pytest.mark.parametrize("where", ["assistant", "messages"])
async def test_a_conversation_that_drifts_from_the_record_is_a_token_mismatch(
    tokenizer: ChatTokenizer, sandbox: Sandbox, where: str
) -> None:
    texts = [tool_call("bash", command="echo hi"), tool_call("finish", answer="1")]
    async with scripted_policy(tokenizer, texts) as (server, llm, _):
        corrupt = LLMContext(llm.balancer, _CorruptingTokenizer(tokenizer, where), llm.agent)  # type: ignore[arg-type]
        with pytest.raises(TokenMismatch) as err:
            await run_agent(make_job(), sandbox, corrupt, TOOLS, user_prompt="q")
    assert err.value.kind == "token_mismatch" and err.value.stage == "run"
    assert is_infrastructure(err.value.kind)
    assert len(server.requests) == 1  # the drifted prompt was never sent


async def test_the_check_passes_on_an_honest_conversation_to_the_end(
    tokenizer: ChatTokenizer, sandbox: Sandbox
) -> None:
    """Same script, real conversation: no false alarm, including the final turn's check."""
    texts = [tool_call("bash", command="echo hi"), tool_call("finish", answer="1")]
    async with scripted_policy(tokenizer, texts) as (server, llm, _):
        out = await run_agent(make_job(), sandbox, llm, TOOLS, user_prompt="q")
    assert out.finish_reason == "finish_tool" and len(server.requests) == 2
