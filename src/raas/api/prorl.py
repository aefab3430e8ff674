"""Drop-in routes of the ProRL Agent Server HTTP API, so trainers written for it switch without code changes.

Semantics follow that server (NVIDIA-NeMo/ProRL-Agent-Server, ``scripts/start_server.py``):

* the server starts *stopped*: ``POST /start`` opens it (400 if already running), ``POST /stop`` closes it
  and cancels the ``/process`` calls in flight (503 if not running);
* ``POST /process {instance, sampling_params, job_id?}`` blocks until the job ends: 503 while stopped or
  with no LLM server, 400 for an unknown ``data_source``, 504 when the job times out (the body still
  carries the result) or the wait exceeds ``2 * timeout + 10`` s;
* ``POST /cancel {job_id}`` (503 while stopped), ``POST /add_llm_server {address}`` (a trailing ``/v1`` is
  fine; accepted while stopped too), ``POST /clear_llm_server``;
* ``GET /status`` reports ``status: running|stopped`` and ``pending_jobs``; unlike the reference it answers
  200 while stopped as well, because raas's own clients read it too.

The ``/process`` result carries the reference's field names next to raas's own ones (see
:func:`prorl_result`).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from raas.api.errors import error_body
from raas.api.models import BODY_ERRORS, ProcessFailure, StatusResponse, error_responses
from raas.api.native import check_job_sizes, normalize_address, service_of
from raas.api.protocol import Served, settle
from raas.core.jobs import JobRequest, JobResult, valid_job_id
from raas.errors import RaasError

NOT_RUNNING = "Server is not running. Please start the server first."
NO_LLM = "No LLM server addresses configured. Please add at least one LLM server address."


class ProcessRequest(BaseModel):
    instance: dict[str, Any]
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    job_id: str | None = None


class CancelRequest(BaseModel):
    job_id: str


class LLMServerRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    address: str = Field(min_length=1, max_length=2048)


class StatusMessage(BaseModel):
    status: str


@dataclass
class ProRLGate:
    """The ``/start``/``/stop`` switch and the ``/process`` jobs it owns."""

    running: bool = False
    jobs: set[str] = field(default_factory=set)
    stopped_jobs: set[str] = field(default_factory=set)


def gate_of(request: Request) -> ProRLGate:
    gate: ProRLGate = request.app.state.prorl
    return gate


def _detail(status: int, message: str, kind: str, extra: dict[str, Any] | None = None) -> JSONResponse:
    # With a result attached, its fields stay as the reference names them; ``detail`` says what happened.
    body = {**extra, "detail": message} if extra else error_body(kind, message)
    return JSONResponse(body, status_code=status)


def _critical_error(result: JobResult) -> str | None:
    if result.status == "completed":
        return None
    if result.status in ("timeout", "cancelled"):
        return "timeout"  # the reference marks cancelled jobs as timed out too
    stage = result.error.stage if result.error else None
    return stage if stage in ("init", "run", "eval") else "init"


def prorl_message(message: dict[str, Any]) -> dict[str, Any]:
    """A raas message in the reference's layout: ``tool_calls`` as ``{name, arguments: JSON string}`` and
    ``token_ids``/``output_ids`` (sampled IDs, empty for non-assistant messages) after ``input_ids``."""
    calls = message.get("tool_calls")
    out: dict[str, Any] = {
        "role": message["role"],
        "content": message.get("content", ""),
        "tool_calls": None
        if calls is None
        else [
            {"id": c.get("id"), "name": c.get("name"), "arguments": json.dumps(c.get("arguments") or {})}
            for c in calls
        ],
    }
    if message.get("tool_call_id") is not None:
        out["tool_call_id"] = message["tool_call_id"]
    if message.get("name") is not None:
        out["name"] = message["name"]
    sampled = list(message.get("output_ids") or [])
    out["input_ids"] = list(message.get("input_ids") or [])
    out["token_ids"] = sampled
    out["output_ids"] = sampled
    out["logprobs"] = list(message.get("logprobs") or [])
    return out


def prorl_result(result: JobResult) -> dict[str, Any]:
    """raas's result plus the reference's fields (``error`` becomes its string form; the typed error stays
    in ``error_detail``; ``timing`` holds both key sets)."""
    native = result.model_dump(mode="json")
    arts = native.get("artifacts") or {}
    finish_reason = arts.get("finish_reason")
    t = native["timing"]
    others = max(0.0, t["total_s"] - t["init_s"] - t["run_s"] - t["eval_s"])
    error = result.error
    critical = _critical_error(result)
    native.update(
        {
            "git_patch": arts.get("git_patch", arts.get("patch")),
            "success": result.status == "completed",
            "error": None
            if error is None
            else f"Error in {error.stage or 'service'}: [{error.kind}] {error.message}",
            "error_detail": None if error is None else error.model_dump(mode="json"),
            "traceback": arts.get("traceback"),
            "finish": finish_reason == "finish_tool",
            "end_properly": finish_reason is not None and finish_reason not in ("error", "length"),
            "resolved": bool(result.resolved),
            "critical_error": critical,
            "timing": {
                **t,
                "init_time": t["init_s"],
                "run_time": t["run_s"],
                "eval_time": t["eval_s"],
                "others_time": others,
                "counted_elapsed": t["init_s"] + t["run_s"] + t["eval_s"],
                "timeout_triggered": result.status == "timeout",
            },
            "messages": [prorl_message(m) for m in native.get("messages", [])],
            "tools": arts.get("tools", []),
        }
    )
    return native


router = APIRouter(responses=error_responses(500, 503))


@router.post(
    "/start",
    response_model=StatusMessage,
    responses=error_responses(*BODY_ERRORS, 401, 503, _400="Already running", _503="Shutting down"),
)
async def start(request: Request) -> Any:
    gate = gate_of(request)
    if gate.running:
        return _detail(400, "Server is already running", "bad_request")
    if not service_of(request).accepting:
        return _detail(503, "the service is not accepting jobs", "unavailable")
    gate.running = True
    return StatusMessage(status="Server started successfully")


@router.post(
    "/stop",
    response_model=StatusMessage,
    responses=error_responses(*BODY_ERRORS, 401, 503, _503="Not running"),
)
async def stop(request: Request) -> Any:
    gate = gate_of(request)
    if not gate.running:
        return _detail(503, NOT_RUNNING, "unavailable")
    gate.running = False
    service = service_of(request)
    jobs = list(gate.jobs)
    gate.stopped_jobs.update(jobs)
    await asyncio.gather(*(service.cancel(j) for j in jobs), return_exceptions=True)
    return StatusMessage(status="Server stopped successfully")


@router.get("/status", response_model=StatusResponse, responses=error_responses(401))
async def status(request: Request) -> StatusResponse:
    service = service_of(request)
    snap = service.status()
    return StatusResponse(
        status="running" if gate_of(request).running else "stopped", pending_jobs=snap["pending"], **snap
    )


@router.post(
    "/cancel",
    response_model=StatusMessage,
    responses=error_responses(*BODY_ERRORS, 401, 503, _503="Not running"),
)
async def cancel(body: CancelRequest, request: Request) -> Any:
    if not gate_of(request).running:
        return _detail(503, NOT_RUNNING, "unavailable")
    if valid_job_id(body.job_id):
        try:
            await service_of(request).cancel(body.job_id)
        except RaasError as exc:
            if exc.kind != "not_found":
                raise
    return StatusMessage(status=f"Cancel requested for job {body.job_id}")


@router.post(
    "/add_llm_server",
    response_model=StatusMessage,
    responses=error_responses(*BODY_ERRORS, 401, 503, _400="Bad address", _503="No LLM layer"),
)
async def add_llm_server(body: LLMServerRequest, request: Request) -> StatusMessage:
    service = service_of(request)
    address = normalize_address(body.address)
    known = {str(s.get("address", "")).rstrip("/") for s in service.llm_servers()}
    if address not in known:
        await settle(service.add_llm_server(address))
    return StatusMessage(status=f"Added LLM server address: {body.address}")


@router.post(
    "/clear_llm_server",
    response_model=StatusMessage,
    responses=error_responses(*BODY_ERRORS, 401, 503, _503="No LLM layer"),
)
async def clear_llm_server(request: Request) -> StatusMessage:
    await settle(service_of(request).clear_llm_servers())
    return StatusMessage(status="Cleared all LLM server addresses")


@router.post(
    "/process",
    responses={
        200: {"description": "The job's result in the ProRL layout (raas's fields next to the reference's)"},
        **error_responses(*BODY_ERRORS, 401, 429, _400="Unknown data_source or invalid instance"),
        503: {
            "model": ProcessFailure,
            "description": "Stopped, no LLM server, or stopped while processing (then with the result)",
        },
        504: {"model": ProcessFailure, "description": "The job timed out (the body carries its result)"},
    },
)
async def process(body: ProcessRequest, request: Request) -> Any:
    """Run one job to the end and return its result (blocking)."""
    gate = gate_of(request)
    service: Served = service_of(request)
    if not gate.running or not service.accepting:
        return _detail(503, NOT_RUNNING, "unavailable")
    if not service.llm_servers():
        return _detail(503, NO_LLM, "llm_unavailable")
    if body.job_id is not None and not valid_job_id(body.job_id):
        return _detail(400, f"invalid job_id {body.job_id!r}", "bad_request")
    try:
        job = JobRequest(instance=body.instance, sampling_params=body.sampling_params, job_id=body.job_id)
    except ValueError as exc:
        return _detail(400, f"Invalid dataset type or function not registered: {exc}", "bad_request")
    check_job_sizes(request, [job], batch=False)
    try:
        accepted = await service.submit(job)
    except RaasError as exc:
        if exc.kind == "bad_request":
            return _detail(
                400, f"Invalid dataset type or function not registered: {exc.message}", "bad_request"
            )
        raise
    job_id = accepted.job_id
    gate.jobs.add(job_id)
    try:
        limit = 2 * service.config.default_timeout_s + 10.0
        result = await service.wait(job_id, limit)
        if result is None:
            await service.cancel(job_id)
            return _detail(504, "Processing timed out", "timeout", {"job_id": job_id})
    finally:
        gate.jobs.discard(job_id)
    payload = prorl_result(result)
    # The reference echoes the instance's own ids, with their JSON types (None when absent).
    payload["instance_id"] = body.instance.get("instance_id")
    payload["trajectory_id"] = body.instance.get("trajectory_id")
    if job_id in gate.stopped_jobs:
        gate.stopped_jobs.discard(job_id)
        return _detail(503, "Server is stopping; job cancelled", "unavailable", payload)
    if result.status == "timeout":
        return _detail(504, f"Job {job_id} timed out", "timeout", payload)
    return JSONResponse(payload)
