"""The math-verify check itself, as it runs inside a verifier worker (:mod:`raas.tasks.verify`).

Kept apart from :mod:`raas.tasks.math` so a worker imports math-verify and sympy only, not the agent
loop; the service process never imports this module. Timeouts are disabled here on purpose: math-verify's
own are SIGALRM-based and would turn a hang into a silent reward of 0; the pool kills a worker that runs
too long and reports ``verifier_timeout`` instead.
"""

from __future__ import annotations

import logging
from typing import Any

from math_verify import parse, verify


class _QuietTimeoutNotice(logging.Filter):
    """math-verify warns that its timeouts are off; they are, on purpose (see the module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_QuietTimeoutNotice())


def verify_answer(answer: str, truth: str) -> tuple[bool, dict[str, Any]]:
    """Whether ``answer`` equals ``truth`` by math-verify, and what each parsed to."""
    gold = parse(truth, parsing_timeout=None)
    if not gold:
        gold = parse(f"${truth}$", parsing_timeout=None)
    pred = parse(answer, parsing_timeout=None)
    if not pred and "$" not in answer and "\\boxed" not in answer:
        pred = parse(f"${answer}$", parsing_timeout=None)
    ok = bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=None)
    return ok, {"parsed_answer": [str(p) for p in pred], "parsed_truth": [str(g) for g in gold]}


def _parse_latex_first(text: str) -> list[Any]:
    """Parse ``text`` as one LaTeX expression first: a bare ``8x + 24x^2`` is otherwise read as its last
    number. Falls back to math-verify's own extraction (``\\boxed``, ``$...$``, plain numbers)."""
    if "$" not in text and "\\boxed" not in text:
        parsed = parse(f"${text}$", parsing_timeout=None)
        if parsed:
            return list(parsed)
    return list(parse(text, parsing_timeout=None))


def verify_expression(answer: str, truth: str) -> tuple[bool, dict[str, Any]]:
    """Whether two short answers are the same expression (STEM answers: bare LaTeX without ``$``)."""
    gold, pred = _parse_latex_first(truth), _parse_latex_first(answer)
    ok = bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=None)
    return ok, {"parsed_answer": [str(p) for p in pred], "parsed_truth": [str(g) for g in gold]}


def numeric_value(answer: str) -> float | None:
    """The value of an answer that is a closed-form number (``\\sqrt{2}``, ``2\\pi``, ``e^{-1}``), else None."""
    import sympy

    for expr in _parse_latex_first(answer):
        if isinstance(expr, sympy.Basic) and expr.is_number:
            try:
                value = complex(sympy.N(expr))
            except (TypeError, ValueError):
                continue
            if value.imag == 0 and abs(value.real) != float("inf"):
                return value.real
    return None
