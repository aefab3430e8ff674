"""``POST /v1/gateway/rollouts``: open a rollout for an agent that runs outside raas.

The rollout is a job (its id is the job's), submitted like any other; its RUN stage waits for the agent
(:mod:`raas.gateway.external`). The answer, once RUN has opened the rollout's gateway session, carries its
key and the base URLs the agent's SDK takes; the agent closes it at ``close_url`` with that key, EVAL grades
it, and the result is read at ``/v1/jobs/{id}/result`` like any job's.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from raas.api.models import BODY_ERRORS, error_responses
from raas.api.native import check_job_sizes, service_of
from raas.core.jobs import JobRequest, new_job_id
from raas.errors import RaasError
from raas.gateway.external import DEFAULT_LEASE_S, MAX_LEASE_S

router = APIRouter(responses=error_responses(500, 503))


class RolloutRequest(BaseModel):
    """An external rollout: the job it is (instance, sampling, budget, priority) and how long it may idle."""

    model_config = ConfigDict(extra="forbid")

    instance: dict[str, Any] = Field(
        description=(
            "The task instance; data_source names the task handler whose EVAL grades the rollout (inferred "
            "from the fields when absent, as for POST /v1/jobs)"
        ),
        json_schema_extra={"properties": {"data_source": {"type": "string", "minLength": 1}}},
    )
    sampling_params: dict[str, Any] | None = Field(
        None, description="The job's sampling params and agent limits (max_turns, max_tokens, ...)"
    )
    timeout_s: float | None = Field(None, gt=0, le=7 * 24 * 3600, description="The job's budget in stages")
    priority: int = Field(0, ge=-1000, le=1000)
    lease_s: float = Field(
        DEFAULT_LEASE_S,
        gt=0,
        le=MAX_LEASE_S,
        description="Idle timeout: a rollout with no request and no close for this long is abandoned",
    )
    open_timeout_s: float = Field(
        120.0, gt=0, le=3600, description="How long to wait for a RUN worker to take the rollout"
    )

    _has_data_source = field_validator("instance")(JobRequest._has_data_source.__func__)  # type: ignore[attr-defined]


class RolloutOpened(BaseModel):
    rollout_id: str = Field(description="The rollout's id, which is also its job id")
    job_id: str
    key: str = Field(description="The rollout's API key: the SDKs' api_key, valid until the rollout ends")
    model: str = Field(description="The model name the gateway answers as (any name is accepted)")
    openai_base_url: str = Field(description="OpenAI SDK base_url (Chat Completions, Responses)")
    anthropic_base_url: str = Field(description="Anthropic SDK base_url (Messages)")
    close_url: str = Field(description="POST here with the key to end the rollout (optional answer/patch)")
    result_url: str
    lease_s: float


@router.post(
    "/v1/gateway/rollouts",
    status_code=201,
    response_model=RolloutOpened,
    responses=error_responses(
        *BODY_ERRORS, 401, 429, 503, _503="No gateway, shutting down, or no RUN worker"
    ),
)
async def open_rollout(body: RolloutRequest, request: Request) -> RolloutOpened:
    """Submit the rollout's job and answer once its RUN stage has opened the gateway session."""
    service = service_of(request)
    gateway = getattr(service, "gateway", None)
    if gateway is None:
        raise RaasError("no agent gateway here (not started, or a cluster router)", kind="unavailable")
    if gateway.tokenizer is None:  # as a job whose handler needs one is refused at submit
        raise RaasError(
            "external rollouts need the policy's chat tokenizer and this service has none: start it with "
            "--tokenizer DIR (or tokenizer_dir in the service config)",
            kind="bad_request",
        )
    job = JobRequest(
        instance=body.instance,
        sampling_params=body.sampling_params,
        job_id=new_job_id(),
        timeout_s=body.timeout_s,
        priority=body.priority,
        external_rollout=True,
    )
    assert job.job_id is not None
    check_job_sizes(request, [job], batch=False)
    rollout = gateway.external.expect(job.job_id, body.lease_s)
    ended: asyncio.Task[Any] | None = None
    opened = False
    try:
        await service.submit(job)
        ended = asyncio.create_task(service.wait(job.job_id, body.open_timeout_s))
        await asyncio.wait(
            {rollout.opened, ended}, timeout=body.open_timeout_s, return_when="FIRST_COMPLETED"
        )
        if rollout.opened.done() and rollout.opened.exception() is None:
            session = rollout.opened.result()
            opened = True
        elif ended.done() and ended.exception() is None and ended.result() is not None:
            error = ended.result().error
            raise RaasError(
                f"the rollout's job ended before it opened: {error.message if error else 'no error'}",
                kind=error.kind if error else "internal",
                stage=error.stage if error else "run",
            )
        else:
            raise RaasError(
                f"no RUN worker took the rollout within {body.open_timeout_s:g} s; retry later",
                kind="unavailable",
            )
    finally:
        if ended is not None:
            ended.cancel()
            with contextlib.suppress(BaseException):
                await ended
        if not opened:  # nobody will hold the key: end the job now rather than at its lease
            gateway.external.forget(job.job_id)
            with contextlib.suppress(Exception):
                await service.cancel(job.job_id)
    base = str(request.base_url).rstrip("/") + "/gateway"
    return RolloutOpened(
        rollout_id=job.job_id,
        job_id=job.job_id,
        key=session.key,
        model=gateway.model_name,
        openai_base_url=f"{base}/v1",
        anthropic_base_url=base,
        close_url=f"{base}/v1/rollouts/{job.job_id}/close",
        result_url=str(request.base_url).rstrip("/") + f"/v1/jobs/{job.job_id}/result",
        lease_s=body.lease_s,
    )
