"""Weight syncs into a llama.cpp server: the trainer's weights, written as a GGUF, served by a
``llama-server`` this object owns, restarted on the same port with each new version.

llama.cpp cannot load new weights into a running server, so a sync is a restart. It is split in two so
that the inference servers wait as little as possible:

* :meth:`LlamaWeightSync.write` exports the new weights to a fresh file while rollouts still run (the
  running server keeps the old file's pages mapped: the new file is renamed over it, never rewritten);
* :meth:`LlamaWeightSync.restart` runs inside raas's pause (``DynamicSampler.update_weights`` /
  ``RolloutClient.weight_sync``): no generate call is in flight, the server restarts on its port with the
  new file, and raas stamps the new version before it resumes. The services' health checks are off while
  paused, so the restart is not mistaken for a failure.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from raas.errors import RaasError
from raas.llm.embedded import EmbeddedServer
from raas.trainer.hf_weights import TensorType, export_gguf

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class LlamaWeightSync:
    """``async with LlamaWeightSync(model, template=gguf) as sync: sync.url`` serves ``model``'s current
    weights (``template``: the GGUF the model was loaded from, for its metadata)."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        parallel: int = 8,
        ctx_per_slot: int = 1024,
        threads: int | None = None,
        tensor_type: TensorType = "f16",
        template: str | Path,
        workdir: str | Path | None = None,
    ) -> None:
        self.model = model
        self.parallel = parallel
        self.ctx_per_slot = ctx_per_slot
        self.threads = threads
        self.tensor_type: TensorType = tensor_type
        self.template = template
        self._own_dir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="raas-policy-"))
        self.path = self.workdir / "policy.gguf"
        self.server: EmbeddedServer | None = None
        self.port: int | None = None
        self.last_write_s = 0.0
        self.last_restart_s = 0.0

    @property
    def url(self) -> str:
        if self.server is None:
            raise RaasError("the policy server is not running", kind="llm_unavailable")
        return self.server.url

    async def write(self) -> float:
        """Export the model's current weights (in a thread: the event loop keeps serving); seconds taken."""
        started = time.monotonic()
        await asyncio.to_thread(
            export_gguf, self.model, self.path, template=self.template, tensor_type=self.tensor_type
        )
        self.last_write_s = time.monotonic() - started
        return self.last_write_s

    async def start(self) -> str:
        """Write the weights and start the server on a free port; returns its URL."""
        await self.write()
        await self._launch()
        return self.url

    async def _launch(self) -> None:
        server = EmbeddedServer(
            self.path,
            port=self.port,
            parallel=self.parallel,
            ctx_per_slot=self.ctx_per_slot,
            threads=self.threads,
        )
        await server.start()
        self.server = server
        self.port = server.port

    async def restart(self) -> float:
        """Stop the server and start it on the same port with the last written file; seconds taken.
        Call it while raas is paused (no generate call in flight)."""
        started = time.monotonic()
        if self.server is not None:
            await self.server.stop()
            self.server = None
        await self._launch()
        self.last_restart_s = time.monotonic() - started
        return self.last_restart_s

    async def aclose(self) -> None:
        if self.server is not None:
            await self.server.stop()
            self.server = None
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    async def __aenter__(self) -> LlamaWeightSync:
        try:
            await self.start()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
