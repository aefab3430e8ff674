"""The tool server's command line, parsed by hand: ``argparse`` (with the ``re`` and ``gettext`` it
imports) would cost more CPU than the whole server's start-up otherwise needs."""

from __future__ import annotations

import sys

from .protocol import (
    DEFAULT_INPUT_WAIT_S,
    DEFAULT_MAX_ATTACHMENT,
    DEFAULT_MAX_FRAME,
    DEFAULT_OUTPUT_CAP,
    DEFAULT_TIMEOUT_S,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Dict, List, NoReturn, Optional, Tuple

# name -> (type, default, help)
_OPTIONS: Dict[str, Tuple[Any, Any, str]] = {
    "socket": (str, None, "Unix socket path to listen on (required)"),
    "workdir": (str, None, "working directory of shells and kernels"),
    "output-cap": (int, DEFAULT_OUTPUT_CAP, "default output cap (bytes)"),
    "max-frame": (int, DEFAULT_MAX_FRAME, "largest frame accepted (bytes)"),
    "max-sessions": (int, 64, "most bash sessions at once"),
    "watch-stdin": (bool, False, "exit when stdin reaches EOF"),
    "listen-fd": (int, None, "serve on this already listening socket"),
    "max-attachment": (int, DEFAULT_MAX_ATTACHMENT, "largest attachment accepted (bytes)"),
    "bash-timeout": (
        float,
        DEFAULT_TIMEOUT_S,
        "seconds after which a bash command given neither timeout is interrupted (0: never)",
    ),
    "bash-input-wait": (
        float,
        DEFAULT_INPUT_WAIT_S,
        "seconds of silence after which a command waiting for terminal input returns (0: never)",
    ),
}


class Options:
    """The parsed command line: one attribute per option (dashes become underscores)."""

    socket: str
    workdir: Optional[str]
    output_cap: int
    max_frame: int
    max_sessions: int
    watch_stdin: bool
    listen_fd: Optional[int]
    max_attachment: int
    bash_timeout: float
    bash_input_wait: float

    def __init__(self) -> None:
        for name, (_, default, _) in _OPTIONS.items():
            setattr(self, name.replace("-", "_"), default)


def _usage_error(message: str) -> NoReturn:
    sys.stderr.write("usage: raas_toolserver --socket PATH [options]\nraas_toolserver: error: %s\n" % message)
    sys.exit(2)


def parse_args(argv: Optional[List[str]] = None) -> Options:
    """``--name VALUE``, ``--name=VALUE`` and ``--flag``; errors exit 2 with a message, like argparse."""
    args = list(sys.argv[1:] if argv is None else argv)
    opts = Options()
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg in ("-h", "--help"):
            lines = ["  --%-16s %s" % (n, h) for n, (_, _, h) in _OPTIONS.items()]
            sys.stdout.write("usage: raas_toolserver --socket PATH [options]\n\n%s\n" % "\n".join(lines))
            sys.exit(0)
        name, eq, value = arg[2:].partition("=")
        if not arg.startswith("--") or name not in _OPTIONS:
            _usage_error("unrecognized argument: %s" % arg)
        kind = _OPTIONS[name][0]
        if kind is bool:
            if eq:
                _usage_error("--%s takes no value" % name)
            setattr(opts, name.replace("-", "_"), True)
            continue
        if not eq:
            if i >= len(args):
                _usage_error("--%s needs a value" % name)
            value = args[i]
            i += 1
        try:
            setattr(opts, name.replace("-", "_"), kind(value))
        except ValueError:
            _usage_error("--%s: invalid %s value %r" % (name, kind.__name__, value))
    if opts.socket is None:
        _usage_error("the following arguments are required: --socket")
    return opts
