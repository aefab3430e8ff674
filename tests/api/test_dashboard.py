"""The dashboard over real HTTP: its auth (attacked), its numbers as jobs run, and its event streams'
lifetimes (bounded, released when the client leaves, ended by shutdown)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from raas.api.dashboard import COOKIE_NAME, Dashboard, session_value
from tests.api.conftest import APIFactory, LiveAPI, sse
from tests.doubles.scripted_llm import ScriptedLLM, fixed

pytestmark = pytest.mark.integration

TOKEN = "dash-s3cret-token"


def dashboard_of(api: LiveAPI) -> Dashboard:
    dashboard: Dashboard = api.served.uvicorn_config.app.state.dashboard  # type: ignore[attr-defined]
    return dashboard


async def until(check: Callable[[], Awaitable[bool]], what: str, limit_s: float = 30.0) -> None:
    """Poll ``check`` (the dashboard samples once a second) until it holds; fail after ``limit_s``."""
    deadline = asyncio.get_running_loop().time() + limit_s
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, f"not within {limit_s} s: {what}"
        await asyncio.sleep(0.1)


async def snapshot(api: LiveAPI, **kw: Any) -> dict[str, Any]:
    r = await api.client.get("/dashboard/snapshot", **kw)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


async def test_dashboard_refuses_without_the_token_and_never_shows_it(
    make_api: APIFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    api = await make_api(api_token=TOKEN)
    c = api.client
    bearer = {"Authorization": f"Bearer {TOKEN}"}

    page = await c.get("/dashboard")
    assert page.status_code == 401
    assert page.headers["content-type"].startswith("text/html")
    assert 'action="/dashboard/login"' in page.text and "name=token type=password" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    for path in ("/dashboard/events", "/dashboard/snapshot", "/dashboard/static/nope.js"):
        r = await c.get(path)
        assert r.status_code == 401, path
        assert r.json()["error"]["kind"] == "unauthorized"
        assert (await c.get(path, headers={"Authorization": "Bearer wrong"})).status_code == 401
    # The script and stylesheet are the same in every install: open, so the login form can be styled.
    assert (await c.get("/dashboard/static/dashboard.js")).status_code == 200
    assert (await c.get("/dashboard/static/nope.js", headers=bearer)).status_code == 404

    assert (await c.get("/dashboard", headers=bearer)).status_code == 200
    assert set((await snapshot(api, headers=bearer))["stages"]) == {"init", "run", "eval"}

    wrong = await c.post("/dashboard/login", data={"token": "guess"})
    assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
    assert "Wrong token" in wrong.text
    for odd in ({f"f{i}": "x" for i in range(50)} | {"token": TOKEN}, {}, {"token": ""}):
        r = await c.post("/dashboard/login", data=odd)
        assert r.status_code == 401 and "set-cookie" not in r.headers, odd
    r = await c.post(
        "/dashboard/login", content=b"\xff\xfe=%ZZ&token", headers={"content-type": "text/plain"}
    )
    assert r.status_code == 401 and "set-cookie" not in r.headers
    ok = await c.post("/dashboard/login", data={"token": TOKEN})
    assert ok.status_code == 303 and ok.headers["location"] == "/dashboard"
    set_cookie = ok.headers["set-cookie"]
    assert set_cookie.startswith(f"{COOKIE_NAME}={session_value(TOKEN)};")
    for attribute in ("HttpOnly", "SameSite=strict", "Path=/dashboard"):
        assert attribute.lower() in set_cookie.lower(), attribute
    assert TOKEN not in str(ok.headers)

    cookie = {"Cookie": f"{COOKIE_NAME}={session_value(TOKEN)}"}
    bare = httpx.AsyncClient(base_url=api.url, timeout=30)  # no cookie jar state from the login above
    try:
        assert (await bare.get("/dashboard", headers=cookie)).status_code == 200
        assert (await bare.get("/dashboard/snapshot", headers=cookie)).status_code == 200
        async with sse(bare, "/dashboard/events", headers=cookie) as events:
            name, _ = await anext(events)
            assert name == "history"
        # The cookie opens the dashboard's GETs and nothing else: not the API, not a write.
        assert (await bare.get("/status", headers=cookie)).status_code == 401
        assert (await bare.get("/v1/events", headers=cookie)).status_code == 401
        job = {"instance": {"data_source": "test.script"}}
        assert (await bare.post("/v1/jobs", json=job, headers=cookie)).status_code == 401
        # Nor is it the token: presented as a bearer token it is refused.
        as_bearer = {"Authorization": f"Bearer {session_value(TOKEN)}"}
        assert (await bare.get("/status", headers=as_bearer)).status_code == 401
        # A cookie minted for another token, or a mangled one, opens nothing.
        for forged in (session_value("other-token"), session_value(TOKEN)[:-1], TOKEN, ""):
            r = await bare.get("/dashboard/snapshot", headers={"Cookie": f"{COOKIE_NAME}={forged}"})
            assert r.status_code == 401, forged
    finally:
        await bare.aclose()
    assert api.service.table.finished_counts == {}, "a refused request submitted a job"
    leaked = [r for r in caplog.records if TOKEN in r.getMessage()]
    assert not leaked, f"the token was logged: {leaked}"


async def test_dashboard_login_without_a_token_configured_sets_no_cookie(make_api: APIFactory) -> None:
    api = await make_api()
    r = await api.client.post("/dashboard/login", data={"token": "anything"})
    assert r.status_code == 303 and "set-cookie" not in r.headers
    page = await api.client.get("/dashboard")
    assert page.status_code == 200 and 'src="/dashboard/static/dashboard.js"' in page.text


async def test_dashboard_snapshot_follows_the_jobs(make_api: APIFactory) -> None:
    """Queue depth, live sandboxes, finished counts, reward, failure kinds, recent failures and per-server
    LLM load, as jobs pass through a real service with a scripted policy server."""
    api = await make_api(run_workers=4)
    first = await snapshot(api)
    assert first["finished"] == {} and first["sandboxes"]["live"] == 0 and first["reward"]["count"] == 0
    assert set(first["stages"]) == {"init", "run", "eval"}

    async with ScriptedLLM(fixed(3)) as llm:
        r = await api.client.post("/v1/llm/servers", json={"address": llm.url})
        assert r.status_code == 200
        hold = {"data_source": "test.script", "init": {"sandbox": True}, "run": {"sleep": 60}}
        held = (await api.client.post("/v1/jobs", json={"instance": hold})).json()["job_id"]

        async def holding() -> bool:
            s = await snapshot(api)
            return s["stages"]["run"]["active"] == 1 and s["sandboxes"]["live"] == 1

        await until(holding, "the held job is in RUN with its sandbox")
        live = (await snapshot(api))["sandboxes"]["items"]
        assert [item["owner"] for item in live] == [held] and live[0]["backend"] == "local"

        jobs = [
            {
                "instance": {
                    "data_source": "test.script",
                    "run": {"generate": [1, 2]},
                    "eval": {"reward": 1.0},
                }
            },
            {"instance": {"data_source": "test.script", "eval": {"reward": 0.0}}},
            {"instance": {"data_source": "test.script", "eval": {"reward": 0.5}}},
            {
                "instance": {
                    "data_source": "test.script",
                    "instance_id": "broken-1",
                    "run": {"raise": "the tool broke", "kind": "tool_error"},
                }
            },
        ]
        r = await api.client.post("/v1/jobs:batch", json={"jobs": jobs})
        assert r.status_code == 202, r.text

        async def four_done() -> bool:
            return sum((await snapshot(api))["finished"].values()) == 4

        await until(four_done, "four jobs finished")
        s = await snapshot(api)
        assert s["finished"] == {"completed": 3, "failed": 1}
        assert s["reward"]["count"] == 3 and s["reward"]["mean"] == pytest.approx(0.5)
        assert s["reward"]["min"] == 0.0 and s["reward"]["max"] == 1.0
        assert sum(s["reward"]["histogram"]["counts"]) == 3
        assert s["failure_kinds"] == [{"stage": "run", "kind": "tool_error", "count": 1}]
        [failure] = s["recent_failures"]
        assert failure["instance_id"] == "broken-1" and failure["status"] == "failed"
        assert (failure["stage"], failure["kind"], failure["message"]) == (
            "run",
            "tool_error",
            "the tool broke",
        )
        assert s["throughput"]["rollouts_per_s"] > 0
        [server] = s["llm"]["servers"]
        assert server["address"] == llm.url and server["requests"] == 1 and server["failures"] == 0
        assert s["point"]["finished"] == 4 and s["point"]["active"]["run"] == 1

        await api.client.delete(f"/v1/jobs/{held}")

        async def released() -> bool:
            s = await snapshot(api)
            return s["sandboxes"]["live"] == 0 and s["finished"].get("cancelled") == 1

        await until(released, "the cancelled job's sandbox is gone from the dashboard")
        assert (await snapshot(api))["point"]["active"]["run"] == 0


async def test_a_dashboard_stream_that_loses_its_client_leaves_nothing_behind(make_api: APIFactory) -> None:
    api = await make_api()
    dashboard = dashboard_of(api)
    await snapshot(api)
    before = asyncio.all_tasks()
    client = httpx.AsyncClient(base_url=api.url, timeout=30)
    try:
        async with sse(client, "/dashboard/events") as events:
            assert (await anext(events))[0] == "history"
            assert (await anext(events))[0] == "snapshot"
            assert (await anext(events))[0] == "snapshot"  # the stream is live: one per interval
            assert dashboard.clients == 1
    finally:
        await client.aclose()  # the client goes away mid-stream

    async def released() -> bool:
        leftover = asyncio.all_tasks() - before - {asyncio.current_task()}
        return dashboard.clients == 0 and not leftover

    await until(released, "the stream's slot and tasks were released")


async def test_dashboard_streams_are_bounded_and_end_at_shutdown(make_api: APIFactory) -> None:
    api = await make_api()
    dashboard = dashboard_of(api)
    dashboard.max_clients = 2
    async with sse(api.client, "/dashboard/events") as one, sse(api.client, "/dashboard/events") as two:
        assert (await anext(one))[0] == "history" and (await anext(two))[0] == "history"
        third = await api.client.get("/dashboard/events")
        assert third.status_code == 503 and third.headers["retry-after"] == "5"
        assert third.json()["error"]["kind"] == "unavailable"
        # Shutdown begins: the event streams close, and the dashboard's end with them.
        api.service.close_event_streams()
        async with asyncio.timeout(30):
            rest = [name async for name, _ in one] + [name async for name, _ in two]
        assert set(rest) <= {"snapshot"}
    assert dashboard.clients == 0
