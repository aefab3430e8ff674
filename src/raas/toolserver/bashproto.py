"""The conversation between the tool server and one interactive bash, as pure functions (no event loop).

Commands are not typed and completion is not read off a prompt:

* The command text sits inline in an ANSI-C quoted assignment on the one line written to the pty (or, when
  long, in a server-owned memory file) and bash runs it with ``eval``, so error messages look like an
  interactive shell's (``bash: foo: command not found``) and no ``RETURN`` trap fires.
* That line restores the user's prompt variables and shell options (the server knows which from the
  previous report), sets ``$?`` to the previous command's status, ``eval``\\ s the command, then calls a
  reporting function that hides the prompt variables again and writes
  ``RAAS1 <nonce> <seq> <status> <options> <$-> <saved> <pwd>\\0<PS1>\\0<PS0>\\0`` to bash's stdin, which
  is the terminal itself whatever the user did to stdout, stderr or ``PROMPT_COMMAND``.
* The server takes the report out of the output by its exact header. The nonce is new for every command
  and never shown to the user's code, so a look-alike printed by a command is just output; and in the same
  stream as the output, the report cannot overtake it.
* Nothing of this lives in the file system, so cleaning ``/tmp`` or ``$TMPDIR`` cannot break a session.
* ``set -x``/``set -v`` are off between commands and come back (through a one-shot ``DEBUG`` trap) at the
  user's first command, so traces show only the user's commands.
* A command that Ctrl-C aborts takes the rest of the line with it (bash discards it); the server then
  writes a *probe* line that re-reads the function definitions and reports with the aborted status.

The line does as little as possible in bash (an assignment, the ``eval``, one function call): it is paid
on every command.
"""

from __future__ import annotations

# Imported by a sandbox's first bash call, on every sandbox start: stdlib modules with a large import cost
# (re and the enum it imports, functools, collections) are kept out; the records below are plain tuples.
TYPE_CHECKING = False  # typing is not imported at run time: it costs a sandbox's first call
if TYPE_CHECKING:
    from typing import Dict, List, Optional, Tuple

MAX_REPORT = 16384
"""A report is a few hundred bytes (the cwd is at most PATH_MAX); a longer field is garbage."""

INLINE_MAX = 3000
"""Longest ANSI-C quoted command sent on the pty line itself; a pty line holds at most 4095 bytes."""

# __raas_z SEQ NONCE STATUS runs with stdout on the terminal (bash's stdin, fd 0): it hides the user's prompt variables (set
# again by the next command line) and, when $SHELLOPTS differs from the tool's last known one, the shell
# options that would show internals (xtrace, verbose, history, vi/emacs), then reports. ``__raas_in`` is
# set while the user's prompt variables are live, so a probe after a normal report only reports; a probe
# also reports the user's expanded PS1/PS0 (${PS1@P}: bash >= 4.4, the eval keeps older parsers away).
# Under ``set -x`` the call of __raas_z is traced: the server cuts that trace from the output. Every
# statement of __raas_z is paid on every command.
_DEFS = r"""
__raas_rc() { return "$1"; }
__raas_z() {
  __raas_in= __raas_f= __raas_q=${PS0+0}${PS1+1} __raas_p0=${PS0-} __raas_p1=${PS1-} PS1=
  [[ -z ${PS0-}${PROMPT_COMMAND[*]+x} ]] || __raas_hide
  [[ $SHELLOPTS == "${__raas_so-}" ]] || __raas_off
  \builtin printf '%s\0\0\0' "RAAS1 $2 $1 $3 $__raas_f $- $__raas_q ${PWD-}"
}
__raas_hide() {
  [[ -z ${PS0+x} ]] || PS0=
  [[ -z ${PROMPT_COMMAND[*]+x} ]] || { __raas_q+=c; __raas_pc=("${PROMPT_COMMAND[@]}"); \builtin unset PROMPT_COMMAND; }
}
__raas_off() {
  [[ $- != *x* ]] || __raas_f+=x
  [[ $- != *v* ]] || __raas_f+=v
  case :$SHELLOPTS: in *:history:*) __raas_f+=h;; esac
  case :$SHELLOPTS: in *:vi:*) __raas_f+=y;; *:emacs:*) __raas_f+=e;; esac
  \builtin set +xv +o history
  [[ $__raas_f != *y* ]] || \builtin set +o vi
  [[ $__raas_f != *e* ]] || \builtin set +o emacs
  __raas_so=$SHELLOPTS
  return 0
}
__raas_probe() {
  local __raas_e= __raas_e0=
  if [[ -n ${__raas_in-} ]]; then
    if ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] >= 404)); then
      [[ -z ${PS1-} ]] || \builtin eval '__raas_e=${PS1@P}' && __raas_e=${__raas_e:0:4096}
      [[ -z ${PS0-} ]] || \builtin eval '__raas_e0=${PS0@P}' && __raas_e0=${__raas_e0:0:4096}
    fi
    __raas_in= __raas_f= __raas_q=${PS0+0}${PS1+1} __raas_p0=${PS0-} __raas_p1=${PS1-} PS1=
    [[ -z ${PS0-}${PROMPT_COMMAND[*]+x} ]] || __raas_hide
  else
    __raas_f=
  fi
  [[ $SHELLOPTS == "${__raas_so-}" ]] || __raas_off
  { \builtin printf '%s\0' "RAAS1 $2 $1 $3 $__raas_f $- ${__raas_q-} ${PWD-}" "$__raas_e" "$__raas_e0"; } >&0
  return 0
}
__raas_pc() {
  if ((${#__raas_pc[@]} > 1)); then PROMPT_COMMAND=("${__raas_pc[@]}"); else PROMPT_COMMAND=${__raas_pc[0]-}; fi
}
"""

