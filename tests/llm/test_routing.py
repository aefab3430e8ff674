"""Routing decisions of the balancer against real HTTP servers speaking the vLLM / SGLang wire protocols:
GRPO groups share a home server while its load allows, trajectories stay sticky, homes are forgotten
when groups end, and the other policies behave as documented."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import ValidationError

from raas.llm import ChatTokenizer, LLMBalancer, RoutingConfig, SamplingParams
from raas.llm.routing import GroupHomes
from raas.pipeline.config import ServiceConfig
from raas.pipeline.service import RolloutService
from tests.llm.wire_doubles import HeldVLLM, SGLangDouble, VLLMDouble

pytestmark = pytest.mark.integration

PROMPT = [1, 2, 3, 4]
SHORT = SamplingParams(max_tokens=4)


async def _until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(3000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def _in_flight(bal: LLMBalancer) -> dict[str, int]:
    return {s["address"]: s["in_flight"] for s in bal.servers()}


async def _start_held(bal: LLMBalancer, tid: str, group: str) -> tuple[asyncio.Task[object], str]:
    """Start a trajectory's first request against held servers; return it and where it went."""
    before = sum(_in_flight(bal).values())
    task = asyncio.create_task(bal.generate(PROMPT, SHORT, trajectory_id=tid, group_id=group))
    await _until(lambda: sum(_in_flight(bal).values()) == before + 1, f"{tid} in flight")
    where = bal.pinned_server(tid)
    assert where is not None
    return task, where


async def test_samples_of_a_group_share_a_home_and_groups_spread() -> None:
    async with SGLangDouble() as a, VLLMDouble() as b:
        async with LLMBalancer(health_interval_s=0) as bal:
            bal.add(a.url)
            bal.add(b.url)
            where: dict[str, set[str]] = {}
            for g in range(4):
                for i in range(4):
                    res = await bal.generate(PROMPT, SHORT, trajectory_id=f"g{g}-{i}", group_id=f"g{g}")
                    where.setdefault(f"g{g}", set()).add(res.server)
            assert all(len(s) == 1 for s in where.values()), where
            assert {next(iter(s)) for s in where.values()} == {a.url, b.url}  # groups use both servers
            assert {s["address"]: s["groups"] for s in bal.servers()} == {a.url: 2, b.url: 2}
            assert bal.group_counts() == {"live": 4, "idle": 0, "trajectories": 16}


async def test_trajectory_routing_ignores_groups() -> None:
    async with SGLangDouble() as a, VLLMDouble() as b:
        async with LLMBalancer(health_interval_s=0, routing=RoutingConfig(mode="trajectory")) as bal:
            bal.add(a.url)
            bal.add(b.url)
            servers = [
                (await bal.generate(PROMPT, SHORT, trajectory_id=f"t{i}", group_id="g")).server
                for i in range(4)
            ]
            assert set(servers) == {a.url, b.url}  # idle servers tie, and ties rotate
            assert bal.group_home("g") is None and bal.group_counts()["live"] == 0


async def test_round_robin_rotates_every_request_and_pins_nothing() -> None:
    async with SGLangDouble() as a, VLLMDouble() as b:
        async with LLMBalancer(health_interval_s=0, routing=RoutingConfig(mode="round_robin")) as bal:
            bal.add(a.url)
            bal.add(b.url)
            servers = [
                (await bal.generate(PROMPT, SHORT, trajectory_id="t", group_id="g")).server for _ in range(4)
            ]
            assert servers[0::2] == [servers[0]] * 2 and servers[1::2] == [servers[1]] * 2
            assert servers[0] != servers[1]
            assert bal.pinned_server("t") is None and bal.group_home("g") is None


async def test_home_takes_new_samples_while_within_the_load_bound_then_they_spill() -> None:
    """slack 2, factor 2: home in flight must stay below max(2, 2 x least in flight)."""
    routing = RoutingConfig(group_slack=2, group_load_factor=2.0)
    async with HeldVLLM(hold={"/v1/completions"}) as a, HeldVLLM(hold={"/v1/completions"}) as b:
        async with LLMBalancer(health_interval_s=0, retries=0, routing=routing) as bal:
            bal.add(a.url)
            bal.add(b.url)
            tasks, placed = [], []
            for i in range(6):
                task, where = await _start_held(bal, f"s{i}", "g")
                tasks.append(task)
                placed.append(where)
            home, other = placed[0], ({a.url, b.url} - {placed[0]}).pop()
            # in flight (home, other) before each: (0,0) (1,0) (2,0)->spill (2,1)->spill (2,2) (3,2)
            assert placed == [home, home, other, other, home, home]
            assert bal.group_home("g") == home  # spilling does not move the group
            a.release.set()
            b.release.set()
            await asyncio.gather(*tasks)

            # Later turns stay on the trajectory's own server, wherever the group's home is.
            for i, first in enumerate(placed):
                res = await bal.generate([*PROMPT, 5], SHORT, trajectory_id=f"s{i}", group_id="g")
                assert res.server == first


