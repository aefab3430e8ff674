"""Gateway test rig: a policy server (the scripted vLLM-protocol double or the embedded llama.cpp model), the
real balancer, a :class:`Gateway`, and per-rollout Unix-socket endpoints driven by the real OpenAI and
Anthropic SDKs."""

from __future__ import annotations

import socket
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import openai
import pytest
from tests.agent.scripted import completions
from tests.doubles.scripted_llm import Completion, CompletionRequest, ScriptedLLM, replay

from raas.agent.config import AgentConfig
from raas.core.jobs import Job
from raas.core.trajectory import RunOutput
from raas.gateway import Gateway, GatewaySession
from raas.llm.balancer import LLMBalancer
from raas.llm.models import prepare_tokenizer
from raas.llm.tokenizer import ChatTokenizer

BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a bash command",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}
ANTHROPIC_BASH = {
    "name": "bash",
    "description": "Run a bash command",
    "input_schema": BASH_TOOL["function"]["parameters"],  # type: ignore[index]
}


@pytest.fixture(scope="session")
def tok() -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(prepare_tokenizer())


@dataclass
class Endpoint:
    session: GatewaySession
    path: str

    def openai(self, key: str | None = None, **kwargs: Any) -> openai.AsyncOpenAI:
        transport = httpx2.AsyncHTTPTransport(uds=self.path)
        return openai.AsyncOpenAI(
            base_url="http://gateway/v1",
            api_key=key or self.session.key,
            http_client=httpx2.AsyncClient(transport=transport, timeout=kwargs.pop("timeout", 60)),
            **kwargs,
        )

    def anthropic(self, key: str | None = None, **kwargs: Any) -> anthropic.AsyncAnthropic:
        transport = httpx2.AsyncHTTPTransport(uds=self.path)
        return anthropic.AsyncAnthropic(
            base_url="http://gateway",
            api_key=key or self.session.key,
            http_client=httpx2.AsyncClient(transport=transport, timeout=kwargs.pop("timeout", 60)),
            **kwargs,
        )

    def http(self, timeout: float = 60) -> httpx2.AsyncClient:
        return httpx2.AsyncClient(
            transport=httpx2.AsyncHTTPTransport(uds=self.path), base_url="http://gateway", timeout=timeout
        )


