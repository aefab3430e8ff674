"""Which task an instance belongs to when it does not say (no ``data_source``): one rule for every entry
point, so a row behaves the same in a dataset file given to ``raas run`` and in a ``POST /v1/jobs`` body."""

from __future__ import annotations

from typing import Any

_CODE_FIELDS = frozenset(
    {"entry_point", "tests", "test_cases", "input_output", "public_tests", "private_tests", "inputs"}
)


SWE_FIELDS = ("problem_statement", "base_commit", "FAIL_TO_PASS")
R2E_FIELDS = ("problem_statement", "docker_image", "expected_output_json")


def infer_data_source(row: dict[str, Any]) -> str | None:
    """The task a row without ``data_source`` belongs to, from its shape: SWE-bench / SWE-Gym records
    (``swebench``), R2E-Gym records (``r2e``); test cases or an entry point make it ``code``, a ``question``
    (and no ``problem``) or ``choices`` make it ``stem``, ``problem`` and ``answer`` make it math; None when
    it fits none. A field whose value is null counts as absent: a parquet file that mixes tasks gives every
    row every column, null where the row has none."""
    row = {k: v for k, v in row.items() if v is not None}
    if all(k in row for k in SWE_FIELDS):
        return "swebench"
    if all(k in row for k in R2E_FIELDS):
        return "r2e"
    if _CODE_FIELDS & row.keys():
        return "code"
    if ("question" in row and "problem" not in row) or "choices" in row or "options" in row:
        return "stem" if "answer" in row or "answerKey" in row else None
    if "problem" in row and "answer" in row:
        return "math"
    return None
