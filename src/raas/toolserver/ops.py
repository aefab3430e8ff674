"""The one declaration of every tool op: its arguments, its result fields, and what the policy sees.

Three parties read it, so a tool is described exactly once:

* the tool server validates each request against it (:func:`validate_args`);
* the host client (``raas.sandbox.client``) builds and checks its requests with the same function before
  sending, and its typed result models are checked against :attr:`Op.result` by the tests;
* the agent derives the JSON schemas shown to the policy from :data:`POLICY_TOOLS` (an op plus the
  arguments marked ``policy=True``) and checks the policy's arguments with :func:`value_problem`.

Runs inside sandboxes on the image's python3 (>= 3.8): standard library only, 3.8 syntax.
"""

from __future__ import annotations

import math

TYPE_CHECKING = False  # typing is not imported at run time: it costs a sandbox's first call ~15 ms of CPU
if TYPE_CHECKING:
    from typing import Any, Dict, List, NamedTuple, Optional, Tuple
else:
    _MISSING = object()

    def _record_class(name, fields, defaults, body):
        """A tuple subclass with named fields, what ``collections.namedtuple`` makes (without importing
        ``collections``, another few milliseconds of every sandbox's start): positional or keyword
        construction with trailing defaults, a read-only property per field, ``_replace`` and a repr."""
        first_default = len(fields) - len(defaults)
        index = {f: i for i, f in enumerate(fields)}

        def __new__(cls, *args, **kwargs):
            if len(args) > len(fields):
                raise TypeError("%s() takes %d arguments, got %d" % (name, len(fields), len(args)))
            values = list(args) + [_MISSING] * (len(fields) - len(args))
            for key, value in kwargs.items():
                i = index.get(key)
                if i is None:
                    raise TypeError("%s() got an unexpected keyword argument %r" % (name, key))
                if values[i] is not _MISSING:
                    raise TypeError("%s() got multiple values for argument %r" % (name, key))
                values[i] = value
            for i, value in enumerate(values):
                if value is _MISSING:
                    if i < first_default:
                        raise TypeError("%s() missing required argument %r" % (name, fields[i]))
                    values[i] = defaults[i - first_default]
            return tuple.__new__(cls, values)

        def _replace(self, **changes):
            return type(self)(**{f: changes.pop(f, v) for f, v in zip(fields, self)}, **changes)  # noqa: B905 - Python 3.8

        def __getnewargs__(self):
            return tuple(self)  # copy and pickle call __new__ with the fields

        def __repr__(self):
            return "%s(%s)" % (name, ", ".join("%s=%r" % fv for fv in zip(fields, self)))  # noqa: B905 - Python 3.8

        def field(i):
            return property(lambda self: self[i])

        ns = {f: field(i) for i, f in enumerate(fields)}
        ns.update(body)
        ns.update(
            __slots__=(),
            __new__=__new__,
            __getnewargs__=__getnewargs__,
            _replace=_replace,
            __repr__=__repr__,
            _fields=tuple(fields),
        )
        return type(name, (tuple,), ns)

    class _RecordType(type):
        """What ``class X(NamedTuple)`` does for the records below, without importing ``typing``: the
        annotated names become the fields of a named tuple, their values its defaults."""

        def __new__(mcs, name, bases, ns):
            if not bases:
                return super().__new__(mcs, name, bases, ns)
            annotations = ns.get("__annotations__")
            if annotations is None and "__annotate__" in ns:  # Python >= 3.14 (PEP 649)
                annotations = ns["__annotate__"](1)
            fields = list(annotations or ())
            defaults = [ns[f] for f in fields if f in ns]
            if any(f in ns for f in fields[: len(fields) - len(defaults)]):
                raise TypeError("%s: fields with defaults must come last" % name)
            body = {
                k: v
                for k, v in ns.items()
                if k not in fields and k not in ("__annotations__", "__annotate__")
            }
            return _record_class(name, fields, defaults, body)

    class NamedTuple(metaclass=_RecordType):
        pass


STR, NUM, INT, BOOL, LIST, OBJECT = "str", "num", "int", "bool", "list", "object"
"""Type tags. ``num`` and ``int`` values are finite, never booleans, and within the argument's bounds."""

MAX_NUMBER = 2**53
"""Default upper bound of every number (larger values, NaN and Infinity are refused)."""

JSON_TYPES = {STR: "string", NUM: "number", INT: "integer", BOOL: "boolean", LIST: "array", OBJECT: "object"}


