"""STEM answers: reading a question record, finding the policy's answer, and comparing the two.

Pure functions (math-verify itself runs in the verifier pool, see :mod:`raas.tasks.stem.handler`), so the
rules are unit-testable and the same at submit time and in EVAL:

* **extraction**: the ``finish`` argument if there is one, else the last ``\\boxed{...}`` or
  ``Answer: X`` / ``the answer is X`` of the final message; a ``\\boxed{}`` or ``Answer:`` inside the
  ``finish`` argument is unwrapped too;
* **choice**: a letter (``B``, ``(B)``, ``B.``, ``B) text``, ``Option B``) in range, or the text of one
  choice; compared with the gold letter;
* **numeric**: the leading number of the answer (``1,234.5``, ``6.02e23``, ``6.02 \\times 10^{23}``,
  ``\\frac{3}{4}``, ``3/4``), units after it ignored, or the value of a closed form (``\\sqrt{2}``,
  evaluated with sympy), within a relative tolerance;
* **text**: case-, whitespace- and end-punctuation-insensitive equality (case kept when the record says
  ``case_sensitive``);
* **expression**: text equality, else math-verify (reading the answer as one LaTeX expression).
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from dataclasses import dataclass
from typing import Any, Literal

from raas.errors import RaasError
from raas.tasks.math import last_boxed

AnswerType = Literal["choice", "numeric", "expression", "text"]
ANSWER_TYPES: tuple[str, ...] = ("choice", "numeric", "expression", "text")
DEFAULT_TOLERANCE = 0.01
"""Relative tolerance of numeric answers (1%: answers rounded to three significant figures still match)."""
ABS_TOLERANCE = 1e-9
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
MAX_ANSWER_CHARS = 2000
MINUS = "\u2212"


def bad(message: str) -> RaasError:
    return RaasError(f"stem instance: {message}", kind="bad_request")


@dataclass(frozen=True)
class StemSpec:
    question: str
    answer_type: AnswerType
    gold: str
    """The gold letter (choice) or answer text."""
    choices: tuple[str, ...] = ()
    tolerance: float = DEFAULT_TOLERANCE
    case_sensitive: bool = False


# -- reading records ------------------------------------------------------------------------------------


def _decoded(value: Any, name: str) -> Any:
    if isinstance(value, str) and value.lstrip()[:1] in ("[", "{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise bad(f"field {name!r} is a string that is not valid JSON: {exc.msg}") from None
    return value


def _choices(instance: dict[str, Any]) -> tuple[str, ...] | None:
    name = "choices" if "choices" in instance else "options" if "options" in instance else None
    if name is None or instance[name] is None:
        return None
    value = _decoded(instance[name], name)
    if isinstance(value, dict) and "text" in value:  # ARC: {"text": [...], "label": ["A", ...]}
        value = _decoded(value["text"], name)
    elif isinstance(value, dict):
        keys = [str(k).strip().upper() for k in value]
        if keys != list(LETTERS[: len(keys)]):
            raise bad(f"field {name!r}: an object of choices needs the keys A, B, C, ... in order")
        value = list(value.values())
    if not isinstance(value, list) or not 2 <= len(value) <= len(LETTERS):
        raise bad(f"field {name!r} must be a list of 2 to {len(LETTERS)} choices")
    out = []
    for i, c in enumerate(value):
        if isinstance(c, bool) or not isinstance(c, str | int | float) or not str(c).strip():
            raise bad(f"field {name!r}: choice {i} must be a non-empty string")
        out.append(str(c).strip())
    return tuple(out)


def _gold_letter(answer: Any, choices: tuple[str, ...]) -> str:
    """A multiple-choice gold answer as a letter: a letter, a 0-based index, or the text of a choice."""
    if isinstance(answer, int) and not isinstance(answer, bool):
        if not 0 <= answer < len(choices):
            raise bad(f"field 'answer' is index {answer}; there are {len(choices)} choices (0-based)")
        return LETTERS[answer]
    if not isinstance(answer, str) or not answer.strip():
        raise bad("field 'answer' must be a choice letter, a 0-based index or the text of a choice")
    text = answer.strip()
    letter = re.fullmatch(r"\(?([A-Za-z])\)?\.?", text)
    if letter and letter.group(1).upper() in LETTERS[: len(choices)]:
        return letter.group(1).upper()
    matches = [i for i, c in enumerate(choices) if normalize_text(c) == normalize_text(text)]
    if len(matches) == 1:
        return LETTERS[matches[0]]
    raise bad(f"field 'answer' {text!r} is not one of the choices {LETTERS[0]}-{LETTERS[len(choices) - 1]}")


def _either(instance: dict[str, Any], name: str, other: str) -> Any:
    """``name``'s value, else ``other``'s (a null counts as absent: mixed-task parquet rows have every column)."""
    value = instance.get(name)
    return instance.get(other) if value is None else value


def parse(instance: dict[str, Any]) -> StemSpec:
    """The :class:`StemSpec` of a record; ``bad_request`` naming the field that is wrong."""
    if not isinstance(instance, dict):
        raise bad("an instance must be an object")
    question = _either(instance, "question", "problem")
    if not isinstance(question, str) or not question.strip():
        raise bad("field 'question' (or 'problem') must be a non-empty string")
    answer = _either(instance, "answer", "answerKey")
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        raise bad("field 'answer' is missing")
    declared = instance.get("answer_type")
    if declared is not None and declared not in ANSWER_TYPES:
        raise bad(f"field 'answer_type' must be one of {', '.join(ANSWER_TYPES)}, got {declared!r}")
    tolerance = instance.get("tolerance", DEFAULT_TOLERANCE)
    if isinstance(tolerance, bool) or not isinstance(tolerance, int | float) or not 0 <= tolerance < 1:
        raise bad("field 'tolerance' must be a relative tolerance in [0, 1)")
    case_sensitive = instance.get("case_sensitive", False)
    if not isinstance(case_sensitive, bool):
        raise bad("field 'case_sensitive' must be true or false")
    choices = _choices(instance)
    if declared == "choice" and choices is None:
        raise bad("answer_type 'choice' needs field 'choices' (or 'options')")
    if choices is not None and declared in (None, "choice"):
        return StemSpec(question.strip(), "choice", _gold_letter(answer, choices), choices)
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise bad("field 'answer' must be a string or a number")
    gold = str(answer).strip()
    if len(gold) > MAX_ANSWER_CHARS:
        raise bad(f"field 'answer' is longer than {MAX_ANSWER_CHARS} characters")
    kind: AnswerType = declared or infer_type(gold)
    if kind == "numeric" and parse_number(gold) is None:
        raise bad(f"field 'answer' {gold!r} does not start with a number (answer_type 'numeric')")
    return StemSpec(question.strip(), kind, gold, choices or (), float(tolerance), case_sensitive)


def infer_type(gold: str) -> AnswerType:
    """``numeric`` when the gold answer is a number (units after it allowed), ``expression`` when it looks
    like mathematics, else ``text``."""
    if parse_number(gold) is not None:
        # "2x", "3n + 1": a number times a variable is an expression; "5 km", "300K" are quantities.
        if re.fullmatch(rf"\s*{_NUM}[a-z](?:\s*[\^+\-*/=].*)?", _strip_latex(gold)):
            return "expression"
        return "numeric"
    if re.search(r"[\\^_=+*/()\[\]{}<>]|\d", gold) or re.fullmatch(r"[A-Za-z]", gold.strip()):
        return "expression"
    return "text"


# -- extraction -----------------------------------------------------------------------------------------

_ANSWER_LINE = re.compile(
    r"(?:final\s+answer|answer)\s*(?:is)?\s*[:\uff1a]\s*(.+)|the\s+(?:final\s+|correct\s+)?answer\s+is\s+(.+)",
    re.IGNORECASE,
)


def _answer_phrase(text: str) -> str | None:
    """What follows the last ``Answer:`` / ``the answer is`` in ``text`` (to the end of its line)."""
    matches = list(_ANSWER_LINE.finditer(text))
    if not matches:
        return None
    phrase = (matches[-1].group(1) or matches[-1].group(2) or "").strip()
    phrase = phrase.rstrip().removesuffix(".").strip()
    return phrase or None


def extract_answer(finish_answer: str | None, last_message: str | None) -> tuple[str | None, str | None]:
    """The policy's answer and where it came from: ``finish``, ``boxed`` or ``answer_line``."""
    if finish_answer is not None and finish_answer.strip():
        inner = last_boxed(finish_answer)
        if inner is None:
            inner = _answer_phrase(finish_answer)
        return (inner if inner is not None and inner.strip() else finish_answer.strip()), "finish"
    if last_message:
        boxed = last_boxed(last_message)
        if boxed is not None and boxed.strip():
            return boxed.strip(), "boxed"
        phrase = _answer_phrase(last_message)
        if phrase is not None:
            return phrase, "answer_line"
    return None, None


