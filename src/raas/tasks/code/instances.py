"""Code task instances: the accepted record shapes, read into one :class:`CodeSpec` (or a 400 naming the field).

Two kinds of problem share the handler:

* **function** (HumanEval): ``prompt`` (signature + docstring), ``entry_point`` (the function's name) and
  ``test`` (Python source defining ``check(candidate)``, kept hidden from the policy);
* **stdio** (Codeforces-style): a statement and ``{input, output}`` test cases, in any of the spellings
  common in RL data (see :data:`TEST_FIELDS`); every field may also be a JSON-encoded string.

Parsing is pure (no I/O), so submit-time validation and EVAL read an instance the same way.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from raas.errors import RaasError

RewardMode = Literal["all", "fraction"]
REWARD_MODES: tuple[str, ...] = ("all", "fraction")

STATEMENT_FIELDS = ("problem", "question", "description", "prompt")
"""Where a stdio problem's statement is read from, first present wins."""
TEST_FIELDS = ("tests", "test_cases", "input_output", "public_tests", "private_tests", "generated_tests")
"""Test-case fields; all present ones are combined (CodeContests splits public, private, generated)."""
PYTHON_NAMES = frozenset({"python", "python3", "python 3", "py", "py3", "cpython", "pypy", "pypy3"})

DEFAULT_TIME_LIMIT_S = 6.0
"""Per test for stdio problems, for the whole ``check`` for function problems (an interpreted language
on a shared node; CodeContests' limits are set for C++)."""
MAX_TIME_LIMIT_S = 60.0
MIN_TIME_LIMIT_S = 0.1
DEFAULT_MEMORY_MB = 1024
MIN_MEMORY_MB = 256
"""An address-space limit below this fails the interpreter itself, not the candidate."""
MAX_MEMORY_MB = 8192
MAX_TESTS = 2000


def bad(message: str) -> RaasError:
    return RaasError(f"code instance: {message}", kind="bad_request")


@dataclass(frozen=True)
class IOTest:
    input: str
    output: str


@dataclass(frozen=True)
class CodeSpec:
    """One code problem, whatever shape it came in."""

    kind: Literal["function", "stdio"]
    statement: str
    time_limit_s: float
    memory_mb: int
    reward_mode: RewardMode = "all"
    float_tolerance: float | None = None
    # function problems
    prompt: str = ""
    entry_point: str = ""
    test: str = ""
    # stdio problems
    tests: tuple[IOTest, ...] = field(default_factory=tuple)


