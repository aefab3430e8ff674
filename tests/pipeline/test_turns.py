"""Turn checkpoints (raas.pipeline.turns) on their own: what a generate call commits, how a replay answers
from it only for the same prompt, and that a gap in the committed turns ends what is trusted."""

from __future__ import annotations

import json
from typing import Any

import pytest

from raas.llm.types import GenerateResult
from raas.pipeline.turns import ReplayDiverged, TurnRecorder, committed_turns, turn_stage

pytestmark = pytest.mark.unit


class Server:
    """Answers every prompt with its length as the only token (and counts the calls)."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    async def generate(self, prompt: list[int], sampling: Any = None, **kw: Any) -> GenerateResult:
        self.prompts.append(list(prompt))
        return GenerateResult(
            output_ids=[len(prompt)], logprobs=[-0.5], finish_reason="stop", weight_version="3"
        )

    def release(self, job_id: str) -> str:
        return f"released {job_id}"


async def test_calls_are_committed_as_deltas_and_replayed_only_for_the_same_prompt() -> None:
    server, log = Server(), {}
    rec = TurnRecorder(server, lambda i, body: log.__setitem__(turn_stage(i), body))
    await rec.generate([1, 2, 3])
    await rec.generate([1, 2, 3, 3, 9, 9])  # extends prompt + output: stored as a delta
    await rec.generate([7])  # a new token sequence: stored whole
    bodies = {k: json.loads(v) for k, v in log.items()}
    assert [(b["base"], b["delta"]) for b in bodies.values()] == [(0, [1, 2, 3]), (4, [9, 9]), (0, [7])]
    assert (
        bodies["turn:1"]["result"]["output_ids"] == [6]
        and bodies["turn:1"]["result"]["weight_version"] == "3"
    )
    assert rec.release("j") == "released j"  # everything else is the balancer's

    turns = committed_turns(list(log.items()))
    again, fresh = Server(), {}
    replaying = TurnRecorder(again, lambda i, body: fresh.__setitem__(i, body), turns)
    assert (await replaying.generate([1, 2, 3])).output_ids == [3]
    assert (await replaying.generate([1, 2, 3, 3, 9, 9])).weight_version == "3"
    assert (await replaying.generate([7])).output_ids == [1]
    assert again.prompts == [] and fresh == {}  # answered from the committed turns, nothing re-committed
    assert (await replaying.generate([7, 1, 5])).output_ids == [3]  # past them: sampled and committed
    assert again.prompts == [[7, 1, 5]] and list(fresh) == [3] and replaying.replayed == 3

    diverging = TurnRecorder(Server(), lambda i, body: None, turns)
    await diverging.generate([1, 2, 3])
    with pytest.raises(ReplayDiverged, match=r"turn 1.*token 5") as err:
        await diverging.generate([1, 2, 3, 3, 9, 8])
    assert err.value.kind == "replay_diverged" and err.value.stage == "run"


def test_a_gap_ends_the_committed_turns() -> None:
    rows = [(turn_stage(0), '{"delta": [1]}'), (turn_stage(2), '{"delta": [3]}'), ("run", "{}")]
    assert committed_turns(rows) == [{"delta": [1]}]
    assert committed_turns([(turn_stage(0), "not json")]) == []
