"""The trajectory inspector in a real headless Chromium (as the dashboard's browser test): ``raas view``'s
app on a results file — list → filter → open a job → the token view shows the right counts of sampled and
masked tokens of a known multi-turn result; and a result whose model and tool output carry markup
(``<script>``, ``<img onerror>``, a ``javascript:`` link) and a 5 MB observation is shown as text, with
no script run, no dialog, no element made from it."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI

from raas.api import inspector, train_view
from raas.api.inspector_data import FileJobs
from raas.core.jobs import ErrorInfo, JobResult
from raas.core.trajectory import Message, ToolCall
from tests.api import test_dashboard_browser as dashboard_browser
from tests.api.conftest import serving
from tests.trainer.test_grpo import result

pytestmark = pytest.mark.e2e

browser_page = dashboard_browser.browser_page  # the dashboard test's headless Chromium (a fixture)
WAIT_MS = dashboard_browser.WAIT_MS

DOCS_IMG = Path(__file__).resolve().parents[2] / "docs" / "img"
ATTACK = '<script>alert("x")</script><img src=x onerror="alert(1)"><a href="javascript:alert(2)">click</a>'


def decode(ids: list[int]) -> str:
    return f"<b>{ids[0]}</b>" if ids[0] == 7 else f"[{ids[0]}]"  # markup in a decoded token too


def results(tmp_path: Path) -> Path:
    known = result("grp.0.0", 1.0, [1, 2, 3], [([5, 6], "0"), ([7, 8, 10], "1")], obs=[9, 9, 9, 9])
    known.messages = [
        Message(role="user", content="what is in answer.txt?"),
        Message(
            role="assistant",
            content="",
            tool_calls=[ToolCall(id="c1", name="bash", arguments={"command": "cat answer.txt"})],
        ),
        Message(role="tool", content="1721", tool_call_id="c1"),
        Message(role="assistant", content="1721"),
    ]
    hostile = result("grp.1.0", 0.0, [1], [([5], "0"), ([6], "0")])
    hostile.messages = [
        Message(
            role="assistant",
            content=ATTACK,
            tool_calls=[ToolCall(id="c", name="bash", arguments={"command": ATTACK})],
        ),
        Message(role="tool", content=ATTACK + "y" * 5_000_000, tool_call_id="c"),
    ]
    hostile.artifacts = {"git_patch": ATTACK}
    failed = JobResult(
        job_id="other.0.0",
        status="failed",
        filter=True,
        error=ErrorInfo(stage="init", kind="sandbox_start", message=ATTACK),
    )
    path = tmp_path / "results.jsonl"
    path.write_text("".join(r.model_dump_json() + "\n" for r in (known, hostile, failed)))
    return path


@pytest.fixture
async def viewer(tmp_path: Path) -> AsyncIterator[str]:
    """``raas view``'s app (the inspector on a results file) on a free loopback port."""
    app = FastAPI()
    inspector.install(app, FileJobs(results(tmp_path)), lambda: decode)
    async with serving(app) as url:
        yield url


async def rows_are(page: Any, n: int) -> None:
    """The list shows ``n`` jobs (waited for without evaluating a script: the page's CSP forbids eval)."""
    from playwright.async_api import expect

    await expect(page.locator("#jobs tbody tr.job-row")).to_have_count(n, timeout=WAIT_MS)