_RC = r"""
export TERM=dumb PAGER=cat GIT_PAGER=cat SYSTEMD_PAGER=cat MANPAGER=cat
\builtin set +o history
\builtin unset HISTFILE
__raas_in=1 __raas_so=$SHELLOPTS
{ __raas_z 0 @NONCE@ 0; } >&0
"""


class _Record(tuple):
    """A tuple with named fields (a subclass's properties), without ``collections.namedtuple``'s import."""

    __slots__ = ()

    def __getnewargs__(self) -> tuple:
        return tuple(self)  # copy and pickle call a subclass's __new__ with the fields


class Paths(_Record):
    """Where bash finds the server's descriptors: ``/proc/<server pid>/fd/<n>`` (nothing to delete).

    ``command``, ``defs`` (str); ``runner``: a file holding ``\\builtin eval "$__raas_c"``, sourced
    instead of a direct ``eval`` (see below)."""

    __slots__ = ()

    def __new__(cls, command: str, defs: str, runner: str) -> Paths:
        return tuple.__new__(cls, (command, defs, runner))

    @property
    def command(self) -> str:
        return self[0]

    @property
    def defs(self) -> str:
        return self[1]

    @property
    def runner(self) -> str:
        return self[2]


def proc_fd_path(pid: int, fd: int) -> str:
    return "/proc/%d/fd/%d" % (pid, fd)


def definitions(paths: Paths) -> str:
    """The shell functions a session relies on (re-read by the probe line if the user removed them)."""
    return _DEFS


def rcfile(paths: Paths, nonce: str) -> str:
    """The ``--rcfile`` of a session: the functions, terminal-neutral settings, then the ready report."""
    return definitions(paths) + _RC.replace("@NONCE@", nonce)


# Every byte (as a latin-1 character) that is not printable ASCII, and !, ', \ : shown as \xHH.
_UNSAFE = {c: "\\x%02x" % c for c in range(256) if not (0x20 <= c <= 0x7E) or chr(c) in "!'\\"}


def ansi_c_quote(data: bytes) -> str:
    """``$'...'`` that bash turns back into exactly ``data`` (NULs excepted), in printable ASCII only.

    No ``!`` (history expansion) and no control byte that the terminal's line discipline would act on.
    """
    return "$'" + data.decode("latin-1").translate(_UNSAFE) + "'"


def command_bytes(command: str) -> bytes:
    """The command as bash will see it: UTF-8 (lone surrogates replaced), no NULs, newline-terminated."""
    data = command.encode("utf-8", errors="replace").replace(b"\0", b"")
    if not data.endswith(b"\n"):
        data += b"\n"
    return data


def inline_argument(data: bytes) -> Optional[str]:
    """The quoted command for the pty line when it is short enough, else None (use the memory file)."""
    if len(data) > INLINE_MAX:
        return None
    quoted = ansi_c_quote(data)
    return quoted if len(quoted) <= INLINE_MAX else None


RUNNER = '\\builtin eval "$__raas_c"\n'
_EDITING_WORDS = ("vi", "emacs")


