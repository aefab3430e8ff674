"""``raas swe eval`` as a user runs it, on the built small set (real images, bwrap sandboxes, the SWE
handler's own EVAL): a predictions file with a gold patch (resolved), a patch that fixes nothing
(unresolved, the failing tests named), a record with an empty ``test_patch`` whose tests come with the
patch, an image given as a path relative to the dataset file, a prediction for an unknown instance and a
malformed patch (an error row each, the others still graded); and ``--patch FILE --instance ID``."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
from tests.e2e.test_cli import RAAS, run_raas, wait_gone
from tests.e2e.test_swe_cli import swe_records  # noqa: F401 - the built small set, a fixture

from raas.tasks.swe.records import SweRecord

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

NOTE = "diff --git a/NOTES.md b/NOTES.md\nnew file mode 100644\n--- /dev/null\n+++ b/NOTES.md\n@@ -0,0 +1 @@\n+reviewed\n"


def swe_eval(cwd: Path, *args: str, mark: str) -> subprocess.CompletedProcess[str]:
    return run_raas(cwd, "swe", "eval", *args, mark=mark)


def test_swe_eval_grades_predictions_through_the_handler_eval(
    swe_records: list[SweRecord],  # noqa: F811
    tmp_path: Path,
) -> None:
    gold, wrong, tests_in_repo, relative = swe_records[0], swe_records[4], swe_records[8], swe_records[9]
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "inst").symlink_to(relative.image)
    rows: list[dict[str, Any]] = [
        gold.model_dump(mode="json"),
        wrong.model_dump(mode="json"),
        {**tests_in_repo.model_dump(mode="json"), "instance_id": "tests-in-repo", "test_patch": ""},
        {**relative.model_dump(mode="json"), "image": "./images/inst"},
        swe_records[1].model_dump(mode="json"),
    ]
    (tmp_path / "swe.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    preds = [
        {"instance_id": gold.instance_id, "model_patch": gold.patch, "model_name_or_path": "gold"},
        {"instance_id": wrong.instance_id, "model_patch": NOTE, "model_name_or_path": "notes"},
        # The record has no test patch: the tests come with the patch, and EVAL applies nothing else.
        {"instance_id": "tests-in-repo", "model_patch": tests_in_repo.patch + tests_in_repo.test_patch},
        {"instance_id": relative.instance_id, "model_patch": relative.patch},
        {"instance_id": "no-such-instance", "model_patch": gold.patch},
        {"instance_id": swe_records[1].instance_id, "model_patch": "please fix the bug"},
    ]
    (tmp_path / "preds.jsonl").write_text("".join(json.dumps(p) + "\n" for p in preds))
    mark = uuid.uuid4().hex
    proc = swe_eval(tmp_path, "swe.jsonl", "-p", "preds.jsonl", "-o", "out.jsonl", "--json", mark=mark)
    assert proc.returncode == 1, proc.stderr[-3000:]  # two predictions could not be graded
    doc = json.loads(proc.stdout)  # --json: stdout is one JSON document and nothing else
    assert (doc["predictions"], doc["graded"], doc["resolved"], doc["errors"]) == (6, 4, 3, 2), doc
    assert "raas swe eval" in proc.stderr and "Traceback" not in proc.stderr
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert out == doc["results"]
    by_id = {r["instance_id"]: r for r in out}

    g = by_id[gold.instance_id]
    assert (g["status"], g["reward"], g["resolved"], g["outcome"], g["filter"]) == (
        "completed",
        1.0,
        True,
        "resolved",
        False,
    )
    assert g["model_name_or_path"] == "gold" and g["failing_tests"] == []
    assert sorted(g["tests"]["FAIL_TO_PASS"]["passed"]) == sorted(gold.FAIL_TO_PASS)
    assert g["artifacts"]["eval_details"]["tests_status"]["FAIL_TO_PASS"]["success"]
    assert g["artifacts"]["eval_details"]["eval_sandbox"] == "fresh" and g["timing"]["eval_s"] > 0

    w = by_id[wrong.instance_id]
    assert (w["status"], w["reward"], w["resolved"], w["outcome"]) == ("completed", 0.0, False, "unresolved")
    assert sorted(w["failing_tests"]) == sorted(wrong.FAIL_TO_PASS)
    assert sorted(w["tests"]["FAIL_TO_PASS"]["failed"]) == sorted(wrong.FAIL_TO_PASS)
    assert not w["tests"]["PASS_TO_PASS"]["failed"]

    assert by_id["tests-in-repo"]["outcome"] == "resolved", by_id["tests-in-repo"]
    assert by_id[relative.instance_id]["outcome"] == "resolved", by_id[relative.instance_id]

    missing = by_id["no-such-instance"]
    assert missing["status"] == "failed" and missing["reward"] is None and missing["filter"] is True
    assert missing["error"]["kind"] == "not_found" and "not in the dataset" in missing["error"]["message"]
    bad = by_id[swe_records[1].instance_id]
    assert bad["error"]["kind"] == "bad_request" and "not a unified diff" in bad["error"]["message"]
    assert wait_gone(mark) == []


def test_swe_eval_one_patch_file(swe_records: list[SweRecord], tmp_path: Path) -> None:  # noqa: F811
    rec = swe_records[2]
    (tmp_path / "swe.json").write_text(json.dumps([rec.model_dump(mode="json")]))
    (tmp_path / "fix.diff").write_text(rec.patch)
    mark = uuid.uuid4().hex
    proc = swe_eval(
        tmp_path, "swe.json", "--patch", "fix.diff", "--instance", rec.instance_id, "--json", mark=mark
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert (doc["graded"], doc["resolved"], doc["errors"]) == (1, 1, 0)
    (row,) = doc["results"]
    assert row["model_name_or_path"] == "fix.diff" and row["resolved"] is True
    assert (tmp_path / "swe-eval.jsonl").is_file()
    missing = swe_eval(tmp_path, "swe.json", "--patch", "fix.diff", mark=mark)
    assert missing.returncode == 2 and "--patch needs --instance" in missing.stderr
    assert wait_gone(mark) == []


def test_raas_run_replay_policy_plays_the_patches(swe_records: list[SweRecord], tmp_path: Path) -> None:  # noqa: F811
    """``raas run --policy replay``: no model; each patch is applied through the RUN sandbox's bash tool,
    taken back out by the handler and graded in EVAL (gold: resolved; a note: unresolved)."""
    gold, other = swe_records[3], swe_records[7]
    data = tmp_path / "swe.jsonl"
    data.write_text(
        json.dumps(gold.model_dump(mode="json")) + "\n" + json.dumps(other.model_dump(mode="json")) + "\n"
    )
    preds = tmp_path / "preds.json"
    preds.write_text(
        json.dumps(
            {
                gold.instance_id: {"model_patch": gold.patch, "model_name_or_path": "gold"},
                other.instance_id: {"model_patch": NOTE, "model_name_or_path": "note"},
            }
        )
    )
    mark = uuid.uuid4().hex
    args = ["run", str(data), "--policy", "replay", "--patches", str(preds), "--sandbox", "bwrap", "--json"]
    proc = run_raas(tmp_path, *args, "-o", str(tmp_path / "out.jsonl"), mark=mark)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["status"] == {"completed": 2} and summary["reward_mean"] == 0.5, summary
    rows = {r["instance_id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    g, o = rows[gold.instance_id], rows[other.instance_id]
    assert (g["reward"], g["artifacts"]["outcome"], g["artifacts"]["finish_reason"]) == (
        1.0,
        "resolved",
        "finish_tool",
    )
    assert g["artifacts"]["git_patch"].strip() and g["turns"] and g["token_trajectory"]["response_ids"]
    assert "NOTES.md" in o["artifacts"]["git_patch"] and o["artifacts"]["outcome"] == "unresolved"
    assert o["reward"] == 0.0
    bad = subprocess.run(
        [*RAAS, "run", str(data), "--policy", "replay"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert bad.returncode == 2 and "--policy replay needs --patches" in bad.stderr
    assert wait_gone(mark) == []
