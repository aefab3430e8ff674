"""Bounded output capture and terminal-noise cleaning.

An agent's context must never be flooded, and a command printing gigabytes must not grow the server's
memory: :class:`OutputBuffer` keeps only the first and last bytes and counts what it dropped.

The escape-sequence cleaner is a single left-to-right pass: each introducer (ESC or an 8-bit C1 control)
is examined once, a string sequence (OSC, DCS, APC, PM, SOS) only counts when its terminator follows
within :data:`MAX_STRING` characters of plain text, and anything malformed loses its introducer only.
So an unterminated ``ESC _`` or a binary dump can never swallow the rest of the output, and the work
is linear in the input.
"""

from __future__ import annotations

from .protocol import truncation_marker

TYPE_CHECKING = False  # typing is not imported at run time: it costs a sandbox's first call
if TYPE_CHECKING:
    from typing import List, Optional, Pattern, Tuple

MAX_STRING = 4096
"""Longest OSC/DCS/APC/PM/SOS body honoured as one sequence; longer ones are treated as unterminated."""

# Where a sequence may start: ESC, and the 8-bit forms of DCS, SOS, CSI, OSC, PM, APC.
_INTROS = "\x1b\x90\x98\x9b\x9d\x9e\x9f"
_STRING_INTROS = frozenset("]P^_X\x90\x98\x9d\x9e\x9f")
# Removed from the text: every C0 control but TAB and LF, DEL and the C1 controls.
_CONTROLS = dict.fromkeys([*range(0x00, 0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0)])
_patterns: Optional[Tuple[Pattern[str], Pattern[str], Pattern[str], Pattern[str]]] = None


def _escape_patterns() -> Tuple[Pattern[str], Pattern[str], Pattern[str], Pattern[str]]:
    """The escape-sequence patterns, compiled on first use: ``re`` (and the ``enum`` it imports) cost a
    sandbox's first call several milliseconds of CPU, and most output has no escape sequence at all."""
    global _patterns
    if _patterns is None:
        import re

        _patterns = (
            re.compile("[%s]" % _INTROS),
            re.compile("[0-?]*[ -/]*"),  # CSI: parameter then intermediate bytes; a final [@-~] must follow
            re.compile("[ -/]*"),  # intermediates of a two-or-more byte escape; a final [0-~] must follow
            # A string body stops at the first control character (ESC, BEL, ST, CR, LF, ...) or at the bound.
            re.compile("[^\x00-\x1f\x7f-\x9f]{0,%d}" % MAX_STRING),
        )
    return _patterns


def _has_intro(text: str) -> bool:
    return any(c in text for c in _INTROS)


def _body_end(pattern: Pattern[str], text: str, pos: int) -> int:
    """Where ``pattern``'s run starting at ``pos`` ends (each body pattern also matches the empty run)."""
    m = pattern.match(text, pos)
    return pos if m is None else m.end()


def strip_escapes(text: str, work: Optional[List[int]] = None) -> str:
    """Remove terminal escape sequences from ``text``; a malformed one loses only its introducer.

    ``work``, when given, gets the number of characters examined added to ``work[0]`` (at most about
    twice the length of ``text``): tests use it to check the pass stays linear.
    """
    intro, csi_body, esc_body, string_body = _escape_patterns()
    out: List[str] = []
    pos = 0
    n = len(text)
    examined = 0
    while True:
        m = intro.search(text, pos)
        if m is None:
            out.append(text[pos:])
            examined += n - pos
            break
        start = m.start()
        examined += start - pos + 1
        out.append(text[pos:start])
        c = text[start]
        if c == "\x1b":
            if start + 1 >= n:
                pos = n
                break
            c = text[start + 1]
            body = start + 2
            if c != "[" and c not in _STRING_INTROS:
                # nF / Fp / Fe / Fs escapes: intermediates, then one final byte.
                end = _body_end(esc_body, text, start + 1)
                examined += end - start
                if end < n and "0" <= text[end] <= "~":
                    pos = end + 1
                else:
                    pos = start + 1  # a lone ESC: drop it, keep what follows
                continue
        else:
            body = start + 1
            c = "[" if c == "\x9b" else c
        if c == "[":
            end = _body_end(csi_body, text, body)
            examined += end - body + 1
            pos = end + 1 if end < n and "@" <= text[end] <= "~" else body
            continue
        end = _body_end(string_body, text, body)
        examined += end - body + 1
        if end < n and text[end] in "\x07\x9c":
            pos = end + 1
        elif end + 1 < n and text[end] == "\x1b" and text[end + 1] == "\\":
            pos = end + 2
        else:
            pos = body  # unterminated: only the introducer goes
    if work is not None:
        work[0] += examined
    return "".join(out)