async def test_list_filter_open_and_the_token_view_counts(
    viewer: str, browser_page: tuple[Any, list[str]]
) -> None:
    page, problems = browser_page
    await page.goto(f"{viewer}/dashboard/jobs")
    await page.wait_for_selector("#jobs tbody tr.job-row", timeout=WAIT_MS)
    assert await page.locator("#jobs tbody tr.job-row").count() == 3
    await page.select_option("select[name=status]", "failed")
    await page.click("#apply")
    await rows_are(page, 1)
    assert await page.text_content("#jobs tbody tr td:first-child") == "other.0.0"
    await page.select_option("select[name=status]", "")
    await page.fill("input[name=group]", "grp")
    await page.click("#apply")
    await rows_are(page, 2)
    assert "group=grp" in page.url  # the filter is in the page's address, to share or reload

    await page.click("text=grp.0.0")
    await page.wait_for_selector("#tokens .tok", timeout=WAIT_MS)
    # prompt 3 tokens; response: turn 0's 2 sampled, 4 observation tokens, turn 1's 3 sampled
    assert await page.locator("#tokens .tok.m1").count() == 5
    assert await page.locator("#tokens .tok.m0").count() == 3 + 4
    assert await page.text_content("#token-counts") == "3 prompt, 5 sampled, 4 masked response tokens"
    assert await page.locator("#tokens .tok.turn-start").count() == 2
    assert "version 0" in await page.text_content("#turns") and "version 1" in await page.text_content(
        "#turns"
    )
    assert await page.text_content("#tokens .tok[data-turn='1'].m1 >> nth=0") == "<b>7</b>"  # text, not bold
    assert await page.locator("#tokens b").count() == 0
    assert await page.locator("#messages .msg").count() == 4
    assert "cat answer.txt" in await page.text_content("#messages .msg.assistant .call")
    raw = await page.get_attribute("#raw", "href")
    assert raw == "/dashboard/api/jobs/grp.0.0/raw"
    assert problems == []
    if os.environ.get("RAAS_SCREENSHOTS"):  # docs/operations.md's pictures, made from this very page
        await page.screenshot(path=str(DOCS_IMG / "inspector-job.png"), full_page=True)
        await page.locator("#tokens-box").screenshot(path=str(DOCS_IMG / "inspector-tokens.png"))


async def test_markup_in_a_rollout_is_shown_as_text_never_run(
    viewer: str, browser_page: tuple[Any, list[str]]
) -> None:
    page, problems = browser_page
    await page.goto(f"{viewer}/dashboard/jobs/grp.1.0")
    await page.wait_for_selector("#messages .msg.tool", timeout=WAIT_MS)
    assistant = await page.text_content("#messages .msg.assistant pre")
    assert assistant == ATTACK
    tool = page.locator("#messages .msg.tool")
    assert (await tool.locator("pre").text_content()).startswith(ATTACK)
    assert "more characters not shown" in await tool.locator(".cut").text_content()  # 5 MB: cut, said
    assert await page.text_content("#eval .artifact pre") == ATTACK  # the patch as it is
    for selector in (
        "main script",
        "main img",
        "main a[href^='javascript']",
        "#messages a",
        "#eval img, #eval script, #eval a",
    ):
        assert await page.locator(selector).count() == 0, selector

    await page.goto(f"{viewer}/dashboard/jobs?status=failed")
    await page.wait_for_selector("#jobs tbody tr.job-row", timeout=WAIT_MS)
    assert ATTACK in await page.text_content("#jobs td.failure")
    assert await page.locator("#jobs img, #jobs script").count() == 0
    await page.goto(f"{viewer}/dashboard/jobs/other.0.0")
    await page.wait_for_selector("#failure-box:not([hidden])", timeout=WAIT_MS)
    assert ATTACK in await page.text_content("#failure")
    await asyncio.sleep(0.5)  # any handler markup could have planted would have fired by now
    assert problems == []


@pytest.fixture
async def train_viewer(tmp_path: Path) -> AsyncIterator[tuple[str, Path]]:
    """``raas view``'s training view on a ``train.jsonl`` the test writes as a run would."""
    log = tmp_path / "train.jsonl"
    app = FastAPI()
    train_view.install(app, log)
    async with serving(app) as url:
        yield url, log


def step_row(step: int, reward: float) -> str:
    row = {"kind": "step", "step": step, "reward_mean": reward, "informative_fraction": 0.5, "wait_s": 3.0,
           "train_s": 2.0, "sync_s": 0.5, "logprob_abs_diff_mean": 0.0002, "rollouts": 16, "rss_mb": 2000.0}  # fmt: skip
    return json.dumps(row) + "\n"


