"""The ``str_replace_editor`` tool: view, create, str_replace, insert, undo_edit.

Follows the contract agents are trained on: absolute paths only, ``cat -n`` style numbering, an edit
must match exactly once, and every mistake comes back as a clear ``tool_error`` message.
"""

from __future__ import annotations

import os
import stat
import threading
from typing import Any, Dict, List, Optional

from .ops import EDITOR_COMMANDS
from .output import cap_text
from .protocol import BAD_REQUEST, TOOL_ERROR, ProtocolError

SNIPPET_LINES = 4
MAX_HISTORY = 16
MAX_FILE_BYTES = 16 * 1024 * 1024
COMMANDS = EDITOR_COMMANDS


def _err(message: str) -> ProtocolError:
    return ProtocolError(TOOL_ERROR, message)


def _encodable(text: str) -> bool:
    try:
        os.fsencode(text)
    except UnicodeError:
        return False
    return True


def _numbered(text: str, start: int = 1) -> str:
    lines = text.split("\n")
    return "\n".join("%6d\t%s" % (i + start, line) for i, line in enumerate(lines))


class Editor:
    """Per-file edit history lives here, so ``undo_edit`` works across requests."""

    def __init__(self, output_cap: int) -> None:
        self.output_cap = output_cap
        self._history: Dict[str, List[Optional[str]]] = {}
        self._lock = threading.Lock()

    def run(self, args: Dict[str, Any]) -> Dict[str, Any]:
        command = args["command"]
        if command not in COMMANDS:
            raise ProtocolError(
                BAD_REQUEST, "unknown editor command %r (known: %s)" % (command, ", ".join(COMMANDS))
            )
        path = args["path"]
        if "\0" in path or not _encodable(path):
            raise _err("The path must be valid Unicode text without NUL characters.")
        if not os.path.isabs(path):
            raise _err(
                "The path %s is not an absolute path, it should start with `/`. Maybe you meant %s?"
                % (path, os.path.join("/", path))
            )
        path = os.path.normpath(path)
        with self._lock:
            output = getattr(self, "_" + command)(path, args)
        text, _ = cap_text(output, self.output_cap)
        return {"output": text}

    # -- helpers -------------------------------------------------------------------------------

    def _check_file(self, path: str, command: str) -> None:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise _err("The path %s does not exist. Please provide a valid path." % path) from None
        except OSError as exc:
            raise _err("Cannot access %s: %s" % (path, exc.strerror)) from None
        if stat.S_ISDIR(st.st_mode):
            raise _err(
                "The path %s is a directory and only the `view` command can be used on directories." % path
            )
        if not stat.S_ISREG(st.st_mode):
            raise _err("The path %s is not a regular file; `%s` needs one." % (path, command))
        if st.st_size > MAX_FILE_BYTES:
            raise _err("The file %s is too large (%d bytes) for the editor." % (path, st.st_size))

    def _read(self, path: str) -> str:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise _err("Cannot read %s: %s" % (path, exc.strerror)) from None
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _err(
                "The file %s is not valid UTF-8 text (byte %d); the editor only handles text files."
                % (path, exc.start)
            ) from None

    def _write(self, path: str, text: str) -> None:
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:
            raise _err("The new text is not valid Unicode (it contains lone surrogates).") from None
        try:
            with open(path, "wb") as f:
                f.write(data)
        except OSError as exc:
            raise _err("Cannot write %s: %s" % (path, exc.strerror)) from None

    def _remember(self, path: str, previous: Optional[str]) -> None:
        hist = self._history.setdefault(path, [])
        hist.append(previous)
        del hist[:-MAX_HISTORY]

    def _snippet(self, text: str, first_line: int, last_line: int) -> str:
        """Lines around the edited region (1-based, inclusive), numbered."""
        lines = text.split("\n")
        start = max(1, first_line - SNIPPET_LINES)
        end = min(len(lines), last_line + SNIPPET_LINES)
        return _numbered("\n".join(lines[start - 1 : end]), start)

    # -- commands ------------------------------------------------------------------------------

    def _view(self, path: str, args: Dict[str, Any]) -> str:
        view_range = args.get("view_range")
        if os.path.isdir(path):
            if view_range is not None:
                raise _err("The `view_range` parameter is not allowed when `path` points to a directory.")
            return self._list_dir(path)
        self._check_file(path, "view")
        text = self._read(path)
        start = 1
        if view_range is not None:
            lines = text.split("\n")
            n = len(lines)
            if len(view_range) != 2 or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in view_range
            ):
                raise _err("Invalid `view_range`: it should be a list of two integers, e.g. [1, 20].")
            first, last = view_range
            if first < 1 or first > n:
                raise _err(
                    "Invalid `view_range`: %r. Its first element `%d` should be within the range of "
                    "lines of the file: [1, %d]." % (view_range, first, n)
                )
            if last == -1:
                last = n
            elif last < first:
                raise _err(
                    "Invalid `view_range`: %r. Its second element `%d` should be larger or equal than "
                    "its first `%d`." % (view_range, last, first)
                )
            elif last > n:
                raise _err(
                    "Invalid `view_range`: %r. Its second element `%d` should be smaller than the "
                    "number of lines in the file: `%d`." % (view_range, last, n)
                )
            text = "\n".join(lines[first - 1 : last])
            start = first
        return "Here's the result of running `cat -n` on %s:\n%s\n" % (path, _numbered(text, start))

    def _list_dir(self, path: str) -> str:
        entries: List[str] = []

        def walk(directory: str, depth: int) -> None:
            try:
                names = sorted(os.listdir(directory))
            except OSError:
                return
            for name in names:
                if name.startswith("."):
                    continue
                full = os.path.join(directory, name)
                entries.append(full)
                if depth < 2 and os.path.isdir(full) and not os.path.islink(full):
                    walk(full, depth + 1)

        walk(path, 1)
        return "Here's the files and directories up to 2 levels deep in %s, excluding hidden items:\n%s\n" % (
            path,
            "\n".join([path, *entries]),
        )

    def _create(self, path: str, args: Dict[str, Any]) -> str:
        file_text = args.get("file_text")
        if file_text is None:
            raise _err("Parameter `file_text` is required for command: create")
        if os.path.lexists(path):
            raise _err("File already exists at: %s. Cannot overwrite files using command `create`." % path)
        parent = os.path.dirname(path)
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as exc:
            raise _err("Cannot create directory %s: %s" % (parent, exc.strerror)) from None
        self._write(path, file_text)
        self._remember(path, None)
        return "File created successfully at: %s" % path

    def _str_replace(self, path: str, args: Dict[str, Any]) -> str:
        old_str = args.get("old_str")
        if old_str is None:
            raise _err("Parameter `old_str` is required for command: str_replace")
        if old_str == "":
            raise _err("Parameter `old_str` must not be empty; use `insert` or `create` to add text.")
        new_str = args.get("new_str") or ""
        self._check_file(path, "str_replace")
        text = self._read(path)
        count = text.count(old_str)
        if count == 0:
            raise _err(
                "No replacement was performed, old_str `%s` did not appear verbatim in %s." % (old_str, path)
            )
        if count > 1:
            lines: List[int] = []
            pos = text.find(old_str)
            while pos >= 0:
                lines.append(text.count("\n", 0, pos) + 1)
                pos = text.find(old_str, pos + 1)
            raise _err(
                "No replacement was performed. old_str `%s` occurs %d times in %s, in lines %s. "
                "Please ensure it is unique." % (old_str, count, path, lines)
            )
        at = text.find(old_str)
        new_text = text[:at] + new_str + text[at + len(old_str) :]
        self._write(path, new_text)
        self._remember(path, text)
        first = text.count("\n", 0, at) + 1
        last = first + new_str.count("\n")
        return (
            "The file %s has been edited. Here's the result of running `cat -n` on a snippet of %s:\n%s\n"
            "Review the changes and make sure they are as expected. Edit the file again if necessary."
            % (path, path, self._snippet(new_text, first, last))
        )

    def _insert(self, path: str, args: Dict[str, Any]) -> str:
        insert_line = args.get("insert_line")
        new_str = args.get("new_str")
        if insert_line is None:
            raise _err("Parameter `insert_line` is required for command: insert")
        if new_str is None:
            raise _err("Parameter `new_str` is required for command: insert")
        self._check_file(path, "insert")
        text = self._read(path)
        lines = text.split("\n")
        n = len(lines)
        if insert_line < 0 or insert_line > n:
            raise _err(
                "Invalid `insert_line` parameter: %d. It should be within the range of lines of the "
                "file: [0, %d]." % (insert_line, n)
            )
        new_lines = new_str.split("\n")
        result = lines[:insert_line] + new_lines + lines[insert_line:]
        new_text = "\n".join(result)
        self._write(path, new_text)
        self._remember(path, text)
        return (
            "The file %s has been edited. Here's the result of running `cat -n` on a snippet of the "
            "edited file:\n%s\nReview the changes and make sure they are as expected (correct "
            "indentation, no duplicate lines, etc). Edit the file again if necessary."
            % (path, self._snippet(new_text, insert_line + 1, insert_line + len(new_lines)))
        )

    def _undo_edit(self, path: str, args: Dict[str, Any]) -> str:
        hist = self._history.get(path)
        if not hist:
            raise _err("No edit history found for %s." % path)
        previous = hist.pop()
        if previous is None:
            try:
                os.unlink(path)
            except OSError as exc:
                raise _err("Cannot remove %s: %s" % (path, exc.strerror)) from None
            return "Undid the creation of %s; the file was removed." % path
        self._write(path, previous)
        return "Last edit to %s undone successfully. Here's the result of running `cat -n` on %s:\n%s\n" % (
            path,
            path,
            _numbered(previous),
        )
