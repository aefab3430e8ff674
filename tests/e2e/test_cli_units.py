"""Pure pieces of the ``raas run`` driver: job construction, the summary, the sandbox choice."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import socket
from pathlib import Path

import pytest

from raas.api.app import listen_socket
from raas.cli.common import choose_sandbox
from raas.cli.run import make_jobs, report, summarize
from raas.core.jobs import JobRequest

pytestmark = pytest.mark.unit


def test_make_jobs_are_valid_requests_with_unique_ids() -> None:
    instances = [
        {"data_source": "math", "problem": f"p{i}", "answer": "1", "instance_id": f"weird id/{i}"}
        for i in range(3)
    ]
    jobs = make_jobs(instances, 2, "run-abc", {"temperature": 0.5}, 30.0)
    assert len(jobs) == 6 and len({j["job_id"] for j in jobs}) == 6
    for j in jobs:
        JobRequest.model_validate(j)  # the service's own request model accepts them
        assert j["sampling_params"] == {"temperature": 0.5} and j["timeout_s"] == 30.0


def _result(status: str, reward: float | None, run_s: float, kind: str | None = None) -> dict:
    return {
        "status": status,
        "reward": reward,
        "filter": reward is None,
        "error": {"stage": "run", "kind": kind, "message": "x"} if kind else None,
        "timing": {"queue_s": 0.0, "init_s": 0.1, "run_s": run_s, "eval_s": 0.01, "total_s": run_s + 0.2},
        "turns": [{}] * 2,
    }


def test_summary_counts_only_unfiltered_rewards() -> None:
    s = summarize(
        [
            _result("completed", 1.0, 1.0),
            _result("completed", 0.0, 3.0),
            _result("failed", None, 2.0, "llm_unavailable"),
            _result("timeout", None, 9.0, "timeout"),
        ]
    )
    assert s["jobs"] == 4 and s["scored"] == 2 and s["filtered"] == 2
    assert s["reward_mean"] == 0.5 and s["pass_rate"] == 0.5
    assert s["failures"] == {"run/llm_unavailable": 1, "run/timeout": 1}
    assert s["timing"]["run_s"]["max"] == 9.0 and s["timing"]["run_s"]["p50"] in (2.0, 3.0)
    empty = summarize([])
    assert empty["reward_mean"] is None and math.isnan(empty["timing"]["run_s"]["p50"])


def test_json_report_is_the_only_thing_on_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    summary = summarize([_result("completed", 1.0, 1.0), _result("failed", None, 2.0, "llm_unavailable")])
    summary["wall_s"] = 3.5
    report(summary, as_json=True)
    out, err = capsys.readouterr()
    assert json.loads(out) == json.loads(json.dumps(summary))  # one JSON document, nothing before or after
    assert "reward mean" in err and "run/llm_unavailable" in err  # the tables, on stderr
    report(summary, as_json=False)
    out, err = capsys.readouterr()
    assert "reward mean" in out and err == ""


def test_choose_sandbox(test_image: Path) -> None:
    assert choose_sandbox("local", None) == {"backend": "local"}
    assert choose_sandbox("auto", str(test_image)) == {"backend": "bwrap", "image": str(test_image)}
    assert choose_sandbox("apptainer", str(test_image)) == {"backend": "apptainer", "image": str(test_image)}
    # The math image is the test image (same packages): auto picks bwrap with it, already built.
    expected = (
        {"backend": "bwrap", "image": str(test_image)} if shutil.which("bwrap") else {"backend": "local"}
    )
    assert choose_sandbox("auto", None) == expected


async def _nodelay_of_accepted(sock: socket.socket) -> int:
    """TCP_NODELAY of the server side of one connection asyncio accepts on ``sock``."""
    accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = writer.get_extra_info("socket")
        accepted.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()
        await writer.wait_closed()

    server = await asyncio.start_server(on_connect, sock=sock)
    try:
        _, writer = await asyncio.open_connection(*sock.getsockname())
        value = await asyncio.wait_for(accepted, 30)
        writer.close()
        await writer.wait_closed()
    finally:
        server.close()
        await server.wait_closed()
    return value


async def test_the_in_process_service_socket_gets_tcp_nodelay_connections() -> None:
    """asyncio turns Nagle off only on connections of a listening socket created as IPPROTO_TCP."""
    assert await _nodelay_of_accepted(listen_socket()) != 0
    plain = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # what the service used to bind
    plain.bind(("127.0.0.1", 0))
    assert await _nodelay_of_accepted(plain) == 0  # the check above can tell the difference