async def test_the_training_view_follows_the_log_as_the_run_writes_it(
    train_viewer: tuple[str, Path], browser_page: tuple[Any, list[str]]
) -> None:
    from playwright.async_api import expect

    url, log = train_viewer
    page, problems = browser_page
    await page.goto(f"{url}/dashboard/train")  # before the run's first line: the page waits for it
    await expect(page.locator("#state")).to_have_text("following", timeout=WAIT_MS)
    log.write_text(json.dumps({"kind": "eval", "step": 0, "pass_rate": 0.25}) + "\n" + step_row(1, 0.1))
    await expect(page.locator("#log tbody tr.log-row")).to_have_count(2, timeout=WAIT_MS)
    with log.open("a") as f:
        f.write(step_row(2, 0.4))
        f.write('{"kind": "<img src=x onerror=alert(1)>", "step": 3')  # a line still being written
    await expect(page.locator("#log tbody tr.log-row")).to_have_count(3, timeout=WAIT_MS)
    with log.open("a") as f:
        f.write(', "pass_rate": 0.5}\n')
    await expect(page.locator("#log tbody tr.log-row")).to_have_count(4, timeout=WAIT_MS)
    assert await page.text_content("#steps") == "2" and await page.text_content("#evals") == "1"
    assert len((await page.get_attribute("#chart-reward polyline", "points")).split()) == 2
    assert await page.text_content("#last-reward") == "0.400"
    assert await page.locator("#chart-time polyline").count() == 3  # wait, train, sync
    assert (
        await page.text_content("#log tbody tr:first-child td:nth-child(2)") == "<img src=x onerror=alert(1)>"
    )
    assert await page.locator("main img").count() == 0
    await asyncio.sleep(0.5)
    assert problems == []


async def test_a_step_links_to_the_jobs_it_trained_on_with_their_advantages(
    tmp_path: Path, browser_page: tuple[Any, list[str]]
) -> None:
    """``raas view OUT`` of a training run in progress: the results file the trainer appends to per step
    (:class:`~raas.trainer.train_log.TrainedResults`) and its ``train.jsonl``; a step links to the jobs it
    trained on, listed with the advantage each was trained with, including a step written after the page
    opened."""
    from playwright.async_api import expect

    from raas.trainer.train_log import TrainedResults
    from raas.trainer.types import Group

    def group(gid: str, rewards: list[float]) -> Group:
        g = Group(group_id=gid, instance={}, size=len(rewards))
        for i, x in enumerate(rewards):
            g.results[i] = result(f"{gid}.{i}.0", x, [1], [([5], "0")])
        return g

    trained = TrainedResults(tmp_path / "results.jsonl")
    log = tmp_path / "train.jsonl"
    trained.write(1, [group("a", [1.0, 0.0]), group("b", [1.0, 1.0, 0.0, 0.0])])
    log.write_text(step_row(1, 0.5))
    app = FastAPI()
    inspector.install(app, FileJobs(trained.path), lambda: decode)
    train_view.install(app, log, jobs=True)
    page, problems = browser_page
    async with serving(app) as url:
        await page.goto(f"{url}/dashboard/train")
        await expect(page.locator("#log a.step-jobs")).to_have_count(1, timeout=WAIT_MS)
        assert trained.write(2, [group("c", [0.0, 1.0, 1.0])]) == 3
        with log.open("a") as f:
            f.write(step_row(2, 0.7))
        await expect(page.locator("#log a.step-jobs")).to_have_count(2, timeout=WAIT_MS)
        await page.click("#log a.step-jobs >> text='2'")
        await rows_are(page, 3)
        assert "step=2" in page.url
        cells = page.locator("#jobs tbody tr.job-row td:nth-child(8)")  # the advantage column
        assert sorted(await cells.all_text_contents()) == ["-0.667", "0.333", "0.333"]
        await page.goto(f"{url}/dashboard/jobs?step=1")
        await rows_are(page, 6)
    trained.close()
    assert problems == []
