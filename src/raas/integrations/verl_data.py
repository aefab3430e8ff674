"""verl's side of raas that needs no verl: the dataset rows that select the raas agent loop, the raas
instance a row carries, and verl's sampling params in raas's terms. Importable where verl is not (a data
preparation script, raas's own tests)."""

from __future__ import annotations

import json
from typing import Any

from raas.errors import RaasError

AGENT_NAME = "raas"
"""The name :class:`raas.integrations.verl.RaasAgentLoop` registers under (``agent_name`` in a row)."""


def instance_of(sample: dict[str, Any]) -> dict[str, Any]:
    """The raas instance a verl dataset row carries: its ``raas_instance`` column, or ``extra_info``'s
    (a dict or its JSON, as :func:`verl_rows` writes it)."""
    extra = sample.get("extra_info")
    value = sample.get("raas_instance")
    if value is None and isinstance(extra, dict):
        value = extra.get("raas_instance")
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, dict):
        raise RaasError(
            "the verl row has no raas instance: put it in extra_info.raas_instance (raas.integrations.verl.verl_rows)",
            kind="bad_request",
        )
    return value


def verl_rows(instances: list[dict[str, Any]], *, prompt_key: str = "problem") -> list[dict[str, Any]]:
    """verl's dataset rows (``RLHFDataset`` columns) for raas instances: ``agent_name`` selects the raas
    agent loop, the instance rides in ``extra_info.raas_instance``. ``prompt`` is only what verl's dataset
    filters and logs; the task's own prompt is built by raas. Write them with ``pandas.to_parquet``."""
    rows = []
    for i, inst in enumerate(instances):
        text = str(inst.get(prompt_key) or inst.get("instance_id") or f"instance {i}")
        rows.append(
            {
                "data_source": str(inst.get("data_source", "raas")),
                "prompt": [{"role": "user", "content": text}],
                "agent_name": AGENT_NAME,
                "reward_model": {"style": "raas", "ground_truth": ""},
                "extra_info": {"index": i, "raas_instance": json.dumps(inst)},
            }
        )
    return rows


def sampling_params_from(verl_params: dict[str, Any], max_tokens: int | None = None) -> dict[str, Any]:
    """verl's per-sample sampling params as raas's (raas always returns the sampling logprobs)."""
    out: dict[str, Any] = {}
    for key in ("temperature", "top_p", "repetition_penalty"):
        if verl_params.get(key) is not None:
            out[key] = float(verl_params[key])
    top_k = verl_params.get("top_k")
    if top_k is not None and int(top_k) > 0:
        out["top_k"] = int(top_k)
    if max_tokens is not None:
        out["max_tokens"] = int(max_tokens)
    return out
