"""``builtin:swe-mini:train`` and ``builtin:swe-mini:test``: the curriculum as a built-in dataset.

The records point at images in the image cache, so the first use builds them (~20 minutes on 2 cores,
as root: :mod:`.build`); later uses read the cached build. Splits share no module of the corpus.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from raas.errors import RaasError

from .build import LEVELS, MiniOptions, build_mini, split_records
from .corpus import SPLITS


def build_default(opts: MiniOptions | None = None) -> list[Any]:
    """The default build's records (built once, then cached), from sync code with or without a running
    event loop in this thread (it then builds on a thread of its own)."""
    opts = opts or MiniOptions()

    def run() -> list[Any]:
        records, _ = asyncio.run(build_mini(opts))
        return records

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return run()
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="raas-swe-mini") as pool:
        return pool.submit(run).result()


def swe_mini(
    n: int | None = None, *, split: str = "train", levels: tuple[str, ...] = LEVELS
) -> list[dict[str, Any]]:
    """The first ``n`` (default all) instances of ``split`` at ``levels``: a prefix mixes the levels."""
    if split not in SPLITS:
        raise RaasError(
            f"builtin:swe-mini has the splits {', '.join(SPLITS)}, not {split!r}", kind="bad_request"
        )
    rows = split_records(build_default(), split, levels)
    if n is not None:
        if not 1 <= n <= len(rows):
            raise RaasError(
                f"builtin:swe-mini:{split} size must be in 1..{len(rows)}, got {n}", kind="bad_request"
            )
        rows = rows[:n]
    return rows
