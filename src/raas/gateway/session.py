"""One rollout behind the gateway: render each request into token IDs, generate, record exactly.

Rendering is append-only where it can be: a request whose messages are an earlier request's messages
plus the reply raas gave it, plus new messages, continues that conversation — the new messages are
rendered by the chat tokenizer's delta machinery and appended after the *sampled* IDs of the reply (the
agent's re-sent text is never re-tokenized). Any other request is rendered in full; if those tokens
happen to extend a segment they are merged into it, otherwise they start a new segment (see
:mod:`raas.gateway.record`). Generation goes through the balancer, sticky per rollout, and waits (never
fails) while the balancer is paused for a weight sync.

Failures: an infrastructure failure (no inference server, a timeout, a token mismatch) is answered to the
agent as an HTTP error and remembered: the harness then fails the job (filtered), since what the agent did
after it is not the policy's doing. A request the agent cannot have meant (bad shape, over the turn or
context budget) is answered as the API's client error and does not fail the job.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Any

from raas.agent.config import AgentConfig
from raas.agent.loop import TokenMismatch
from raas.agent.toolcalls import parse_tool_calls
from raas.core.executors import Executor
from raas.core.trajectory import RunOutput, TokenTrajectory, Turn
from raas.errors import RaasError
from raas.gateway.messages import ChatRequest, MessageKey, Msg, message_key, template_message, tools_key
from raas.gateway.record import Reply, Segment, core_message, drift_of
from raas.llm.balancer import LLMBalancer
from raas.llm.stream_gaps import Replay, fill_gaps
from raas.llm.tokenizer import ChatTokenizer, Conversation
from raas.llm.types import GenerateResult, SamplingParams


class TurnLimit(RaasError):
    """The rollout used its turns (``AgentConfig.max_turns``): answered as a client error."""

    kind = "bad_request"


class ContextBudget(RaasError):
    """The prompt leaves no room within ``AgentConfig.context_budget``: the API's context-length error."""

    kind = "context_window_exceeded"


@dataclass
class Completion:
    """What one request produced, in API-neutral form."""

    turn: int
    segment: int
    text: str
    content: str
    tool_calls: list[dict[str, Any]]
    finish: str  # "stop" | "length" | "tool_calls"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    parse_failed: bool = False


class TextStream:
    """A streaming request's reply text, piece by piece as the inference server generates it, and its
    prompt's length once the request is placed (what a stream's first event reports)."""

    def __init__(self) -> None:
        self.pieces: asyncio.Queue[str] = asyncio.Queue()
        self.prompt_tokens = 0
        self.started = asyncio.Event()
        """Set with the first piece of text."""

    def put(self, piece: str) -> None:
        self.pieces.put_nowait(piece)
        self.started.set()


@dataclass
class _Placement:
    seg: Segment
    prompt: list[int]
    """The conversation's live ID list (the segment is busy: nothing else appends to it meanwhile)."""
    delta: list[int]
    new_segment: bool
    undo: Any
    new_messages: list[Msg]
    prompt_len: int = 0

    def __post_init__(self) -> None:
        self.prompt_len = len(self.prompt)


@dataclass
class SessionStats:
    requests: int = 0
    by_api: dict[str, int] = field(default_factory=dict)
    continued: int = 0
    merged: int = 0
    full_renders: int = 0
    tool_call_parse_failures: int = 0
    refused: int = 0
    errors: list[dict[str, Any]] = field(default_factory=list)


