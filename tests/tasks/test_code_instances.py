"""Code task records: every accepted spelling reads into the same tests; every bad one is a 400 naming the
field. And the output comparison (normalization, float tolerance)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from raas.errors import RaasError
from raas.tasks.code.grading import normalize, outputs_match
from raas.tasks.code.humaneval import humaneval
from raas.tasks.code.instances import DEFAULT_TIME_LIMIT_S, IOTest, parse
from raas.tasks.registry import CODE_ALIASES, HandlerRegistry

pytestmark = pytest.mark.unit

STATEMENT = "Print the sum of two integers."
WANT = (IOTest("1 2\n", "3\n"), IOTest("5 5\n", "10\n"))


@pytest.mark.parametrize(
    "fields",
    [
        {"tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10\n"}]},
        {"tests": json.dumps([{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10\n"}])},
        {
            "tests": [
                {"input": "1 2\n", "output": "3\n", "testtype": "stdin"},
                {"input": "5 5\n", "output": "10\n"},
            ]
        },
        {"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]},
        {"test_cases": {"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]}},
        {"input_output": json.dumps({"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]})},
        {
            "public_tests": {"input": ["1 2\n"], "output": ["3\n"]},
            "private_tests": {"input": ["5 5\n"], "output": ["10\n"]},
        },
        {
            "test_cases": [
                {"stdin": "1 2\n", "expected_output": "3\n"},
                {"stdin": "5 5\n", "expected_output": "10\n"},
            ]
        },
        {"input_output": {"inputs": [["1 2"], ["5 5"]], "outputs": [["3"], ["10"]]}},  # lists of lines
    ],
)
def test_stdio_test_spellings(fields: dict[str, Any]) -> None:
    spec = parse({"data_source": "code", "problem": STATEMENT, **fields})
    assert spec.kind == "stdio" and spec.statement == STATEMENT
    assert len(spec.tests) == 2
    for got, want in zip(spec.tests, WANT, strict=True):
        assert got.input.split() == want.input.split()
        assert outputs_match(got.output, want.output)
    assert spec.time_limit_s == DEFAULT_TIME_LIMIT_S and spec.reward_mode == "all"


@pytest.mark.parametrize(
    ("extra", "seconds", "mb"),
    [
        ({"time_limit": 2}, 2.0, 1024),
        ({"time_limit": "3 seconds", "memory_limit": "512 megabytes"}, 3.0, 512),
        ({"time_limit": {"seconds": 1, "nanos": 500000000}, "memory_limit_bytes": 268435456}, 1.5, 256),
        ({"time_limit": 1000, "memory_limit": 10}, 60.0, 256),  # clamped to the allowed range
    ],
)
def test_limits(extra: dict[str, Any], seconds: float, mb: int) -> None:
    spec = parse({"problem": STATEMENT, "inputs": ["1"], "outputs": ["1"], **extra})
    assert (spec.time_limit_s, spec.memory_mb) == (seconds, mb)


def test_every_humaneval_record_parses_as_a_function_problem() -> None:
    for record in humaneval():
        spec = parse(record)
        assert spec.kind == "function" and spec.entry_point == record["entry_point"]
        assert "def check" in spec.test


@pytest.mark.parametrize(
    ("instance", "field"),
    [
        ({"problem": STATEMENT}, "no test cases"),
        ({"problem": STATEMENT, "tests": "[{not json"}, "'tests'"),
        ({"problem": STATEMENT, "tests": [{"input": "1"}]}, "'tests'"),
        ({"problem": STATEMENT, "tests": [["1", "2"]]}, "'tests'"),
        ({"problem": STATEMENT, "inputs": ["1", "2"], "outputs": ["1"]}, "2 inputs but 1 outputs"),
        ({"problem": STATEMENT, "tests": [{"input": 1.5j, "output": "1"}]}, "input must be a string"),
        (
            {"problem": STATEMENT, "input_output": {"inputs": [[1]], "outputs": [[1]], "fn_name": "f"}},
            "fn_name",
        ),
        (
            {"problem": STATEMENT, "tests": [{"input": "", "output": "", "testtype": "functional"}]},
            "testtype",
        ),
        ({"problem": "  ", "inputs": ["1"], "outputs": ["1"]}, "statement"),
        ({"problem": STATEMENT, "inputs": ["1"], "outputs": ["1"], "language": "cpp"}, "'language'"),
        ({"problem": STATEMENT, "inputs": ["1"], "outputs": ["1"], "time_limit": -1}, "'time_limit'"),
        ({"problem": STATEMENT, "inputs": ["1"], "outputs": ["1"], "time_limit": "soon"}, "'time_limit'"),
        ({"problem": STATEMENT, "inputs": ["1"], "outputs": ["1"], "memory_limit": "lots"}, "'memory_limit'"),
        (
            {"problem": STATEMENT, "inputs": ["1"], "outputs": ["1"], "reward_mode": "partial"},
            "'reward_mode'",
        ),
        (
            {"problem": STATEMENT, "inputs": ["1"], "outputs": ["1"], "float_tolerance": 2},
            "'float_tolerance'",
        ),
        ({"prompt": "def f():\n", "entry_point": "f", "test": "def check(c): pass"}, "'prompt' is not valid"),
        (
            {"prompt": "def f(): pass\n", "entry_point": "not a name", "test": "def check(c): pass"},
            "'entry_point'",
        ),
        ({"prompt": "def f(): pass\n", "entry_point": "f", "test": "assert True"}, "'test'"),
        ({"prompt": "", "entry_point": "f", "test": "def check(c): pass"}, "'prompt'"),
    ],
)
def test_bad_records_name_the_field(instance: dict[str, Any], field: str) -> None:
    with pytest.raises(RaasError) as err:
        parse({"data_source": "code", **instance})
    assert err.value.kind == "bad_request"
    assert field in err.value.message, err.value.message


@pytest.mark.parametrize("language", ["python", "Python3", "python 3", "py"])
def test_python_is_accepted_in_any_spelling(language: str) -> None:
    parse({"problem": STATEMENT, "inputs": ["1"], "outputs": ["1"], "language": language})


def test_the_handler_answers_to_its_aliases() -> None:
    registry = HandlerRegistry(entry_points=False)
    handlers = {name: registry.get(name) for name in ("code", *CODE_ALIASES)}
    assert {type(h).__name__ for h in handlers.values()} == {"CodeHandler"}
    assert all(h.needs_tokenizer for h in handlers.values())
    assert handlers["code"].policy.stage_timeouts.eval is not None


@pytest.mark.parametrize(
    ("got", "expected", "same"),
    [
        ("3\n", "3", True),
        ("3   \r\n4\t\r\n\r\n\n", "3\n4\n", True),
        ("1 2\n", "1  2\n", False),  # inner whitespace counts
        ("\n3\n", "3\n", False),  # leading blank lines count
        ("yes\n", "YES\n", False),
        ("", "", True),
    ],
)
def test_output_normalization(got: str, expected: str, same: bool) -> None:
    assert outputs_match(got, expected) is same
    assert normalize("a \r\nb  \n\n") == "a\nb"


def test_float_tolerance_compares_numbers_token_by_token() -> None:
    assert not outputs_match("0.3333333\n", "0.333333333\n")
    assert outputs_match("0.3333333\n", "0.333333333\n", 1e-6)
    assert outputs_match("1e6 x", "1000000.0 x", 1e-9)
    assert not outputs_match("0.34\n", "0.333333333\n", 1e-6)
    assert not outputs_match("0.3333333 extra", "0.333333333", 1e-6)
    assert outputs_match("nan", "nan", 1e-6)  # equal text matches before any number is read
    assert not outputs_match("nan", "0", 1e-6)