# -- normalization and comparison -----------------------------------------------------------------------


def _strip_latex(text: str) -> str:
    text = unicodedata.normalize("NFKC", text)
    text = text.replace("$", "").replace("\\!", "").replace("\\,", " ").replace("\\;", " ").replace("~", " ")
    text = re.sub(r"\\(?:text|mathrm|textbf|mathbf|operatorname)\s*\{([^{}]*)\}", r"\1", text)
    text = re.sub(r"\^\s*\{?\s*\\circ\s*\}?", "°", text)
    text = text.replace("\\left", "").replace("\\right", "").replace("\\%", "%")
    return re.sub(r"\*\*(.+?)\*\*", r"\1", text)


def normalize_text(text: str, *, case_sensitive: bool = False) -> str:
    text = _strip_latex(text).strip()
    text = re.sub(r"\s+", " ", text)
    text = text.strip(" .;:!\"'`")
    if not case_sensitive:
        text = text.lower()
        text = re.sub(r"^(?:the|a|an) ", "", text)
    return text


_NUM = r"[-+\u2212]?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_NUMBER = re.compile(
    rf"^\s*(?P<num>{_NUM})"
    r"(?:\s*(?:\u00d7|x|\*|\\times|\\cdot|\u00b7)\s*10\s*(?:\^|\*\*)\s*\{?\s*(?P<exp>[-+\u2212]?\d+)\s*\}?)?"
)
_FRACTION = re.compile(
    rf"^\s*(?P<sign>[-+\u2212]?)\s*\\[dt]?frac\s*\{{\s*(?P<a>{_NUM})\s*\}}\s*\{{\s*(?P<b>{_NUM})\s*\}}"
)
_SLASH = re.compile(rf"^\s*(?P<a>{_NUM})\s*/\s*(?P<b>{_NUM})(?![\d.])")


