"""The SWE commands as a user runs them: ``raas run swe.jsonl`` (the embedded model, bwrap sandboxes, one
short job) and ``raas images pull`` (converting a dataset's images once, in parallel, with a progress bar)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
from tests.conftest import unavailable
from tests.e2e.test_cli import RAAS, run_raas, wait_gone

from raas.errors import RaasError
from raas.sandbox.images import build_sif
from raas.tasks.swe.build import BuildOptions, build
from raas.tasks.swe.packages import FAST_PACKAGES
from raas.tasks.swe.records import SweRecord

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

SMALL_SET = {"packages": list(FAST_PACKAGES), "per_package": 4, "seed": 0, "jobs": 2}


@pytest.fixture(scope="module")
def swe_records(backend_available: dict[str, str | None]) -> list[SweRecord]:
    if backend_available.get("bwrap"):
        unavailable(str(backend_available["bwrap"]))
    try:
        records, _ = asyncio.run(build(BuildOptions(**SMALL_SET)))  # type: ignore[arg-type]
    except RaasError as e:
        if os.geteuid() != 0 and e.kind == "sandbox_start_failed":
            unavailable(f"the SWE small set is not built and this user cannot build it: {e.message}")
        raise
    return records


def test_raas_run_swe_jsonl_with_the_embedded_model(swe_records: list[SweRecord], tmp_path: Path) -> None:
    data = tmp_path / "swe.jsonl"
    data.write_text(json.dumps(swe_records[5].model_dump(mode="json")) + "\n")
    out = tmp_path / "results.jsonl"
    mark = uuid.uuid4().hex
    args = ["--sandbox", "bwrap", "--max-turns", "2", "--max-tokens", "64", "--context-budget", "4096"]
    proc = run_raas(tmp_path, "run", str(data), *args, "-o", str(out), "--json", mark=mark)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["jobs"] == 1 and summary["status"] == {"completed": 1}, summary
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    arts = row["artifacts"]
    # The tiny model's reward does not matter; the path does: a real RUN, a patch taken, a graded EVAL.
    assert row["reward"] in (0.0, 1.0) and row["filter"] is False
    assert "git_patch" in arts and arts["outcome"] in (
        "resolved",
        "unresolved",
        "empty_patch",
        "patch_failed",
    )
    assert row["turns"] and row["token_trajectory"]["response_ids"]
    assert row["timing"]["prewarm_s"] > 0
    assert wait_gone(mark) == []


def test_images_pull_converts_each_image_once(
    swe_records: list[SweRecord], tmp_path: Path, backend_available: dict[str, str | None]
) -> None:
    if backend_available.get("apptainer"):
        unavailable(str(backend_available["apptainer"]))
    tiny = tmp_path / "tiny-root"
    (tiny / "testbed").mkdir(parents=True)
    (tiny / "testbed" / "README").write_text("a tiny image\n")
    sif = build_sif(tiny, tmp_path / "tiny.sif")
    built = swe_records[0].model_dump(mode="json")
    rows = [
        built,
        {**swe_records[1].model_dump(mode="json"), "image": str(sif)},
        {**swe_records[2].model_dump(mode="json"), "image": str(sif)},  # the same SIF: one conversion
    ]
    data = tmp_path / "swe.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {**os.environ, "RAAS_IMAGE_CACHE": str(tmp_path / "cache")}

    def pull(dataset: Path) -> subprocess.CompletedProcess[str]:
        cmd = [*RAAS, "images", "pull", str(dataset), "--jobs", "2", "--json"]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)

    first = pull(data)
    assert first.returncode == 0, first.stderr[-3000:]
    results = {r["reference"]: r for r in json.loads(first.stdout.strip().splitlines()[-1])}
    assert set(results) == {built["image"], str(sif)}
    assert results[built["image"]]["cached"] and results[built["image"]]["path"] == built["image"]
    converted = results[str(sif)]
    assert (
        not converted["cached"]
        and (Path(converted["path"]) / "testbed" / "README").read_text() == "a tiny image\n"
    )
    assert "2 of 2 images ready (3 rows)" in first.stderr
    again = pull(data)
    assert again.returncode == 0
    assert all(r["cached"] for r in json.loads(again.stdout.strip().splitlines()[-1]))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**built, "image": str(tmp_path / "missing.sif")}) + "\n")
    failed = pull(bad)
    assert failed.returncode == 1 and "failed" in failed.stderr and "Traceback" not in failed.stderr
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)
