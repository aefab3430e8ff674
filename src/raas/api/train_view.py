"""The live training view: ``raas train``'s ``train.jsonl`` as charts and a table that follow the file while
the run writes it (the page asks for new lines every 2 s).

Routes (``GET``, under the dashboard's path, in the inspector's page family):

* ``/dashboard/train`` — the page;
* ``/dashboard/api/train?after=N`` — the log's lines from index ``N`` on, and the index to ask from next.

A step links to the jobs it trained on (``/dashboard/jobs?step=N``) where the same app serves the run's
``results.jsonl`` (``raas view OUT``).

Why a file and not the trainer's memory: ``train.jsonl`` is what ``raas train`` already writes, line by
line, for every step and held-out evaluation; reading it serves a run in progress, a finished one and one
copied from a cluster alike, and the trainer does no extra work.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Query
from fastapi.responses import JSONResponse, Response

from raas.api.dashboard import DASHBOARD_PATH
from raas.api.inspector import install_static, page_response

TRAIN_PATH = DASHBOARD_PATH + "/train"
API_PATH = DASHBOARD_PATH + "/api/train"
MAX_LINES_PER_REPLY = 5000


class TrainLogTail:
    """The lines of a growing JSONL file, read once each: a partial last line (the trainer is writing it)
    waits for the next read; a line that is not a JSON object is kept as ``{"kind": "unreadable"}``."""

    def __init__(self, path: Path, *, jobs: bool = False) -> None:
        self.path = path
        self.jobs = jobs
        """Whether the same app lists the run's trained jobs (a step then links to them)."""
        self.rows: list[dict[str, Any]] = []
        self._offset = 0
        self._lock = threading.Lock()

    def _read(self) -> None:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return  # the run has not written its first line yet
        end = data.rfind(b"\n") + 1
        for line in data[:end].splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            self.rows.append(row if isinstance(row, dict) else {"kind": "unreadable"})
        self._offset += end

    def since(self, after: int) -> dict[str, Any]:
        with self._lock:
            self._read()
            rows = self.rows[after : after + MAX_LINES_PER_REPLY]
            return {"rows": rows, "next": after + len(rows), "file": self.path.name, "jobs": self.jobs}


def install(app: FastAPI, path: Path, *, jobs: bool = False) -> TrainLogTail:
    """Add the training view's routes for the log at ``path`` (which may not exist yet); ``jobs``: the app
    also serves the run's results file in the inspector, so each step links to the jobs it trained on."""
    tail = TrainLogTail(path, jobs=jobs)
    router = APIRouter()

    @router.get(TRAIN_PATH, include_in_schema=False)
    async def page() -> Response:
        return page_response("train.html")

    @router.get(API_PATH, include_in_schema=False)
    def rows(after: int = Query(0, ge=0)) -> JSONResponse:  # a plain def: FastAPI runs it in its thread pool
        return JSONResponse(tail.since(after), headers={"Cache-Control": "no-store"})

    app.include_router(router)
    install_static(app)
    return tail
