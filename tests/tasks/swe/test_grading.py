"""Grading through SWE-bench's own parser and grading functions, on real pytest output.

``data/pytest_demo.log`` is the unedited output of ``python3 -B -m pytest -rA --tb=short -p
no:cacheprovider --rootdir=/testbed tests/test_demo.py`` (``data/demo_tests.py.txt``) run with pytest
8.4.2 inside a SWE environment image.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from raas.errors import RaasError
from raas.tasks.swe import grading
from raas.tasks.swe.build import safe_test_ids

pytestmark = pytest.mark.unit

LOG = (Path(__file__).parent / "data" / "pytest_demo.log").read_text()
T = "tests/test_demo.py::"


def _record(f2p: list[str], p2p: list[str], **extra: Any) -> dict[str, Any]:
    return {
        "instance_id": "demo",
        "FAIL_TO_PASS": f2p,
        "PASS_TO_PASS": p2p,
        "log_parser": "parse_log_pytest",
    } | extra


def test_the_parser_reads_every_outcome() -> None:
    sm = grading.parse_test_output(LOG, "parse_log_pytest")
    assert sm[T + "test_ok"] == "PASSED"
    assert sm[T + "test_bad"] == "FAILED"
    assert sm[T + "Cases::test_unit_ok"] == "PASSED"
    assert sm[T + "Cases::test_unit_bad"] == "FAILED"
    assert sm[T + "test_error"] == "ERROR"
    # the parser splits on whitespace: an id with a space comes back cut short
    assert T + "test_param[b" in sm and T + "test_param[b c]" not in sm


def test_ids_the_parser_cannot_read_back_are_unsafe() -> None:
    safe = safe_test_ids(LOG)
    assert T + "test_ok" in safe and T + "Cases::test_unit_bad" in safe
    assert T + "test_param[a]" in safe
    assert not any(s.startswith(T + "test_param[b") for s in safe)
    assert not any(s.startswith("[") for s in safe)  # the SKIPPED [1] summary line is no test


def test_all_named_tests_passing_is_resolved() -> None:
    g = grading.grade(_record([T + "test_ok"], [T + "Cases::test_unit_ok", T + "test_param[a]"]), LOG, 1)
    assert g.log_valid and g.resolved and g.status == "RESOLVED_FULL"


@pytest.mark.parametrize(
    ("f2p", "p2p"),
    [
        ([T + "test_bad"], [T + "test_ok"]),  # the fail-to-pass test still fails
        ([T + "test_ok"], [T + "Cases::test_unit_bad"]),  # a pass-to-pass test broke
        ([T + "test_error"], []),  # an error is no pass
        ([T + "test_not_run"], []),  # a test missing from the log is no pass
    ],
)
def test_any_named_test_not_passing_is_unresolved(f2p: list[str], p2p: list[str]) -> None:
    g = grading.grade(_record(f2p, p2p), LOG, 1)
    assert g.log_valid and not g.resolved


def test_lists_may_be_json_strings_as_on_the_hub() -> None:
    g = grading.grade(_record('["' + T + 'test_ok"]', "[]"), LOG, 1)  # type: ignore[arg-type]
    assert g.resolved


def test_a_log_without_results_is_invalid_not_resolved() -> None:
    crashed = "Traceback (most recent call last):\nImportError: cannot import name 'x'\n"
    g = grading.grade(_record([T + "test_ok"], []), crashed, 2)
    assert not g.log_valid and not g.resolved


def test_a_log_contradicting_its_exit_status_is_invalid() -> None:
    only_passes = "\n".join(line for line in LOG.splitlines() if not line.startswith(("FAILED", "ERROR")))
    assert grading.grade(_record([T + "test_ok"], []), only_passes, 0).resolved
    # the same "all passed" log, but the test command exited 1: something printed fake results
    g = grading.grade(_record([T + "test_ok"], []), only_passes, 1)
    assert not g.log_valid and not g.resolved


def test_unknown_parser_is_a_bad_request() -> None:
    with pytest.raises(RaasError) as e:
        grading.grade(_record([T + "test_ok"], [], log_parser="parse_log_nonsense"), LOG, 0)
    assert e.value.kind == "bad_request"
    with pytest.raises(RaasError):
        grading.parse_test_output(LOG, "nope")


def test_the_frame_is_swebench_s() -> None:
    from swebench.harness.constants import END_TEST_OUTPUT, START_TEST_OUTPUT, TEST_EXIT_CODE

    framed = grading.frame_log("x", 3)
    assert framed.index(START_TEST_OUTPUT) < framed.index("x") < framed.index(END_TEST_OUTPUT)
    assert f"{TEST_EXIT_CODE}: 3" in framed
