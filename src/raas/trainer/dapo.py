"""DAPO dynamic sampling with asynchronous refill, cancel of surplus, and carry-over across weight updates.

DAPO trains only on groups whose rewards are not all equal (the others have zero advantage everywhere).
Generating a batch, filtering it and generating again makes the trainer wait for the slowest rollout of
every round. :class:`DynamicSampler` instead keeps up to ``max_inflight_groups`` groups running, takes each
group the moment it finishes, submits a new one whenever one finishes, and stops as soon as
``target_groups`` informative groups are in. Then it either cancels what is still running (the service
stops those jobs and closes their sandboxes), or — with ``carry_over`` — lets it keep running across the
weight update (the services pause around the sync; no in-flight turn is aborted) and uses it next step.

Staleness: every turn carries the weight version that sampled it. A group whose oldest turn is more than
``max_staleness`` versions behind the current policy is dropped (``stale="drop"``) or run again
(``"rerun"``). With ``carry_over``, admission also keeps ``in flight + accepted <= (max_staleness + 1) *
target_groups``, so work started at version ``v`` is normally consumed by version ``v + max_staleness``.
Without carry-over no group outlives the step it started in (the rest is cancelled before the weight
update), so staleness is 0 by construction and only ``max_inflight_groups`` limits admission.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from raas.errors import RaasError
from raas.trainer.grpo import Batch, assemble_batch
from raas.trainer.pass_rates import PassRateFilter
from raas.trainer.rollout import RolloutClient
from raas.trainer.types import Group


@dataclass
class StepStats:
    """What one :meth:`DynamicSampler.next_step` did. Samples (rollouts) and groups are counted apart."""

    step: int
    policy_version: int
    target_groups: int
    accepted_groups: int = 0
    uninformative_groups: int = 0
    """Finished with all rewards equal (DAPO filters them)."""
    stale_dropped_groups: int = 0
    stale_rerun_groups: int = 0
    failed_groups: int = 0
    """Dropped by the failure policy (fewer usable samples than its minimum)."""
    informative_fraction: float = 0.0
    """accepted / (accepted + uninformative) among the groups judged this step."""
    submitted_groups: int = 0
    rollouts_used: int = 0
    rollouts_wasted: int = 0
    """Usable samples finished but not trained on: uninformative, stale, failed and surplus groups, and the
    finished samples of cancelled groups."""
    cancelled_groups: int = 0
    cancelled_jobs: int = 0
    carried_over_groups: int = 0
    """Groups left running (and accepted groups kept) for the next step (``carry_over``)."""
    carried_in_groups: int = 0
    """Accepted groups of this step that were submitted under an older policy version."""
    staleness: dict[int, int] = field(default_factory=dict)
    """Accepted groups by staleness (current version minus the group's oldest turn version)."""
    skipped_prompts: int = 0
    """Prompts the pass-rate filter deferred this step (all solved or all failed recently)."""
    time_waiting_s: float = 0.0
    """Wall time the trainer spent inside ``next_step``."""
    exhausted: bool = False
    """The dataset ran out before ``target_groups`` were in."""
    failures: dict[str, int] = field(default_factory=dict)
    """The client's failure counters during this step (filtered, resubmitted, dropped_samples, ...)."""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


_CLIENT_COUNTERS = (
    "filtered",
    "resubmitted",
    "dropped_samples",
    "refilled_samples",
    "dropped_groups",
    "moved",
    "cancelled",
    "stream_reconnects",
)


class DynamicSampler:
    """See the module docstring. One sampler per :class:`RolloutClient`."""

    def __init__(
        self,
        client: RolloutClient,
        dataset: Iterable[dict[str, Any]],
        group_size: int,
        target_groups: int,
        max_inflight_groups: int,
        carry_over: bool = False,
        max_staleness: int = 1,
        *,
        sampling_params: dict[str, Any] | None = None,
        stale: Literal["drop", "rerun"] = "drop",
        mask_stale_turns: bool = False,
        accept: Callable[[Group], bool] | None = None,
        policy_version: int = 0,
        pass_rates: PassRateFilter | None = None,
    ) -> None:
        if group_size < 1 or target_groups < 1 or max_inflight_groups < 1 or max_staleness < 0:
            raise RaasError(
                "group_size, target_groups, max_inflight_groups >= 1 and max_staleness >= 0 are required",
                kind="bad_request",
            )
        if stale not in ("drop", "rerun"):
            raise RaasError(f"stale must be 'drop' or 'rerun', got {stale!r}", kind="bad_request")
        self.client = client
        self.group_size = group_size
        self.target_groups = target_groups
        self.max_inflight_groups = max_inflight_groups
        self.carry_over = carry_over
        self.max_staleness = max_staleness
        self.sampling_params = sampling_params
        self.stale = stale
        self.mask_stale_turns = mask_stale_turns
        self.accept = accept or (lambda g: g.informative)
        self.policy_version = policy_version
        self.pass_rates = pass_rates
        """Per-prompt pass-rate tracking (:mod:`raas.trainer.pass_rates`): skip settled prompts, prefer
        uncertain ones; None: the data's order."""
        self._lookahead: list[dict[str, Any]] = []
        self.step = 0
        self._data: Iterator[dict[str, Any]] = iter(dataset)
        self._again: collections.deque[dict[str, Any]] = collections.deque()
        self._exhausted = False
        self._inflight: dict[str, Group] = {}
        self._ready: list[Group] = []

    # -- admission ---------------------------------------------------------------------------------------

    @property
    def admission_limit(self) -> int:
        """The most groups in flight plus accepted at any time: ``(max_staleness + 1) * target_groups``
        with carry-over; without it, ``max_inflight_groups + target_groups`` (no bound beyond the in-flight
        cap is needed: nothing survives a weight update)."""
        if self.carry_over:
            return (self.max_staleness + 1) * self.target_groups
        return self.max_inflight_groups + self.target_groups

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def _next_instance(self) -> dict[str, Any] | None:
        if self._again:
            return self._again.popleft()
        if self._exhausted:
            return None
        if self.pass_rates is not None:
            chosen = self.pass_rates.choose(self._data, self._lookahead)
            if chosen is None:
                self._exhausted = True
            return chosen
        try:
            return next(self._data)
        except StopIteration:
            self._exhausted = True
            return None

    async def _top_up(self, accepted: int, stats: StepStats) -> None:
        room = min(
            self.max_inflight_groups - len(self._inflight),
            self.admission_limit - len(self._inflight) - accepted,
        )
        groups: list[Group] = []
        for _ in range(max(room, 0)):
            instance = self._next_instance()
            if instance is None:
                break
            groups.append(
                self.client.new_group(
                    instance,
                    self.group_size,
                    sampling_params=self.sampling_params,
                    version=self.policy_version,
                )
            )
        if not groups:
            return
        await self.client.submit_groups(groups)
        for g in groups:
            self._inflight[g.group_id] = g
        stats.submitted_groups += len(groups)

    # -- one step ----------------------------------------------------------------------------------------

    def staleness_of(self, group: Group) -> int:
        return self.policy_version - group.oldest_version()

    def _judge(self, group: Group, accepted: list[Group], stats: StepStats) -> None:
        """Sort one finished group into accepted / uninformative / stale / failed."""
        usable = len(group.results)
        if group.dropped:
            stats.failed_groups += 1
            stats.rollouts_wasted += usable
            return
        if self.staleness_of(group) > self.max_staleness:
            stats.rollouts_wasted += usable
            if self.stale == "rerun":
                stats.stale_rerun_groups += 1
                self._again.append(group.instance)
            else:
                stats.stale_dropped_groups += 1
            return
        if self.accept(group):
            accepted.append(group)
        else:
            stats.uninformative_groups += 1
            stats.rollouts_wasted += usable

    async def next_step(self) -> tuple[list[Group], StepStats]:
        """Collect ``target_groups`` accepted groups (fewer only if the dataset ran out)."""
        started = time.monotonic()
        before = self.client.stats.snapshot()
        stats = StepStats(
            step=self.step, policy_version=self.policy_version, target_groups=self.target_groups
        )
        skipped_before = self.pass_rates.skipped if self.pass_rates is not None else 0
        accepted: list[Group] = []
        for g in self._ready:  # accepted last step beyond the target (carry_over): re-checked for staleness
            self._judge(g, accepted, stats)
        self._ready = []
        while len(accepted) < self.target_groups:
            for g in self.client.finished_nowait():
                self._take(g, accepted, stats)
            if len(accepted) >= self.target_groups:
                break
            await self._top_up(len(accepted), stats)
            if not self._inflight:
                stats.exhausted = True
                break
            self._take(await self.client.next_group(), accepted, stats)
        batch, surplus = accepted[: self.target_groups], accepted[self.target_groups :]
        if self.carry_over:
            self._ready = surplus
            await self._top_up(len(surplus), stats)  # keep the services busy while the trainer trains
            stats.carried_over_groups = len(self._inflight) + len(surplus)
        else:
            stats.rollouts_wasted += sum(len(g.results) for g in surplus)
            await self._cancel_inflight(stats)
        judged = len(batch) + len(surplus) + stats.uninformative_groups
        stats.accepted_groups = len(batch)
        stats.informative_fraction = (len(batch) + len(surplus)) / judged if judged else 0.0
        stats.rollouts_used = sum(len(g.results) for g in batch)
        for g in batch:
            s = self.staleness_of(g)
            stats.staleness[s] = stats.staleness.get(s, 0) + 1
            if g.submit_version < self.policy_version:
                stats.carried_in_groups += 1
        after = self.client.stats.snapshot()
        stats.failures = {k: after[k] - before[k] for k in _CLIENT_COUNTERS}
        if self.pass_rates is not None:
            stats.skipped_prompts = self.pass_rates.skipped - skipped_before
        stats.time_waiting_s = time.monotonic() - started
        self.step += 1
        return batch, stats

    def _take(self, group: Group, accepted: list[Group], stats: StepStats) -> None:
        if self._inflight.pop(group.group_id, None) is None:
            return  # not one of this sampler's groups
        if self.pass_rates is not None and not group.dropped:
            self.pass_rates.observe(group.instance, group.rewards)
        self._judge(group, accepted, stats)

    async def _cancel_inflight(self, stats: StepStats) -> None:
        """Stop every group still running and discard groups that finished after the target was met."""
        for g in self.client.finished_nowait():
            if self._inflight.pop(g.group_id, None) is not None:
                stats.rollouts_wasted += len(g.results)
        groups = list(self._inflight.values())
        self._inflight.clear()
        stats.cancelled_groups = len(groups)
        stats.rollouts_wasted += sum(len(g.results) for g in groups)
        stats.cancelled_jobs = await self.client.cancel_groups(groups, wait=False)

    # -- weights and batches -----------------------------------------------------------------------------

    async def update_weights(self, sync: Callable[[], Awaitable[Any]] | None = None) -> int:
        """The weight update between steps: pause every service (running turns finish with the old
        weights), run ``sync``, stamp the next version on every inference server, resume. Returns the new
        policy version."""
        version = self.policy_version + 1
        await self.client.weight_sync(str(version), sync)
        self.policy_version = version
        return version

    def assemble(
        self, groups: list[Group], pad_id: int, max_prompt_len: int, max_response_len: int, **kw: Any
    ) -> Batch:
        """:func:`assemble_batch` with this sampler's stale-turn masking (``mask_stale_turns``: turns
        sampled by a policy older than the current one get loss 0)."""
        if self.mask_stale_turns:
            kw.setdefault("mask_turns_before", self.policy_version)
        return assemble_batch(groups, pad_id, max_prompt_len, max_response_len, **kw)

    async def close(self) -> int:
        """Cancel everything this sampler still has running; returns the number of jobs cancelled."""
        groups = list(self._inflight.values())
        self._inflight.clear()
        self._ready = []
        return await self.client.cancel_groups(groups, wait=True)