async def test_a_trajectory_keeps_its_server_even_when_it_is_loaded() -> None:
    routing = RoutingConfig(group_slack=1, group_load_factor=1.0)
    async with HeldVLLM(hold={"/v1/completions"}) as a, HeldVLLM(hold={"/v1/completions"}) as b:
        async with LLMBalancer(health_interval_s=0, retries=0, routing=routing) as bal:
            bal.add(a.url)
            bal.add(b.url)
            first, home = await _start_held(bal, "t", "g")
            second, where = await _start_held(bal, "t", "g")  # the same trajectory's next request
            assert where == home and _in_flight(bal)[home] == 2
            spilled, elsewhere = await _start_held(bal, "u", "g")  # a new sample of the group spills
            assert elsewhere != home
            a.release.set()
            b.release.set()
            await asyncio.gather(first, second, spilled)


async def test_group_homes_are_forgotten_when_groups_end_and_stay_bounded() -> None:
    async with SGLangDouble() as a, VLLMDouble() as b:
        async with LLMBalancer(health_interval_s=0, routing=RoutingConfig(idle_groups=8)) as bal:
            bal.add(a.url)
            bal.add(b.url)
            for g in range(50):
                tids = [f"g{g}-{i}" for i in range(3)]
                for tid in tids:
                    await bal.generate(PROMPT, SHORT, trajectory_id=tid, group_id=f"g{g}")
                assert bal.group_counts() == {"live": 1, "idle": min(g, 8), "trajectories": 3}
                for tid in tids:
                    bal.release(tid)
                assert bal.pinned_server(tids[0]) is None
            assert bal.group_counts() == {"live": 0, "idle": 8, "trajectories": 0}
            assert all(s["pinned"] == 0 and s["groups"] == 0 for s in bal.servers())
            assert bal.group_home("g0") is None  # evicted: the oldest idle group goes first
            assert bal.group_home("g49") is not None


async def test_a_straggler_of_an_ended_group_goes_back_to_its_home() -> None:
    async with SGLangDouble() as a, VLLMDouble() as b:
        async with LLMBalancer(health_interval_s=0) as bal:
            bal.add(a.url)
            bal.add(b.url)
            home = (await bal.generate(PROMPT, SHORT, trajectory_id="g-0", group_id="g")).server
            bal.release("g-0")
            assert bal.group_counts() == {"live": 0, "idle": 1, "trajectories": 0}
            others, stragglers = set(), set()
            for i in range(4):  # other groups' first requests land on both servers (ties rotate)...
                others.add(
                    (await bal.generate(PROMPT, SHORT, trajectory_id=f"o{i}", group_id=f"o{i}")).server
                )
                res = await bal.generate(PROMPT, SHORT, trajectory_id=f"g-{i + 1}", group_id="g")
                stragglers.add(res.server)  # ...while the ended group's stragglers go home
                bal.release(f"g-{i + 1}")
            assert others == {a.url, b.url}
            assert stragglers == {home}


async def test_a_group_moves_when_its_home_is_removed_or_dies() -> None:
    async with VLLMDouble() as c:
        async with LLMBalancer(health_interval_s=0, retries=0) as bal:
            async with SGLangDouble() as a, VLLMDouble() as b:
                bal.add(a.url)
                bal.add(b.url)
                home = (await bal.generate(PROMPT, SHORT, trajectory_id="t0", group_id="g")).server
                bal.remove(home)
                rest = ({a.url, b.url} - {home}).pop()
                assert (await bal.generate(PROMPT, SHORT, trajectory_id="t1", group_id="g")).server == rest
                assert bal.group_home("g") == rest
                assert (await bal.generate(PROMPT, SHORT, trajectory_id="t0", group_id="g")).server == rest
            bal.add(c.url)
            # The home is down now (its server stopped): the next sample fails over and the group moves.
            res = await bal.generate(PROMPT, SHORT, trajectory_id="t2", group_id="g")
            assert res.server == c.url and bal.group_home("g") == c.url
            assert {s["address"]: s["healthy"] for s in bal.servers()} == {rest: False, c.url: True}