def _wordish(c: str) -> bool:
    """A character that continues a word: what a regular expression's ``[\\w-]`` matches."""
    return c.isalnum() or c == "_" or c == "-"


def needs_runner(command: str) -> bool:
    """Whether the command may switch bash's line editing (``set -o vi``, ``set +o emacs``).

    bash 5.2 crashes or loses its place in the input when the editing mode changes inside an ``eval``
    run from the interactive prompt, but not inside a sourced file; such commands are ``eval``\\ ed from
    the sourced runner file instead (a ``RETURN`` trap then fires once after them).
    """
    for word in _EDITING_WORDS:
        at = command.find(word)
        while at >= 0:
            end = at + len(word)
            if (at == 0 or not _wordish(command[at - 1])) and (
                end == len(command) or not _wordish(command[end])
            ):
                return True
            at = command.find(word, at + 1)
    return False


class ShellState(_Record):
    """What the previous report said about the shell, which the next command line restores.

    * ``status`` (int): ``$?`` for the next command.
    * ``flags`` (str): options hidden between commands: x(trace), v(erbose), h(istory), y (vi), e(macs);
      a(llexport). Distinct letters whatever their case: a terminal in ``olcuc`` mode prints the report
      in upper case.
    * ``saved`` (str): prompt variables the user had set (hidden between commands): 0, 1 for PS0, PS1;
      c for PROMPT_COMMAND. PS2 is never shown: every line the tool writes is a complete command.
    """

    __slots__ = ()

    def __new__(cls, status: int = 0, flags: str = "", saved: str = "1") -> ShellState:
        return tuple.__new__(cls, (status, flags, saved))

    @property
    def status(self) -> int:
        return self[0]

    @property
    def flags(self) -> str:
        return self[1]

    @property
    def saved(self) -> str:
        return self[2]


# Restores PS0/1/2 in one assignment; the DEBUG trap turns tracing back on at the user's first command.
_TRACE_TRAP = (
    "\\builtin trap '[[ -n ${FUNCNAME-} || $BASH_COMMAND == *__raas_* || $BASH_COMMAND == *%s ]] || "
    "{ \\builtin trap - DEBUG; %s}' DEBUG; "
)


def command_line(
    seq: int, nonce: str, state: ShellState, inline: Optional[str], paths: Paths, runner: bool = False
) -> bytes:
    """The line that runs command ``seq`` in the shell ``state`` describes.

    ``__raas_rc N || eval`` sets ``$?`` without tripping ``set -e`` or an ``ERR`` trap (a failing command
    left of ``||`` does neither); after an assignment ``$?`` is already 0. With ``runner``, the command runs
    from the sourced runner file instead (see :func:`needs_runner`).
    """
    head, tail = _line_template(state, inline is not None, runner, paths)
    line = "%s%s%s%d %s $?; } >&0\n" % (head, inline or "", tail, seq, nonce)
    return line.encode("ascii")


_TEMPLATES: Dict[Tuple[ShellState, bool, bool, Paths], Tuple[str, str]] = {}
_TEMPLATES_MAX = 64


def _line_template(state: ShellState, inline: bool, runner: bool, paths: Paths) -> Tuple[str, str]:
    """The parts of a command line around the inline command: they change only with the shell's state
    (kept for the last few states: a session goes back and forth between a handful)."""
    key = (state, inline, runner, paths)
    parts = _TEMPLATES.get(key)
    if parts is None:
        if len(_TEMPLATES) >= _TEMPLATES_MAX:
            _TEMPLATES.clear()
        parts = _TEMPLATES[key] = _make_line_template(state, inline, runner, paths)
    return parts


