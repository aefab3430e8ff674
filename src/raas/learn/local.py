"""The raas service a trainer samples from: one in this process (what ``raas serve`` runs, on a free local
port) or a running one pointed at the trainer's inference server."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from raas.trainer.rollout import RolloutClient


async def policy_tokenizer(model: str | None) -> Path:
    """The chat tokenizer dir of a policy GGUF (None: the embedded model), prepared once. Keyed by the
    file's path, so two checkpoints with the same file name never share a directory by accident."""
    from raas.llm.models import prepare_tokenizer, raas_home

    if not model:
        return await asyncio.to_thread(prepare_tokenizer)

    def prepare() -> Path:
        source = Path(model).resolve()
        key = hashlib.sha256(str(source).encode()).hexdigest()[:10]
        return prepare_tokenizer(source, raas_home() / "models" / f"{source.stem}-{key}" / "tokenizer")

    return await asyncio.to_thread(prepare)


@contextlib.asynccontextmanager
async def local_service(
    llm_urls: Sequence[str],
    tokenizer: Path,
    *,
    run_workers: int = 8,
    sandbox: dict[str, Any] | None = None,
) -> AsyncIterator[str]:
    """A raas service in this process on a free local port, its state in a temp dir removed on exit;
    yields its URL."""
    from raas.api.app import served
    from raas.pipeline.config import ServiceConfig
    from raas.pipeline.service import RolloutService

    with tempfile.TemporaryDirectory(prefix="raas-train-") as state:
        config = ServiceConfig(
            state_dir=Path(state),
            llm_servers=list(llm_urls),
            tokenizer_dir=tokenizer,
            run_workers=run_workers,
            max_pending=4096,
            shutdown_grace_s=0.0,
            default_timeout_s=900,
            **({"sandbox": sandbox} if sandbox else {}),
        )
        async with served(RolloutService(config)) as url:
            yield url


@contextlib.asynccontextmanager
async def rollout_service(
    llm_url: str,
    *,
    server: str | None = None,
    model: str | None = None,
    run_workers: int = 8,
    sandbox: dict[str, Any] | None = None,
) -> AsyncIterator[str]:
    """``server`` pointed at this trainer's inference server ``llm_url``, or (None) a service in this
    process that templates and tokenizes with the policy's own tokenizer (``model``'s)."""
    if server is not None:
        async with RolloutClient(server) as c:
            await c.assign_llm_servers([llm_url], weight_version="0")
        yield server
        return
    tokenizer = await policy_tokenizer(model)
    async with local_service([llm_url], tokenizer, run_workers=run_workers, sandbox=sandbox) as url:
        yield url