class GatewaySession:
    """The gateway's state for one rollout (one job's RUN stage). Use :meth:`complete` per request and
    :meth:`run_output` at the end."""

    RESPONSES_KEPT = 64

    def __init__(
        self,
        *,
        session_id: str,
        key: str,
        trajectory_id: str,
        group_id: str | None = None,
        tokenizer: ChatTokenizer,
        balancer: LLMBalancer,
        agent: AgentConfig,
        renderer: Executor,
        sampling_params: dict[str, Any] | None = None,
        honor_request_sampling: bool = False,
    ) -> None:
        """``renderer``: the gateway's pool for full chat-template renders (one costs milliseconds for a
        long history: off the loop, and off its default pool)."""
        self.id = session_id
        self.key = key
        self.trajectory_id = trajectory_id
        self.group_id = group_id
        self.tok = tokenizer
        self.renderer = renderer
        self.balancer = balancer
        self.agent = agent
        self.job_sampling = {
            k: v for k, v in (sampling_params or {}).items() if k in SamplingParams.model_fields
        }
        self.honor_request_sampling = honor_request_sampling
        self.native_tools = tokenizer.supports_tools
        self.segments: list[Segment] = []
        self.turns: list[Turn] = []
        self.replies: list[Reply] = []
        self.stats = SessionStats()
        self.infra_error: RaasError | None = None
        self.finish_reason: str | None = None
        self.closed = False
        self.in_flight = 0
        self.idle = asyncio.Event()
        """Set while no request is in flight."""
        self.idle.set()
        self.last_active = time.monotonic()
        """When a request last arrived or finished (an external rollout's lease counts from it)."""
        self.responses: collections.OrderedDict[str, list[Msg]] = collections.OrderedDict()
        self._lock = asyncio.Lock()

    # -- one request ---------------------------------------------------------------------------------

    async def complete(self, req: ChatRequest, stream: TextStream | None = None) -> Completion:
        """Render, generate, record; raises :class:`RaasError` (typed) for anything that went wrong.
        With ``stream``, the text goes there as it is generated (where the server can stream); the
        record is the same token-exact one."""
        self.stats.requests += 1
        self.stats.by_api[req.api] = self.stats.by_api.get(req.api, 0) + 1
        if self.closed:
            raise RaasError(f"rollout {self.trajectory_id} has ended", kind="unauthorized", stage="run")
        if req.messages[-1]["role"] == "assistant":
            raise RaasError(
                "the conversation ends with an assistant message: continuing a prefilled reply is not "
                "supported",
                kind="bad_request",
                stage="run",
            )
        if len(self.turns) + self.in_flight >= self.agent.max_turns:
            self.stats.refused += 1
            self.finish_reason = self.finish_reason or "max_turns"
            raise TurnLimit(
                f"this rollout may make {self.agent.max_turns} model calls (max_turns)", stage="run"
            )
        self.in_flight += 1
        self.idle.clear()
        self.last_active = time.monotonic()
        try:
            async with self._lock:
                place = await self._place(req)
            try:
                sampling = self._sampling(req, place.prompt_len)
                if stream is not None:
                    stream.prompt_tokens = place.prompt_len
                result = await self.balancer.generate(
                    place.prompt,
                    sampling,
                    trajectory_id=self.trajectory_id,
                    group_id=self.group_id,
                    on_text=None if stream is None else stream.put,
                )
                await fill_gaps(self.tok.tokenizer, result, self._replay(place.prompt, sampling, result))
            except BaseException as exc:
                self._undo(place)
                if isinstance(exc, RaasError) and exc.kind == "context_window_exceeded":
                    self.finish_reason = self.finish_reason or "context_budget"
                self._remember(exc)
                raise
            return self._record(place, result, req)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()
            self.last_active = time.monotonic()

    def _replay(self, prompt: list[int], sampling: SamplingParams, streamed: GenerateResult) -> Replay:
        """The same generation again, not streamed, up to ``n`` tokens, with the seed the stream used
        (see :func:`fill_gaps`)."""
        seed = streamed.extra.get("seed", sampling.seed)

        async def again(n: int) -> list[int]:
            params = sampling.model_copy(update={"max_tokens": n, "seed": seed})
            result = await self.balancer.generate(
                list(prompt), params, trajectory_id=self.trajectory_id, group_id=self.group_id
            )
            return [int(t) for t in result.output_ids]

        return again

    def _remember(self, exc: BaseException) -> None:
        if isinstance(exc, RaasError):
            self.stats.errors.append({"kind": exc.kind, "message": exc.message})
            if exc.infrastructure and exc.kind != "context_window_exceeded" and self.infra_error is None:
                self.infra_error = exc

    def _sampling(self, req: ChatRequest, prompt_len: int) -> SamplingParams:
        room = self.agent.context_budget - prompt_len
        if room <= 0:
            raise ContextBudget(
                f"the prompt is {prompt_len} tokens; this rollout's context budget is {self.agent.context_budget}",
                stage="run",
            )
        params: dict[str, Any] = {}
        if self.honor_request_sampling:
            params.update({k: v for k, v in req.sampling.items() if k in SamplingParams.model_fields})
        params.update(self.job_sampling)
        limits = [self.agent.max_tokens_per_turn, room]
        for value in (req.max_tokens, params.pop("max_tokens", None)):
            if isinstance(value, int) and value > 0:
                limits.append(value)
        params["max_tokens"] = min(limits)
        return SamplingParams.parse(params)

    # -- placing a request in the record -------------------------------------------------------------

    async def _place(self, req: ChatRequest) -> _Placement:
        keys = [message_key(m) for m in req.messages]
        tkey = tools_key(req.tools)
        for seg in reversed(self.segments):
            if seg.busy or not seg.replied or seg.tools_key != tkey:
                continue
            n = len(seg.keys)
            if len(keys) > n and keys[:n] == seg.keys:
                return self._continue(seg, req.messages[n:], keys[n:])
        templated = [template_message(m, self.native_tools) for m in req.messages]
        conv = await self.renderer.run(self.tok.conversation, templated, tools=req.tools)
        self.stats.full_renders += 1
        ids = conv.ids
        for seg in reversed(self.segments):
            if seg.busy or not seg.replied:
                continue
            have = seg.conv.ids
            if len(ids) > len(have) and ids[: len(have)] == have:
                return self._merge(seg, conv, req, keys, tkey)
        seg = Segment(
            index=len(self.segments),
            reason=self._why_new(keys, tkey),
            conv=conv,
            msgs=list(req.messages),
            keys=keys,
            tools_key=tkey,
            tools=req.tools,
            busy=True,
        )
        self.segments.append(seg)
        return _Placement(seg, conv.ids, list(conv.ids), True, None, list(req.messages))

    def _continue(self, seg: Segment, tail: list[Msg], tail_keys: list[MessageKey]) -> _Placement:
        conv = seg.conv
        undo = ("continue", _snapshot(conv), len(seg.msgs))
        seg.busy = True
        try:
            conv.add_messages([template_message(m, self.native_tools) for m in tail])
        except BaseException:
            seg.busy = False
            _restore(conv, undo[1])
            raise
        seg.msgs.extend(tail)
        seg.keys.extend(tail_keys)
        self.stats.continued += 1
        self._mark_resent(seg)
        return _Placement(seg, conv.ids, conv.ids[len(seg.ids) :], False, undo, tail)

    def _merge(
        self, seg: Segment, conv: Conversation, req: ChatRequest, keys: list[MessageKey], tkey: str
    ) -> _Placement:
        undo = ("merge", seg.conv, seg.msgs, seg.keys, seg.tools_key, seg.tools)
        new_messages = (
            req.messages[len(seg.msgs) :] if len(req.messages) > len(seg.msgs) else req.messages[-1:]
        )
        seg.conv, seg.msgs, seg.keys, seg.tools_key, seg.tools = (
            conv,
            list(req.messages),
            keys,
            tkey,
            req.tools,
        )
        seg.busy = True
        self.stats.merged += 1
        self._mark_resent(seg)
        return _Placement(seg, conv.ids, conv.ids[len(seg.ids) :], False, undo, new_messages)

    def _mark_resent(self, seg: Segment) -> None:
        if seg.last_reply is not None:
            self.replies[seg.last_reply].resent = True

    def _undo(self, place: _Placement) -> None:
        seg = place.seg
        seg.busy = False
        if place.new_segment:
            self.segments.remove(seg)
            return
        kind = place.undo[0]
        if kind == "continue":
            _restore(seg.conv, place.undo[1])
            del seg.msgs[place.undo[2] :]
            del seg.keys[place.undo[2] :]
        else:
            seg.conv, seg.msgs, seg.keys, seg.tools_key, seg.tools = place.undo[1:]

    def _why_new(self, keys: list[MessageKey], tkey: str) -> str:
        if not self.segments:
            return "first request"
        last = next((s for s in reversed(self.segments) if s.replied), None)
        if last is None:
            return "the earlier conversations are still generating"
        if tkey != last.tools_key:
            return f"the tools differ from segment {last.index}'s"
        same = 0
        for a, b in zip(keys, last.keys, strict=False):
            if a != b:
                break
            same += 1
        if same == len(keys):
            return f"the request repeats segment {last.index} up to message {same - 1} (a retry or a branch)"
        role = "a message"
        if same < len(last.msgs):
            role = f"message {same} ({last.msgs[same]['role']})"
        return f"{role} differs from segment {last.index}: the agent rewrote its history or started anew"

    # -- recording a generated reply -------------------------------------------------------------------

    def _record(self, place: _Placement, result: Any, req: ChatRequest) -> Completion:
        seg = place.seg
        turn = len(self.turns)
        try:
            out = [int(t) for t in result.output_ids]
            logprobs = [None if x is None else float(x) for x in result.logprobs]
            if len(logprobs) != len(out):
                raise RaasError(
                    f"server returned {len(logprobs)} logprobs for {len(out)} tokens", kind="llm_error"
                )
            start = len(seg.ids) + len(place.delta)
            if start != place.prompt_len or len(place.prompt) != place.prompt_len:
                raise TokenMismatch("the prompt sent does not extend the segment's record", stage="run")
            if seg.last_reply is not None:  # the previous reply's sampled IDs sit where the record has them
                prev = self.replies[seg.last_reply].output_ids
                if place.prompt[len(seg.ids) - len(prev) : len(seg.ids)] != prev:
                    raise TokenMismatch(
                        "the prompt sent does not hold the previous reply's sampled IDs", stage="run"
                    )
            message = seg.conv.add_assistant(out, logprobs)
            if seg.conv.ids[start : start + len(out)] != out:
                raise TokenMismatch(
                    "the conversation does not hold the sampled IDs where recorded", stage="run"
                )
        except BaseException as exc:
            self._undo(place)
            self._remember(exc)
            raise
        seg.add_prompt(place.delta)
        seg.add_sampled(out, logprobs)
        seg.busy = False
        seg.replied = True
        seg.turns.append(turn)
        text = str(message.get("content") or "")
        content, calls, parse_failed = self._parse(text, req)
        finish = "length" if result.finish_reason == "length" else ("tool_calls" if calls else "stop")
        reply: Msg = {"role": "assistant", "content": content}
        if calls:
            reply["tool_calls"] = calls
        seg.msgs.append(reply)
        seg.keys.append(message_key(reply))
        closing = seg.conv.turns[-1].closing_ids
        self.replies.append(Reply(turn, seg.index, reply, out, list(closing), self.native_tools, req.tools))
        seg.last_reply = len(self.replies) - 1
        # the readable record: the new messages carry the prompt delta, the reply its sampled IDs
        for i, m in enumerate(place.new_messages):
            seg.messages.append(
                core_message(m, input_ids=list(place.delta) if i == len(place.new_messages) - 1 else [])
            )
        seg.messages.append(core_message({**reply, "content": text}, output_ids=out, logprobs=logprobs))
        self.turns.append(
            Turn(
                index=turn,
                prompt_ids=list(place.delta),
                prompt_is_delta=not place.new_segment,
                prompt_len=place.prompt_len,
                output_ids=out,
                logprobs=logprobs,
                finish_reason=str(result.finish_reason),
                weight_version=result.weight_version,
                server=result.server,
                latency_s=float(result.latency_s),
                segment=seg.index,
            )
        )
        return Completion(
            turn=turn,
            segment=seg.index,
            text=text,
            content=content,
            tool_calls=calls,
            finish=finish,
            prompt_tokens=place.prompt_len,
            completion_tokens=len(out),
            cached_tokens=int(result.cached_tokens or 0),
            parse_failed=parse_failed,
        )

    def _parse(self, text: str, req: ChatRequest) -> tuple[str, list[dict[str, Any]], bool]:
        """Tool calls out of the sampled text; a call that cannot be read makes the whole reply plain
        content (counted), so the agent sees what the policy wrote."""
        if not req.tools or req.tool_choice == "none":
            return text, [], False
        parsed = parse_tool_calls(text, req.tools)
        if parsed.errors:
            self.stats.tool_call_parse_failures += 1
            return text, [], True
        calls = [{"id": c.id, "name": c.name, "arguments": dict(c.arguments)} for c in parsed.calls]
        return (parsed.content if calls else text), calls, False

    # -- Responses API state ---------------------------------------------------------------------------

    def remember_response(self, response_id: str, messages: list[Msg]) -> None:
        """Keep a response's conversation for ``previous_response_id`` (the most recent few)."""
        self.responses[response_id] = messages
        while len(self.responses) > self.RESPONSES_KEPT:
            self.responses.popitem(last=False)

    def history_of(self, response_id: str) -> list[Msg]:
        try:
            return [dict(m) for m in self.responses[response_id]]
        except KeyError:
            raise RaasError(
                f"no response {response_id!r} in this rollout", kind="not_found", stage="run"
            ) from None

    # -- the end ----------------------------------------------------------------------------------------

    def run_output(self, finish_reason: str | None = None) -> RunOutput:
        """The rollout's record: every turn, every segment, the drift report."""
        segments = [s for s in self.segments if s.turns]
        last = max(segments, key=lambda s: s.turns[-1]) if segments else None
        drift = []
        resent = 0
        for reply in self.replies:
            if reply.resent:
                resent += 1
                found = drift_of(self.tok, reply)
                if found is not None:
                    drift.append(found)
        notes = [n for s in segments for n in s.conv.notes]
        turns = sorted(self.turns, key=lambda t: t.index)
        metrics = {
            "turns": float(len(turns)),
            "requests": float(self.stats.requests),
            "segments": float(len(segments)),
            "response_tokens": float(sum(len(t.output_ids) for t in turns)),
            "llm_latency_s": float(sum(t.latency_s for t in turns)),
            "logprobs_missing": float(sum(1 for t in turns for x in t.logprobs if x is None)),
            "tool_call_parse_failures": float(self.stats.tool_call_parse_failures),
            "drift_turns": float(len(drift)),
        }
        gateway = {
            "requests": self.stats.requests,
            "by_api": dict(self.stats.by_api),
            "continued": self.stats.continued,
            "merged": self.stats.merged,
            "full_renders": self.stats.full_renders,
            "refused": self.stats.refused,
            "tool_call_parse_failures": self.stats.tool_call_parse_failures,
            "segments": [
                {"index": s.index, "reason": s.reason, "turns": list(s.turns), "tokens": len(s.ids)}
                for s in segments
            ],
            "drift": {"resent_replies": resent, "retokenize_differently": drift},
            "errors": list(self.stats.errors),
        }
        if notes:
            gateway["template_notes"] = notes
        return RunOutput(
            messages=list(last.messages) if last else [],
            turns=turns,
            token_trajectory=last.trajectory() if last else TokenTrajectory(),
            segments=[s.trajectory() for s in segments] if len(segments) > 1 else [],
            finish_reason=finish_reason or self.finish_reason or "agent_exit",
            artifacts={"gateway": gateway},
            metrics=metrics,
        )


def _snapshot(conv: Conversation) -> tuple[Any, ...]:
    return (
        len(conv.ids),
        len(conv.segments),
        len(conv.messages),
        len(conv.turns),
        len(conv.notes),
        getattr(conv, "_open", True),
    )


def _restore(conv: Conversation, snap: tuple[Any, ...]) -> None:
    n, segs, msgs, turns, notes, is_open = snap
    del conv.ids[n:]
    del conv.mask[n:]
    del conv.logprobs[n:]
    del conv.segments[segs:]
    del conv.messages[msgs:]
    del conv.turns[turns:]
    del conv.notes[notes:]
    conv._open = is_open