def _make_line_template(state: ShellState, inline: bool, runner: bool, paths: Paths) -> Tuple[str, str]:
    assign = ["__raas_in=1"]
    for key, var in (("0", "PS0"), ("1", "PS1")):
        if key in state.saved:
            assign.append("%s=$__raas_p%s" % (var, key))
    head = " ".join(assign) + (" __raas_c=" if inline else ";")
    parts = [";"] if inline else []
    if "1" not in state.saved:
        parts.append("\\builtin unset PS1;")  # hidden as an empty string: unset again
    zero = inline and len(parts) == 1
    if not inline:
        parts.append("IFS= \\builtin read -r -d '' __raas_c <%s;" % paths.command)
    if "c" in state.saved:
        parts.append("__raas_pc;")
    if "a" in state.flags:
        parts.append("\\builtin export -n __raas_c __raas_in __raas_q __raas_p0 __raas_p1 __raas_pc;")
    if "h" in state.flags:
        parts.append('\\builtin set -o history; \\builtin history -s "$__raas_c";')
    if "y" in state.flags:
        parts.append("\\builtin set -o vi;")
    elif "e" in state.flags:
        parts.append("\\builtin set -o emacs;")
    trace = "".join("\\builtin set -%s; " % f for f in "vx" if f in state.flags)
    if trace:
        parts.append(_TRACE_TRAP % (paths.runner, trace))
        zero = False
    run = '\\builtin eval "$__raas_c"' if not runner else "\\builtin source " + paths.runner
    if state.status:
        parts.append("__raas_rc %d || %s;" % (state.status, run))
    elif zero:
        parts.append(run + ";")
    else:
        parts.append("__raas_rc 0 && %s;" % run)
    parts.append("{ __raas_z ")
    return head, (" " if not inline else "") + " ".join(parts)


def probe_line(seq: int, nonce: str, paths: Paths) -> bytes:
    """After Ctrl-C aborted a command line: reload the functions and report the aborted status."""
    line = (
        "{ __raas_s=$?; IFS= \\builtin read -r -d '' __raas_d <%s || :; \\builtin eval \"${__raas_d-}\"; "
        '__raas_probe %d %s "$__raas_s"; \\builtin unset __raas_s __raas_d; } 2>&-\n'
        % (paths.defs, seq, nonce)
    )
    return line.encode("ascii")


class Report(_Record):
    """One report: ``nonce`` (str), ``seq``, ``status`` (int), ``flags``, ``saved`` (see
    :class:`ShellState`), ``cwd``; ``prompt``: the user's expanded PS1 (probe reports only: the prompt
    bash printed after an aborted command); ``prompt0``: the user's expanded PS0 (probe reports only:
    printed before bash ran the probe line)."""

    __slots__ = ()

    def __new__(
        cls, nonce: str, seq: int, status: int, flags: str, saved: str, cwd: str, prompt: str, prompt0: str
    ) -> Report:
        return tuple.__new__(cls, (nonce, seq, status, flags, saved, cwd, prompt, prompt0))

    @property
    def nonce(self) -> str:
        return self[0]

    @property
    def seq(self) -> int:
        return self[1]

    @property
    def status(self) -> int:
        return self[2]

    @property
    def flags(self) -> str:
        return self[3]

    @property
    def saved(self) -> str:
        return self[4]

    @property
    def cwd(self) -> str:
        return self[5]

    @property
    def prompt(self) -> str:
        return self[6]

    @property
    def prompt0(self) -> str:
        return self[7]

    def state(self) -> ShellState:
        return ShellState(self.status, self.flags, self.saved)


_HEADER = b"RAAS1 "
_FLAG_BYTES = frozenset(b"xvhyeXVHYE")
_SAVED_BYTES = frozenset(b"012cC")


def _digits(field: bytes, most: int) -> bool:
    return 0 < len(field) <= most and field.isdigit()  # bytes.isdigit: ASCII digits only


def parse_report(record: bytes) -> Optional[Report]:
    """A report as bash printed it (``RAAS1 ...`` up to its third NUL), or None if it is not one.

    ``RAAS1 <nonce: 1-32 digits> <seq: 1-18 digits> <status: 1-3 digits> <flags: 0-8 of xvhye>
    <$-: 0-32 letters> <saved: 0-4 of 012c> <cwd>\\0<PS1>\\0<PS0>\\0`` and nothing after; letters in
    either case (a terminal in ``olcuc`` mode prints the report in upper case)."""
    if record[:6].upper() != _HEADER:
        return None
    fields = record[6:].split(b" ", 6)
    if len(fields) != 7:
        return None
    nonce, seq, status, flags, options, saved, rest = fields
    if not (_digits(nonce, 32) and _digits(seq, 18) and _digits(status, 3)):
        return None
    if len(flags) > 8 or not all(b in _FLAG_BYTES for b in flags):
        return None
    if len(options) > 32 or (options and not options.isalpha()):  # bytes.isalpha: ASCII letters only
        return None
    if len(saved) > 4 or not all(b in _SAVED_BYTES for b in saved):
        return None
    texts = rest.split(b"\0")
    if len(texts) != 4 or texts[3]:
        return None
    shown = flags.decode("ascii").lower()
    if b"a" in options.lower():
        shown += "a"
    return Report(
        nonce.decode("ascii"),
        int(seq),
        int(status),
        shown,
        saved.decode("ascii").lower(),
        texts[0].decode("utf-8", "replace"),
        texts[1].decode("utf-8", "replace"),
        texts[2].decode("utf-8", "replace"),
    )


