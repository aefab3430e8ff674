"""STEM records, answer extraction and grading (math-verify through the real verifier pool)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from raas.errors import RaasError
from raas.tasks.stem.answers import choice_letter, extract_answer, infer_type, parse, parse_number
from raas.tasks.stem.data import builtin_stem
from raas.tasks.stem.handler import score, user_prompt

CHOICES = ("helium", "neon", "A cat", "bromine")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("42", 42.0),
        ("9.8 m/s^2", 9.8),
        ("9.8m/s^2", 9.8),
        ("-4 °C", -4.0),
        ("1,234.5 kg", 1234.5),
        ("6.02e23", 6.02e23),
        ("6.02 \\times 10^{23} mol^{-1}", 6.02e23),
        ("3.0 x 10^8 m/s", 3.0e8),
        ("\\frac{3}{4}", 0.75),
        ("-\\frac{1}{2}", -0.5),
        ("3/4", 0.75),
        ("$12.5\\,\\text{g}$", 12.5),
        ("50\\%", 50.0),
        ("\u22124.5", -4.5),
        ("2\\pi", None),
        ("3^2", None),
        ("2 + 3", None),
        ("x", None),
        ("1/0", None),
        ("1e999", None),
    ],
)
def test_numbers(text: str, value: float | None) -> None:
    got = parse_number(text)
    assert got == (pytest.approx(value) if value is not None else None)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("answer", "letter"),
    [
        ("B", "B"),
        ("b", "B"),
        ("(B)", "B"),
        ("B.", "B"),
        ("B) neon", "B"),
        ("**B**", "B"),
        ("Option B", "B"),
        ("neon", "B"),
        ("Neon.", "B"),
        ("A cat", "C"),  # a choice text that starts like a letter
        ("E", None),  # out of range
        ("AB", None),
        ("krypton", None),
    ],
)
def test_choice_letters(answer: str, letter: str | None) -> None:
    assert choice_letter(answer, CHOICES) == letter


@pytest.mark.unit
@pytest.mark.parametrize(
    ("finish", "message", "want"),
    [
        ("12 m", None, ("12 m", "finish")),
        ("The answer is \\boxed{C}", None, ("C", "finish")),
        ("Answer: 7 g", "whatever", ("7 g", "finish")),
        (None, "Compute... so \\boxed{\\frac{1}{2}} is it.", ("\\frac{1}{2}", "boxed")),
        (None, "First 5 steps.\nAnswer: 12 m\n", ("12 m", "answer_line")),
        (None, "So the final answer is (B).", ("(B)", "answer_line")),
        (None, "I am not sure.", (None, None)),
        ("   ", "", (None, None)),
    ],
)
def test_extraction(finish: str | None, message: str | None, want: tuple[str | None, str | None]) -> None:
    assert extract_answer(finish, message) == want


@pytest.mark.unit
def test_types_are_inferred_from_the_gold_answer() -> None:
    assert [
        infer_type(g) for g in ("9.8 m/s^2", "300K", "2x", "3n + 1", "x^2 + 1", "\\sqrt{2}", "mitochondria")
    ] == [
        "numeric",
        "numeric",
        "expression",
        "expression",
        "expression",
        "expression",
        "text",
    ]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("record", "kind", "gold"),
    [
        ({"question": "q", "choices": ["a", "b", "c"], "answer": "B"}, "choice", "B"),
        ({"question": "q", "choices": ["a", "b", "c"], "answer": 2}, "choice", "C"),  # MMLU: 0-based index
        ({"question": "q", "choices": '["a", "b", "c"]', "answer": "c"}, "choice", "C"),
        ({"question": "q", "options": {"A": "x", "B": "y"}, "answer": "y"}, "choice", "B"),
        (
            {"question": "q", "choices": {"text": ["x", "y"], "label": ["A", "B"]}, "answerKey": "A"},
            "choice",
            "A",
        ),
        ({"problem": "q", "answer": 3.5}, "numeric", "3.5"),
        ({"question": "q", "answer": "Na", "case_sensitive": True}, "text", "Na"),
    ],
)
def test_records(record: dict[str, Any], kind: str, gold: str) -> None:
    spec = parse(record)
    assert (spec.answer_type, spec.gold) == (kind, gold)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("record", "field"),
    [
        ({"answer": "1"}, "'question'"),
        ({"question": "q"}, "'answer'"),
        ({"question": "q", "answer": ""}, "'answer'"),
        ({"question": "q", "answer": "1", "answer_type": "essay"}, "'answer_type'"),
        ({"question": "q", "answer": "x", "answer_type": "numeric"}, "'answer'"),
        ({"question": "q", "answer": "B", "answer_type": "choice"}, "'choices'"),
        ({"question": "q", "choices": ["only one"], "answer": "A"}, "'choices'"),
        ({"question": "q", "choices": ["a", ""], "answer": "A"}, "'choices'"),
        ({"question": "q", "choices": {"B": "x", "A": "y"}, "answer": "A"}, "'choices'"),
        ({"question": "q", "choices": ["a", "b"], "answer": "C"}, "'answer'"),
        ({"question": "q", "choices": ["a", "b"], "answer": 5}, "'answer'"),
        ({"question": "q", "answer": "1", "tolerance": 3}, "'tolerance'"),
        ({"question": "q", "answer": "1", "case_sensitive": "yes"}, "'case_sensitive'"),
        ({"question": "q", "answer": ["1"]}, "'answer'"),
    ],
)
def test_bad_records_name_the_field(record: dict[str, Any], field: str) -> None:
    with pytest.raises(RaasError) as err:
        parse(record)
    assert err.value.kind == "bad_request"
    assert field in err.value.message, err.value.message


@pytest.mark.unit
def test_builtin_set_is_deterministic_valid_and_covers_every_answer_type() -> None:
    a, b = builtin_stem(40), builtin_stem(40)
    assert a == b and builtin_stem(10) == a[:10]
    assert len({x["instance_id"] for x in a}) == 40
    specs = [parse(x) for x in a]
    assert {s.answer_type for s in specs} == {"choice", "numeric", "text", "expression"}
    for spec in specs:
        if spec.answer_type == "choice":
            right = spec.choices["ABCD".index(spec.gold)]
            assert f"\n{spec.gold}. {right}\n" in user_prompt(spec)
    with pytest.raises(RaasError):
        builtin_stem(0)


@pytest.mark.unit
def test_builtin_numeric_answers_are_recomputable_from_the_question() -> None:
    checked = 0
    for record in builtin_stem(100):
        q = record["question"]
        if m := re.search(r"accelerates uniformly at (\d+) m/s\^2 for (\d+) s", q):
            a, t = map(int, m.groups())
            assert parse_number(record["answer"]) == pytest.approx(0.5 * a * t * t, rel=1e-3)
            checked += 1
        if m := re.search(r"resistor of (\d+) ohms is connected across an ideal (\d+) V", q):
            ohms, volts = map(int, m.groups())
            assert parse_number(record["answer"]) == pytest.approx(volts / ohms, rel=1e-3)
            checked += 1
    assert checked >= 15


@pytest.mark.integration
@pytest.mark.parametrize(
    ("record", "answer", "reward"),
    [
        ({"question": "q", "choices": list(CHOICES), "answer": "B"}, "(B) neon", 1.0),
        ({"question": "q", "choices": list(CHOICES), "answer": "B"}, "C", 0.0),
        ({"question": "q", "answer": "9.81 m/s^2"}, "9.8 m/s^2", 1.0),  # within 1%
        ({"question": "q", "answer": "9.81 m/s^2"}, "9.5", 0.0),
        ({"question": "q", "answer": "9.81 m/s^2", "tolerance": 0.0001}, "9.8", 0.0),
        ({"question": "q", "answer": "1.414"}, "\\sqrt{2}", 1.0),  # not a plain number: math-verify
        ({"question": "q", "answer": "0.5"}, "\\frac{1}{2}", 1.0),
        ({"question": "q", "answer": "24x^2 + 8x"}, "8x + 24x^2", 1.0),
        ({"question": "q", "answer": "24x^2 + 8x"}, "24x^2", 0.0),
        ({"question": "q", "answer": "Mitochondria"}, "the mitochondria.", 1.0),
        ({"question": "q", "answer": "Co", "case_sensitive": True}, "CO", 0.0),
        ({"question": "q", "answer": "Co", "case_sensitive": True}, "Co", 1.0),
        ({"question": "q", "answer": "42"}, None, 0.0),
        ({"question": "q", "answer": "42"}, "4" * 5000, 0.0),
    ],
)
async def test_scores(record: dict[str, Any], answer: str | None, reward: float) -> None:
    got, details = await score(parse(record), answer, timeout_s=30)
    assert got == reward, details
