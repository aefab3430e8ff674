"""What the trajectory inspector shows, computed once on the server: a job's list row, and its token view.

Why on the server: the page then needs no tokenizer and does no arithmetic on token streams; it only puts
strings into text nodes. The token view walks the turns the way the agent loop built the trajectory
(turn 0's output, then per later turn the environment's delta and the sampled output), so each token
carries its turn, weight version, segment, loss mask and logprob.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raas.core.jobs import JobResult
from raas.core.trajectory import TokenTrajectory
from raas.errors import RaasError
from raas.pipeline.ledger_search import LedgerSearch

MAX_VIEW_TOKENS = 20_000
"""Tokens shown in one token view (the rest is counted, not listed): a page stays usable for a 5 MB
observation."""

MAX_TEXT_CHARS = 200_000
"""Characters of one message shown on the job page (the rest is cut, and the cut is said)."""


@dataclass(frozen=True)
class JobQuery:
    """A page of the job list: every filter optional, ``text`` matched in the id and the instance."""

    status: str | None = None
    outcome: str | None = None  # "resolved" | "unresolved" | "filtered"
    data_source: str | None = None
    text: str | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    weight_version: str | None = None
    group: str | None = None
    step: int | None = None
    """A ``raas train`` step: the jobs it trained on (a training run's results file only)."""
    offset: int = 0
    limit: int = 50


@dataclass
class JobRow:
    """One job in the list."""

    job_id: str
    status: str
    data_source: str | None
    instance_id: str | None
    group_id: str | None
    trajectory_id: str | None
    reward: float | None
    resolved: bool | None
    filtered: bool
    turns: int
    weight_versions: list[str] = field(default_factory=list)
    total_s: float = 0.0
    error: str | None = None
    train_step: int | None = None
    """The ``raas train`` step that trained on this sample (a training run's results file)."""
    advantage: float | None = None
    """The group-relative advantage it was trained with (same)."""

    def outcome(self) -> str:
        if self.filtered:
            return "filtered"
        return "resolved" if self.resolved or (self.reward or 0.0) >= 1.0 else "unresolved"

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "outcome": self.outcome()}


def group_of(job_id: str) -> str | None:
    """The GRPO group of a job: the instance's ``group_id`` when the request had one (the trainer's
    clients use ``<group>.<trajectory>.<attempt>`` job ids), else None."""
    parts = job_id.rsplit(".", 2)
    return parts[0] if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit() else None


def row_of(result: JobResult, data_source: str | None = None) -> JobRow:
    versions = sorted({t.weight_version for t in result.turns if t.weight_version is not None})
    return JobRow(
        job_id=result.job_id,
        status=str(result.status),
        data_source=data_source,
        instance_id=result.instance_id,
        group_id=group_of(result.job_id),
        trajectory_id=result.trajectory_id,
        reward=result.reward,
        resolved=result.resolved,
        filtered=bool(result.filter),
        turns=len(result.turns),
        weight_versions=versions,
        total_s=result.timing.total_s,
        error=f"{result.error.stage}/{result.error.kind}: {result.error.message}" if result.error else None,
    )


def matches(row: JobRow, q: JobQuery) -> bool:
    if q.status and row.status != q.status:
        return False
    if q.outcome and row.outcome() != q.outcome:
        return False
    if q.data_source and row.data_source != q.data_source:
        return False
    if q.group and row.group_id != q.group:
        return False
    if q.step is not None and row.train_step != q.step:
        return False
    if q.weight_version and q.weight_version not in row.weight_versions:
        return False
    if q.min_reward is not None and (row.reward is None or row.reward < q.min_reward):
        return False
    if q.max_reward is not None and (row.reward is None or row.reward > q.max_reward):
        return False
    if q.text:
        needle = q.text.lower()
        if needle not in row.job_id.lower() and needle not in (row.instance_id or "").lower():
            return False
    return True