def _decoded(value: Any, name: str) -> Any:
    """``value``, or what it decodes to when it is a JSON-encoded string of a list or object."""
    if isinstance(value, str) and value.lstrip()[:1] in ("[", "{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise bad(f"field {name!r} is a string that is not valid JSON: {exc.msg}") from None
    return value


def _text(value: Any, name: str) -> str:
    """A test's input or output: a string, or a list of lines (joined with newlines)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(x, str) for x in value):
        return "\n".join(value) + ("\n" if value else "")
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise bad(f"{name} must be a string (or a list of lines), got {type(value).__name__}")


def _pairs(inputs: Any, outputs: Any, name: str) -> list[IOTest]:
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise bad(f"field {name!r} needs lists of inputs and outputs")
    if len(inputs) != len(outputs):
        raise bad(f"field {name!r} has {len(inputs)} inputs but {len(outputs)} outputs")
    return [
        IOTest(_text(i, f"{name} input {n}"), _text(o, f"{name} output {n}"))
        for n, (i, o) in enumerate(zip(inputs, outputs, strict=True))
    ]


def _tests_of(value: Any, name: str) -> list[IOTest]:
    """Test cases from one field: a list of ``{input, output}`` objects or ``{inputs, outputs}`` lists."""
    value = _decoded(value, name)
    if value is None:
        return []
    if isinstance(value, dict):
        if value.get("fn_name"):
            raise bad(
                f"field {name!r} holds call-based tests (fn_name); only stdin/stdout tests are supported "
                "(give function problems in the HumanEval shape: prompt, entry_point, test)"
            )
        for ins, outs in (("inputs", "outputs"), ("input", "output"), ("stdin", "stdout")):
            if ins in value or outs in value:
                return _pairs(_decoded(value.get(ins), name), _decoded(value.get(outs), name), name)
        raise bad(f"field {name!r} needs 'inputs' and 'outputs' (or a list of {{input, output}})")
    if isinstance(value, list):
        out = []
        for n, case in enumerate(value):
            if not isinstance(case, dict):
                raise bad(f"field {name!r}: test {n} is not an object with input and output")
            if str(case.get("testtype", "stdin")).lower() not in ("stdin", "stdio"):
                raise bad(
                    f"field {name!r}: test {n} has testtype {case['testtype']!r}; only stdin is supported"
                )
            in_key = next((k for k in ("input", "stdin", "inputs") if k in case), None)
            out_key = next((k for k in ("output", "expected_output", "stdout", "outputs") if k in case), None)
            if in_key is None or out_key is None:
                raise bad(f"field {name!r}: test {n} needs 'input' and 'output'")
            out.append(
                IOTest(
                    _text(case[in_key], f"{name} test {n} input"),
                    _text(case[out_key], f"{name} test {n} output"),
                )
            )
        return out
    raise bad(f"field {name!r} must be a list of tests or an object of inputs/outputs")


def _seconds(value: Any, name: str) -> float:
    """A time limit: seconds as a number or numeric string ("2", "2 seconds"), or ``{seconds, nanos}``."""
    if isinstance(value, dict):
        try:
            secs = float(value.get("seconds") or 0) + float(value.get("nanos") or 0) / 1e9
        except (TypeError, ValueError):
            raise bad(f"field {name!r} must be {{seconds, nanos}} numbers") from None
    elif isinstance(value, int | float) and not isinstance(value, bool):
        secs = float(value)
    elif isinstance(value, str) and (m := re.fullmatch(r"\s*([0-9.]+)\s*(s|sec|secs|seconds?)?\s*", value)):
        secs = float(m.group(1))
    else:
        raise bad(f"field {name!r} must be seconds (a number), got {value!r}")
    if not math.isfinite(secs) or secs <= 0:
        raise bad(f"field {name!r} must be a positive number of seconds")
    return min(max(secs, MIN_TIME_LIMIT_S), MAX_TIME_LIMIT_S)


def _megabytes(instance: dict[str, Any]) -> int:
    if "memory_limit_bytes" in instance:
        raw, scale, name = instance["memory_limit_bytes"], 1 / (1024 * 1024), "memory_limit_bytes"
    elif "memory_limit" in instance:
        raw, scale, name = instance["memory_limit"], 1.0, "memory_limit"
    else:
        return DEFAULT_MEMORY_MB
    if isinstance(raw, str) and (m := re.fullmatch(r"\s*([0-9.]+)\s*(mb|megabytes?|m)?\s*", raw, re.I)):
        raw = float(m.group(1))
    if not isinstance(raw, int | float) or isinstance(raw, bool) or not math.isfinite(raw) or raw <= 0:
        raise bad(f"field {name!r} must be a positive number")
    return int(min(max(raw * scale, MIN_MEMORY_MB), MAX_MEMORY_MB))


def reward_mode_of(value: Any, where: str) -> RewardMode:
    if value not in REWARD_MODES:
        raise bad(f"{where} must be one of {', '.join(REWARD_MODES)}, got {value!r}")
    return "all" if value == "all" else "fraction"


def _float_tolerance(instance: dict[str, Any]) -> float | None:
    value = instance.get("float_tolerance")
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value < 1:
        raise bad("field 'float_tolerance' must be a number in [0, 1)")
    return float(value)


def _check_language(instance: dict[str, Any]) -> None:
    lang = instance.get("language")
    if lang is None:
        return
    if not isinstance(lang, str) or lang.strip().lower() not in PYTHON_NAMES:
        raise bad(f"field 'language' is {lang!r}; only Python is supported")


def _function_spec(instance: dict[str, Any], common: dict[str, Any]) -> CodeSpec:
    prompt, entry, test = instance.get("prompt"), instance.get("entry_point"), instance.get("test")
    if not isinstance(prompt, str) or not prompt.strip():
        raise bad("field 'prompt' (the function's signature and docstring) must be a non-empty string")
    if not isinstance(entry, str) or not entry.isidentifier():
        raise bad("field 'entry_point' must be the function's name (a Python identifier)")
    if not isinstance(test, str) or "def check" not in test:
        raise bad("field 'test' must be Python source that defines check(candidate)")
    for name, source in (("prompt", prompt), ("test", test)):
        try:
            compile(source, f"<{name}>", "exec")
        except (SyntaxError, ValueError) as exc:
            raise bad(f"field {name!r} is not valid Python: {exc}") from None
    return CodeSpec(kind="function", statement=prompt, prompt=prompt, entry_point=entry, test=test, **common)


def parse(instance: dict[str, Any]) -> CodeSpec:
    """The :class:`CodeSpec` of ``instance``; ``bad_request`` naming the field that is wrong."""
    if not isinstance(instance, dict):
        raise bad("an instance must be an object")
    _check_language(instance)
    common: dict[str, Any] = {
        "time_limit_s": _seconds(instance["time_limit"], "time_limit")
        if instance.get("time_limit") not in (None, "", 0)
        else DEFAULT_TIME_LIMIT_S,
        "memory_mb": _megabytes(instance),
        "reward_mode": reward_mode_of(instance.get("reward_mode", "all"), "field 'reward_mode'"),
        "float_tolerance": _float_tolerance(instance),
    }
    if "entry_point" in instance or isinstance(instance.get("test"), str):
        return _function_spec(instance, common)
    statement = next((instance[k] for k in STATEMENT_FIELDS if instance.get(k) is not None), None)
    if not isinstance(statement, str) or not statement.strip():
        raise bad(f"a stdio problem needs a statement in one of {', '.join(STATEMENT_FIELDS)}")
    tests: list[IOTest] = []
    for name in TEST_FIELDS:
        if name in instance:
            tests.extend(_tests_of(instance[name], name))
    if "inputs" in instance or "outputs" in instance:
        tests.extend(
            _pairs(
                _decoded(instance.get("inputs"), "inputs"),
                _decoded(instance.get("outputs"), "outputs"),
                "inputs/outputs",
            )
        )
    if not tests:
        raise bad(
            f"no test cases: give one of {', '.join(TEST_FIELDS)} or inputs/outputs "
            "(or a function problem: prompt, entry_point, test)"
        )
    if len(tests) > MAX_TESTS:
        raise bad(f"{len(tests)} test cases; at most {MAX_TESTS} are run per problem")
    return CodeSpec(kind="stdio", statement=statement, tests=tuple(tests), **common)