class Arg(NamedTuple):
    """One argument of an op."""

    name: str
    type: str
    required: bool = False
    description: str = ""
    minimum: Optional[float] = None
    """Numbers only; None means 0 (every number on the wire is a size, a count or a duration)."""
    maximum: Optional[float] = None
    """Numbers only; None means :data:`MAX_NUMBER`."""
    choices: Optional[Tuple[str, ...]] = None
    items: Optional[str] = None
    """Type tag of a list's items, for the policy's schema (the tool checks the items itself)."""
    policy: bool = False
    """Shown to the policy in the tool's JSON schema (see :data:`POLICY_TOOLS`)."""

    @property
    def bounds(self) -> Tuple[float, float]:
        low = 0 if self.minimum is None else self.minimum
        high = MAX_NUMBER if self.maximum is None else self.maximum
        return low, high


class Field(NamedTuple):
    """One field of an op's result."""

    name: str
    type: str
    nullable: bool = False
    fields: Tuple["Field", ...] = ()
    """For an ``object`` field, or a ``list`` of objects: the fields of that object."""
    items: Optional[str] = None
    """For a ``list`` field: the type tag of its items."""


class Op(NamedTuple):
    """One op: ``tool.name {args}`` → ``{result}``, with or without a raw attachment each way."""

    tool: str
    name: str
    summary: str
    args: Tuple[Arg, ...] = ()
    result: Tuple[Field, ...] = ()
    takes_attachment: bool = False
    returns_attachment: bool = False

    def arg(self, name: str) -> Optional[Arg]:
        for a in self.args:
            if a.name == name:
                return a
        return None


class PolicyTool(NamedTuple):
    """A tool as the policy calls it: an op's ``policy`` arguments plus arguments of the agent's own."""

    name: str
    description: str
    op: Optional[Tuple[str, str]] = None
    extra: Tuple[Arg, ...] = ()
    """Arguments the agent interprets itself (``bash``'s ``is_input`` switches to ``bash.send``)."""


class ArgumentError(ValueError):
    """A request whose tool, op or arguments do not fit the declaration; the message says what is wrong."""


def _timeout(policy: bool = False, description: str = "Seconds before the call is interrupted.") -> Arg:
    return Arg("timeout", NUM, description=description, policy=policy)


_OUTPUT_CAP = Arg("output_cap", INT, description="Bytes of output kept (head and tail) for this call.")
_NO_OUTPUT_TIMEOUT = Arg(
    "no_output_timeout", NUM, description="Seconds without output after which the command is interrupted."
)
_SESSION = Arg("session", STR, description='The bash session (default "default").')
_BASH_RESULT = (
    Field("output", STR),
    Field("exit_code", INT, nullable=True),
    Field("timed_out", BOOL),
    Field("interrupted", BOOL),
    Field("restarted", BOOL),
    Field("truncated", BOOL),
    Field("waiting_for_input", BOOL),
    Field("cwd", STR),
    Field("session", STR),
)
EDITOR_COMMANDS = ("view", "create", "str_replace", "insert", "undo_edit")

