"""Image gates: many jobs of one image convert it once; starts are capped per image and per node."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest
from tests.conftest import unavailable

from raas.errors import RaasError
from raas.sandbox.images import build_sif
from raas.tasks.swe.images import ImageGates

pytestmark = pytest.mark.integration


async def test_one_conversion_per_image_however_many_jobs_ask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend_available: dict[str, str | None]
) -> None:
    if backend_available.get("apptainer"):
        unavailable(str(backend_available["apptainer"]))
    root = tmp_path / "root"
    (root / "testbed").mkdir(parents=True)
    (root / "testbed" / "f.py").write_text("x = 1\n")
    sif = build_sif(root, tmp_path / "img.sif")
    cache = tmp_path / "cache"
    monkeypatch.setenv("RAAS_IMAGE_CACHE", str(cache))
    gates = ImageGates(starts_per_image=2, starts_per_node=3)
    paths = await asyncio.gather(*(gates.resolve(str(sif)) for _ in range(8)))
    assert len(set(paths)) == 1 and (paths[0] / "testbed" / "f.py").read_text() == "x = 1\n"
    assert [p.name for p in cache.iterdir() if p.is_dir()] == [paths[0].name]
    assert await gates.repo_mb(paths[0], "/testbed") > 0
    with pytest.raises(RaasError) as err:
        await gates.resolve(str(tmp_path / "missing.sif"))
    assert err.value.kind == "sandbox_start_failed" and "missing.sif" in err.value.message


async def test_starts_are_capped_per_image_and_per_node() -> None:
    gates = ImageGates(starts_per_image=2, starts_per_node=3)
    active: Counter[str] = Counter()
    peak: Counter[str] = Counter()

    async def start(ref: str) -> None:
        async with gates.start_slot(ref):
            active[ref] += 1
            active["node"] += 1
            peak[ref] = max(peak[ref], active[ref])
            peak["node"] = max(peak["node"], active["node"])
            await asyncio.sleep(0.02)  # holds the slot while the others queue
            active[ref] -= 1
            active["node"] -= 1

    await asyncio.gather(*(start(ref) for ref in ["a"] * 6 + ["b"] * 6))
    assert peak["a"] <= 2 and peak["b"] <= 2 and peak["node"] <= 3
    assert peak["node"] == 3 and max(peak["a"], peak["b"]) == 2  # the caps are reached, not just respected
