"""The native, non-blocking ``/v1`` API: submit, poll, long-poll, cancel, stream events, manage servers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any
from urllib.parse import unquote

from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from raas.api.models import (
    BODY_ERRORS,
    HTTP_URL_PATTERN,
    AddServerRequest,
    BatchRequest,
    BatchResponse,
    JobSubmission,
    OkResponse,
    ServersResponse,
    error_responses,
)
from raas.api.protocol import Served, settle
from raas.core.jobs import JOB_ID_PATTERN, JobInfo, JobRequest, JobResult, SubmitResponse
from raas.errors import RaasError

JobId = Annotated[str, Path(pattern=JOB_ID_PATTERN, description="The job's id")]
SSE_HEARTBEAT_S = 15.0


def service_of(request: Request) -> Served:
    service: Served = request.app.state.service
    return service


def normalize_address(address: str) -> str:
    """Accept ``http://host:port``, with or without a trailing ``/`` or ``/v1`` (ProRL clients send it)."""
    a = address.strip().rstrip("/")
    if a.endswith("/v1"):
        a = a[: -len("/v1")]
    if not a.startswith(("http://", "https://")) or len(a) <= len("http://"):
        raise RaasError(
            f"LLM server address must be an http(s) URL, got {address!r}", kind="bad_request", stage="api"
        )
    return a


def json_size(value: Any) -> int:
    """Bytes of ``value`` as compact UTF-8 JSON (what the ledger stores and memory holds, roughly)."""
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def check_job_sizes(request: Request, jobs: Sequence[JobRequest], *, batch: bool) -> None:
    """413 for a batch over ``max_batch_jobs`` or an instance over ``max_instance_bytes``: every accepted
    job is held in memory until it ends, so the cap on what one job may carry bounds the service's RSS.
    Instances are measured only when the body is larger than the cap (a smaller body cannot hold one)."""
    cfg = service_of(request).config
    if batch and len(jobs) > cfg.max_batch_jobs:
        raise RaasError(
            f"jobs has {len(jobs)} entries, over the limit max_batch_jobs = {cfg.max_batch_jobs}; "
            "split the batch",
            kind="payload_too_large",
            stage="api",
        )
    limit = cfg.max_instance_bytes
    body_bytes = getattr(request.state, "body_bytes", None)
    if body_bytes is not None and body_bytes <= limit:
        return
    for i, job in enumerate(jobs):
        size = json_size(job.instance)
        if size > limit:
            where = f"jobs[{i}].instance" if batch else "instance"
            raise RaasError(
                f"{where} is {size} bytes as JSON, over the limit max_instance_bytes = {limit}",
                kind="payload_too_large",
                stage="api",
            )


router = APIRouter(responses=error_responses(500, 503))


@router.post(
    "/v1/jobs",
    status_code=202,
    response_model=SubmitResponse,
    responses=error_responses(
        *BODY_ERRORS, 401, 429, 503, _400="Unknown data_source or invalid instance", _503="Shutting down"
    ),
)
async def submit_job(body: JobSubmission, request: Request) -> SubmitResponse:
    """Accept one job; idempotent on ``job_id``."""
    check_job_sizes(request, [body], batch=False)
    return await service_of(request).submit(body)


@router.post(
    "/v1/jobs:batch",
    status_code=202,
    response_model=BatchResponse,
    responses=error_responses(
        *BODY_ERRORS, 401, 429, 503, _429="Not enough room for the whole batch", _503="Shutting down"
    ),
)
async def submit_batch(body: BatchRequest, request: Request) -> BatchResponse:
    """Accept many jobs, all or nothing."""
    check_job_sizes(request, body.jobs, batch=True)
    return BatchResponse(jobs=await service_of(request).submit_many(body.jobs))


@router.get(
    "/v1/jobs/{job_id}", response_model=JobInfo, responses=error_responses(401, 404, 422, _404="Unknown job")
)
async def get_job(job_id: JobId, request: Request) -> JobInfo:
    return await service_of(request).get(job_id)


@router.get(
    "/v1/jobs/{job_id}/result",
    response_model=JobResult,
    responses={
        202: {"model": JobInfo, "description": "Not finished yet"},
        **error_responses(401, 404, 422, _404="Unknown job"),
    },
)
async def get_result(
    job_id: JobId,
    request: Request,
    wait: Annotated[float, Query(ge=0, le=3600, description="Long-poll up to this many seconds")] = 0.0,
) -> Any:
    """The result (200) or, if the job is still running after ``wait`` seconds, its state (202)."""
    service = service_of(request)
    result = await service.wait(job_id, min(wait, service.config.max_wait_s)) if wait > 0 else None
    if result is None:
        result = await service.result(job_id)
    if result is None:
        info = await service.get(job_id)
        return JSONResponse(info.model_dump(mode="json"), status_code=202)
    # Serialized once, straight from the model (trajectories can be large; no second validation pass).
    return Response(result.model_dump_json(), media_type="application/json")