def clean_text(raw: bytes) -> str:
    """Decode terminal bytes (invalid UTF-8 replaced) and strip escape sequences and control characters.

    ``\\r\\n`` becomes ``\\n``; a bare ``\\r`` (progress bars) keeps what a terminal would finally show
    on that line: the text after the last carriage return.
    """
    text = raw.decode("utf-8", errors="replace")
    if _has_intro(text):
        text = strip_escapes(text)
    if "\r" in text:
        lines = text.split("\n")
        for i, line in enumerate(lines):
            if i < len(lines) - 1:
                line = line.rstrip("\r")  # CR...CR LF ends a line like LF
            if "\r" in line:
                parts = [p for p in line.split("\r") if p]
                line = parts[-1] if parts else ""
            lines[i] = line
        text = "\n".join(lines)
    return text.translate(_CONTROLS)


class OutputBuffer:
    """Keeps the head and tail of a byte stream within ``cap`` bytes, counting the dropped middle."""

    __slots__ = ("_head", "_head_cap", "_tail", "_tail_cap", "total")

    def __init__(self, cap: int) -> None:
        cap = max(int(cap), 2)
        self._head_cap = cap // 2
        self._tail_cap = cap - self._head_cap
        self._head = bytearray()
        self._tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        if not data:
            return
        self.total += len(data)
        room = self._head_cap - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
            if not data:
                return
        if len(data) >= self._tail_cap:
            self._tail = bytearray(data[-self._tail_cap :])
            return
        self._tail += data
        # Trim lazily (at twice the cap) so appends stay amortized O(1).
        if len(self._tail) > 2 * self._tail_cap:
            del self._tail[: len(self._tail) - self._tail_cap]

    def drop_suffix(self, suffix: bytes) -> bool:
        """Remove ``suffix`` if the kept bytes end with it (text the shell printed that is not output)."""
        if not suffix:
            return False
        head, tail, dropped = self.raw()
        if tail.endswith(suffix):
            del self._tail[len(self._tail) - len(suffix) :]
        elif dropped == 0 and (head + tail).endswith(suffix):
            keep = head + tail
            self._head, self._tail = bytearray(), bytearray()
            self.total = 0
            self.feed(keep[: len(keep) - len(suffix)])
            return True
        else:
            return False
        self.total -= len(suffix)
        return True

    def cut_line(self, needle: bytes) -> bool:
        """Drop the last line containing ``needle`` and everything after it (a trace of the tool's own call)."""
        head, tail, dropped = self.raw()
        kept = tail if dropped else head + tail
        at = kept.rfind(needle)
        if at < 0:
            return False
        start = kept.rfind(b"\n", 0, at) + 1
        keep = kept[:start]
        removed = len(kept) - len(keep)
        if dropped:
            self._tail = bytearray(keep)
        else:
            self._head, self._tail = bytearray(), bytearray()
            self.total = 0
            self.feed(keep)
            return True
        self.total -= removed
        return True

    def raw(self) -> Tuple[bytes, bytes, int]:
        """Return (head, tail, bytes dropped between them)."""
        if len(self._tail) > self._tail_cap:
            del self._tail[: len(self._tail) - self._tail_cap]
        dropped = self.total - len(self._head) - len(self._tail)
        return bytes(self._head), bytes(self._tail), dropped

    def text(self) -> Tuple[str, bool]:
        """The cleaned text with the truncation marker when bytes were dropped; and whether they were."""
        head, tail, dropped = self.raw()
        if dropped <= 0:
            return clean_text(head + tail), False
        return clean_text(head) + truncation_marker(dropped) + clean_text(tail), True


def cap_text(text: str, cap: int) -> Tuple[str, bool]:
    """Cap an already-decoded string to about ``cap`` UTF-8 bytes, head and tail."""
    data = text.encode("utf-8")
    if len(data) <= cap:
        return text, False
    buf = OutputBuffer(cap)
    buf.feed(data)
    head, tail, dropped = buf.raw()
    return (
        head.decode("utf-8", errors="replace")
        + truncation_marker(dropped)
        + tail.decode("utf-8", errors="replace"),
        True,
    )
