"""Restarts resume what they can, checked on a real service process (``python -m raas.api``) and a real
scripted inference server process, with the ledger on disk read as it was committed (no mocks):

* a job killed inside EVAL (SIGKILL, or a graceful SIGTERM) resumes at EVAL with its committed RUN output:
  graded, token-exact against what the inference server sampled, and never generating again (the
  inference server is gone by then, so any new generate call would fail the job);
* jobs killed before RUN (queued, in INIT) run again in their old order and with their priorities, and a
  request with ``resume_on_restart: false`` is failed ``interrupted`` as before;
* an external rollout whose close was answered ``200`` just before a SIGKILL resumes at EVAL and is graded,
  with the turns the agent's requests generated;

and no sandbox process survives any of it.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from raas.llm.models import prepare_tokenizer
from raas.sandbox import procs
from tests.api.test_restart import REPO, ServiceProcess, free_port, sandbox_ids

pytestmark = pytest.mark.e2e

SAMPLED_TOKENS = 5  # the scripted server's completion: token 42 five times, logprob -0.25 each


class Service(ServiceProcess):
    """``python -m raas.api`` with the test handler, an inference server and (optionally) a tokenizer."""

    def __init__(self, state: Path, port: int, llm: str, tokenizer: Path | None = None) -> None:
        super().__init__(state, port)
        self.llm = llm
        self.tokenizer = tokenizer

    def command(self) -> list[str]:
        tokenizer = ["--tokenizer-dir", str(self.tokenizer)] if self.tokenizer is not None else []
        return [*super().command(), "--llm", self.llm, *tokenizer]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def llm() -> Iterator[subprocess.Popen[str]]:
    """The scripted inference server as a process of its own (killed by the tests before a restart)."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.doubles.scripted_llm",
            "--port",
            str(port),
            "--tokens",
            str(SAMPLED_TOKENS),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and "SCRIPTED_LLM_READY" in proc.stdout.readline()
    proc.args = f"http://127.0.0.1:{port}"  # type: ignore[assignment]  # where the tests find its URL
    yield proc
    proc.kill()
    proc.wait()


