"""A weight sync really changes what llama.cpp serves: the server started from the trainer's weights
gives the trainer's log-probs, and after the trainer's weights change (here: the final norm zeroed, so
every next token is equally likely) a write + restart serves the new weights on the same port. Nothing
is left behind: the server process and the weights directory are gone after close."""

from __future__ import annotations

import math
import os
from typing import Any

import httpx
import pytest
import torch

from raas.learn.llama_sync import LlamaWeightSync
from raas.llm.models import default_gguf_path
from raas.trainer.hf_weights import load_policy

pytestmark = pytest.mark.integration

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 2, 198, 1, 4093, 198]


async def sample(url: str) -> list[tuple[int, float]]:
    body = {
        "prompt": PROMPT,
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 7,
        "logprobs": 1,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
    }
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(f"{url}/v1/completions", json=body)
    r.raise_for_status()
    content = r.json()["choices"][0]["logprobs"]["content"]
    return [(int(c["id"]), float(c["logprob"])) for c in content]


def trainer_logprobs(model: Any, tokens: list[int]) -> list[float]:
    ids = torch.tensor([PROMPT + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    return [float(logp[len(PROMPT) - 1 + i, t]) for i, t in enumerate(tokens)]


async def test_the_server_serves_the_trainers_weights_after_each_sync() -> None:
    model = load_policy(default_gguf_path())
    sync = LlamaWeightSync(model, template=default_gguf_path(), parallel=1, ctx_per_slot=256)
    async with sync:
        port, workdir, pid = sync.port, sync.workdir, sync.server.pid if sync.server else None
        served = await sample(sync.url)
        tokens = [t for t, _ in served]
        for (_, lp_server), lp_trainer in zip(served, trainer_logprobs(model, tokens), strict=True):
            assert abs(lp_server - lp_trainer) < 0.05  # f16 weights vs the trainer's fp32
        with torch.no_grad():
            model.model.norm.weight.zero_()  # logits all 0: every token has probability 1/vocab
        await sync.write()
        await sync.restart()
        assert sync.port == port and sync.server is not None and sync.server.pid != pid
        uniform = -math.log(model.config.vocab_size)
        after = await sample(sync.url)
        assert all(abs(lp - uniform) < 1e-3 for _, lp in after), after
    assert sync.server is None and not workdir.exists()
    assert pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
