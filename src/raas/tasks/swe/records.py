"""The record a built SWE-style instance is, one JSON object per JSONL line (see docs/swe-records.md).

SWE-bench's public fields, plus what a runner needs to evaluate the instance without knowing how it was
built: the image, the repository's place in it, the exact test command and the SWE-bench log parser that
reads its output.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from raas.errors import RaasError


class SweRecord(BaseModel):
    """One instance. ``FAIL_TO_PASS``/``PASS_TO_PASS`` may arrive as JSON-encoded strings (as on the
    SWE-bench hub) and are lists here."""

    model_config = ConfigDict(extra="allow")

    instance_id: str = Field(min_length=1)
    repo: str
    base_commit: str = Field(pattern=r"^[0-9a-f]{40}$")
    problem_statement: str = Field(min_length=1)
    patch: str
    test_patch: str
    FAIL_TO_PASS: list[str] = Field(min_length=1)
    PASS_TO_PASS: list[str]
    version: str
    environment_setup_commit: str
    created_at: str
    data_source: Literal["swebench", "swe-mini"] = "swebench"
    """``swe-mini``: served with the small-policy scaffold (:mod:`raas.tasks.swe.mini.handler`)."""
    image: str
    workdir: str = "/testbed"
    test_cmd: str
    log_parser: str = "parse_log_pytest"

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS", mode="before")
    @classmethod
    def _json_list(cls, v: Any) -> Any:
        if isinstance(v, str):
            try:
                return json.loads(v)
            except ValueError as e:
                raise ValueError(f"not a JSON list of test ids: {e}") from e
        return v

    @field_validator("workdir")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError("workdir must be an absolute path")
        return v


def validate_record(data: dict[str, Any]) -> SweRecord:
    """A record, or a ``bad_request`` naming the field that is wrong."""
    try:
        return SweRecord.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "record"
        raise RaasError(f"invalid SWE record field {loc}: {first['msg']}", kind="bad_request") from e


def write_jsonl(records: Iterable[SweRecord], path: Path) -> int:
    """Write records atomically; returns how many."""
    tmp = path.with_name(path.name + ".part")
    n = 0
    with tmp.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r.model_dump(mode="json"), ensure_ascii=False) + "\n")
            n += 1
    tmp.replace(path)
    return n


def read_jsonl(path: Path) -> Iterator[SweRecord]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except ValueError as e:
                raise RaasError(f"{path}:{lineno}: not JSON: {e}", kind="bad_request") from e
            yield validate_record(data)