def ledger_rows(state: Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    db = sqlite3.connect(f"file:{state / 'ledger.sqlite3'}?mode=ro", uri=True, timeout=10)
    try:
        return db.execute(sql, args).fetchall()
    finally:
        db.close()


def wait_for(predicate: Any, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def durable(state: Path, job_id: str) -> str | None:
    rows = ledger_rows(state, "SELECT status FROM jobs WHERE job_id=?", job_id)
    return rows[0][0] if rows else None


def gate(marker: Path) -> dict[str, Any]:
    """A stage script that opens a sandbox and waits (in it) until the test creates ``marker``."""
    return {"sandbox": True, "bash": f"test -f {marker} || sleep 600", "bash_timeout": 700}


def assert_no_sandbox_left(state: Path, ids: set[str]) -> None:
    for sid in ids:
        assert procs.pids_with_env(sid) == [], "a sandbox process outlived the crash and the restart"


@pytest.mark.parametrize(
    ("sig", "twice"),
    [(signal.SIGKILL, False), (signal.SIGTERM, False), (signal.SIGKILL, True)],
    ids=["sigkill", "sigterm", "sigkill-again-while-restarting"],
)
def test_a_job_stopped_inside_eval_resumes_at_eval_and_never_generates_again(
    tmp_path: Path, llm: subprocess.Popen[str], sig: int, twice: bool
) -> None:
    state, marker = tmp_path / "state", tmp_path / "eval-may-finish"
    svc = Service(state, free_port(), str(llm.args))
    svc.start()
    try:
        with httpx.Client(base_url=svc.url, timeout=60) as client:
            instance = {"data_source": "test.script", "run": {"generate": [5, 6, 7], "max_tokens": 5}}
            instance["eval"] = {**gate(marker), "reward": 0.75}
            r = client.post("/v1/jobs", json={"job_id": "graded", "instance": instance})
            assert r.status_code == 202, r.text
            wait_for(lambda: durable(state, "graded") == "eval", "the job did not reach EVAL")
            ids = sandbox_ids(state)
        [(body,)] = ledger_rows(state, "SELECT body FROM checkpoints WHERE job_id='graded' AND stage='run'")
        committed = json.loads(body)["run_output"]
        sampled = committed["turns"][0]
        assert (
            sampled["output_ids"] == [42] * SAMPLED_TOKENS and sampled["logprobs"] == [-0.25] * SAMPLED_TOKENS
        )
        svc.kill(sig)
        llm.kill()  # nothing may generate after the restart
        llm.wait()
        if twice:  # killed again while it starts (importing, opening the ledger, recovering)
            svc.start(wait=False)
            time.sleep(1.5)
            svc.kill(signal.SIGKILL)
        marker.touch()
        svc.start()
        with httpx.Client(base_url=svc.url, timeout=60) as client:
            res = client.get("/v1/jobs/graded/result", params={"wait": 60}).json()
        assert res["status"] == "completed" and res["reward"] == 0.75, res
        assert res["timing"]["resumed_at"] == "eval"
        assert res["timing"]["run_s"] > 0  # RUN's time kept from before the restart
        assert res["token_trajectory"] == committed["token_trajectory"]
        assert res["turns"] == committed["turns"]  # token-exact: ids, logprobs, versions as sampled
        trail = ledger_rows(
            state, "SELECT status, detail FROM transitions WHERE job_id='graded' ORDER BY seq"
        )
        statuses = [s for s, _ in trail]
        assert statuses.count("run") == 1 and statuses.count("init") == 1  # generated once, set up once
        assert any("resumes at EVAL" in (d or "") or "resumed at EVAL" in (d or "") for _, d in trail)
        assert_no_sandbox_left(state, ids)
    finally:
        svc.stop()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_jobs_that_had_not_generated_run_again_in_their_place(
    tmp_path: Path, llm: subprocess.Popen[str], sig: int
) -> None:
    state, marker = tmp_path / "state", tmp_path / "init-may-finish"
    svc = Service(state, free_port(), str(llm.args))
    svc.start()
    order = ["busy-0", "busy-1", "low-a", "high", "low-b", "optout"]
    try:
        with httpx.Client(base_url=svc.url, timeout=60) as client:

            def submit(job_id: str, **request: Any) -> None:
                instance = {"data_source": "test.script", "init": gate(marker), "run": {"generate": [1]}}
                r = client.post("/v1/jobs", json={"job_id": job_id, "instance": instance, **request})
                assert r.status_code == 202, r.text

            submit("busy-0")
            submit("busy-1")  # the two INIT workers are now held
            wait_for(lambda: durable(state, "busy-1") == "init", "INIT did not start")
            submit("low-a")
            submit("high", priority=5)
            submit("low-b")
            submit("optout", resume_on_restart=False)
            assert {client.get(f"/v1/jobs/{j}").json()["status"] for j in order[2:]} == {"queued"}
            ids = sandbox_ids(state)
        svc.kill(sig)
        marker.touch()
        svc.start()
        with httpx.Client(base_url=svc.url, timeout=60) as client:
            results = {j: client.get(f"/v1/jobs/{j}/result", params={"wait": 60}).json() for j in order}
            attempts = {j: client.get(f"/v1/jobs/{j}").json()["attempts"] for j in order[:-1]}
        for job_id in order[:-1]:
            res = results[job_id]
            assert res["status"] == "completed" and res["reward"] == 1.0, (job_id, res)
            assert res["timing"]["resumed_at"] == "init"
        assert set(attempts.values()) == {1}
        # after the restart INIT took them by priority, then in their old order
        started = {
            j: ledger_rows(state, "SELECT MAX(at) FROM transitions WHERE job_id=? AND status='init'", j)[0][0]
            for j in order[:-1]
        }
        assert sorted(order[:-1], key=lambda j: started[j]) == ["busy-0", "busy-1", "high", "low-a", "low-b"]
        opted = results["optout"]
        assert (
            opted["status"] == "failed"
            and opted["error"]["kind"] == "interrupted"
            and opted["reward"] is None
        )
        assert_no_sandbox_left(state, ids)
    finally:
        svc.stop()


def test_a_close_answered_200_then_sigkill_is_graded_after_the_restart(
    tmp_path: Path, llm: subprocess.Popen[str]
) -> None:
    state, marker = tmp_path / "state", tmp_path / "eval-may-finish"
    svc = Service(state, free_port(), str(llm.args), tokenizer=prepare_tokenizer())
    svc.start()
    try:
        with httpx.Client(base_url=svc.url, timeout=60) as client:
            instance = {"data_source": "test.script", "eval": {**gate(marker), "reward": 1.0}}
            opened = client.post("/v1/gateway/rollouts", json={"instance": instance})
            assert opened.status_code == 201, opened.text
            rollout = opened.json()
            key = {"Authorization": f"Bearer {rollout['key']}"}
            reply = client.post(
                rollout["openai_base_url"] + "/chat/completions",
                json={"model": rollout["model"], "messages": [{"role": "user", "content": "hi"}]},
                headers=key,
            )
            assert reply.status_code == 200, reply.text
            closed = client.post(rollout["close_url"], json={"answer": "42"}, headers=key)
            assert closed.status_code == 200 and closed.json()["status"] == "closed", closed.text
        svc.kill(signal.SIGKILL)  # at once: the close's answer is all the agent has
        ids = sandbox_ids(state)
        llm.kill()
        llm.wait()
        marker.touch()
        svc.start()
        with httpx.Client(base_url=svc.url, timeout=60) as client:
            res = client.get(f"/v1/jobs/{rollout['job_id']}/result", params={"wait": 60}).json()
        assert res["status"] == "completed" and res["reward"] == 1.0, res
        assert res["timing"]["resumed_at"] == "eval"
        [turn] = res["turns"]
        assert turn["output_ids"] == [42] * SAMPLED_TOKENS and turn["logprobs"] == [-0.25] * SAMPLED_TOKENS
        assert res["artifacts"]["external"]["closed"] is True
        assert_no_sandbox_left(state, ids)
    finally:
        svc.stop()


class TurnServer:
    """``tests.doubles.turn_llm`` as a process: completions ``start..`` of ``script``, blocking at
    ``hold_at``, each request logged."""

    def __init__(self, script: Path, log: Path, *, start: int = 0, hold_at: int | None = None) -> None:
        port = free_port()
        cmd = [sys.executable, "-m", "tests.doubles.turn_llm", "--port", str(port), "--script", str(script)]
        cmd += ["--start", str(start), "--log", str(log)]
        if hold_at is not None:
            cmd += ["--hold-at", str(hold_at)]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and "SCRIPTED_LLM_READY" in self.proc.stdout.readline()
        self.url = f"http://127.0.0.1:{port}"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def scripted_turns(tmp_path: Path, texts: list[str]) -> tuple[Path, list[dict[str, Any]]]:
    """The policy's turns as completions of the embedded tokenizer (each ending in EOS, distinct
    logprobs so a mix-up shows), written where :class:`TurnServer` reads them."""
    from raas.llm.tokenizer import ChatTokenizer
    from tests.agent.scripted import completions

    tok = ChatTokenizer.from_pretrained(prepare_tokenizer())
    script = [{"token_ids": c.token_ids, "logprobs": c.logprobs} for c in completions(tok, texts)]
    path = tmp_path / "script.json"
    path.write_text(json.dumps(script))
    return path, script


def requests_of(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def committed_turn_count(state: Path, job_id: str) -> int:
    return len(ledger_rows(state, "SELECT 1 FROM checkpoints WHERE job_id=? AND stage LIKE 'turn:%'", job_id))


MATH_EDITS = {"data_source": "math", "problem": "Edit mod.py so that x is 3, then answer x.", "answer": "3"}


def stopped_after_two_turns(
    tmp_path: Path, texts: list[str], sig: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A math job whose policy says ``texts``: the service is stopped (``sig``) while the job waits for
    turn 2 (turns 0 and 1 committed), then started again beside a fresh server that answers from turn 2
    on. Returns the job's result and the script; no sandbox may outlive the stop."""
    script_path, script = scripted_turns(tmp_path, texts)
    state = tmp_path / "state"
    first = TurnServer(script_path, tmp_path / "llm-1.log", hold_at=2)
    svc = Service(state, free_port(), first.url, tokenizer=prepare_tokenizer())
    second: TurnServer | None = None
    try:
        svc.start()
        with httpx.Client(base_url=svc.url, timeout=60) as client:
            r = client.post("/v1/jobs", json={"job_id": "job", "instance": MATH_EDITS})
            assert r.status_code == 202, r.text
            wait_for(lambda: committed_turn_count(state, "job") == 2, "two turns were not committed")
            wait_for(lambda: len(requests_of(tmp_path / "llm-1.log")) == 3, "turn 2 was not asked for")
            ids = sandbox_ids(state)
        svc.kill(sig)
        first.kill()
        second = TurnServer(script_path, tmp_path / "llm-2.log", start=2)
        svc.llm = second.url
        svc.start()
        with httpx.Client(base_url=svc.url, timeout=60) as client:
            res: dict[str, Any] = client.get("/v1/jobs/job/result", params={"wait": 90}).json()
        assert_no_sandbox_left(state, ids)
        return res, script
    finally:
        svc.stop()
        first.kill()
        if second is not None:
            second.kill()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_a_job_stopped_in_run_after_turn_k_replays_its_turns_and_samples_on(tmp_path: Path, sig: int) -> None:
    """Two committed turns edit a file; the service stops while the job waits for turn 2. After the
    restart a fresh INIT, the two tool calls executed again (their observations equal the committed
    ones), and sampling goes on at turn 2 on the exact committed prefix: the file edits are there, and
    the result is token-exact against what the two server processes sampled."""
    from tests.agent.scripted import tool_call

    texts = [
        tool_call("bash", command="printf 'x = 1\\n' > mod.py && cat mod.py"),
        tool_call("bash", command="sed -i 's/1/3/' mod.py && cat mod.py"),
        tool_call("bash", command="cat mod.py"),
        tool_call("finish", answer="3"),
    ]
    res, script = stopped_after_two_turns(tmp_path, texts, sig)
    assert res["status"] == "completed" and res["reward"] == 1.0, res.get("error")
    assert res["timing"]["resumed_at"] == "run"
    assert res["artifacts"]["resumed"] == {"replayed_turns": 2, "committed_turns": 2}
    assert [t["output_ids"] for t in res["turns"]] == [c["token_ids"] for c in script]
    assert [t["logprobs"] for t in res["turns"]] == [c["logprobs"] for c in script]
    # the restarted server sampled turns 2 and 3 only, turn 2 on exactly the committed prefix
    asked = requests_of(tmp_path / "llm-2.log")
    assert [a["completion"] for a in asked] == [2, 3]
    assert asked[0]["prompt_ids"] == requests_of(tmp_path / "llm-1.log")[2]["prompt_ids"]
    # the replayed edits rebuilt the file: turn 2's observation reads it
    tools = [m["content"] for m in res["messages"] if m["role"] == "tool"]
    assert tools[1].startswith("x = 3\n") and tools[2].startswith("x = 3\n"), tools
    flat = res["token_trajectory"]
    sampled = [t for c in script for t in c["token_ids"]]
    assert [t for t, m in zip(flat["response_ids"], flat["loss_mask"], strict=True) if m] == sampled


def test_a_replay_whose_tool_answers_differently_is_filtered_as_diverged(tmp_path: Path) -> None:
    from tests.agent.scripted import tool_call

    texts = [
        tool_call("bash", command="date +%s%N"),  # another answer every time it runs
        tool_call("bash", command="echo next"),
        tool_call("finish", answer="3"),
    ]
    res, _ = stopped_after_two_turns(tmp_path, texts, signal.SIGKILL)
    assert res["status"] == "failed" and res["reward"] is None and res["filter"] is True
    assert res["error"]["kind"] == "replay_diverged" and res["error"]["stage"] == "run", res["error"]
    assert requests_of(tmp_path / "llm-2.log") == []  # nothing sampled on a diverged history
