"""Async client of the native raas HTTP API, for trainers and for ``raas run``/``raas status``.

Every failure surfaces as :class:`~raas.errors.RaasError` with the server's typed ``kind`` when it sent one,
so a trainer handles "service full" (retried here, honouring ``Retry-After``), "unknown job" and "service
down" without parsing HTTP.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any
from urllib.parse import quote

import httpx

from raas.errors import RaasError

_STATUS_KIND = {
    400: "bad_request",
    401: "bad_request",
    403: "bad_request",
    404: "not_found",
    409: "bad_request",
    413: "payload_too_large",
    422: "bad_request",
    429: "overloaded",
    503: "unavailable",
    504: "timeout",
}


def _error_from(resp: httpx.Response) -> RaasError:
    """A typed error from an error response, whatever shape its body has."""
    kind = _STATUS_KIND.get(resp.status_code, "internal")
    message = f"HTTP {resp.status_code}"
    stage: str | None = None
    try:
        body = resp.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            kind = str(err.get("kind") or kind)
            message = str(err.get("message") or message)
            stage = err.get("stage")
        elif "detail" in body:
            detail = body["detail"]
            if isinstance(detail, dict):
                kind = str(detail.get("kind") or kind)
                message = str(detail.get("message") or detail)
            else:
                message = str(detail)
        elif isinstance(err, str):
            message = err
    elif resp.text:
        message = f"HTTP {resp.status_code}: {resp.text[:500]}"
    return RaasError(message, kind=kind, stage=stage)


class RaasClient:
    """``async with RaasClient(url) as c: await c.submit(instance)``."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout_s: float = 30.0,
        max_retries_429: int = 30,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_retries_429 = max_retries_429
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=headers, transport=transport, timeout=httpx.Timeout(timeout_s)
        )

    async def __aenter__(self) -> RaasClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        ok: Iterable[int] = (200, 201, 202),
        headers: dict[str, str] | None = None,
    ) -> Any:
        attempts = 0
        while True:
            try:
                resp = await self._http.request(
                    method,
                    path,
                    json=json_body,
                    params=params,
                    headers=headers,
                    timeout=httpx.Timeout(timeout_s) if timeout_s is not None else httpx.USE_CLIENT_DEFAULT,
                )
            except httpx.TimeoutException as e:
                raise RaasError(
                    f"{method} {path}: no answer from {self.base_url} in time", kind="timeout"
                ) from e
            except httpx.HTTPError as e:
                raise RaasError(
                    f"{method} {path}: cannot reach {self.base_url}: {e}", kind="unavailable"
                ) from e
            if resp.status_code == 429 and attempts < self.max_retries_429:
                attempts += 1
                await asyncio.sleep(_retry_after(resp))
                continue
            if resp.status_code not in ok:
                raise _error_from(resp)
            if not resp.content:
                return None
            try:
                return resp.json()
            except ValueError as e:
                raise RaasError(f"{method} {path}: response is not JSON", kind="internal") from e

    # -- jobs ---------------------------------------------------------------------------------------
    async def submit(
        self,
        instance: dict[str, Any],
        *,
        sampling_params: dict[str, Any] | None = None,
        job_id: str | None = None,
        timeout_s: float | None = None,
        priority: int | None = None,
        retry_on_restart: bool | None = None,
    ) -> dict[str, Any]:
        """Queue one job; returns ``{job_id, status, ...}`` (idempotent on ``job_id``)."""
        return await self._request(
            "POST",
            "/v1/jobs",
            json_body=_job_body(instance, sampling_params, job_id, timeout_s, priority, retry_on_restart),
        )

    async def submit_batch(self, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Queue many jobs (each a request body: ``{instance, sampling_params?, job_id?, ...}``)."""
        body = await self._request("POST", "/v1/jobs:batch", json_body={"jobs": jobs})
        if isinstance(body, dict):
            for key in ("jobs", "results", "items"):
                if isinstance(body.get(key), list):
                    return list(body[key])
        if isinstance(body, list):
            return body
        raise RaasError("unexpected batch response shape", kind="internal")

    async def get(self, job_id: str) -> dict[str, Any]:
        return await self._request("GET", f"/v1/jobs/{quote(job_id, safe='')}")

    async def result(self, job_id: str, wait_s: float = 0.0) -> dict[str, Any] | None:
        """The result if the job is finished (waiting up to ``wait_s`` server-side), else None."""
        body = await self._request(
            "GET",
            f"/v1/jobs/{quote(job_id, safe='')}/result",
            params={"wait": wait_s} if wait_s else None,
            timeout_s=wait_s + self.timeout_s,
            ok=(200, 202),
        )
        if (
            isinstance(body, dict)
            and body.get("status") in ("completed", "failed", "timeout", "cancelled")
            and "token_trajectory" in body
        ):
            return body
        return None

    async def wait(self, job_id: str, timeout_s: float | None = None, poll_s: float = 30.0) -> dict[str, Any]:
        """Long-poll until the job finishes; ``timeout`` error when ``timeout_s`` passes first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = poll_s if deadline is None else min(poll_s, deadline - time.monotonic())
            if left <= 0:
                raise RaasError(f"job {job_id} did not finish within {timeout_s}s", kind="timeout")
            res = await self.result(job_id, wait_s=max(left, 0.1))
            if res is not None:
                return res

    # -- external rollouts (an agent outside raas talks to the gateway) -------------------------------
    async def open_rollout(
        self,
        instance: dict[str, Any],
        *,
        sampling_params: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        priority: int | None = None,
        lease_s: float | None = None,
        open_timeout_s: float = 120.0,
    ) -> dict[str, Any]:
        """Open a rollout for an agent that runs outside raas: ``{rollout_id, job_id, key,
        openai_base_url, anthropic_base_url, close_url, ...}`` (the agent's SDKs take the base URLs and
        the key). Its result is the job's: ``wait(rollout["job_id"])``."""
        body: dict[str, Any] = {"instance": instance, "open_timeout_s": open_timeout_s}
        for name, value in (
            ("sampling_params", sampling_params),
            ("timeout_s", timeout_s),
            ("priority", priority),
            ("lease_s", lease_s),
        ):
            if value is not None:
                body[name] = value
        return await self._request(
            "POST", "/v1/gateway/rollouts", json_body=body, timeout_s=open_timeout_s + self.timeout_s
        )

    async def close_rollout(
        self,
        rollout: dict[str, Any],
        *,
        answer: str | None = None,
        patch: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """End a rollout :meth:`open_rollout` opened (with its key), with the agent's final ``answer`` or
        ``patch``; EVAL then grades it."""
        body = {
            k: v for k, v in (("answer", answer), ("patch", patch), ("metadata", metadata)) if v is not None
        }
        path = f"/gateway/v1/rollouts/{quote(str(rollout['rollout_id']), safe='')}/close"
        return await self._request(
            "POST", path, json_body=body, headers={"Authorization": f"Bearer {rollout['key']}"}
        )

    async def cancel(self, job_id: str) -> dict[str, Any]:
        return await self._request("DELETE", f"/v1/jobs/{quote(job_id, safe='')}")

    async def events(self, *, timeout_s: float | None = None) -> AsyncIterator[dict[str, Any]]:
        """Job state changes as they happen (Server-Sent Events), one dict per event."""
        async for name, data in self.stream_events(timeout_s=timeout_s):
            if name == "job" and data is not None:
                yield data

    async def stream_events(
        self, *, terminal_only: bool = False, timeout_s: float | None = None
    ) -> AsyncIterator[tuple[str, dict[str, Any] | None]]:
        """The raw event stream as ``(name, data)`` pairs: ``("connected", None)`` once the service has
        subscribed this stream (events from then on are not missed), ``("job", JobEvent dict)`` per state
        change, ``("dropped", {"dropped": n})`` when this consumer fell behind and events were lost.
        ``timeout_s`` bounds the wait for the next line (the service sends a keep-alive every 15 s)."""
        timeout = httpx.Timeout(self.timeout_s, read=timeout_s)
        params = {"terminal_only": "true"} if terminal_only else None
        try:
            async with self._http.stream("GET", "/v1/events", params=params, timeout=timeout) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    raise _error_from(resp)
                name = "job"
                data: list[str] = []
                async for line in resp.aiter_lines():
                    if line.startswith(": connected"):
                        yield "connected", None
                    elif line.startswith("event:"):
                        name = line[6:].strip() or "job"
                    elif line.startswith("data:"):
                        data.append(line[5:].lstrip(" "))
                    elif line == "" and data:
                        payload = "\n".join(data)
                        data = []
                        try:
                            body = json.loads(payload)
                        except ValueError:
                            continue
                        yield name, body if isinstance(body, dict) else None
                        name = "job"
        except httpx.TimeoutException as e:
            raise RaasError("event stream idle for too long", kind="timeout") from e
        except httpx.HTTPError as e:
            raise RaasError(f"event stream from {self.base_url} failed: {e}", kind="unavailable") from e

    # -- LLM servers --------------------------------------------------------------------------------
    async def servers(self) -> Any:
        return await self._request("GET", "/v1/llm/servers")

    async def add_server(self, address: str, weight_version: str | None = None) -> Any:
        body: dict[str, Any] = {"address": address}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return await self._request("POST", "/v1/llm/servers", json_body=body)

    async def remove_server(self, address: str) -> Any:
        return await self._request("DELETE", f"/v1/llm/servers/{quote(address, safe='')}")

    async def clear_servers(self) -> Any:
        return await self._request("POST", "/v1/llm/servers:clear")

    async def pause(self) -> Any:
        return await self._request("POST", "/v1/llm:pause")

    async def resume(self) -> Any:
        return await self._request("POST", "/v1/llm:resume")

    # -- service ------------------------------------------------------------------------------------
    async def health(self) -> Any:
        return await self._request("GET", "/healthz")

    async def status(self) -> dict[str, Any]:
        return await self._request("GET", "/status")


def _retry_after(resp: httpx.Response) -> float:
    try:
        return min(max(float(resp.headers.get("Retry-After", "1")), 0.05), 30.0)
    except ValueError:
        return 1.0


def _job_body(
    instance: dict[str, Any],
    sampling_params: dict[str, Any] | None,
    job_id: str | None,
    timeout_s: float | None,
    priority: int | None,
    retry_on_restart: bool | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"instance": instance}
    for key, value in (
        ("sampling_params", sampling_params),
        ("job_id", job_id),
        ("timeout_s", timeout_s),
        ("priority", priority),
        ("retry_on_restart", retry_on_restart),
    ):
        if value is not None:
            body[key] = value
    return body
