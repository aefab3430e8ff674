"""Generate clients, one per inference-server kind, and detection of a server's kind."""

from __future__ import annotations

from typing import Any

import httpx

from raas.errors import RaasError
from raas.llm.servers.base import ServerClient
from raas.llm.servers.llamacpp import LlamaCppClient
from raas.llm.servers.sglang import SGLangClient
from raas.llm.servers.vllm import VLLMClient

CLIENTS: dict[str, type[ServerClient]] = {
    "llamacpp": LlamaCppClient,
    "vllm": VLLMClient,
    "sglang": SGLangClient,
}
_ALIASES = {"llama.cpp": "llamacpp", "llama-cpp": "llamacpp", "llama": "llamacpp"}


async def detect_kind(address: str, http: httpx.AsyncClient, timeout_s: float = 5.0) -> str:
    """Tell the server kind from the endpoints it answers: llama.cpp has ``/props``, SGLang has
    ``/get_model_info``, vLLM has ``/v1/models`` with ``max_model_len``."""
    base = address.rstrip("/")

    async def ok(path: str) -> Any:
        try:
            r = await http.get(base + path, timeout=timeout_s)
        except httpx.HTTPError:
            return None
        if not r.is_success:
            return None
        try:
            return r.json()
        except ValueError:
            return None

    props = await ok("/props")
    if isinstance(props, dict) and ("default_generation_settings" in props or "total_slots" in props):
        return "llamacpp"
    if isinstance(await ok("/get_model_info"), dict):
        return "sglang"
    models = await ok("/v1/models")
    if isinstance(models, dict) and models.get("data"):
        return "vllm"
    raise RaasError(f"cannot tell what kind of inference server answers at {address}", kind="llm_unavailable")


def make_client(kind: str, address: str, http: httpx.AsyncClient, **kwargs: Any) -> ServerClient:
    kind = _ALIASES.get(kind, kind)
    if kind not in CLIENTS:
        raise RaasError(f"unknown server kind {kind!r} (known: {', '.join(CLIENTS)})", kind="bad_request")
    return CLIENTS[kind](address, http, **kwargs)


__all__ = [
    "CLIENTS",
    "LlamaCppClient",
    "SGLangClient",
    "ServerClient",
    "VLLMClient",
    "detect_kind",
    "make_client",
]