OPS: Dict[Tuple[str, str], Op] = {
    (op.tool, op.name): op
    for op in (
        Op(
            "server",
            "ping",
            "Handshake: protocol version, server pid and python, which tools work.",
            result=(
                Field("version", INT),
                Field("pid", INT),
                Field("python", STR),
                Field("sandbox_id", STR, nullable=True),
                Field("tools", OBJECT),
            ),
        ),
        Op("server", "shutdown", "Answer, then stop as SIGTERM does.", result=(Field("stopping", BOOL),)),
        Op(
            "bash",
            "run",
            "Run a command in a persistent bash session on a terminal.",
            args=(
                Arg("command", STR, required=True, description="The command to run.", policy=True),
                _SESSION,
                _timeout(True, "Seconds before the command is interrupted."),
                _NO_OUTPUT_TIMEOUT,
                _OUTPUT_CAP,
            ),
            result=_BASH_RESULT,
        ),
        Op(
            "bash",
            "send",
            "Type into the command still running in a session (or interrupt it) and read on.",
            args=(
                _SESSION,
                Arg("input", STR, description='Text to type; "C-c", "C-d", "C-z" and "C-\\\\" are keys.'),
                Arg("interrupt", BOOL, description="Stop the command as a timeout would."),
                _timeout(),
                _NO_OUTPUT_TIMEOUT,
                _OUTPUT_CAP,
            ),
            result=_BASH_RESULT,
        ),
        Op(
            "bash",
            "close",
            "Close a bash session.",
            args=(_SESSION._replace(required=True),),
            result=(Field("closed", BOOL),),
        ),
        Op(
            "bash",
            "list",
            "The bash sessions.",
            result=(
                Field(
                    "sessions",
                    LIST,
                    items=OBJECT,
                    fields=(
                        Field("session", STR),
                        Field("alive", BOOL),
                        Field("busy", BOOL),
                        Field("cwd", STR),
                        Field("pid", INT),
                    ),
                ),
            ),
        ),
        Op(
            "ipython",
            "run",
            "Run code in a persistent IPython kernel.",
            args=(
                Arg("code", STR, required=True, description="Python code to execute.", policy=True),
                _timeout(),
                _OUTPUT_CAP,
            ),
            result=(
                Field("stdout", STR),
                Field("stderr", STR),
                Field("result", STR, nullable=True),
                Field(
                    "error",
                    OBJECT,
                    nullable=True,
                    fields=(Field("ename", STR), Field("evalue", STR), Field("traceback", LIST, items=STR)),
                ),
                Field("images", LIST, items=STR),
                Field("timed_out", BOOL),
                Field("restarted", BOOL),
            ),
        ),
        Op("ipython", "restart", "Restart the kernel.", result=(Field("restarted", BOOL),)),
        Op(
            "editor",
            "run",
            "View, create and edit files (str_replace_editor).",
            args=(
                Arg("command", STR, required=True, choices=EDITOR_COMMANDS, policy=True),
                Arg(
                    "path",
                    STR,
                    required=True,
                    description="Absolute path of the file or directory.",
                    policy=True,
                ),
                Arg("file_text", STR, description="Content for `create`.", policy=True),
                Arg("old_str", STR, description="Exact text to replace (`str_replace`).", policy=True),
                Arg("new_str", STR, description="Replacement or inserted text.", policy=True),
                Arg("insert_line", INT, description="Insert after this line (`insert`).", policy=True),
                Arg(
                    "view_range",
                    LIST,
                    items=INT,
                    description="[start, end] lines for `view`; end -1 means to the end.",
                    policy=True,
                ),
            ),
            result=(Field("output", STR),),
        ),
        Op(
            "gateway",
            "forward",
            "Start (once per socket) a 127.0.0.1 TCP port in the sandbox that leads to a Unix socket.",
            args=(
                Arg("socket", STR, required=True, description="Absolute path of the Unix socket."),
                Arg("port", INT, maximum=65535, description="The TCP port (default 0: any free one)."),
            ),
            result=(
                Field("host", STR),
                Field("port", INT),
                Field("socket", STR),
                Field("connections", INT),
                Field("refused", INT),
            ),
        ),
        # File contents travel as the message's attachment (raw bytes), never in args.
        Op(
            "files",
            "upload",
            "Extract a tar stream (the attachment) into a directory.",
            args=(Arg("path", STR, required=True), Arg("mode", INT)),
            result=(Field("path", STR), Field("files", INT)),
            takes_attachment=True,
        ),
        Op(
            "files",
            "download",
            "A tar stream (the attachment) of a file or of a directory's contents.",
            args=(Arg("path", STR, required=True),),
            result=(Field("size", INT),),
            returns_attachment=True,
        ),
        Op(
            "files",
            "write",
            "Write one whole file from the attachment.",
            args=(Arg("path", STR, required=True), Arg("mode", INT)),
            result=(Field("path", STR), Field("size", INT)),
            takes_attachment=True,
        ),
        Op(
            "files",
            "read",
            "Read one whole regular file into the attachment.",
            args=(Arg("path", STR, required=True),),
            result=(Field("size", INT),),
            returns_attachment=True,
        ),
    )
}

POLICY_TOOLS: Dict[str, PolicyTool] = {
    t.name: t
    for t in (
        PolicyTool(
            "bash",
            "Run a bash command in a persistent shell in the sandbox and return its output. "
            "A command that waits for keyboard input returns early and keeps running: call bash again "
            "with is_input=true to type into it.",
            op=("bash", "run"),
            extra=(
                Arg(
                    "is_input",
                    BOOL,
                    description="Send `command` as input to the program still running in the shell "
                    '(include "\\n" for Enter; "C-c", "C-d" or "C-z" send those keys) instead of '
                    "running it as a new command.",
                ),
            ),
        ),
        PolicyTool(
            "ipython",
            "Run Python code in a persistent IPython kernel; returns stdout, the value of "
            "the last expression and any error.",
            op=("ipython", "run"),
        ),
        PolicyTool(
            "str_replace_editor",
            "View, create and edit files: view a file or directory, create a file, replace "
            "an exact unique string, insert text after a line, or undo the last edit.",
            op=("editor", "run"),
        ),
    )
}
"""The tools the policy can call that run an op in the sandbox."""


