"""Caps on what one job and one batch may carry, through the HTTP API: a clear 413 that names the field and
the setting, and nothing accepted (every accepted job is held in memory until it ends)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.api.conftest import APIFactory, LiveAPI
from tests.pipeline.conftest import script

pytestmark = pytest.mark.integration

CAP = 2048


def instance_of_size(size: int, filler: str = "x") -> dict[str, object]:
    """A ``test.script`` instance whose compact UTF-8 JSON is exactly ``size`` bytes."""
    base = script(init={"sleep": 0})
    base["blob"] = ""
    overhead = len(json.dumps(base, separators=(",", ":"), ensure_ascii=False).encode())
    per_char = len(filler.encode())
    assert (size - overhead) % per_char == 0
    base["blob"] = filler * ((size - overhead) // per_char)
    return base


def assert_too_large(r: httpx.Response, *phrases: str) -> None:
    body = r.json()
    assert r.status_code == 413, body
    assert body["error"]["kind"] == "payload_too_large" and body["error"]["stage"] == "api"
    for phrase in phrases:
        assert phrase in body["detail"] and phrase in body["error"]["message"], body


async def nothing_accepted(api: LiveAPI) -> None:
    assert await api.service.ledger.counts() == {}
    assert api.service.status()["pending"] == 0


async def test_one_job_over_the_instance_cap(make_api: APIFactory) -> None:
    api = await make_api(max_instance_bytes=CAP)
    r = await api.client.post("/v1/jobs", json={"instance": instance_of_size(CAP + 1)})
    assert_too_large(r, "instance is 2049 bytes", "max_instance_bytes = 2048")
    # Bytes, not characters: 2-byte UTF-8 characters count twice.
    r = await api.client.post("/v1/jobs", json={"instance": instance_of_size(CAP + 2, filler="é")})
    assert_too_large(r, "instance is 2050 bytes")
    await nothing_accepted(api)
    r = await api.client.post("/v1/jobs", json={"instance": instance_of_size(CAP)})
    assert r.status_code == 202, r.text


async def test_batch_caps_name_the_offending_job_and_setting(make_api: APIFactory) -> None:
    api = await make_api(max_instance_bytes=CAP, max_batch_jobs=8, max_batch_bytes=16 * 1024)
    small = {"instance": script()}
    r = await api.client.post("/v1/jobs:batch", json={"jobs": [small] * 9})
    assert_too_large(r, "jobs has 9 entries", "max_batch_jobs = 8")
    r = await api.client.post(
        "/v1/jobs:batch", json={"jobs": [small, {"instance": instance_of_size(CAP + 1)}, small]}
    )
    assert_too_large(r, "jobs[1].instance is 2049 bytes", "max_instance_bytes = 2048")
    fits = {"instance": instance_of_size(CAP)}
    r = await api.client.post("/v1/jobs:batch", json={"jobs": [fits] * 8})  # each job fits, the body not
    assert_too_large(r, "max_batch_bytes = 16384")
    await nothing_accepted(api)
    r = await api.client.post("/v1/jobs:batch", json={"jobs": [fits] * 3})
    assert r.status_code == 202 and len(r.json()["jobs"]) == 3


async def test_the_batch_body_cap_is_separate_from_the_request_cap(make_api: APIFactory) -> None:
    api = await make_api(max_request_bytes=4096, max_batch_bytes=64 * 1024, max_instance_bytes=CAP)
    jobs = [{"instance": instance_of_size(CAP)} for _ in range(10)]
    r = await api.client.post("/v1/jobs:batch", json={"jobs": jobs})
    assert r.status_code == 202, r.text
    r = await api.client.post("/v1/jobs", json={"instance": instance_of_size(CAP), "pad": "x" * 4096})
    assert_too_large(r, "max_request_bytes = 4096")


async def test_prorl_process_refuses_a_big_instance(make_api: APIFactory) -> None:
    api = await make_api(max_instance_bytes=CAP)
    c = api.client
    assert (await c.post("/start")).status_code == 200
    assert (await c.post("/add_llm_server", json={"address": "http://127.0.0.1:9/v1"})).status_code == 200
    r = await c.post("/process", json={"instance": instance_of_size(CAP + 1), "sampling_params": {}})
    assert_too_large(r, "instance is 2049 bytes", "max_instance_bytes = 2048")
    await nothing_accepted(api)