async def test_weight_sync_pause_holds_group_requests_and_they_go_home_after_resume() -> None:
    async with HeldVLLM(hold={"/v1/completions"}) as a, HeldVLLM(hold={"/v1/completions"}) as b:
        async with LLMBalancer(health_interval_s=0, retries=0) as bal:
            bal.add(a.url, weight_version="v1")
            bal.add(b.url, weight_version="v1")
            first, home = await _start_held(bal, "s0", "g")
            pause = asyncio.create_task(bal.pause())
            late = asyncio.create_task(bal.generate(PROMPT, SHORT, trajectory_id="s1", group_id="g"))
            for _ in range(20):
                await asyncio.sleep(0.01)
            assert not pause.done() and not late.done() and bal.in_flight == 1
            a.release.set()
            b.release.set()
            await asyncio.wait_for(pause, 30)
            assert first.result().weight_version == "v1"  # type: ignore[attr-defined]
            assert not late.done() and sum(_in_flight(bal).values()) == 0
            bal.set_weight_version("v2")
            bal.resume()
            res = await asyncio.wait_for(late, 30)
            assert res.server == home and res.weight_version == "v2"


def test_routing_settings_are_validated_and_reach_the_service_config() -> None:
    with pytest.raises(ValidationError):
        RoutingConfig(mode="random")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        RoutingConfig(group_load_factor=0.5)
    with pytest.raises(ValidationError):
        RoutingConfig(idle_groups=-1)
    config = ServiceConfig.model_validate({"llm_routing": {"mode": "trajectory", "group_slack": 8}})
    assert config.llm_routing == RoutingConfig(mode="trajectory", group_slack=8)
    assert ServiceConfig().llm_routing.mode == "group"
    with pytest.raises(ValidationError):
        ServiceConfig.model_validate({"llm_routing": {"mode": "group", "bogus": 1}})


async def test_group_samples_share_a_real_llama_server_and_its_prefix_cache(
    llama_url: str, llama_url_b: str, smol: ChatTokenizer
) -> None:
    """Two real llama.cpp servers: each group's concurrent samples land on one server, the two groups on
    different ones, and a later sample of a group is served from its home's prefix cache."""
    prompts = {
        g: smol.conversation(
            [
                {
                    "role": "user",
                    "content": f"Problem {g}: " + " ".join(f"{g} fact {i} holds." for i in range(30)),
                }
            ]
        ).prompt_ids
        for g in ("alpha", "beta")
    }
    sampling = SamplingParams(max_tokens=4, seed=1)
    async with LLMBalancer(health_interval_s=0) as bal:
        bal.add(llama_url)
        bal.add(llama_url_b)
        results = await asyncio.gather(
            *(
                bal.generate(prompts[g], sampling, trajectory_id=f"{g}-{i}", group_id=g)
                for g in prompts
                for i in range(3)
            )
        )
        where = {g: {r.server for r in results[k * 3 : k * 3 + 3]} for k, g in enumerate(prompts)}
        assert all(len(s) == 1 for s in where.values()), where
        assert where["alpha"] != where["beta"]
        for g in prompts:
            late = await bal.generate(prompts[g], sampling, trajectory_id=f"{g}-late", group_id=g)
            assert {late.server} == where[g]
            assert (late.cached_tokens or 0) >= len(prompts[g]) - 1  # all but the token it must evaluate
        for tid in [f"{g}-{i}" for g in prompts for i in (0, 1, 2, "late")]:
            bal.release(tid)
        assert bal.group_counts() == {"live": 0, "idle": 2, "trajectories": 0}


async def test_the_service_builds_its_balancer_with_the_configured_routing(tmp_path: Path) -> None:
    routing = {"mode": "round_robin", "idle_groups": 3}
    svc = RolloutService(ServiceConfig(state_dir=tmp_path / "svc", llm_routing=routing, shutdown_grace_s=0.0))
    await svc.start()
    try:
        assert isinstance(svc.balancer, LLMBalancer)
        assert svc.balancer.routing == RoutingConfig(mode="round_robin", idle_groups=3)
    finally:
        await svc.shutdown()


def test_a_trajectory_id_reused_by_another_group_moves_without_leaking() -> None:
    """Callers that reuse trajectory IDs across groups (e.g. per-group sample indices) keep the bookkeeping
    bounded: the ID leaves its old group, which goes idle, and nothing outlives the releases."""
    homes = GroupHomes(idle_limit=2)
    homes.join("g1", "0")
    homes.set_home("g1", "http://a")
    homes.join("g2", "0")
    homes.set_home("g2", "http://b")
    assert homes.counts() == {"live": 1, "idle": 1, "trajectories": 1}
    assert homes.home("g1") == "http://a" and homes.home("g2") == "http://b"
    homes.leave("0")
    homes.leave("0")  # releasing twice is harmless
    assert homes.counts() == {"live": 0, "idle": 2, "trajectories": 0}
    homes.forget_address("http://a")
    assert homes.home("g1") is None and homes.counts()["idle"] == 1