def nonce_from(random: bytes) -> str:
    """A command's nonce: decimal digits, which no terminal output mode rewrites."""
    return "%d" % int.from_bytes(random, "big")


class ReportScanner:
    """Takes the reports of the current and the previous command out of the terminal's output.

    Only the exact header ``RAAS1 <nonce> <seq> `` is a report: the nonce is new for every command and never
    shown to the user's code, so output that imitates a report is just output. The previous command's
    header is still recognized (and returned, for the caller to ignore): after an interrupt, a probe line
    can make bash report a command twice. Bytes that may begin a header are held back until the next read
    decides; an incomplete record is held up to :data:`MAX_REPORT` bytes.
    """

    def __init__(self) -> None:
        self._keys: Tuple[bytes, ...] = ()
        self._held = b""

    def expect(self, nonce: str, seq: int) -> None:
        """From now on, look for the report of command ``seq`` sent with ``nonce`` (and the previous one)."""
        self._keys = (b"RAAS1 %s %d " % (nonce.encode("ascii"), seq), *self._keys[:1])

    def release(self) -> bytes:
        """What is held back, as output: the command waits for input, so no report is on its way."""
        held, self._held = self._held, b""
        return held

    def feed(self, data: bytes) -> Tuple[bytes, List[Report]]:
        """Split ``data`` into output and the reports complete in what was seen so far."""
        if self._held:
            data = self._held + data
            self._held = b""
        reports: List[Report] = []
        if not self._keys:
            return data, reports
        if data[-1:] == b"\0":
            # The usual last read of a command: output, then its whole report.
            at = data.find(self._keys[0])
            if at >= 0 and data.count(b"\0", at) == 3:
                report = parse_report(data[at:])
                if report is not None and all(data.find(k) < 0 for k in self._keys[1:]):
                    return data[:at], [report]
        out = []
        while data:
            hits = [(i, k) for i, k in ((data.find(k), k) for k in self._keys) if i >= 0]
            if not hits:
                # Hold back a tail that could be the start of a header ("R" only begins one).
                r = data.rfind(b"R", max(0, len(data) - max(map(len, self._keys)) + 1))
                if r >= 0 and any(k.startswith(data[r:]) for k in self._keys):
                    self._held = data[r:]
                    data = data[:r]
                out.append(data)
                break
            at, key = min(hits)
            end = at
            for _ in range(3):
                end = data.find(b"\0", end) + 1
                if end == 0:
                    break
            if end == 0:
                if len(data) - at > MAX_REPORT:
                    out.append(data)  # not a report of ours after all
                else:
                    out.append(data[:at])
                    self._held = data[at:]
                break
            report = parse_report(data[at:end])
            if report is None:
                out.append(data[: at + len(key)])
                data = data[at + len(key) :]
                continue
            reports.append(report)
            out.append(data[:at])
            data = data[end:]
        return b"".join(out), reports


class Limits:
    """The deadlines of one call: ``timeout_s`` overall, and the silence after which to look at the command."""

    __slots__ = ("_start", "no_output_s", "silence", "timeout_s")

    def __init__(
        self, timeout_s: Optional[float], no_output_s: Optional[float], input_wait_s: Optional[float]
    ):
        self.timeout_s = timeout_s
        self.no_output_s = no_output_s
        self.silence = no_output_s if no_output_s is not None else (input_wait_s or 0.0)
        self._start: Optional[float] = None

    def deadline(self, now: float) -> float:
        if self._start is None:
            self._start = now
        return self._start + self.timeout_s if self.timeout_s is not None else float("inf")


CONTROL_KEYS = {"C-c": b"\x03", "C-d": b"\x04", "C-z": b"\x1a", "C-\\": b"\x1c"}
"""``bash.send`` inputs that mean a key, not text (as OpenHands spells them)."""


def input_bytes(text: str) -> bytes:
    """What ``bash.send`` writes to the terminal for ``text``: a named control key, or the text itself."""
    key = CONTROL_KEYS.get(text)
    if key is not None:
        return key
    return text.encode("utf-8", errors="replace")
