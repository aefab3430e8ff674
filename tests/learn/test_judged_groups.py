"""A group the DAPO sampler judges twice (carried over past one step's target) counts in one step's log."""

from __future__ import annotations

import pytest

from raas.learn.reference import JudgedGroups
from raas.trainer.types import Group

pytestmark = pytest.mark.unit


def _group(gid: str) -> Group:
    return Group(group_id=gid, instance={"data_source": "x"}, size=2)


def test_a_carried_group_counts_once() -> None:
    judged = JudgedGroups()
    a, b, c = _group("g1"), _group("g2"), _group("g3")
    for g in (a, b):  # step 1: both accepted, b beyond the target (carried to step 2)
        judged.accept(g)
    assert [g.group_id for g in judged.groups] == ["g1", "g2"]
    judged.clear()
    for g in (b, c):  # step 2: b re-judged for staleness, c new
        judged.accept(g)
    assert [g.group_id for g in judged.groups] == ["g3"]


def test_accept_is_the_dapo_test() -> None:
    judged = JudgedGroups()
    g = _group("g1")
    assert judged.accept(g) is False  # no results: rewards all equal
    assert judged.accept(g) is False  # judged again: same verdict, still listed once
    assert len(judged.groups) == 1