class FileJobs:
    """The jobs of a results file (``raas run -o``'s ``results.jsonl``: one ``JobResult`` per line; ``raas
    train -o``'s adds the step and advantage each sample was trained with). Read into memory, and lines
    appended later (a training run in progress) are read at the next request; a partial last line waits.
    A line that is not a result is an error naming the line: the file is not a results file, and
    guessing would show the wrong thing."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.results: dict[str, JobResult] = {}
        self.rows: list[JobRow] = []
        self._offset = 0
        self._lines = 0
        self._lock = threading.Lock()
        self._read_new()

    def _read_new(self) -> None:
        with self._lock, self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
            end = data.rfind(b"\n") + 1
            for line in data[:end].splitlines():
                self._lines += 1
                if line.strip():
                    self._add(line, self._lines)
            self._offset += end

    def _add(self, line: bytes, n: int) -> None:
        try:
            body = json.loads(line)
            result = JobResult.model_validate(body)
        except ValueError as exc:
            raise RaasError(f"{self.path}:{n} is not a raas job result: {exc}", kind="bad_request") from exc
        source = body.get("data_source") or (body.get("artifacts") or {}).get("data_source")
        row = row_of(result, str(source) if source else None)
        step = _number(body.get("train_step"))
        row.train_step = None if step is None else int(step)
        row.advantage = _number(body.get("advantage"))
        if result.job_id in self.results:
            self.rows = [r for r in self.rows if r.job_id != result.job_id]  # a later line replaces it
        self.results[result.job_id] = result
        self.rows.append(row)

    async def page(self, q: JobQuery) -> dict[str, Any]:
        await asyncio.to_thread(self._read_new)
        hits = [r for r in self.rows if matches(r, q)]
        chosen = hits[q.offset : q.offset + q.limit]
        return {"total": len(hits), "offset": q.offset, "jobs": [r.as_dict() for r in chosen]}

    async def get(self, job_id: str) -> JobResult | None:
        await asyncio.to_thread(self._read_new)
        return self.results.get(job_id)

    async def history(self, job_id: str) -> list[tuple[str, float, str | None]]:
        return []  # a results file keeps no transitions


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


class LedgerJobs:
    """The jobs of a running service's ledger (:class:`~raas.pipeline.ledger_search.LedgerSearch`): the
    newest first, running ones included (without a result yet)."""

    def __init__(self, ledger_path: Path) -> None:
        self.search = LedgerSearch(ledger_path)

    async def page(self, q: JobQuery) -> dict[str, Any]:
        if q.step is not None:
            raise RaasError(
                "a service's ledger does not know training steps: open the run's directory with "
                "`raas view OUT` to list a step's jobs",
                kind="bad_request",
            )
        found = await self.search.page(
            q.offset,
            q.limit,
            status=q.status,
            outcome=q.outcome,
            data_source=q.data_source,
            text=q.text,
            min_reward=q.min_reward,
            max_reward=q.max_reward,
            weight_version=q.weight_version,
            group=q.group,
        )
        # a page's results can be megabytes of JSON: parsed off the event loop
        jobs = await asyncio.to_thread(self._rows, found["rows"])
        return {"total": found["total"], "offset": found["offset"], "jobs": jobs}

    @staticmethod
    def _rows(rows: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
        jobs = []
        for job_id, status, source, instance_id, trajectory_id, result, error in rows:
            if result:
                row = row_of(JobResult.model_validate_json(result), source)
            else:
                row = JobRow(
                    job_id=job_id,
                    status=status,
                    data_source=source,
                    instance_id=instance_id,
                    group_id=group_of(job_id),
                    trajectory_id=trajectory_id,
                    reward=None,
                    resolved=None,
                    filtered=False,
                    turns=0,
                    error=_error_text(error),
                )
            jobs.append(row.as_dict())
        return jobs

    async def get(self, job_id: str) -> JobResult | None:
        found = await self.search.get(job_id)
        return None if found is None else found[0]

    async def history(self, job_id: str) -> list[tuple[str, float, str | None]]:
        return await self.search.history(job_id)


def _error_text(error: str | None) -> str | None:
    if not error:
        return None
    try:
        e = json.loads(error)
        return f"{e.get('stage')}/{e.get('kind')}: {e.get('message')}"
    except (ValueError, AttributeError):
        return str(error)


def _cut(text: str) -> dict[str, Any]:
    if len(text) <= MAX_TEXT_CHARS:
        return {"text": text, "cut": 0}
    return {"text": text[:MAX_TEXT_CHARS], "cut": len(text) - MAX_TEXT_CHARS}


def conversation(result: JobResult) -> list[dict[str, Any]]:
    """The messages turn by turn: role, text (cut beyond :data:`MAX_TEXT_CHARS`), tool calls with their
    arguments, the tool a message answers."""
    out = []
    for m in result.messages:
        calls = [{"name": c.name, "arguments": c.arguments} for c in (m.tool_calls or [])]
        out.append({"role": m.role, **_cut(m.content), "tool_calls": calls, "name": m.name})
    return out


def _segment_rows(
    result: JobResult, index: int, tt: TokenTrajectory
) -> list[tuple[int, int, float | None, int, int]]:
    """One token sequence's tokens as ``(id, mask, logprob, turn, segment)``: its prompt (turn -1), then
    per turn of this segment the environment's delta (but for the segment's first turn) and the output."""
    owners: list[int] = []
    first = True
    for k, turn in enumerate(result.turns):
        if turn.segment != index:
            continue
        if not first:
            owners += [k] * len(turn.prompt_ids)
        owners += [k] * len(turn.output_ids)
        first = False
    if len(owners) != len(tt.response_ids):
        owners = [-2] * len(tt.response_ids)  # turns and trajectory disagree: show the tokens unowned
    return [
        *((t, 0, None, -1, index) for t in tt.prompt_ids),
        *(
            (t, m, lp, turn, index)
            for t, m, lp, turn in zip(tt.response_ids, tt.loss_mask, tt.logprobs, owners, strict=True)
        ),
    ]


def token_view(result: JobResult, decode: Callable[[Sequence[int]], str]) -> dict[str, Any]:
    """Every token of the trajectory as ``[text, mask, logprob, turn, segment]`` (``mask`` 1 = sampled and
    trained on; ``turn`` -1 for a prompt), every token sequence in order (a rollout whose context was
    rebuilt has several), with the counts and each turn's weight version and segment."""
    sequences = result.segments or [result.token_trajectory]
    rows = [row for i, tt in enumerate(sequences) for row in _segment_rows(result, i, tt)]
    shown = rows[:MAX_VIEW_TOKENS]
    sampled = sum(sum(tt.loss_mask) for tt in sequences)
    return {
        "tokens": [[decode([t]), m, lp, turn, seg] for t, m, lp, turn, seg in shown],
        "total": len(rows),
        "shown": len(shown),
        "prompt": sum(len(tt.prompt_ids) for tt in sequences),
        "sampled": sampled,
        "masked": sum(len(tt.loss_mask) for tt in sequences) - sampled,
        "turns": [
            {
                "index": t.index,
                "weight_version": t.weight_version,
                "segment": t.segment,
                "finish": t.finish_reason,
            }
            for t in result.turns
        ],
        "segments": len(sequences),
    }