def get_op(tool: Any, op: Any, ops: Optional[Dict[Tuple[str, str], Op]] = None) -> Op:
    """The declaration of ``tool.op``; :class:`ArgumentError` naming the known ones otherwise."""
    table = OPS if ops is None else ops
    found = table.get((tool, op))
    if found is not None:
        return found
    known = sorted({t for t, _ in table})
    if tool not in known:
        raise ArgumentError("unknown tool %r (known: %s)" % (tool, ", ".join(known)))
    names = sorted(o for t, o in table if t == tool)
    raise ArgumentError("unknown op %r for tool %r (known: %s)" % (op, tool, ", ".join(names)))


def _number_text(x: float) -> str:
    return "2**53" if x == MAX_NUMBER else "%g" % x


def describe(arg: Arg) -> str:
    """What ``arg`` accepts, in words ("a number in [0, 2**53]")."""
    if arg.choices is not None:
        return "one of %s" % ", ".join(arg.choices)
    if arg.type in (NUM, INT):
        low, high = arg.bounds
        kind = "an integer" if arg.type == INT else "a number"
        return "%s in [%s, %s]" % (kind, _number_text(low), _number_text(high))
    return {STR: "a string", BOOL: "true or false", LIST: "a list", OBJECT: "an object"}[arg.type]


def type_fits(tag: str, value: Any) -> bool:
    """``value`` has the JSON type of ``tag`` (booleans are not numbers)."""
    if tag == STR:
        return isinstance(value, str)
    if tag == NUM:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tag == INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if tag == BOOL:
        return isinstance(value, bool)
    if tag == LIST:
        return isinstance(value, list)
    if tag == OBJECT:
        return isinstance(value, dict)
    return True


def value_problem(arg: Arg, value: Any) -> Optional[str]:
    """None when ``value`` fits ``arg``; else ``"type"``, ``"range"`` (out of bounds, NaN, infinite) or
    ``"choice"``."""
    if not type_fits(arg.type, value):
        return "type"
    if arg.type in (NUM, INT):
        low, high = arg.bounds
        if isinstance(value, float) and not math.isfinite(value):
            return "range"
        if not low <= value <= high:
            return "range"
    if arg.choices is not None and value not in arg.choices:
        return "choice"
    return None


def validate_args(
    tool: Any, op: Any, args: Any, ops: Optional[Dict[Tuple[str, str], Op]] = None
) -> Dict[str, Any]:
    """Check a request's tool, op and arguments; returns the arguments without the ``None`` ones.

    Raises :class:`ArgumentError` with the message both sides of the wire show."""
    decl = get_op(tool, op, ops)
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ArgumentError("args must be an object")
    known = set(a.name for a in decl.args)
    unknown = sorted(str(k) for k in args if k not in known)
    if unknown:
        raise ArgumentError("unknown argument(s) for %s.%s: %s" % (tool, op, ", ".join(unknown)))
    out = {}  # type: Dict[str, Any]
    for arg in decl.args:
        value = args.get(arg.name)
        if value is None:
            if arg.required:
                raise ArgumentError("%s.%s needs argument %r" % (tool, op, arg.name))
            continue
        if value_problem(arg, value) is not None:
            raise ArgumentError("%s.%s argument %r must be %s" % (tool, op, arg.name, describe(arg)))
        out[arg.name] = value
    return out


def policy_args(tool: PolicyTool, ops: Optional[Dict[Tuple[str, str], Op]] = None) -> List[Arg]:
    """The arguments the policy sees for ``tool``: its op's ``policy`` ones, then the agent's own."""
    shown = []  # type: List[Arg]
    if tool.op is not None:
        shown = [a for a in get_op(tool.op[0], tool.op[1], ops).args if a.policy]
    return shown + list(tool.extra)


def json_schema(arg: Arg) -> Dict[str, Any]:
    """The JSON schema of one argument, as the policy's tool schema shows it."""
    out = {"type": JSON_TYPES[arg.type]}  # type: Dict[str, Any]
    if arg.choices is not None:
        out["enum"] = list(arg.choices)
    if arg.items is not None:
        out["items"] = {"type": JSON_TYPES[arg.items]}
    if arg.type in (NUM, INT):
        low, high = arg.bounds
        out["minimum"] = low
        if high != MAX_NUMBER:
            out["maximum"] = high
    if arg.description:
        out["description"] = arg.description
    return out


def function_schema(tool: PolicyTool, ops: Optional[Dict[Tuple[str, str], Op]] = None) -> Dict[str, Any]:
    """The OpenAI-style function tool schema of ``tool``, derived from the declaration."""
    args = policy_args(tool, ops)
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": {
                "type": "object",
                "properties": {a.name: json_schema(a) for a in args},
                "required": [a.name for a in args if a.required],
            },
        },
    }
