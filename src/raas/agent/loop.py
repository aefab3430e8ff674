"""The token-level multi-turn agent loop.

The loop never re-tokenizes text: prompts grow by the chat tokenizer's exact deltas and responses are the
IDs the server sampled, so the recorded sequence is exactly what the policy saw and produced. It keeps one
ordered list of pieces (``prompt`` pieces added by the template/environment, ``sampled`` pieces from the
policy) from which the messages, the turns and the flattened :class:`TokenTrajectory` are all derived, and
before every generate call (and once at the end) it checks that the conversation's own token view
(``conv.ids``) equals that list. The check looks only at the tokens appended since the previous one
(O(new tokens) per step, so it stays on); a difference raises :class:`TokenMismatch` (``token_mismatch``,
infrastructure: the trajectory is filtered, never trained on).
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from raas.agent.config import AgentConfig
from raas.agent.context import LLMContext
from raas.agent.toolcalls import FORMAT_HINT, parse_tool_calls
from raas.agent.tools import Observation, ToolSet
from raas.core.jobs import Job
from raas.core.trajectory import Message, RunOutput, TokenTrajectory, ToolCall, Turn
from raas.errors import RaasError
from raas.llm.types import SamplingParams

if TYPE_CHECKING:
    from raas.sandbox import Sandbox

NUDGE = "You did not call a tool. Call a tool to continue, or call finish with your final answer."


class TokenMismatch(RaasError):
    """The chat tokenizer's conversation and the recorded pieces disagree: a template or tokenizer bug in
    raas or the model's files, never the policy's doing, so the rollout is filtered."""

    kind = "token_mismatch"


@dataclass
class _Piece:
    ids: list[int]
    sampled: bool
    logprobs: list[float | None] = field(default_factory=list)


@dataclass
class _State:
    pieces: list[_Piece] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    pending_prompt: list[int] = field(default_factory=list)
    """Prompt tokens added since the last generation (the next turn's ``prompt_ids`` delta)."""
    unseen: list[Message] = field(default_factory=list)
    """Results of calls executed after the policy's last turn: kept as an artifact, not as messages, so
    ``messages`` mirror exactly the token sequence the policy saw (and end with its last turn)."""

    length: int = 0
    checked_len: int = 0
    """Tokens of the recorded sequence already proven equal to the conversation's (see :meth:`check`)."""
    checked_pieces: int = 0

    def seq_len(self) -> int:
        return self.length

    def seq(self) -> list[int]:
        return [t for p in self.pieces for t in p.ids]

    def add_piece(self, piece: _Piece) -> None:
        self.pieces.append(piece)
        self.length += len(piece.ids)

    def add_prompt(self, ids: list[int]) -> None:
        if ids:
            self.add_piece(_Piece(list(ids), sampled=False))
            self.pending_prompt.extend(ids)

    def check(self, conv_ids: Sequence[int], *, exact: bool) -> None:
        """Prove the conversation's tokens equal the recorded pieces, comparing only what was appended
        since the previous check. ``exact``: the conversation holds nothing beyond the pieces (it does
        after an assistant turn, whose template closing is recorded with the next prompt)."""
        n = self.length
        if len(conv_ids) < n or (exact and len(conv_ids) != n):
            raise TokenMismatch(
                f"the conversation holds {len(conv_ids)} tokens where the recorded trajectory has {n}",
                stage="run",
            )
        pos = self.checked_len
        for piece in self.pieces[self.checked_pieces :]:
            end = pos + len(piece.ids)
            got = conv_ids[pos:end]
            if got != piece.ids:
                at = next((i for i, (a, b) in enumerate(zip(got, piece.ids, strict=True)) if a != b), 0)
                raise TokenMismatch(
                    f"the conversation's token {pos + at} is {got[at]} where the recorded "
                    f"{'sampled' if piece.sampled else 'prompt'} piece has {piece.ids[at]}",
                    stage="run",
                )
            pos = end
        self.checked_len, self.checked_pieces = n, len(self.pieces)

    def bump(self, key: str, by: float = 1.0) -> None:
        self.metrics[key] = self.metrics.get(key, 0.0) + by


def _sampling(job: Job, max_tokens: int) -> SamplingParams:
    """The job's sampling parameters with this turn's token limit."""

    # sampling_params may also carry agent knobs (the pipeline applies them) and client-specific keys
    # (ProRL clients send model names, API keys, ...); the server only ever sees sampling fields.
    params = {k: v for k, v in (job.sampling_params or {}).items() if k in SamplingParams.model_fields}
    requested = params.pop("max_tokens", None)
    if isinstance(requested, int) and requested > 0:
        max_tokens = min(max_tokens, requested)
    params["max_tokens"] = max_tokens
    return SamplingParams.parse(params)


def _call_key(name: str, arguments: dict[str, Any]) -> str:
    return json.dumps([name, arguments], sort_keys=True, default=str)


def _parse(text: str) -> tuple[list[ToolCall], list[str]]:
    """Tool calls in an assistant message and the errors of the calls that could not be parsed."""
    parsed = parse_tool_calls(text)
    calls: list[ToolCall] = []
    for i, c in enumerate(parsed.calls):
        call_id = getattr(c, "id", None) or f"call_{i}"
        calls.append(ToolCall(id=call_id, name=c.name, arguments=dict(c.arguments)))
    return calls, [str(e) for e in parsed.errors]


async def run_agent(
    job: Job,
    sandbox: Sandbox,
    llm: LLMContext,
    tools: ToolSet,
    config: AgentConfig | None = None,
    *,
    user_prompt: str,
    system_prompt: str | None = None,
    examples: Sequence[Message] = (),
) -> RunOutput:
    """Run the policy against ``sandbox`` until it finishes or a limit stops it; returns the exact record.

    ``examples`` are a scripted exchange placed between the system and the user message (few-shot: a tiny
    policy copies a demonstrated tool call far more often than it follows a described one); they are part
    of the prompt and of ``messages``, never sampled (no ``output_ids``).

    Policy-level endings (``finish_tool``, ``no_tool_call``, ``max_turns``, ``context_budget``,
    ``loop_detected``, ``length``) return normally; infrastructure failures (LLM down, sandbox dead) raise
    :class:`RaasError` so the pipeline can filter the trajectory instead of scoring it.
    """
    config = config or llm.agent
    system = system_prompt or ""
    shots = [m.model_copy(update={"input_ids": [], "output_ids": None, "logprobs": None}) for m in examples]
    init_messages = [
        {"role": "system", "content": system},
        *(_as_chat(m) for m in shots),
        {"role": "user", "content": user_prompt},
    ]
    # The chat tokenizer renders the schemas with the template, or injects them into the system message
    # in the Hermes format when the template has no tool support.
    conv = llm.require_tokenizer().conversation(init_messages, tools=tools.schemas)

    st = _State()
    st.add_prompt(list(conv.prompt_ids))
    st.messages.append(Message(role="system", content=system))
    st.messages.extend(shots)
    st.messages.append(Message(role="user", content=user_prompt, input_ids=list(st.pending_prompt)))
    if st.seq_len() >= config.context_budget:
        raise RaasError(
            f"the initial prompt ({st.seq_len()} tokens) does not fit the context budget "
            f"({config.context_budget})",
            kind="context_window_exceeded",
            stage="run",
        )

    finish_reason = "max_turns"
    answer: str | None = None
    last_key: str | None = None
    repeats = 0
    started = time.monotonic()
    try:
        for turn_index in range(config.max_turns):
            remaining = config.context_budget - st.seq_len()
            if remaining <= 0:
                finish_reason = "context_budget"
                break
            sampling = _sampling(job, min(config.max_tokens_per_turn, remaining))
            st.check(conv.prompt_ids, exact=True)
            prompt_len = st.seq_len()
            try:
                res = await llm.balancer.generate(
                    st.seq(), sampling, trajectory_id=job.job_id, group_id=job.group_key
                )
            except RaasError as e:
                if e.kind == "context_window_exceeded" and st.turns:
                    finish_reason = "context_budget"
                    st.bump("server_context_exceeded")
                    break
                raise
            output_ids = list(res.output_ids)
            logprobs = [None if x is None else float(x) for x in res.logprobs]
            if len(logprobs) != len(output_ids):
                raise RaasError(
                    f"server returned {len(logprobs)} logprobs for {len(output_ids)} tokens",
                    kind="llm_error",
                    stage="run",
                )
            st.turns.append(
                Turn(
                    index=turn_index,
                    prompt_ids=list(st.pending_prompt),
                    prompt_is_delta=turn_index > 0,
                    prompt_len=prompt_len,
                    output_ids=output_ids,
                    logprobs=logprobs,
                    finish_reason=str(res.finish_reason),
                    weight_version=res.weight_version,
                    server=res.server,
                    latency_s=float(res.latency_s),
                )
            )
            st.bump("llm_latency_s", float(res.latency_s))
            st.bump("response_tokens", len(output_ids))
            st.bump("logprobs_missing", sum(1 for x in logprobs if x is None))
            st.pending_prompt = []
            st.add_piece(_Piece(output_ids, sampled=True, logprobs=logprobs))
            assistant = conv.add_assistant(output_ids, logprobs)
            text = _assistant_text(assistant)
            calls, errors = _parse(text)
            msg = Message(
                role="assistant",
                content=text,
                tool_calls=calls or None,
                output_ids=output_ids,
                logprobs=logprobs,
            )
            st.messages.append(msg)

            last_turn = turn_index + 1 >= config.max_turns
            if not calls and not errors:
                if config.stop_on_no_tool_call or last_turn:
                    finish_reason = "length" if res.finish_reason == "length" else "no_tool_call"
                    break
                pending: list[Message] = [Message(role="user", content=NUDGE)]
            else:
                pending = []
                stop: str | None = None
                for err in errors:
                    st.bump("malformed_tool_calls")
                    pending.append(
                        Message(
                            role="tool",
                            content=f"Error: malformed tool call: {err}. {FORMAT_HINT}",
                            name="error",
                        )
                    )
                for call in calls:
                    key = _call_key(call.name, call.arguments)
                    repeats = repeats + 1 if key == last_key else 1
                    last_key = key
                    if repeats >= config.loop_detection_repeats:
                        stop = "loop_detected"
                        break
                    st.bump("tool_calls")
                    bad = tools.check(call.name, call.arguments)
                    if bad is None and tools.is_terminal(call.name):
                        answer = (
                            str(call.arguments["answer"])
                            if call.arguments.get("answer") is not None
                            else None
                        )
                        stop = "finish_tool"
                        break
                    if bad is not None:
                        st.bump("malformed_tool_calls")
                        obs = bad
                    else:
                        t0 = time.monotonic()
                        obs = await tools.dispatch(
                            sandbox,
                            call.name,
                            call.arguments,
                            timeout_s=config.tool_timeout_s,
                            cap_bytes=config.observation_cap_bytes,
                        )
                        st.bump("tool_time_s", time.monotonic() - t0)
                    if obs.is_error and obs.kind not in ("unknown_tool", "bad_arguments"):
                        st.bump("tool_errors")
                    pending.append(_tool_message(call, obs))
                if stop is not None:
                    st.unseen.extend(pending)
                    finish_reason = stop
                    break
            if last_turn:
                st.unseen.extend(pending)
                finish_reason = "max_turns"
                break
            before = st.seq_len()
            conv.add_messages([_as_chat(m) for m in pending])
            # The delta is the template's closing of the assistant turn, the new messages and the next
            # generation prompt; a closing after the final turn is never part of the record.
            delta = list(conv.prompt_ids[before:])
            if before + len(delta) >= config.context_budget:
                st.unseen.extend(pending)
                finish_reason = "context_budget"
                break
            st.add_prompt(delta)
            pending[0].input_ids = delta
            st.messages.extend(pending)
    finally:
        release = getattr(llm.balancer, "release", None)
        if release is not None:
            release(job.job_id)

    st.check(conv.prompt_ids, exact=False)
    st.metrics["turns"] = float(len(st.turns))
    st.metrics["run_agent_s"] = time.monotonic() - started
    # The tool schemas the policy was shown, so a trainer can re-render the same prompt (ProRL's ``tools``).
    artifacts: dict[str, Any] = {"tools": copy.deepcopy(tools.schemas)}
    if st.unseen:
        artifacts["unseen_observations"] = [m.model_dump(exclude_none=True) for m in st.unseen]
    return RunOutput(
        messages=st.messages,
        turns=st.turns,
        token_trajectory=_flatten(st),
        finish_reason=finish_reason,
        answer=answer,
        artifacts=artifacts,
        metrics=st.metrics,
    )


def _assistant_text(assistant: Any) -> str:
    if isinstance(assistant, str):
        return assistant
    if isinstance(assistant, dict):
        return str(assistant.get("content") or "")
    return str(getattr(assistant, "content", "") or "")


def _tool_message(call: ToolCall, obs: Observation) -> Message:
    return Message(role="tool", content=obs.text, tool_call_id=call.id, name=call.name)


def _as_chat(m: Message) -> dict[str, Any]:
    d: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_call_id:
        d["tool_call_id"] = m.tool_call_id
    if m.name:
        d["name"] = m.name
    return d


def _flatten(st: _State) -> TokenTrajectory:
    """Prompt = the first prompt piece; response = everything after, mask 1 only on sampled tokens."""
    traj = TokenTrajectory()
    if not st.pieces:
        return traj
    traj.prompt_ids = list(st.pieces[0].ids)
    for p in st.pieces[1:]:
        traj.response_ids.extend(p.ids)
        if p.sampled:
            traj.loss_mask.extend([1] * len(p.ids))
            traj.logprobs.extend(p.logprobs)
        else:
            traj.loss_mask.extend([0] * len(p.ids))
            traj.logprobs.extend([0.0] * len(p.ids))
    return traj
