"""The trajectory inspector: a job list and a job page (conversation, timings, EVAL report, failure, token
view), in the dashboard's page family: plain HTML + JS from package data, the dashboard's CSP, every string
from a job put into the page as text, never as markup.

Routes (all ``GET``, under the dashboard's path so the dashboard's auth covers them):

* ``/dashboard/jobs`` — the list page; ``/dashboard/jobs/{job_id}`` — a job's page;
* ``/dashboard/api/jobs`` — a page of the list as JSON (``status``, ``outcome``, ``data_source``, ``q``,
  ``min_reward``, ``max_reward``, ``weight_version``, ``group``, ``step``, ``offset``, ``limit``);
* ``/dashboard/api/jobs/{job_id}`` — the job page's data; ``.../raw`` — the result as the API returns it.

``raas view results.jsonl`` serves these routes for a results file with no service running
(:class:`~raas.api.inspector_data.FileJobs`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any, Protocol

from fastapi import APIRouter, FastAPI, Query
from fastapi.responses import JSONResponse, Response

from raas.api.dashboard import DASHBOARD_PATH, PAGE_HEADERS
from raas.api.errors import error_body
from raas.api.inspector_data import JobQuery, job_detail
from raas.core.jobs import JobResult
from raas.errors import RaasError

JOBS_PATH = DASHBOARD_PATH + "/jobs"
API_PATH = DASHBOARD_PATH + "/api/jobs"
_PAGES = {"list": "jobs.html", "job": "job.html"}
STATIC_PATH = DASHBOARD_PATH + "/inspector"
"""The inspector's script and stylesheet (beside the dashboard's own ``/dashboard/static``)."""
STATIC = ("inspector.js", "inspector.css", "train.js")


class JobsSource(Protocol):
    """Where the inspector reads jobs: a results file (``FileJobs``) or a service's ledger (``LedgerJobs``)."""

    async def page(self, q: JobQuery) -> dict[str, Any]: ...

    async def get(self, job_id: str) -> JobResult | None: ...

    async def history(self, job_id: str) -> list[tuple[str, float, str | None]]: ...


def _static(name: str) -> bytes:
    return resources.files("raas.api").joinpath("static", name).read_bytes()


def page_response(name: str) -> Response:
    """A page of the inspector's family, with the dashboard's security headers."""
    return Response(_static(name), media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)


Decoder = Callable[[Sequence[int]], str]


def _no_decoder() -> Decoder | None:
    return None


def install(app: FastAPI, source: JobsSource, decoder: Callable[[], Decoder | None] = _no_decoder) -> None:
    """Add the inspector's routes. ``decoder()`` gives what turns token ids into text (the policy's
    tokenizer's ``decode``), asked per request (a service loads its tokenizer when it starts); without one
    the job page has no token view."""
    router = APIRouter()

    @router.get(JOBS_PATH, include_in_schema=False)
    async def jobs_page() -> Response:
        return page_response(_PAGES["list"])

    @router.get(JOBS_PATH + "/{job_id}", include_in_schema=False)
    async def job_page(job_id: str) -> Response:
        return page_response(_PAGES["job"])

    @router.get(API_PATH, include_in_schema=False)
    async def jobs(
        status: str | None = None,
        outcome: str | None = None,
        data_source: str | None = None,
        q: str | None = None,
        min_reward: float | None = None,
        max_reward: float | None = None,
        weight_version: str | None = None,
        group: str | None = None,
        step: int | None = None,
        offset: int = Query(0, ge=0),
        limit: int = Query(50, ge=1, le=500),
    ) -> JSONResponse:
        query = JobQuery(
            status=status or None,
            outcome=outcome or None,
            data_source=data_source or None,
            text=q or None,
            min_reward=min_reward,
            max_reward=max_reward,
            weight_version=weight_version or None,
            group=group or None,
            step=step,
            offset=offset,
            limit=limit,
        )
        try:
            page = await source.page(query)
        except RaasError as exc:
            return JSONResponse(error_body(exc.kind, exc.message), status_code=400)
        return JSONResponse(page, headers={"Cache-Control": "no-store"})

    @router.get(API_PATH + "/{job_id}", include_in_schema=False)
    async def job(job_id: str) -> JSONResponse:
        result = await source.get(job_id)
        if result is None:
            return JSONResponse(error_body("not_found", f"no job {job_id}"), status_code=404)
        history = await source.history(job_id)
        # decoding up to 20,000 tokens one by one: off the event loop
        detail = await asyncio.to_thread(job_detail, result, decoder(), history)
        return JSONResponse(detail, headers={"Cache-Control": "no-store"})

    @router.get(API_PATH + "/{job_id}/raw", include_in_schema=False)
    async def raw(job_id: str) -> JSONResponse:
        result = await source.get(job_id)
        if result is None:
            return JSONResponse(error_body("not_found", f"no job {job_id}"), status_code=404)
        return JSONResponse(result.model_dump(mode="json"), headers={"Cache-Control": "no-store"})

    app.include_router(router)
    install_static(app)


def install_static(app: FastAPI) -> None:
    """The script and stylesheet of the inspector's pages (and the training view's), once per app."""
    if getattr(app.state, "inspector_static", False):
        return
    app.state.inspector_static = True
    router = APIRouter()
    for name in STATIC:
        media = "text/javascript; charset=utf-8" if name.endswith(".js") else "text/css; charset=utf-8"

        def serve(name: str = name, media: str = media) -> Response:
            return Response(_static(name), media_type=media, headers={"X-Content-Type-Options": "nosniff"})

        router.add_api_route(f"{STATIC_PATH}/{name}", serve, methods=["GET"], include_in_schema=False)
    app.include_router(router)
