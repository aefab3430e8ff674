"""The output cleaner: escape sequences never swallow output, and the work stays linear on any input."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raas.toolserver.output import MAX_STRING, OutputBuffer, clean_text, strip_escapes

pytestmark = pytest.mark.unit


def test_clean_text_keeps_text_after_unterminated_sequences() -> None:
    assert clean_text(b"y\x1b_apc\nEND\n1\n2\n3\n") == "yapc\nEND\n1\n2\n3\n"
    assert clean_text(b"a\x1bPdcs\nb\x1b]0;title\nc\x1b^pm\nd\x1bXsos\n") == "adcs\nb0;title\ncpm\ndsos\n"
    assert clean_text(b"x\x1b[12;") == "x12;"
    assert clean_text(b"x\x1b") == "x"
    assert clean_text(b"\x1b]0;t\x07a\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\") == "alink"
    assert clean_text(b"\x1b[1;31mred\x1b[0m \x1b(Bok\x1b=\x1b7") == "red ok"
    assert clean_text("\x9b1mc1\x9d0;t\x9cz".encode()) == "c1z"
    # A string sequence longer than the bound is not one.
    body = b"b" * (MAX_STRING + 10)
    assert clean_text(b"\x1b]" + body + b"\x07end") == body.decode() + "end"


def test_drop_suffix() -> None:
    buf = OutputBuffer(100)
    buf.feed(b"out\n(v) root$ ")
    assert buf.drop_suffix(b"(v) root$ ") and buf.text() == ("out\n", False)
    assert not buf.drop_suffix(b"nope")
    buf = OutputBuffer(20)
    buf.feed(b"0123456789abcdefPROMPT")
    assert buf.drop_suffix(b"PROMPT") and buf.raw() == (b"0123456789", b"cdef", 2)


PRINTABLE = st.text(
    alphabet=st.characters(blacklist_categories=("Cc", "Cs"), blacklist_characters="\x9c"), max_size=200
)
INTRODUCERS = ["\x1b[", "\x1b]", "\x1bP", "\x1b_", "\x1b^", "\x1bX", "\x9b", "\x9d", "\x90", "\x9f"]


@settings(max_examples=400, deadline=None, database=None)
@given(st.binary(max_size=5000))
def test_cleaner_is_total_and_linear(data: bytes) -> None:
    text = data.decode("utf-8", errors="replace")
    work = [0]
    out = strip_escapes(text, work)
    assert work[0] <= 2 * len(text) + 2
    assert is_subsequence(out, text)
    cleaned = clean_text(data)
    assert not any(c in cleaned for c in "\x1b\x00\x07\r\x9b\x9d")


@settings(max_examples=400, deadline=None, database=None)
@given(st.binary(max_size=500), st.sampled_from(INTRODUCERS), PRINTABLE)
def test_unterminated_sequence_keeps_what_follows(before: bytes, intro: str, after: str) -> None:
    """Whatever precedes it, an introducer followed by printable text removes at most the introducer."""
    if intro in ("\x1b[", "\x9b") and after[:1] and " " <= after[0] <= "~":
        after = "\u00e9" + after  # "ESC [ 1 m" or "ESC [ @" would be complete: keep the case unterminated
    cleaned = clean_text(before + (intro + after).encode())
    assert cleaned.endswith(after)


def test_cleaner_work_on_adversarial_inputs() -> None:
    for text in (
        "\x1b]" * 50_000,
        ("\x1b]" + "a" * (MAX_STRING - 1)) * 30,
        "\x1b[" + "1;" * 100_000,
        ("\x1bP" + "x" * 100 + "\x1b") * 2000,
    ):
        work = [0]
        strip_escapes(text, work)
        assert work[0] <= 2 * len(text) + 2


def is_subsequence(small: str, big: str) -> bool:
    it = iter(big)
    return all(c in it for c in small)