def _float(token: str) -> float:
    return float(token.replace(",", "").replace(MINUS, "-"))


def _leading_number(text: str) -> tuple[float | None, str]:
    """The number ``text`` starts with (or None) and the text after it."""
    if m := _FRACTION.match(text):
        den = _float(m.group("b"))
        sign = -1.0 if m.group("sign") in ("-", MINUS) else 1.0
        return (None if den == 0 else sign * _float(m.group("a")) / den), text[m.end() :]
    if m := _SLASH.match(text):
        den = _float(m.group("b"))
        return (None if den == 0 else _float(m.group("a")) / den), text[m.end() :]
    if m := _NUMBER.match(text):
        try:
            value = _float(m.group("num"))
            if m.group("exp"):
                value *= 10.0 ** int(m.group("exp").replace(MINUS, "-"))
        except (ValueError, OverflowError):
            return None, text
        return value, text[m.end() :]
    return None, text


_MORE_MATH = re.compile(r"\s*(?:[\^_=+\-*/(!]|\\(?!%))")
"""After a number, the start of more mathematics ("3^2", "2 + 1", "4\\pi"): then it is no plain number."""


def parse_number(text: str) -> float | None:
    """The number an answer starts with (a unit after it is ignored), or None (also for "3^2", "2\\pi")."""
    if not text or len(text) > MAX_ANSWER_CHARS:
        return None
    value, rest = _leading_number(_strip_latex(text).strip())
    if value is None or _MORE_MATH.match(rest) or not math.isfinite(value):
        return None
    return value


def numbers_match(pred: float, gold: float, tolerance: float) -> bool:
    return abs(pred - gold) <= max(tolerance * abs(gold), ABS_TOLERANCE)


def choice_letter(answer: str, choices: tuple[str, ...]) -> str | None:
    """The choice an answer names: a letter in range (``B``, ``(B)``, ``B.``, ``B) text``, ``Option B``)
    or the exact (normalized) text of one choice; None when it names none or several."""
    text = _strip_latex(answer).strip().strip("*").strip()
    valid = LETTERS[: len(choices)]
    m = re.fullmatch(
        r"(?:(?:option|choice)\s+)?\(?([A-Za-z])\)?(?:[.):]\s*.*)?", text, re.IGNORECASE | re.DOTALL
    )
    if m and m.group(1).upper() in valid:
        return m.group(1).upper()
    matches = [LETTERS[i] for i, c in enumerate(choices) if normalize_text(c) == normalize_text(text)]
    return matches[0] if len(matches) == 1 else None
