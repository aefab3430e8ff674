"""Property-based fuzzing of the published OpenAPI schema with schemathesis, every built-in check on.

The schema comes from the app itself; every generated request goes over HTTP to a live server (uvicorn on
a real socket with the settings ``raas serve`` uses, the service running in its own event loop on a
background thread) and its response is validated with all of schemathesis's checks: no 5xx, only
documented status codes, bodies and headers that match the schema (error bodies included), schema-valid
data accepted, invalid data rejected, a correct ``Allow`` on 405.

Where an answer depends on state the schema cannot express, the check is told so, per operation:

* ProRL's lifecycle (the reference server's semantics): the routes start *stopped* (503 until ``/start``),
  ``/start`` twice is 400, and a fuzzer may call ``/stop``;
* a job's (or an external rollout's) ``data_source`` must name a registered task handler (400 otherwise),
  and ProRL's ``/add_llm_server`` takes any string and answers 400 for what is not an http(s) URL.

``/v1/events`` is an endless stream and is covered by its own test.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, settings

from raas.api.app import create_app, server_config
from raas.pipeline.config import ServiceConfig
from raas.pipeline.service import RolloutService
from tests.doubles.handlers import script_registry
from tests.pipeline.conftest import RecordingSandboxManager, assert_no_leftovers

pytestmark = pytest.mark.integration

POSITIVE = ["2xx", "3xx", "401", "403", "404", "409", "429", "5xx"]  # schemathesis's defaults
SERVER_ERRORS_OK = ["2xx", "3xx", "4xx"]  # likewise
STATE_DEPENDENT = schemathesis.Config.from_dict(
    {
        "operations": [
            {
                "include-path": ["/start", "/stop", "/cancel", "/process"],
                "checks": {"not_a_server_error": {"expected-statuses": [*SERVER_ERRORS_OK, "503"]}},
            },
            {
                "include-path": [
                    "/v1/jobs",
                    "/v1/jobs:batch",
                    "/v1/gateway/rollouts",
                    "/process",
                    "/start",
                    "/add_llm_server",
                ],
                "checks": {"positive_data_acceptance": {"expected-statuses": [*POSITIVE, "400"]}},
            },
        ]
    }
)

_spec_app = create_app(RolloutService(ServiceConfig(state_dir=Path("/nonexistent/raas-schema-only"))))
schema = schemathesis.openapi.from_dict(_spec_app.openapi(), config=STATE_DEPENDENT).exclude(
    path="/v1/events"
)


class ThreadedServer:
    """A started service + uvicorn on a private loop in a background thread."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.loop = asyncio.new_event_loop()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.ready = threading.Event()
        self.errors: list[BaseException] = []
        self.manager: RecordingSandboxManager | None = None
        self.server: uvicorn.Server | None = None
        self.thread = threading.Thread(target=self._main, name="raas-schemathesis", daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._serve())
        except BaseException as exc:
            self.errors.append(exc)
        finally:
            self.ready.set()
            self.loop.close()

    async def _serve(self) -> None:
        cfg = ServiceConfig(
            state_dir=self.state, shutdown_grace_s=0.0, max_request_bytes=1 << 20, default_timeout_s=2.0
        )
        self.manager = RecordingSandboxManager(self.state / "sandboxes")
        app = create_app(RolloutService(cfg, sandbox_manager=self.manager, handlers=script_registry()))
        self.server = uvicorn.Server(server_config(app, cfg, log_level="warning", fit_fd_limit=False))
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started and not task.done():  # noqa: ASYNC110 - uvicorn has no started event
            await asyncio.sleep(0.01)
        self.ready.set()
        await task
        await self.manager.close_all()

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        self.ready.wait(60)
        if self.errors:
            raise self.errors[0]
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.should_exit = True
        self.thread.join(60)
        self.sock.close()
        assert not self.thread.is_alive() and not self.errors, self.errors


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedServer]:
    with ThreadedServer(tmp_path_factory.mktemp("fuzz")) as server:
        yield server
    assert server.manager is not None
    assert_no_leftovers(server.manager)


@schema.parametrize()
@settings(
    max_examples=int(os.environ.get("RAAS_FUZZ_EXAMPLES", "12")),
    deadline=None,
    derandomize=True,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.function_scoped_fixture,
    ],
)
def test_responses_match_the_schema(case: schemathesis.Case, live: ThreadedServer) -> None:
    case.call_and_validate(base_url=live.url, timeout=30)
