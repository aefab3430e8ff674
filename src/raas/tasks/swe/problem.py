"""Problem statements written from the failing tests, in the style of an issue report.

The statement names the failing tests and shows what they report (assertion messages, the test's own
failing line, a short traceback of the test code), and never where the fix goes: frames inside the
package's code are dropped, and any line that mentions the mutated file or the mutated function is left
out (test ids are kept even when they contain the function's name: a test named after the API it tests
is what a real report would quote).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

_HEADER = re.compile(r"^_{2,} (.+?) _{2,}$")
_SECTION = re.compile(r"^={5,} .* ={5,}$")
_FRAME = re.compile(r"^(\S+?):(\d+): in (\S+)$")
_CARETS = re.compile(r"^\s*[\^~]+\s*$")  # Python 3.11's position markers under a traceback line
MAX_DETAILED = 3
MAX_LINES_PER_TEST = 14
MAX_LISTED = 20


@dataclass(frozen=True)
class Secrets:
    """What a problem statement must never name."""

    words: tuple[str, ...]  # identifiers matched as whole words (the function and enclosing functions)
    paths: tuple[str, ...]  # substrings (file paths, file names, dotted module names)

    def leaks(self, text: str, allowed: Iterable[str] = ()) -> list[str]:
        """The secrets that ``text`` mentions outside the ``allowed`` strings (test ids)."""
        for a in sorted(allowed, key=len, reverse=True):
            text = text.replace(a, " ")
        found = [w for w in self.words if re.search(rf"(?<!\w){re.escape(w)}(?!\w)", text)]
        found += [p for p in self.paths if p in text]
        return found


def secrets_for(file: str, functions: Sequence[str], top_modules: Sequence[str]) -> Secrets:
    """Secrets of a mutation in ``file`` (repository-relative) inside ``functions`` (innermost last)."""
    parts = file.split("/")
    # A bare ``__init__.py`` names no place (every package has one): its directory does.
    paths = {file, "/".join(parts[-2:]) if parts[-1] == "__init__.py" else parts[-1]}
    if parts[0] == "src" and len(parts) > 1:
        paths.add("/".join(parts[1:]))
    stem = [p for p in parts if p != "src"]
    stem[-1] = stem[-1].removesuffix(".py")
    if stem[-1] == "__init__":
        stem = stem[:-1]
    dotted = ".".join(stem)
    if dotted and dotted not in top_modules:
        paths.add(dotted)
    return Secrets(words=tuple(dict.fromkeys(functions)), paths=tuple(sorted(paths)))


def failure_sections(log: str) -> dict[str, list[str]]:
    """pytest's FAILURES/ERRORS sections: {headline (e.g. ``Class.test_x[param]``): lines}."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    in_failures = False
    for line in log.splitlines():
        if _SECTION.match(line):
            in_failures = " FAILURES " in line or " ERRORS " in line
            current = None
            continue
        if not in_failures:
            continue
        m = _HEADER.match(line)
        if m:
            title = re.sub(r"^ERROR at (?:setup|teardown|call) of ", "", m.group(1))
            current = out.setdefault(title, [])
            continue
        if current is not None:
            current.append(line)
    return out


def headline(test_id: str) -> str:
    """The FAILURES section title pytest gives a test id."""
    return test_id.split("::", 1)[-1].replace("::", ".")


def test_excerpt(
    lines: list[str], test_files: set[str], secrets: Secrets, allowed: Sequence[str]
) -> list[str]:
    """The parts of one failure a reporter would paste: frames in test files (not in the package's
    code, not in the standard library) and the final error lines, minus anything naming a secret."""
    keep: list[str] = []
    in_test_frame = False
    errors: list[str] = []
    for line in lines:
        m = _FRAME.match(line)
        if m:
            in_test_frame = m.group(1) in test_files
            if in_test_frame:
                keep.append(line)
            continue
        if line.startswith("E "):
            errors.append(line)
            continue
        if in_test_frame and line.strip() and not _CARETS.match(line):
            keep.append(line)
    # An error line that names a secret keeps only the exception's type.
    shown: list[str] = []
    for line in errors[:8]:
        if not secrets.leaks(line, allowed):
            shown.append(line)
        elif not shown and (kind := _error_kind([line])) != "test failure":
            shown.append(f"E   {kind}: ...")
    body = keep[-(MAX_LINES_PER_TEST - len(shown)) :] + shown
    return [ln for ln in body if not secrets.leaks(ln, allowed)]


def _error_kind(lines: list[str]) -> str:
    for line in lines:
        m = re.match(r"^E\s+([A-Za-z_][\w.]*(?:Error|Exception|Exit|Warning|Interrupt))\b", line)
        if m:
            return m.group(1).rsplit(".", 1)[-1]
        if re.match(r"^E\s+assert\b", line):  # a bare assert, as pytest rewrites it
            return "AssertionError"
    return "test failure"


_OPENINGS = (
    "After updating to the current checkout, {n} of {package}'s own tests fail.",
    "I am seeing {n} failing test{s} in {package}'s test suite on the current code.",
    "Running {package}'s test suite on this checkout, {n} test{s} fail{v} that should pass.",
)
_CLOSINGS = (
    "Expected behaviour: all of the tests above pass, without changing the tests.",
    "These tests describe the intended behaviour; the library should make them pass again.",
    "Please fix the library so that these tests pass (the tests themselves are correct).",
)


def write_problem_statement(
    package: str,
    failing: Sequence[str],
    log: str,
    test_files: Iterable[str],
    secrets: Secrets,
    seed: str = "",
) -> str:
    """An issue-style report of ``failing`` test ids from the ``log`` of the run where they failed."""
    files = set(test_files)
    sections = failure_sections(log)
    pick = int(hashlib.sha256((seed or ",".join(failing)).encode()).hexdigest(), 16)
    n = len(failing)
    first_lines = sections.get(headline(failing[0]), [])
    title = f"{package}: {_error_kind(first_lines)} in {headline(failing[0])}"
    if n > 1:
        title += f" (and {n - 1} more failing test{'s' if n > 2 else ''})"
    opening = _OPENINGS[pick % len(_OPENINGS)].format(
        n=n, package=package, s="s" if n != 1 else "", v="" if n != 1 else "s"
    )
    parts = [title, "", opening, "", "Failing tests:", ""]
    parts += [f"- `{t}`" for t in failing[:MAX_LISTED]]
    if n > MAX_LISTED:
        parts.append(f"- ... and {n - MAX_LISTED} more")
    shown = 0
    for t in failing:
        if shown >= MAX_DETAILED:
            break
        lines = sections.get(headline(t))
        if not lines:
            continue
        excerpt = test_excerpt(lines, files, secrets, failing)
        if not excerpt:
            continue
        parts += ["", f"`{t}` fails with:", "", "```", *excerpt, "```"]
        shown += 1
    parts += ["", _CLOSINGS[(pick // 7) % len(_CLOSINGS)]]
    text = "\n".join(parts).rstrip() + "\n"
    leaks = secrets.leaks(text, failing)
    if leaks:  # the title's error name or a listed line slipped through: drop the offending lines
        text = "\n".join(ln for ln in text.splitlines() if not secrets.leaks(ln, failing)) + "\n"
    return text
