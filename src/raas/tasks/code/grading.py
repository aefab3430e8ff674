"""Comparing a program's output with the expected one, on the host (expected outputs never enter a sandbox).

Normalization is what online judges do for problems without a special checker: line endings are unified,
trailing whitespace on every line and trailing empty lines are ignored; nothing else is. With a
``float_tolerance`` the outputs are compared token by token instead, and tokens that both read as numbers
may differ by that much (absolute or relative), for problems that accept approximate answers.
"""

from __future__ import annotations

import math


def normalize(text: str) -> str:
    """Line endings unified, trailing whitespace of each line and trailing blank lines dropped."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return "\n".join(line.rstrip() for line in lines).rstrip("\n")


def _number(token: str) -> float | None:
    try:
        value = float(token)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def outputs_match(got: str, expected: str, float_tolerance: float | None = None) -> bool:
    """Whether ``got`` is an accepted output for ``expected`` (see the module docstring)."""
    if normalize(got) == normalize(expected):
        return True
    if float_tolerance is None:
        return False
    got_tokens, want_tokens = got.split(), expected.split()
    if len(got_tokens) != len(want_tokens):
        return False
    for g, w in zip(got_tokens, want_tokens, strict=True):
        if g == w:
            continue
        gv, wv = _number(g), _number(w)
        if gv is None or wv is None:
            return False
        if abs(gv - wv) > float_tolerance * max(1.0, abs(wv)):
            return False
    return True


def decode_output(raw: bytes) -> str:
    """A program's stdout as text (invalid UTF-8 is replaced, so it can only fail to match)."""
    return raw.decode("utf-8", errors="replace")
