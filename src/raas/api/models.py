"""Request and response bodies of the native API that are not pipeline records themselves."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from raas.pipeline.jobs import JobRequest, SubmitResponse


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    jobs: list[JobRequest] = Field(min_length=1, max_length=10_000)


class BatchResponse(BaseModel):
    jobs: list[SubmitResponse]


class AddServerRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    address: str = Field(min_length=1, max_length=2048, description="Base URL; a trailing /v1 is accepted")
    weight_version: str | None = Field(None, max_length=256)
    kind: str = Field("auto", max_length=32, description="auto | vllm | sglang | llamacpp")


class ServersResponse(BaseModel):
    servers: list[dict[str, Any]]


class StageStatus(BaseModel):
    queued: int
    active: int
    workers: int


class StatusResponse(BaseModel):
    """Service state. ``status``/``pending_jobs`` are the ProRL server's fields (``running`` once started
    through ``/start``, else ``stopped``); the rest is raas's own view."""

    status: str
    pending_jobs: int
    accepting: bool
    pending: int
    max_pending: int
    stages: dict[str, StageStatus]
    finished: dict[str, int]
    llm_servers: list[dict[str, Any]]
    llm_available: bool
    llm_paused: bool


class OkResponse(BaseModel):
    ok: bool = True
    detail: str | None = None
