"""Per-prompt pass-rate tracking for dynamic sampling: spend rollouts where the policy is uncertain.

DAPO keeps only groups whose rewards differ. As a policy learns, more prompts come back all solved (and
some stay all failed), and the sampler pays for whole groups it then throws away: on ``builtin:addition``
the informative fraction fell from 1.0 to 0.03-0.05 and the trainer's wait per step rose from 36 s to
250-516 s. :class:`PassRateFilter` remembers each prompt's recent rewards and, when the sampler asks for
its next prompt:

* **skips** a prompt whose last ``window`` samples (at least ``min_samples``) were all solved or all
  failed: it would most likely be uninformative again. Every ``revisit_every``-th time a skipped prompt
  comes up it is let through anyway, so a prompt the policy has since learned (or unlearned) is noticed;
* **prefers** prompts near a 50% pass rate: it looks ``lookahead`` prompts ahead in the data and takes the
  one with the largest ``p(1-p)`` (the reward variance of a group, the thing GRPO learns from). A prompt
  never sampled scores as ``p = 0.5`` (worth a look).

Rewards count as pass rates (mean reward; raas rewards are in [0, 1]). A skipped prompt is counted
(``skipped``) and stays in the data: it is only deferred, never dropped from the epoch for good.
"""

from __future__ import annotations

import collections
import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from raas.errors import RaasError


def prompt_key(instance: dict[str, Any]) -> str:
    """A prompt's identity: its ``instance_id``, else a hash of the instance."""
    iid = instance.get("instance_id")
    if isinstance(iid, str) and iid:
        return iid
    blob = json.dumps(instance, sort_keys=True, default=str).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()[:16]


@dataclass
class PassRateFilter:
    """See the module docstring. Give one to :class:`~raas.trainer.dapo.DynamicSampler` (``pass_rates=``)."""

    window: int = 16
    """Rewards remembered per prompt (the most recent)."""
    min_samples: int = 8
    """A prompt is skipped only after this many remembered samples (one full group, by default)."""
    revisit_every: int = 4
    """A skipped prompt is let through every this-many times it comes up."""
    lookahead: int = 4
    """Prompts drawn ahead to choose from (1: data order, skipping only)."""
    skipped: int = 0
    revisited: int = 0
    _rewards: dict[str, collections.deque[float]] = field(default_factory=dict, repr=False)
    _passes: dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.window < 1 or self.min_samples < 1 or self.revisit_every < 1 or self.lookahead < 1:
            raise RaasError(
                "window, min_samples, revisit_every and lookahead must be >= 1", kind="bad_request"
            )
        if self.min_samples > self.window:
            raise RaasError("min_samples cannot exceed window", kind="bad_request")

    def observe(self, instance: dict[str, Any], rewards: Sequence[float]) -> None:
        """Record a finished group's rewards for its prompt."""
        if not rewards:
            return
        key = prompt_key(instance)
        q = self._rewards.setdefault(key, collections.deque(maxlen=self.window))
        q.extend(float(r) for r in rewards)

    def pass_rate(self, instance: dict[str, Any]) -> float | None:
        q = self._rewards.get(prompt_key(instance))
        return sum(q) / len(q) if q else None

    def settled(self, instance: dict[str, Any]) -> bool:
        """All solved or all failed over at least ``min_samples`` remembered samples."""
        return self._settled_key(prompt_key(instance))

    def score(self, instance: dict[str, Any]) -> float:
        """``p(1-p)``: a group's reward variance at this prompt's pass rate (0.25 when never sampled)."""
        p = self.pass_rate(instance)
        return 0.25 if p is None else p * (1.0 - p)

    def admit(self, instance: dict[str, Any]) -> bool:
        """Whether to sample ``instance`` now (counts skips and revisits)."""
        if not self.settled(instance):
            return True
        key = prompt_key(instance)
        self._passes[key] = self._passes.get(key, 0) + 1
        if self._passes[key] % self.revisit_every == 0:
            self.revisited += 1
            return True
        self.skipped += 1
        return False

    def choose(self, source: Iterator[dict[str, Any]], buffer: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The next prompt to sample: ``buffer`` (prompts drawn earlier and not taken) is filled up to
        ``lookahead`` from ``source``; settled prompts are skipped (kept out of the buffer); of the rest,
        the one with the largest score. None when the data ran out. A skipped prompt is deferred, not
        dropped: it comes up again with the data's next epoch (and every
        ``revisit_every``-th time is let through)."""
        while len(buffer) < self.lookahead:
            try:
                inst = next(source)
            except StopIteration:
                break
            if self.admit(inst):
                buffer.append(inst)
        if not buffer:
            return None
        best = max(range(len(buffer)), key=lambda i: self.score(buffer[i]))
        return buffer.pop(best)

    def summary(self) -> dict[str, Any]:
        rates = [sum(q) / len(q) for q in self._rewards.values() if q]
        return {
            "prompts_seen": len(self._rewards),
            "settled": sum(1 for k in self._rewards if self._settled_key(k)),
            "skipped": self.skipped,
            "revisited": self.revisited,
            "mean_pass_rate": sum(rates) / len(rates) if rates else None,
        }

    def _settled_key(self, key: str) -> bool:
        q = self._rewards.get(key)
        return (
            q is not None
            and len(q) >= self.min_samples
            and (all(r >= 1.0 for r in q) or all(r <= 0.0 for r in q))
        )
