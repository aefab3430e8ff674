"""The SWE handler's pure parts: record shapes, SWE-bench's conventions for classic records, image names,
R2E-Gym's grading rule, SWE-bench's grading of whole eval-script logs.

``data/swebench_records.jsonl`` holds three records in the shape of public SWE-bench Verified rows (the
hub's fields, ``FAIL_TO_PASS`` / ``PASS_TO_PASS`` as JSON-encoded strings; patches shortened);
``data/r2e_records.jsonl`` one in R2E-Gym's shape. Their images cannot run here (no Docker registry), so
what is checked is what raas derives from them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from raas.errors import RaasError
from raas.tasks.datasets import load_file
from raas.tasks.registry import HandlerRegistry
from raas.tasks.swe import grading, r2e, specs
from raas.tasks.swe.evaluation import environment_failure
from raas.tasks.swe.images import image_reference
from raas.tasks.swe.instance import parse_task
from raas.tasks.swe.patch import exclude_pathspecs
from raas.tasks.swe.workspace import _quote_exclude

pytestmark = pytest.mark.unit

DATA = Path(__file__).parent / "data"


def records() -> dict[str, dict[str, Any]]:
    rows = [json.loads(line) for line in (DATA / "swebench_records.jsonl").read_text().splitlines()]
    return {r["instance_id"]: r for r in rows}


def test_classic_records_get_swebench_test_commands_and_parsers() -> None:
    from swebench.harness.log_parsers import PARSER_REGISTRY
    from swebench.harness.log_parsers.python import MAP_REPO_TO_PARSER_PY

    recs = records()
    astropy = parse_task(recs["astropy__astropy-12907"])
    assert astropy.grading == "test_cmd" and astropy.derived
    assert astropy.fail_to_pass[0].endswith("test_separable[compound_model6-result6]")  # JSON string read
    assert astropy.test_cmd is not None
    assert astropy.test_cmd.endswith(f"{specs.TEST_ASTROPY} astropy/modeling/tests/test_separable.py")
    assert astropy.test_cmd.startswith(specs.CONDA_ACTIVATE)
    django = parse_task(recs["django__django-11099"])
    assert django.test_cmd is not None and django.test_cmd.endswith(
        f"{specs.TEST_DJANGO} auth_tests.test_validators"
    )
    sympy = parse_task(recs["sympy__sympy-20590"])
    assert sympy.test_cmd is not None and sympy.test_cmd.endswith(
        f"{specs.TEST_SYMPY} sympy/core/tests/test_basic.py"
    )
    for task in (astropy, django, sympy):
        assert task.log_parser is not None
        assert PARSER_REGISTRY[task.log_parser] is MAP_REPO_TO_PARSER_PY[task.repo]
        assert task.protected_files == specs.test_patch_files(task.test_patch)


def test_directives_skip_non_test_files_and_django_uses_module_labels() -> None:
    patch = (
        "diff --git a/tests/forms_tests/tests/test_forms.py b/tests/forms_tests/tests/test_forms.py\n"
        "diff --git a/tests/forms_tests/data.json b/tests/forms_tests/data.json\n"
        "diff --git a/docs/notes.txt b/docs/notes.txt\n"
    )
    assert specs.test_directives("django/django", patch) == ["forms_tests.tests.test_forms"]
    assert specs.test_directives("psf/requests", patch) == ["tests/forms_tests/tests/test_forms.py"]
    assert specs.derive_test_cmd("django/django", "1.9", patch).endswith(  # type: ignore[union-attr]
        f"{specs.TEST_DJANGO_NO_PARALLEL} forms_tests.tests.test_forms"
    )
    assert specs.derive_test_cmd("someone/unknown", "1.0", patch) is None


def test_a_record_that_names_its_grading_keeps_it() -> None:
    rec = records()["astropy__astropy-12907"]
    own = parse_task({**rec, "test_cmd": "pytest -rA x.py", "log_parser": "parse_log_pytest"})
    assert (own.test_cmd, own.log_parser, own.derived) == ("pytest -rA x.py", "parse_log_pytest", False)
    script = "cd /testbed\n: '>>>>> Start Test Output'\npytest -rA x.py\n: '>>>>> End Test Output'\n"
    v5 = parse_task(
        {**rec, "eval_script": script, "log_parser": "parse_log_pytest", "eval_type": "pass_and_fail"}
    )
    assert v5.grading == "eval_script" and v5.eval_script == script


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"FAIL_TO_PASS": None}, "FAIL_TO_PASS"),
        ({"FAIL_TO_PASS": "[not json"}, "FAIL_TO_PASS"),
        ({"FAIL_TO_PASS": "[]"}, "FAIL_TO_PASS"),
        ({"PASS_TO_PASS": 3}, "PASS_TO_PASS"),
        ({"base_commit": "main"}, "base_commit"),
        ({"test_patch": "just text"}, "test_patch"),
        ({"problem_statement": ""}, "problem_statement"),
        ({"instance_id": "../../etc"}, "instance_id"),
        ({"workdir": "testbed"}, "workdir"),
        ({"repo": "me/unknown"}, "test_cmd"),
        ({"log_parser": "parse_log_nonsense"}, "log_parser"),
    ],
)
def test_bad_records_name_the_field(change: dict[str, Any], field: str) -> None:
    rec = {**records()["astropy__astropy-12907"], **change}
    rec = {k: v for k, v in rec.items() if v is not None}
    with pytest.raises(RaasError) as err:
        parse_task(rec)
    assert err.value.kind == "bad_request" and f"field {field}" in err.value.message, err.value.message


def test_r2e_records() -> None:
    row = json.loads((DATA / "r2e_records.jsonl").read_text().splitlines()[0])
    task = parse_task(row)
    assert task.grading == "r2e" and task.base_commit is None
    assert task.image == f"docker://{row['docker_image']}"
    assert task.expected_output == {"test_1.py::test_empty": "PASSED", "test_1.py::test_full": "PASSED"}
    assert "/r2e_tests" in task.hidden_paths and "run_tests.sh" in task.protected_files
    with pytest.raises(RaasError, match="field expected_output_json"):
        parse_task({**row, "expected_output_json": "{oops"})
    with pytest.raises(RaasError, match="field docker_image"):
        parse_task({k: v for k, v in row.items() if k != "docker_image"})


def test_swebench_image_names() -> None:
    from swebench.task.checks import expected_image

    name = specs.swebench_image_name("astropy__astropy-12907")
    assert name == "sweb.eval.x86_64.astropy_1776_astropy-12907:latest"
    assert expected_image("astropy__astropy-12907") == f"swebench/{name}"
    task = parse_task(records()["astropy__astropy-12907"])
    assert image_reference(task) == f"docker://docker.io/swebench/{name}"
    assert image_reference(task, "/shared/sifs/{name}.sif") == f"/shared/sifs/{name}.sif"
    assert image_reference(task, "docker://registry.local/{instance_id}") == (
        "docker://registry.local/astropy__astropy-12907"
    )
    task.image = "swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest"  # a SWE-bench 5 row's image
    assert image_reference(task) == f"docker://{task.image}"
    task.image = "docker-archive:/data/img.tar"
    assert image_reference(task) == "docker-archive:/data/img.tar"
    task.image = None
    with pytest.raises(RaasError, match="image_template"):
        image_reference(task, "{nope}")


def test_r2e_grading_follows_r2e_gym() -> None:
    log = (
        "r2e_tests/test_1.py ..F\n=== short test summary info ===\n"
        "PASSED r2e_tests/test_1.py::test_empty\nPASSED r2e_tests/test_1.py::TestX::test_full\n"
        "FAILED r2e_tests/test_1.py::test_other - AssertionError: boom\n"
    )
    assert r2e.parse_log(log) == {
        "test_1.py::test_empty": "PASSED",
        "test_1.py::test_full": "PASSED",
        "test_1.py::test_other": "FAILED",
    }
    expected = {
        "test_1.py::test_empty": "PASSED",
        "test_1.py::test_full": "PASSED",
        "test_1.py::test_other": "FAILED",
    }
    assert r2e.grade(log, expected).resolved  # statuses must match, failures included
    assert not r2e.grade(log, {**expected, "test_1.py::test_other": "PASSED"}).resolved
    assert not r2e.grade(log, {"test_1.py::test_empty": "PASSED"}).resolved  # sizes differ
    coloured = log.replace("test_empty", "\x1b[32mtest_empty\x1b[0m")
    assert r2e.grade(coloured, expected).resolved
    assert not r2e.grade("no summary here", expected).log_valid


def test_a_whole_eval_script_log_is_graded_by_swebench() -> None:
    record = {
        "FAIL_TO_PASS": ["t.py::test_a"],
        "PASS_TO_PASS": ["t.py::test_b"],
        "log_parser": "parse_log_pytest",
    }
    log = (
        "+ git apply -v -\n>>>>> Start Test Output\n=== short test summary info ===\n"
        "PASSED t.py::test_a\nPASSED t.py::test_b\n>>>>> End Test Output\n>>>>> Test Exit Code: 0\n"
    )
    g = grading.grade(record, log, None, framed=True)
    assert g.log_valid and g.resolved
    failed = log.replace("PASSED t.py::test_a", "FAILED t.py::test_a").replace("Code: 0", "Code: 1")
    assert not grading.grade(record, failed, None, framed=True).resolved
    # A log that reports passes while the test command failed is rejected by SWE-bench's cross-check.
    lying = log.replace("Code: 0", "Code: 1")
    assert not grading.grade(record, lying, None, framed=True).log_valid


def test_environment_failures_are_told_apart_from_broken_patches() -> None:
    assert environment_failure("E   Could not resolve host: pypi.org") == "network_unreachable"
    assert environment_failure("ModuleNotFoundError: No module named 'x'") is None  # may be the patch
    assert environment_failure("SyntaxError: invalid syntax") is None


def test_exclusions_are_literal() -> None:
    assert exclude_pathspecs(["a/*.py", ""]) == [":(top,literal,exclude)a/*.py"]
    assert _quote_exclude("build/[x]*.so") == "/build/\\[x\\]\\*.so"
    assert _quote_exclude("#notes") == "/\\#notes"


def test_every_alias_routes_to_the_handler_and_validates() -> None:
    registry = HandlerRegistry()
    rec = records()["django__django-11099"]
    for name in ("swebench", "swe-bench", "swebench-verified", "swe-gym", "r2e", "r2e-gym"):
        handler = registry.get(name)
        assert type(handler).__name__ == "SweHandler" and handler.needs_tokenizer
        handler.validate_instance(rec)
        assert handler.policy.max_share.eval == 0.5 and handler.policy.stage_timeouts.eval == 2400


def test_public_rows_without_a_data_source_load_as_swe(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = list(records().values())
    loaded = load_file(DATA / "swebench_records.jsonl")
    assert {r["data_source"] for r in loaded} == {"swebench"}
    assert {r["data_source"] for r in load_file(DATA / "r2e_records.jsonl")} == {"r2e"}
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "swe.parquet")
    from_parquet = load_file(tmp_path / "swe.parquet")
    assert [r["instance_id"] for r in from_parquet] == [r["instance_id"] for r in rows]
    assert parse_task(from_parquet[0]).fail_to_pass == json.loads(rows[0]["FAIL_TO_PASS"])
