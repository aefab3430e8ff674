"""The dashboard in a real headless Chromium (Debian's ``chromium`` package driven by playwright, no browser
download): the login, live numbers that change as jobs run, job errors that cannot inject markup, and the
per-node table a router's source fills.

CI installs chromium (.ci/run) and sets RAAS_CI: there a missing browser fails the test. Elsewhere the
test is skipped, saying what to install."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from raas.api import dashboard
from raas.api.dashboard_stats import ServiceStats
from raas.api.middleware import GuardMiddleware
from raas.core.jobs import JobEvent
from raas.pipeline.events import EventBus
from tests.api.conftest import APIFactory, serving
from tests.doubles.scripted_llm import ScriptedLLM, fixed

pytestmark = pytest.mark.e2e

CHROMIUM = os.environ.get("RAAS_CHROMIUM", "/usr/bin/chromium")
TOKEN = "browser-s3cret"
WAIT_MS = 30_000


def _need_browser() -> Any:
    """playwright's ``async_playwright`` and a runnable chromium, or a skip (a failure in CI)."""
    problem = None
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        problem = "the playwright package is not installed (pip install -e '.[dev]')"
    if problem is None and not os.access(CHROMIUM, os.X_OK):
        problem = f"{CHROMIUM} is missing (apt-get install chromium)"
    if problem is not None:
        if os.environ.get("RAAS_CI"):
            pytest.fail(f"CI must run the dashboard in a browser, but {problem}")
        pytest.skip(problem)
    return async_playwright


@pytest.fixture
async def browser_page() -> AsyncIterator[tuple[Any, list[str]]]:
    """A fresh page in headless Chromium, and the list of script errors and dialogs seen on it."""
    async_playwright = _need_browser()
    problems: list[str] = []
    async with async_playwright() as pw:
        # The page under test is our own; chromium's sandbox needs --no-sandbox when run as root (CI).
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = await browser.new_page()
            page.on("pageerror", lambda exc: problems.append(f"pageerror: {exc}"))

            def on_console(m: Any) -> None:
                # The sign-in page is answered with a 401 on purpose; any other error is a problem.
                if m.type == "error" and "status of 401" not in m.text:
                    problems.append(f"console: {m.text}")

            page.on("console", on_console)

            async def on_dialog(d: Any) -> None:
                problems.append(f"dialog: {d.message}")
                await d.dismiss()

            page.on("dialog", on_dialog)
            yield page, problems
        finally:
            await browser.close()


async def text_is(page: Any, selector: str, expected: str) -> None:
    await page.wait_for_function(
        "([s, e]) => { const el = document.querySelector(s); return !!el && el.textContent === e; }",
        arg=[selector, expected],
        timeout=WAIT_MS,
    )


async def test_dashboard_in_chromium_shows_live_numbers_that_follow_the_jobs(
    make_api: APIFactory, browser_page: tuple[Any, list[str]]
) -> None:
    page, problems = browser_page
    api = await make_api(api_token=TOKEN, run_workers=4)
    bearer = {"Authorization": f"Bearer {TOKEN}"}

    response = await page.goto(f"{api.url}/dashboard")
    assert response.status == 401  # no token: the login form, and nothing else
    assert await page.locator("#conn").count() == 0
    await page.fill("#token", "not-the-token")
    await page.click("#login")
    await page.wait_for_selector("text=Wrong token.", timeout=WAIT_MS)
    await page.fill("#token", TOKEN)
    await page.click("#login")
    await page.wait_for_selector('#conn[data-state="live"]', timeout=WAIT_MS)
    assert page.url == f"{api.url}/dashboard"  # the token never appears in a URL
    await text_is(page, "#finished-completed", "0")
    await text_is(page, "#stage-run-workers", "4")
    await text_is(page, "#sandboxes-live", "0")
    first_update = await page.text_content("#updated")

    async with ScriptedLLM(fixed(3)) as llm:
        r = await api.client.post("/v1/llm/servers", json={"address": llm.url}, headers=bearer)
        assert r.status_code == 200
        hold = {"data_source": "test.script", "init": {"sandbox": True}, "run": {"sleep": 120}}
        r = await api.client.post(
            "/v1/jobs:batch", json={"jobs": [{"instance": hold}, {"instance": hold}]}, headers=bearer
        )
        held = [j["job_id"] for j in r.json()["jobs"]]
        await text_is(page, "#stage-run-active", "2")
        await text_is(page, "#sandboxes-live", "2")
        assert await page.locator("#sandboxes tbody tr").count() == 2
        assert await page.text_content("#updated") != first_update  # new snapshots keep arriving

        rewards = [1.0, 0.0, 1.0, 0.0, 1.0]
        jobs = [
            {"instance": {"data_source": "test.script", "run": {"generate": [5, 6]}, "eval": {"reward": x}}}
            for x in rewards
        ]
        r = await api.client.post("/v1/jobs:batch", json={"jobs": jobs}, headers=bearer)
        assert r.status_code == 202
        await text_is(page, "#finished-completed", "5")
        await text_is(page, "#reward-mean", "0.600")
        await text_is(page, "#reward-count", "5")
        await text_is(page, "#servers tbody tr td:nth-child(5)", "5")  # requests to the one LLM server
        assert await page.text_content("#servers tbody tr td:first-child") == llm.url
        assert float(await page.text_content("#rollouts-per-s")) > 0
        assert await page.locator("#reward-hist rect.bar").count() == 10
        points = await page.get_attribute("#stage-chart polyline.s-run.active", "points")
        assert points is not None and len(points.split()) > 2, points

        for job_id in held:
            assert (await api.client.delete(f"/v1/jobs/{job_id}", headers=bearer)).status_code == 200
        await text_is(page, "#finished-cancelled", "2")
        await text_is(page, "#stage-run-active", "0")
        await text_is(page, "#sandboxes-live", "0")
    assert problems == []


