"""Grading with SWE-bench's own code (the ``swebench`` package, ``pip install 'raas[swe]'``).

A record names its log parser (``log_parser``, a key of ``swebench.harness.log_parsers.PARSER_REGISTRY``,
e.g. ``parse_log_pytest``) and its ``FAIL_TO_PASS`` / ``PASS_TO_PASS`` test ids. The output of the
record's ``test_cmd`` and its exit status are framed the way SWE-bench's eval script frames them and
handed to ``swebench.harness.grading.get_logs_eval`` (which also rejects a log without test results, or
one whose exit status contradicts it), then ``get_eval_tests_report`` and ``get_resolution_status``:
resolved iff every FAIL_TO_PASS and every PASS_TO_PASS test passes.
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from raas.errors import RaasError


@functools.cache
def _swebench() -> tuple[ModuleType, ModuleType, ModuleType, Any]:
    try:
        from swebench.harness import constants, grading, log_parsers
        from swebench.types import TestSpec
    except ImportError as e:  # pragma: no cover - depends on the install
        raise RaasError(
            f"grading SWE tasks needs the swebench package ({e}); install it with pip install 'raas[swe]'",
            kind="unavailable",
        ) from e
    return constants, grading, log_parsers, TestSpec


def known_parser(name: str) -> bool:
    return name in _swebench()[2].PARSER_REGISTRY


def parse_test_output(output: str, log_parser: str) -> dict[str, str]:
    """{test id: PASSED | FAILED | SKIPPED | ERROR | XFAIL} as SWE-bench's parser reads ``output``."""
    _, _, log_parsers, TestSpec = _swebench()
    parser = log_parsers.PARSER_REGISTRY.get(log_parser)
    if parser is None:
        raise RaasError(f"unknown SWE-bench log parser {log_parser!r}", kind="bad_request")
    spec = TestSpec("", "", [], "", "", [], [], log_parser=log_parser, eval_type="pass_and_fail")
    return dict(parser(output, spec))


def frame_log(test_output: str, exit_code: int | None) -> str:
    """The test output as SWE-bench's eval script logs it: between its start/end markers, followed by
    the test command's exit status."""
    constants = _swebench()[0]
    tail = f"{constants.TEST_EXIT_CODE}: {exit_code}\n" if exit_code is not None else ""
    return f"{constants.START_TEST_OUTPUT}\n{test_output.rstrip()}\n{constants.END_TEST_OUTPUT}\n{tail}"


@dataclass
class Grade:
    """The verdict on one test run."""

    resolved: bool
    status: str  # RESOLVED_FULL | RESOLVED_PARTIAL | RESOLVED_NO
    log_valid: bool  # False: no usable test results in the log (nothing ran, or the log contradicts itself)
    tests_status: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    status_map: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "resolved": self.resolved,
            "status": self.status,
            "log_valid": self.log_valid,
            "tests_status": self.tests_status,
        }


def _ids(value: Sequence[str] | str) -> list[str]:
    if isinstance(value, str):
        import json

        return list(json.loads(value))
    return list(value)


def grade(
    record: Mapping[str, Any], test_output: str, exit_code: int | None, *, framed: bool = False
) -> Grade:
    """Grade ``test_output`` (what the record's ``test_cmd`` printed, exit status ``exit_code``) against
    the record's FAIL_TO_PASS / PASS_TO_PASS with SWE-bench's grading functions. ``framed``: the output
    is a whole SWE-bench eval script's log, which brackets the test output and records the exit status
    itself. The record's ``eval_type`` (``pass_and_fail``, default, or ``fail_only``) is SWE-bench's.

    A log without usable results (``log_valid`` False) is not resolved; whether that is the model's
    doing (a patch that breaks the test run) or the harness's is the caller's call."""
    constants, grading, _, TestSpec = _swebench()
    f2p, p2p = _ids(record["FAIL_TO_PASS"]), _ids(record["PASS_TO_PASS"])
    eval_type = constants.EvalType(str(record.get("eval_type") or constants.EvalType.PASS_AND_FAIL.value))
    spec = TestSpec(
        instance_id=str(record.get("instance_id", "")),
        image=str(record.get("image", "")),
        eval_script_list=[],
        repo=str(record.get("repo", "")),
        version=str(record.get("version", "")),
        FAIL_TO_PASS=f2p,
        PASS_TO_PASS=p2p,
        log_parser=str(record.get("log_parser") or "parse_log_pytest"),
        eval_type=eval_type.value,
    )
    if not known_parser(spec.log_parser):
        raise RaasError(f"unknown SWE-bench log parser {spec.log_parser!r}", kind="bad_request")
    fd, path = tempfile.mkstemp(prefix="raas-swe-log-", suffix=".txt")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", errors="replace") as f:
            f.write(test_output if framed else frame_log(test_output, exit_code))
        status_map, found = grading.get_logs_eval(spec, path)
    finally:
        os.unlink(path)
    if not found:
        return Grade(False, constants.ResolvedStatus.NO.value, False)
    gold = {constants.FAIL_TO_PASS: f2p, constants.PASS_TO_PASS: p2p}
    report = grading.get_eval_tests_report(status_map, gold, eval_type=eval_type)
    status = grading.get_resolution_status(report)
    tests_status = {k: report[k] for k in (constants.FAIL_TO_PASS, constants.PASS_TO_PASS)}
    return Grade(status == constants.ResolvedStatus.FULL.value, status, True, tests_status, dict(status_map))
