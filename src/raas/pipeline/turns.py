"""Turn checkpoints and replay: a RUN that a restart cut off goes on from its last committed turn.

Every generate call a job's RUN makes through its balancer is committed to the ledger as one turn
checkpoint (the prompt as a delta over the previous call's prompt and output, and exactly what the server
sampled: IDs, logprobs, finish reason, weight version, server). The writes ride the ledger's group commit
(fire-and-forget, ordered), so a turn costs one small row and no wait, and a crash loses at most a suffix
of turns, never a middle one.

After a restart the job runs INIT afresh and RUN again, with :class:`TurnRecorder` in front of the
balancer holding the committed turns: the first calls are answered from them instead of the server, each
only if the prompt the agent built is token for token the committed one. A prompt carries every
observation the previous tools returned, so re-executing the committed tool calls in the fresh sandbox and
getting the same observations is what makes the prompts equal; any difference (a tool that reads the
clock, a network fetch, a random seed) ends the job ``failed`` with kind ``replay_diverged``: filtered,
never a reward. From the first call past the committed ones sampling continues on the exact committed
token prefix, so loss masks, logprobs and weight versions of the replayed turns are the ones originally
sampled.

Why at the balancer and not inside the agent loop: it is the one place every raas agent's turn passes
through, it sees the exact token IDs, and it needs nothing from a handler. The same piece starts any
trajectory's sandbox at turn ``k`` (replay ``k`` committed turns, then stop), which is also what branching
a trajectory at a turn needs. Agents behind the gateway (``harness`` jobs, external rollouts) do not pass
through it and are not replayed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from raas.errors import RaasError
from raas.llm.types import GenerateResult, SamplingParams

TURN_STAGE = "turn:"
"""Checkpoint stage names of turns: ``turn:0``, ``turn:1``, ..."""


def turn_stage(index: int) -> str:
    return f"{TURN_STAGE}{index}"


class ReplayDiverged(RaasError):
    """The replayed RUN built a prompt that differs from the committed one: its environment answered
    differently the second time. Infrastructure, never the policy's doing: filtered."""

    kind = "replay_diverged"


def committed_turns(rows: Sequence[tuple[str, str]]) -> list[dict[str, Any]]:
    """The turn checkpoints ``(stage, body)`` of one job as records in call order, up to the first gap
    (a suffix lost to a crash is simply not there; a gap would mean a torn write, and nothing after it is
    trusted)."""
    by_index: dict[int, dict[str, Any]] = {}
    for stage, body in rows:
        if not stage.startswith(TURN_STAGE):
            continue
        try:
            by_index[int(stage[len(TURN_STAGE) :])] = json.loads(body)
        except ValueError:
            continue
    out: list[dict[str, Any]] = []
    while len(out) in by_index:
        out.append(by_index[len(out)])
    return out


class TurnRecorder:
    """A job's balancer: commits each generate call (``commit(index, body)``) and answers the first
    ``len(replay)`` calls from committed turns when their prompts match (see the module docstring).
    Everything else (``release``, ``pause``, ...) is the balancer's own."""

    def __init__(
        self,
        inner: Any,
        commit: Callable[[int, str], None],
        replay: Sequence[dict[str, Any]] = (),
    ) -> None:
        self.inner = inner
        self.commit = commit
        self.replay = list(replay)
        self.calls = 0
        self.replayed = 0
        self._last: list[int] = []
        """The previous call's prompt and output: the next prompt is stored as a delta over it."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        trajectory_id: str | None = None,
        group_id: str | None = None,
        on_text: Any = None,
    ) -> GenerateResult:
        index = self.calls
        self.calls += 1
        prompt = list(prompt_ids)
        if index < len(self.replay):
            record = self.replay[index]
            expected = _prompt_of(record, self._last)
            if prompt != expected:
                at = next((i for i, (a, b) in enumerate(zip(prompt, expected, strict=False)) if a != b), None)
                where = f"token {at}" if at is not None else f"length {len(prompt)} vs {len(expected)}"
                raise ReplayDiverged(
                    f"replaying turn {index}: the prompt differs from the committed one at {where} (a tool "
                    "answered differently when its call was executed again)",
                    stage="run",
                )
            result = GenerateResult(**record["result"])
            self.replayed += 1
        else:
            result = await self.inner.generate(
                prompt, sampling, trajectory_id=trajectory_id, group_id=group_id, on_text=on_text
            )
            self.commit(index, json.dumps({**_delta(prompt, self._last), "result": asdict(result)}))
        self._last = prompt + list(result.output_ids)
        return result


def _delta(prompt: list[int], last: list[int]) -> dict[str, Any]:
    """``prompt`` as ``{"base": n, "delta": ...}``: the first ``n`` tokens are the previous call's prompt
    and output (a multi-turn agent's prompt extends them), ``delta`` the rest; ``base`` 0 when it does not
    extend them (a new token sequence)."""
    n = len(last)
    if n and len(prompt) >= n and prompt[:n] == last:
        return {"base": n, "delta": prompt[n:]}
    return {"base": 0, "delta": prompt}


def _prompt_of(record: dict[str, Any], last: list[int]) -> list[int]:
    base = int(record.get("base", 0))
    delta = [int(t) for t in record.get("delta", [])]
    if base and base != len(last):
        return [-1]  # the committed prompt extended a different history: nothing can match it
    return (last[:base] if base else []) + delta