@router.delete(
    "/v1/jobs/{job_id}", response_model=JobInfo, responses=error_responses(401, 404, 422, _404="Unknown job")
)
async def cancel_job(job_id: JobId, request: Request) -> JobInfo:
    """Stop the job wherever it is and release its sandboxes (idempotent)."""
    return await service_of(request).cancel(job_id)


@router.get(
    "/v1/events",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "Server-Sent Events"},
        **error_responses(401, 422),
    },
)
async def events(
    request: Request,
    terminal_only: Annotated[bool, Query(description="Only terminal states")] = False,
) -> StreamingResponse:
    """Server-Sent Events: one ``job`` event per state change (``data`` is a JobEvent). A client too slow
    to keep up gets a ``dropped`` event (``{"dropped": n}``, the running total) and should poll results."""
    service = service_of(request)

    async def stream() -> AsyncIterator[bytes]:
        async with service.events() as sub:
            yield b": connected\n\n"
            reported = 0
            while True:
                if sub.dropped > reported:
                    reported = sub.dropped
                    yield f'event: dropped\ndata: {{"dropped": {reported}}}\n\n'.encode()
                try:
                    event = await asyncio.wait_for(sub.get(), SSE_HEARTBEAT_S)
                except TimeoutError:
                    yield b": keep-alive\n\n"
                    continue
                if event is None:
                    return
                if terminal_only and event.status not in ("completed", "failed", "timeout", "cancelled"):
                    continue
                yield f"event: job\ndata: {event.model_dump_json()}\n\n".encode()

    return StreamingResponse(
        stream(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


# -- inference servers ---------------------------------------------------------------------------------


@router.get("/v1/llm/servers", response_model=ServersResponse, responses=error_responses(401))
async def list_servers(request: Request) -> ServersResponse:
    return ServersResponse(servers=service_of(request).llm_servers())


@router.post(
    "/v1/llm/servers",
    response_model=ServersResponse,
    responses=error_responses(*BODY_ERRORS, 401, 503, _400="Bad address", _503="No LLM layer"),
)
async def add_server(body: AddServerRequest, request: Request) -> ServersResponse:
    service = service_of(request)
    await settle(
        service.add_llm_server(
            normalize_address(body.address), weight_version=body.weight_version, kind=body.kind
        )
    )
    return ServersResponse(servers=service.llm_servers())


@router.delete(
    "/v1/llm/servers/{address:path}",
    response_model=ServersResponse,
    responses=error_responses(
        400, 401, 404, 422, 503, _400="Bad address", _404="Unknown server", _503="No LLM layer"
    ),
)
async def remove_server(
    address: Annotated[str, Path(pattern=HTTP_URL_PATTERN, description="The server's base URL")],
    request: Request,
) -> ServersResponse:
    service = service_of(request)
    await settle(service.remove_llm_server(normalize_address(unquote(address))))
    return ServersResponse(servers=service.llm_servers())


@router.post(
    "/v1/llm/servers:clear",
    response_model=OkResponse,
    responses=error_responses(*BODY_ERRORS, 401, 503, _503="No LLM layer"),
)
async def clear_servers(request: Request) -> OkResponse:
    await settle(service_of(request).clear_llm_servers())
    return OkResponse(detail="cleared")


@router.post(
    "/v1/llm:pause",
    response_model=OkResponse,
    responses=error_responses(*BODY_ERRORS, 401, 503, _503="No LLM layer"),
)
async def pause(request: Request) -> OkResponse:
    """Hold new generate calls and wait for in-flight ones (weight sync); RUN stages do not time out for
    the time they spend paused."""
    await service_of(request).pause_llm()
    return OkResponse(detail="paused")


@router.post(
    "/v1/llm:resume",
    response_model=OkResponse,
    responses=error_responses(*BODY_ERRORS, 401, 503, _503="No LLM layer"),
)
async def resume(request: Request) -> OkResponse:
    await service_of(request).resume_llm()
    return OkResponse(detail="resumed")


# -- health and metrics ----------------------------------------------------------------------------------


@router.get("/healthz", response_model=OkResponse)
async def healthz(request: Request) -> OkResponse:
    """Liveness; never needs a token."""
    return OkResponse(detail="accepting" if service_of(request).accepting else "not accepting")


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}}, **error_responses(401)},
)
async def metrics_endpoint(request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    from raas.core import metrics

    body = metrics.render(service_of(request).gauges)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