def history_view(history: Sequence[tuple[str, float, str | None]]) -> dict[str, Any]:
    """A job's state changes (seconds since it was accepted) and the sandboxes it opened, from its
    ledger history (empty for a results file)."""
    start = history[0][1] if history else 0.0
    steps, sandboxes = [], []
    for status, at, detail in history:
        if status == "sandbox":
            try:
                box = json.loads(detail or "{}")
            except ValueError:
                box = {}
            if isinstance(box, dict):
                sandboxes.append({**box, "at_s": at - start})
            continue
        steps.append({"status": status, "at_s": at - start, "detail": detail})
    return {"transitions": steps, "sandboxes": sandboxes}


def job_detail(
    result: JobResult,
    decode: Callable[[Sequence[int]], str] | None,
    history: Sequence[tuple[str, float, str | None]] = (),
) -> dict[str, Any]:
    """The job page's data: list row, timings, history and sandboxes, failure, EVAL artifacts,
    conversation, token view."""
    row = row_of(result)
    return {
        "row": row.as_dict(),
        **history_view(history),
        "timing": result.timing.model_dump(),
        "error": result.error.model_dump() if result.error else None,
        "artifacts": result.artifacts,
        "messages": conversation(result),
        "tokens": token_view(result, decode) if decode is not None else None,
    }
