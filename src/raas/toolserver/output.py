"""Bounded output capture and terminal-noise cleaning.

An agent's context must never be flooded, and a command printing gigabytes must not grow the server's
memory: :class:`OutputBuffer` keeps only the first and last bytes and counts what it dropped.
"""

from __future__ import annotations

import re
from typing import Tuple

from .protocol import truncation_marker

_ANSI = re.compile(
    r"""
    \x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?   # OSC ... BEL / ST
    | \x1b[P^_X][^\x1b]*(?:\x1b\\)?      # DCS / PM / APC / SOS strings
    | \x1b\[[0-?]*[ -/]*[@-~]            # CSI
    | \x9b[0-?]*[ -/]*[@-~]              # 8-bit CSI
    | \x1b[ -/]*[0-~]                    # other escapes (charset selection, keypad modes, ...)
    """,
    re.VERBOSE,
)
_CR_NL = re.compile(r"\r+\n")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def clean_text(raw: bytes) -> str:
    """Decode terminal bytes (invalid UTF-8 replaced) and strip ANSI sequences and control characters.

    ``\\r\\n`` becomes ``\\n``; a bare ``\\r`` (progress bars) keeps what a terminal would finally show
    on that line: the text after the last carriage return.
    """
    text = raw.decode("utf-8", errors="replace")
    if "\x1b" in text or "\x9b" in text:
        text = _ANSI.sub("", text)
    if "\r" in text:
        text = _CR_NL.sub("\n", text)
        if "\r" in text:
            lines = text.split("\n")
            for i, line in enumerate(lines):
                if "\r" in line:
                    parts = [p for p in line.split("\r") if p]
                    lines[i] = parts[-1] if parts else ""
            text = "\n".join(lines)
    return _CONTROL.sub("", text)


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
