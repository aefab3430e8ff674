"""The hand-written parsers that keep ``re`` out of a sandbox's first bash call behave exactly like the
regular expressions they replaced (kept here as the reference), on random and adversarial input; and the
first call really imports none of the costly stdlib modules."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from raas.sandbox import SandboxManager
from raas.sandbox.config import make_config
from raas.toolserver import bashproto
from raas.toolserver.output import clean_text, strip_escapes

pytestmark = pytest.mark.unit

REF_RECORD = re.compile(
    rb"RAAS1 ([0-9]{1,32}) ([0-9]{1,18}) ([0-9]{1,3}) ([xvhye]{0,8}) ([a-z]{0,32}) ([012c]{0,4}) "
    rb"([^\0]*)\0([^\0]*)\0([^\0]*)\0\Z",
    re.S | re.I,
)
REF_EDITING_WORD = re.compile(r"(?<![\w-])(vi|emacs)(?![\w-])")
REF_UNSAFE = re.compile(r"[^\x20\x22-\x26\x28-\x5b\x5d-\x7e]")
REF_CR_NL = re.compile(r"\r+\n")
REF_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def ref_parse(record: bytes) -> tuple[object, ...] | None:
    m = REF_RECORD.match(record)
    if m is None:
        return None
    flags = m.group(4).decode("ascii").lower()
    if b"a" in m.group(5).lower():
        flags += "a"
    return (
        m.group(1).decode("ascii"),
        int(m.group(2)),
        int(m.group(3)),
        flags,
        m.group(6).decode("ascii").lower(),
        m.group(7).decode("utf-8", "replace"),
        m.group(8).decode("utf-8", "replace"),
        m.group(9).decode("utf-8", "replace"),
    )


def ref_clean(raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace")
    text = strip_escapes(text)
    if "\r" in text:
        text = REF_CR_NL.sub("\n", text)
        if "\r" in text:
            lines = text.split("\n")
            for i, line in enumerate(lines):
                if "\r" in line:
                    parts = [p for p in line.split("\r") if p]
                    lines[i] = parts[-1] if parts else ""
            text = "\n".join(lines)
    return REF_CONTROL.sub("", text)


# Records near the grammar: real field values, mutated lengths, case, separators and NULs.
FIELD = st.sampled_from(
    [
        b"",
        b"0",
        b"7",
        b"123",
        b"9" * 18,
        b"9" * 19,
        b"9" * 32,
        b"9" * 33,
        b"x",
        b"xvhye",
        b"XVH",
        b"xvhyexvhy",
        b"a",
        b"himBH",
        b"hB" * 17,
        b"01c",
        b"012cC",
        b"0123",
        b"-1",
        b" ",
        b"1 2",
        "é".encode(),
        b"\xff",
        b"\n",
    ]
)
TEXT = st.binary(max_size=12)


@st.composite
def records(draw: st.DrawFn) -> bytes:
    head = draw(st.sampled_from([b"RAAS1 ", b"raas1 ", b"RaAs1 ", b"RAAS2 ", b"RAAS1", b"RAAS1  ", b""]))
    fields = draw(st.lists(FIELD, min_size=4, max_size=8))
    sep = draw(st.sampled_from([b" ", b"  ", b"\t"]))
    texts = draw(st.lists(TEXT, min_size=2, max_size=4))
    tail = draw(st.sampled_from([b"", b"\0", b"x", b"\0\0"]))
    return head + sep.join(fields) + b" " + b"\0".join(texts) + b"\0" + tail


VALID = b"RAAS1 123 4 0 xh himBH 01 /work dir\0$ \0\0"


@settings(max_examples=3000, deadline=None, database=None)
@given(st.one_of(records(), st.binary(max_size=80), st.just(VALID)))
@example(VALID)
@example(VALID.upper())
@example(VALID + b"x")
@example(b"RAAS1 1 1 1     \0\0\0")
def test_parse_report_matches_the_regex(record: bytes) -> None:
    got = bashproto.parse_report(record)
    assert (None if got is None else tuple(got)) == ref_parse(record)


WORDS = st.text(alphabet=st.sampled_from(list("vi emacs-_xé1\u00e9\u0663\u2160\t;|set-o")), max_size=30)


@settings(max_examples=3000, deadline=None, database=None)
@given(st.one_of(WORDS, st.text(max_size=40)))
@example("set -o vi")
@example("set -o vim")
@example("vi_mode")
@example("x-emacs")
@example("emacs\u0663")
@example("\u2160vi")
def test_needs_runner_matches_the_regex(command: str) -> None:
    assert bashproto.needs_runner(command) == (REF_EDITING_WORD.search(command) is not None)


@settings(max_examples=500, deadline=None, database=None)
@given(st.binary(max_size=200))
def test_ansi_c_quote_matches_the_regex(data: bytes) -> None:
    ref = "$'" + REF_UNSAFE.sub(lambda m: f"\\x{ord(m.group()):02x}", data.decode("latin-1")) + "'"
    assert bashproto.ansi_c_quote(data) == ref


CLEAN = st.binary(max_size=60) | st.lists(
    st.sampled_from(
        [b"\r", b"\n", b"\r\n", b"\r\r\n", b"ab", b"\x1b[1m", b"\x9b", b"\x07", b"\t", b"\x7f", b"\xc2\x85"]
    ),
    max_size=20,
).map(b"".join)


@settings(max_examples=3000, deadline=None, database=None)
@given(CLEAN)
def test_clean_text_matches_the_regex_version(raw: bytes) -> None:
    assert clean_text(raw) == ref_clean(raw)


COSTLY = ("re", "enum", "functools", "collections", "signal", "typing")


@pytest.mark.integration
async def test_the_first_bash_call_imports_no_costly_module(tmp_path: Path) -> None:
    """What a ``local`` sandbox's tool server imports up to its first bash command's answer (Python's own
    import log, ``PYTHONPROFILEIMPORTTIME``, in the sandbox's log): none of ``COSTLY``."""
    manager = SandboxManager(tmp_path / "state")
    try:
        sb = await manager.start(
            make_config(backend="local", env={"PYTHONPROFILEIMPORTTIME": "1"}), owner="t"
        )
        result = await sb.tools.bash("echo hi; false")
        assert (result.output.strip(), result.exit_code) == ("hi", 1)
        log = sb.log_path.read_text()
    finally:
        await manager.close_all()
    imported = {
        line.rsplit("|", 1)[1].strip() for line in log.splitlines() if line.startswith("import time:")
    }
    assert "raas_toolserver.bashtool" in imported  # the log is the server's
    assert sorted(imported & set(COSTLY)) == []


def test_the_records_behave_like_named_tuples() -> None:
    """Copy, pickle, equality, hashing, ``_replace`` and argument errors, as with ``collections.namedtuple``."""
    import copy
    import pickle

    from raas.toolserver import ops

    records = [
        bashproto.Paths("/proc/1/fd/5", "/proc/1/fd/7", "/proc/1/fd/8"),
        bashproto.ShellState(2, "x", "01"),
        bashproto.ShellState(),
        bashproto.Report("12", 3, 0, "xh", "1", "/work", "$ ", ""),
        ops.Arg("path", ops.STR, required=True),
        next(iter(ops.OPS.values())),
    ]
    for r in records:
        for again in (copy.copy(r), copy.deepcopy(r), pickle.loads(pickle.dumps(r))):
            assert type(again) is type(r) and again == r and hash(again) == hash(r)
    assert bashproto.ShellState() == (0, "", "1") and bashproto.ShellState().saved == "1"
    arg = ops.Arg("n", ops.INT)
    assert arg._replace(required=True).required and not arg.required
    assert repr(arg).startswith("Arg(name='n', type='int', required=False")
    with pytest.raises(TypeError):
        ops.Arg("n")  # a field without a default is missing
    with pytest.raises(TypeError):
        ops.Arg("n", ops.INT, nope=1)
    with pytest.raises(TypeError):
        arg._replace(nope=1)