XSS = '<img src=x onerror="window.__pwned=1;alert(1)"><script>window.__pwned=2</script>'
XSS_KIND = "<b id=kind-markup>tool_error</b>"
XSS_INSTANCE = '"><svg onload="window.__pwned=3"></svg>'


async def test_dashboard_in_chromium_shows_job_errors_as_text(
    make_api: APIFactory, browser_page: tuple[Any, list[str]]
) -> None:
    """An error message, error kind and instance id full of markup are shown as the text they are: no
    element is made from them and no script runs (checked in the DOM, not only by the CSP)."""
    page, problems = browser_page
    api = await make_api()
    await page.goto(f"{api.url}/dashboard")
    await page.wait_for_selector('#conn[data-state="live"]', timeout=WAIT_MS)
    instance = {
        "data_source": "test.script",
        "instance_id": XSS_INSTANCE,
        "run": {"raise": XSS, "kind": XSS_KIND},
    }
    assert (await api.client.post("/v1/jobs", json={"instance": instance})).status_code == 202
    await text_is(page, "#failures tbody tr td:nth-child(7)", XSS)
    row = page.locator("#failures tbody tr")
    assert await row.count() == 1
    assert await row.locator("td:nth-child(3)").text_content() == XSS_INSTANCE
    assert await row.locator("td:nth-child(6)").text_content() == XSS_KIND
    assert await page.text_content("#kinds tbody tr td:nth-child(2)") == XSS_KIND
    made = await page.evaluate(
        "document.querySelectorAll('main img, main script, main b, #failures svg, #kind-markup').length"
    )
    assert made == 0
    assert await page.evaluate("window.__pwned") is None
    await text_is(page, "#finished-failed", "1")
    assert problems == []


class RouterDouble:
    """The parts of a cluster router the dashboard reads (a test double): ``status()`` with its nodes, and
    its job events. It has no sandbox manager, balancer or job table of its own."""

    def __init__(self) -> None:
        self.bus = EventBus()

    def status(self) -> dict[str, Any]:
        return {
            "accepting": True,
            "pending": 7,
            "max_pending": 100,
            "stages": {"init": {"queued": 1, "active": 1, "workers": 8}},
            "finished": {"completed": 1},
            "llm_servers": [{"address": "http://10.0.0.9:8000", "nodes": ["node-a"]}],
            "llm_available": True,
            "llm_paused": False,
            "nodes": [
                {"node_id": "node-a", "url": "http://10.0.0.1:8008", "host": "10.0.0.1", "capacity": 16,
                 "jobs": 7, "load": 0.4375, "healthy": True, "llm_servers": ["http://10.0.0.9:8000"]},
                {"node_id": "node-b", "url": "http://10.0.0.2:8008", "host": "10.0.0.2", "capacity": 16,
                 "jobs": 0, "load": 0.0, "healthy": False, "llm_servers": [],
                 "error": "<i>unreachable</i> for 12 s"},
            ],
        }  # fmt: skip

    def events(self) -> contextlib.AbstractAsyncContextManager[Any]:
        return self.bus.subscribe()


@contextlib.asynccontextmanager
async def bare_app_with_dashboard(router: RouterDouble) -> AsyncIterator[str]:
    """The dashboard mounted on an app of its own, behind the API's guard, over a router's numbers."""
    app = FastAPI()
    stats = ServiceStats(router)
    await stats.start()
    dashboard.install(app, stats, lambda: TOKEN)
    app.add_middleware(GuardMiddleware, max_bytes=1 << 20, token=lambda: TOKEN)
    try:
        async with serving(app) as url:
            try:
                yield url
            finally:
                router.bus.close()  # what a router's shutdown does: the dashboard's streams end with its events
    finally:
        await stats.aclose()


async def test_dashboard_mounted_over_a_router_shows_its_nodes(browser_page: tuple[Any, list[str]]) -> None:
    page, problems = browser_page
    router = RouterDouble()
    async with bare_app_with_dashboard(router) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            assert (await client.get("/dashboard/snapshot")).status_code == 401
            r = await client.get("/dashboard/snapshot", headers={"Authorization": f"Bearer {TOKEN}"})
            snap = r.json()
            assert snap["sandboxes"] is None and snap["llm"]["in_flight"] == 0
            assert [n["node_id"] for n in snap["nodes"]] == ["node-a", "node-b"]
        await page.goto(f"{url}/dashboard")
        await page.fill("#token", TOKEN)
        await page.click("#login")
        await page.wait_for_selector('#conn[data-state="live"]', timeout=WAIT_MS)
        assert await page.is_visible("#nodes-panel")
        rows = page.locator("#nodes tbody tr")
        assert await rows.count() == 2
        assert await rows.nth(0).locator("td").all_text_contents() == [
            "node-a", "http://10.0.0.1:8008", "10.0.0.1", "yes", "7", "0.44", "16", "http://10.0.0.9:8000",
            "\u2013",
        ]  # fmt: skip
        assert await rows.nth(1).get_attribute("class") == "unhealthy"
        assert await rows.nth(1).locator("td:last-child").text_content() == "<i>unreachable</i> for 12 s"
        assert await page.evaluate("document.querySelectorAll('#nodes i').length") == 0
        # A job finishing on a node reaches the router's events, and the page's reward with it.
        router.bus.publish(JobEvent(job_id="j1", status="completed", at=time.time(), reward=0.25))
        await text_is(page, "#reward-mean", "0.250")
        await text_is(page, "#sandboxes-live", "\u2013")
    assert problems == []