@dataclass
class Rig:
    balancer: LLMBalancer
    gateway: Gateway
    server: ScriptedLLM | None = None
    script: list[Completion] = field(default_factory=list)
    dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="raas-gw-")))

    async def open(
        self, job_id: str = "job-1", agent: AgentConfig | None = None, **sampling: Any
    ) -> Endpoint:
        job = Job(job_id=job_id, instance={}, trajectory_id=f"traj-{job_id}", sampling_params=sampling)
        session = self.gateway.open_session(
            job, agent=agent or AgentConfig(max_turns=50, context_budget=8192)
        )
        path = str(self.dir / f"{job_id}.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        sock.listen(64)
        await self.gateway.serve_socket(session, sock, path)
        return Endpoint(session, path)


@asynccontextmanager
async def scripted_rig(
    tok: ChatTokenizer,
    texts: Sequence[str] | None = None,
    *,
    script: list[Completion] | None = None,
    **kw: Any,
) -> AsyncIterator[Rig]:
    """The scripted policy replaying ``texts`` (or ``script``), behind a real balancer and a gateway."""
    items = script if script is not None else completions(tok, texts or ["ok"])
    async with ScriptedLLM(replay(items), **kw) as server:
        balancer = LLMBalancer(health_interval_s=0)
        balancer.add(server.url)
        gateway = Gateway(balancer, tok)
        rig = Rig(balancer, gateway, server, items)
        try:
            yield rig
        finally:
            await gateway.aclose()
            await balancer.aclose()
            import shutil

            shutil.rmtree(rig.dir, ignore_errors=True)


def check_exact(out: RunOutput, sent: list[list[int]] | None = None) -> None:
    """The record is exactly the prompts sent and the IDs sampled.

    Per segment: ``prompt_ids + response_ids`` is the concatenation of its turns' prompt deltas (the full
    prompt for its first turn) and sampled IDs; the loss mask is 1 exactly on sampled IDs, whose logprobs
    are the server's; every turn's prompt is the segment up to it. ``sent``: the prompts the inference
    server received, in turn order, compared one by one with what the record says was sent."""
    segments = out.segments or [out.token_trajectory]
    by_segment: dict[int, list[Any]] = {}
    for turn in out.turns:
        by_segment.setdefault(turn.segment, []).append(turn)
    assert sorted(by_segment) == list(range(len(segments)))
    prompts: dict[int, list[int]] = {}
    for index, traj in enumerate(segments):
        seq: list[int] = []
        mask: list[int] = []
        logprobs: list[float | None] = []
        for i, turn in enumerate(by_segment[index]):
            assert turn.prompt_is_delta is (i > 0)
            seq += turn.prompt_ids
            mask += [0] * len(turn.prompt_ids)
            logprobs += [0.0] * len(turn.prompt_ids)
            assert turn.prompt_len == len(seq)
            prompts[turn.index] = list(seq)
            seq += turn.output_ids
            mask += [1] * len(turn.output_ids)
            logprobs += turn.logprobs
        first = len(by_segment[index][0].prompt_ids)
        assert traj.prompt_ids + traj.response_ids == seq
        assert len(traj.prompt_ids) == first
        assert traj.loss_mask == mask[first:]
        assert traj.logprobs == logprobs[first:]
        assert len(traj.response_ids) == len(traj.loss_mask) == len(traj.logprobs)
    if out.segments:
        assert out.token_trajectory == out.segments[out.turns[-1].segment]
    if out.turns:  # the readable messages of the last segment concatenate to its exact sequence
        last = out.token_trajectory
        flat = [t for m in out.messages for t in m.input_ids + (m.output_ids or [])]
        assert flat == last.prompt_ids + last.response_ids
    if sent is not None:
        assert len(sent) == len(out.turns)
        for turn in out.turns:
            assert sent[turn.index] == prompts[turn.index], (
                f"turn {turn.index}: the record differs from what was sent"
            )


def assert_output_is_servers(output_ids: list[int], logprobs: list[float | None], answer: Any) -> None:
    """A turn's sampled IDs and logprobs are what llama-server answered. ``answer``: its JSON (a plain
    generation) or the list of its stream's events. A stream lists each token at its position
    (``tokens_predicted``) except those llama.cpp leaves out (the first bytes of a multi-byte character;
    raas recovers them, checked against plain generations in test_streaming); a stream may run a few
    tokens past the reply's limit, which the reply does not keep."""
    if not isinstance(answer, list):
        assert output_ids == answer["tokens"]
        want = [p["logprob"] for p in answer["completion_probabilities"]]
        assert [x for x in logprobs if x is not None] == pytest.approx(want)
        return
    final = answer[-1]
    assert final["stop"] is True
    assert len(output_ids) <= final["tokens_predicted"]
    if len(output_ids) < final["tokens_predicted"]:
        # The stream ran past the reply's limit (raas asks a few tokens more so a cut character's IDs are
        # known) and ended there at its own limit or at an EOS sampled within those extra tokens.
        assert final["stop_type"] in ("limit", "eos")
    for event in answer[:-1]:
        tokens = event["tokens"]
        for j, tid in enumerate(tokens):
            pos = event["tokens_predicted"] - len(tokens) + j
            if pos < len(output_ids):
                assert output_ids[pos] == tid, f"position {pos}"
                assert logprobs[pos] == pytest.approx(event["completion_probabilities"][j]["logprob"])


def sent_prompts(server: ScriptedLLM) -> list[list[int]]:
    return [list(r.prompt_ids) for r in server.requests]


def responder_by_turn(tok: ChatTokenizer, texts: Sequence[str]) -> Any:
    """A responder answering request i with texts[i] (EOS-terminated), for tests that need it lazily."""
    items = completions(tok, texts)

    def respond(req: CompletionRequest) -> Completion:
        return items[req.index]

    return respond
