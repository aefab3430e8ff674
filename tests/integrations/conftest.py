"""One raas service and one embedded llama-server for the trainer-plugin tests: the lookup task (a bash tool
in a bwrap sandbox, several turns), the llama-server standing in for the trainer's own inference server.
The service starts with no inference server: each trainer's plugin must register the one its trainer names."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from raas.agent.config import AgentConfig
from raas.cli.inprocess import service_in_process
from raas.core.jobs import JobResult
from raas.llm.embedded import EmbeddedServer
from raas.llm.models import default_gguf_path, prepare_tokenizer
from raas.pipeline.config import ServiceConfig
from raas.tasks.datasets import load_dataset
from tests.conftest import unavailable

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Stack:
    url: str
    llama_url: str

    @property
    def llama_address(self) -> str:
        """``host:port``, as trainers name their servers."""
        return self.llama_url.split("://", 1)[1].rstrip("/")

    async def result(self, job_id: str) -> JobResult:
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as c:
            r = await c.get(f"/v1/jobs/{job_id}/result")
            assert r.status_code == 200, (job_id, r.text)
            return JobResult.model_validate(r.json())

    async def reset_servers(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as c:
            r = await c.post("/v1/llm/servers:clear")
            assert r.status_code == 200, r.text
            await c.post("/v1/llm:resume")


@pytest.fixture(scope="package")
async def stack(
    tmp_path_factory: pytest.TempPathFactory, test_image: Path, backend_available: dict[str, str | None]
) -> AsyncIterator[Stack]:
    if backend_available.get("bwrap"):
        unavailable(str(backend_available["bwrap"]))
    config = ServiceConfig(
        state_dir=tmp_path_factory.mktemp("plugins-svc"),
        sandbox={"backend": "bwrap", "image": str(test_image), "start_timeout_s": 120},
        tokenizer_dir=prepare_tokenizer(),
        agent=AgentConfig(max_turns=4, max_tokens_per_turn=256, context_budget=1536),
        init_workers=2,
        run_workers=4,
        eval_workers=2,
        default_timeout_s=300,
        shutdown_grace_s=0.0,
    )
    async with EmbeddedServer(parallel=4, ctx_per_slot=1536) as llama:
        async with service_in_process(config) as url:
            yield Stack(url=url, llama_url=llama.url)


def lookup_instances(count: int) -> list[dict[str, Any]]:
    return load_dataset(f"builtin:lookup:{count}")


@pytest.fixture(scope="package")
def hf_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded model as a Hugging Face model dir (config + tokenizer), which trainers load their
    tokenizer and model config from: the config read from the shipped GGUF, the prepared tokenizer."""
    from transformers import AutoConfig

    gguf = default_gguf_path()
    out = tmp_path_factory.mktemp("smollm2-hf")
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config.architectures = ["LlamaForCausalLM"]  # what a checkpoint's config names; the GGUF does not
    config.save_pretrained(out)
    for f in prepare_tokenizer().iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    return out


def multi_turn(mask: list[int]) -> bool:
    """A response whose sampled tokens come in more than one run (tool output between them)."""
    runs, prev = 0, 0
    for m in mask:
        if m and not prev:
            runs += 1
        prev = m
    return runs > 1


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=1)[:4000]
