"""The tool server: a Unix-socket front end that validates requests and routes them to the tools.

One asyncio loop serves every connection; requests on a connection run concurrently and answer out
of order. The server owns everything it starts: on SIGTERM/SIGINT, ``server.shutdown``, losing its
parent, or (with ``--watch-stdin``) EOF on stdin, it kills every process it started, removes its
temporary files and its socket, and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import sys
import tempfile
from typing import Any, Awaitable, Callable, Dict, Optional, Set, Tuple

from . import procs
from .bash import DEFAULT_INPUT_WAIT_S, DEFAULT_TIMEOUT_S, find_bash
from .bashtool import BashTool
from .protocol import (
    ATTACHMENT_KEY,
    BAD_REQUEST,
    DEFAULT_MAX_ATTACHMENT,
    DEFAULT_MAX_FRAME,
    DEFAULT_OUTPUT_CAP,
    INTERNAL,
    PAYLOAD_TOO_LARGE,
    PROTOCOL_VERSION,
    READY_LINE,
    SANDBOX_ID_ENV,
    ProtocolError,
    attachment_size,
    decode_body,
    encode_message,
    error_response,
    ok_response,
    read_attachment,
    read_frame,
)

# Argument specs: name -> (type tag, required). Type tags: str, num (>= 0), int (>= 0), bool, list, any.
ArgSpec = Dict[str, Tuple[str, bool]]
_SPECS: Dict[Tuple[str, str], ArgSpec] = {
    ("server", "ping"): {},
    ("server", "shutdown"): {},
    ("bash", "run"): {
        "command": ("str", True),
        "session": ("str", False),
        "timeout": ("num", False),
        "no_output_timeout": ("num", False),
        "output_cap": ("int", False),
    },
    ("bash", "send"): {
        "session": ("str", False),
        "input": ("str", False),
        "interrupt": ("bool", False),
        "timeout": ("num", False),
        "no_output_timeout": ("num", False),
        "output_cap": ("int", False),
    },
    ("bash", "close"): {"session": ("str", True)},
    ("bash", "list"): {},
    ("ipython", "run"): {"code": ("str", True), "timeout": ("num", False), "output_cap": ("int", False)},
    ("ipython", "restart"): {},
    ("editor", "run"): {
        "command": ("str", True),
        "path": ("str", True),
        "file_text": ("str", False),
        "old_str": ("str", False),
        "new_str": ("str", False),
        "insert_line": ("int", False),
        "view_range": ("list", False),
    },
    # File contents travel as the message's attachment (raw bytes), not in args.
    ("files", "upload"): {"path": ("str", True), "mode": ("int", False)},
    ("files", "download"): {"path": ("str", True)},
    ("files", "write"): {"path": ("str", True), "mode": ("int", False)},
    ("files", "read"): {"path": ("str", True)},
    # The agent gateway: a loopback TCP port in the sandbox that leads to a Unix socket (see forward.py).
    ("gateway", "forward"): {"socket": ("str", True), "port": ("int", False)},
}


# Larger values (and NaN/Infinity, which Python's JSON parser accepts) are refused.
_MAX_NUMBER = 2**53


def validate_args(tool: str, op: str, args: Any) -> Dict[str, Any]:
    """Check a request's tool, op and argument names/types against the spec table."""
    spec = _SPECS.get((tool, op))
    if spec is None:
        known = sorted({t for t, _ in _SPECS})
        if tool not in known:
            raise ProtocolError(BAD_REQUEST, "unknown tool %r (known: %s)" % (tool, ", ".join(known)))
        ops = sorted(o for t, o in _SPECS if t == tool)
        raise ProtocolError(BAD_REQUEST, "unknown op %r for tool %r (known: %s)" % (op, tool, ", ".join(ops)))
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ProtocolError(BAD_REQUEST, "args must be an object")
    unknown = sorted(set(args) - set(spec))
    if unknown:
        raise ProtocolError(BAD_REQUEST, "unknown argument(s) for %s.%s: %s" % (tool, op, ", ".join(unknown)))
    out: Dict[str, Any] = {}
    for name, (tag, required) in spec.items():
        value = args.get(name)
        if value is None:
            if required:
                raise ProtocolError(BAD_REQUEST, "%s.%s needs argument %r" % (tool, op, name))
            continue
        _check_type(tool, op, name, tag, value)
        out[name] = value
    return out


def _check_type(tool: str, op: str, name: str, tag: str, value: Any) -> None:
    ok = True
    if tag == "str":
        ok = isinstance(value, str)
    elif tag in ("num", "int"):
        numeric = (int,) if tag == "int" else (int, float)
        ok = isinstance(value, numeric) and not isinstance(value, bool) and 0 <= value <= _MAX_NUMBER
    elif tag == "list":
        ok = isinstance(value, list)
    elif tag == "bool":
        ok = isinstance(value, bool)
    if not ok:
        want = {
            "str": "a string",
            "num": "a number in [0, 2**53]",
            "int": "an integer in [0, 2**53]",
            "list": "a list",
            "bool": "true or false",
        }[tag]
        raise ProtocolError(BAD_REQUEST, "%s.%s argument %r must be %s" % (tool, op, name, want))


class ToolServer:
    """Owns the listening socket, the tools, and every process they start."""

    def __init__(
        self,
        socket_path: str,
        workdir: str,
        output_cap: int = DEFAULT_OUTPUT_CAP,
        max_frame: int = DEFAULT_MAX_FRAME,
        max_sessions: int = 64,
        watch_stdin: bool = False,
        listen_fd: Optional[int] = None,
        max_attachment: int = DEFAULT_MAX_ATTACHMENT,
        bash_timeout: Optional[float] = DEFAULT_TIMEOUT_S,
        bash_input_wait: Optional[float] = DEFAULT_INPUT_WAIT_S,
    ) -> None:
        self.max_attachment = max_attachment
        self.socket_path = socket_path
        self.listen_fd = listen_fd
        self.workdir = workdir
        self.output_cap = output_cap
        self.max_frame = max_frame
        self.watch_stdin = watch_stdin
        self.max_sessions = max_sessions
        self.tmpdir = tempfile.mkdtemp(prefix="raas-ts-")
        self.reaper = procs.Reaper()
        self.env = _child_env()
        self.bash = BashTool(
            workdir, self.env, self.tmpdir, self.reaper, max_sessions, bash_timeout, bash_input_wait
        )
        self._ipython: Any = None
        self._editor: Any = None
        self._stop: Optional[asyncio.Event] = None
        self._server: Optional[asyncio.AbstractServer] = None
        self._conns: Dict[asyncio.StreamWriter, Optional[asyncio.Task]] = {}
        self._tasks: Set[asyncio.Task] = set()
        self._forwarders: Dict[str, Any] = {}  # gateway socket -> forward.Forwarder

    # -- lifecycle -------------------------------------------------------------------------

    async def serve(self) -> int:
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        parent = os.getppid()
        procs.become_subreaper()
        procs.die_with_parent(signal.SIGTERM)
        loop.add_signal_handler(signal.SIGCHLD, self.reaper.reap)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, self._stop.set)
        if os.getppid() != parent:
            self._stop.set()
        try:
            if self.listen_fd is not None:
                # Bound by the sandbox's boot step, before the socket's directory became read-only.
                sock = socket.socket(fileno=self.listen_fd)
                self._server = await asyncio.start_unix_server(self._handle_conn, sock=sock, limit=2**16)
            else:
                _remove_stale_socket(self.socket_path)
                self._server = await asyncio.start_unix_server(
                    self._handle_conn, path=self.socket_path, limit=2**16
                )
            if self.watch_stdin:
                self._watch_stdin(loop)
            _announce_ready()
            await self._stop.wait()
        finally:
            await self._shutdown()
        return 0

    def _watch_stdin(self, loop: asyncio.AbstractEventLoop) -> None:
        def on_stdin() -> None:
            try:
                data = os.read(0, 4096)
            except OSError:
                data = b""
            if not data:
                loop.remove_reader(0)
                assert self._stop is not None
                self._stop.set()

        try:
            loop.add_reader(0, on_stdin)
        except (OSError, ValueError):
            # stdin is a regular file or /dev/null (epoll refuses those): nothing to watch.
            sys.stderr.write("raas_toolserver: --watch-stdin ignored, stdin is not a pipe or socket\n")

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        conn_tasks = [t for t in self._conns.values() if t is not None]
        for writer in list(self._conns):
            writer.close()  # the handler sees EOF and returns by itself
        for task in list(self._tasks):
            task.cancel()
        pending = conn_tasks + list(self._tasks)
        if pending:
            await asyncio.wait(pending, timeout=2.0)
        for forwarder in self._forwarders.values():
            await forwarder.close()
        self.bash.close_all()
        if self._ipython is not None:
            await self._ipython.close()
        procs.kill_descendants_and_wait()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        try:
            os.unlink(self.socket_path)
        except OSError:
            pass

    # -- connections ---------------------------------------------------------------------------

    async def _handle_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns[writer] = asyncio.current_task()
        drain_lock = asyncio.Lock()

        async def send(msg: Dict[str, Any], attachment: Optional[bytes] = None) -> None:
            try:
                parts = encode_message(msg, attachment)
            except (TypeError, ValueError) as exc:
                parts = encode_message(
                    error_response(msg.get("id"), INTERNAL, "unencodable response: %s" % exc)
                )
            if len(parts[0]) - 4 > self.max_frame:
                msg = error_response(
                    msg.get("id"),
                    PAYLOAD_TOO_LARGE,
                    "response of %d bytes exceeds the frame limit of %d bytes"
                    % (len(parts[0]) - 4, self.max_frame),
                )
                parts = encode_message(msg)
            if writer.is_closing():
                return
            writer.writelines(parts)
            async with drain_lock:
                try:
                    await writer.drain()
                except (ConnectionError, OSError):
                    pass

        try:
            while True:
                try:
                    body = await read_frame(reader, self.max_frame)
                    if body is None:
                        break
                    req, attachment = await self._read_request(body, reader)
                except ProtocolError as exc:
                    # The stream position is lost (or the peer is misbehaving): answer, then hang up.
                    await send(error_response(None, exc.kind, exc.message))
                    break
                task = asyncio.ensure_future(self._serve_one(req, attachment, send))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except (ConnectionError, OSError):
            pass
        finally:
            self._conns.pop(writer, None)
            writer.close()

    async def _read_request(self, body: bytes, reader: asyncio.StreamReader) -> Tuple[Any, Optional[bytes]]:
        """Decode a frame and read its attachment; an undecodable frame is answered, not fatal."""
        try:
            req = decode_body(body)
        except ProtocolError as exc:
            return exc, None
        n = attachment_size(req, self.max_attachment)
        return req, (await read_attachment(reader, n) if ATTACHMENT_KEY in req else None)

    async def _serve_one(
        self, req: Any, attachment: Optional[bytes], send: Callable[..., Awaitable[None]]
    ) -> None:
        req_id: Any = None
        out: Optional[bytes] = None
        try:
            if isinstance(req, ProtocolError):
                raise req
            req_id = req.get("id")
            if req.get("v", PROTOCOL_VERSION) != PROTOCOL_VERSION:
                raise ProtocolError(BAD_REQUEST, "unsupported protocol version %r" % (req.get("v"),))
            tool, op = req.get("tool"), req.get("op")
            if not isinstance(tool, str) or not isinstance(op, str):
                raise ProtocolError(BAD_REQUEST, "request needs string fields 'tool' and 'op'")
            args = validate_args(tool, op, req.get("args"))
            if tool == "files":
                from . import files

                result, out = await _in_thread(getattr(files, op), args, attachment, self.max_attachment)
            else:
                if attachment is not None:
                    raise ProtocolError(BAD_REQUEST, "%s.%s takes no attachment" % (tool, op))
                result = await self._dispatch(tool, op, args)
            response = ok_response(req_id, result)
        except ProtocolError as exc:
            response = error_response(req_id, exc.kind, exc.message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must not take the server down
            response = error_response(req_id, INTERNAL, "%s: %s" % (type(exc).__name__, exc))
        await send(response, out if response.get("ok") else None)
        if (
            response.get("ok")
            and isinstance(req, dict)
            and req.get("tool") == "server"
            and req.get("op") == "shutdown"
        ):
            assert self._stop is not None
            self._stop.set()

    async def _dispatch(self, tool: str, op: str, args: Dict[str, Any]) -> Dict[str, Any]:
        if tool == "server":
            if op == "ping":
                return self.info()
            return {"stopping": True}
        if tool == "gateway":
            return await self.forward(args["socket"], args.get("port", 0))
        if tool == "bash":
            if op == "run":
                return await self.bash.run(
                    args["command"],
                    args.get("session", "default"),
                    args.get("timeout"),
                    args.get("no_output_timeout"),
                    args.get("output_cap", self.output_cap),
                )
            if op == "send":
                return await self.bash.send(
                    args.get("session", "default"),
                    args.get("input", ""),
                    bool(args.get("interrupt", False)),
                    args.get("timeout"),
                    args.get("no_output_timeout"),
                    args.get("output_cap", self.output_cap),
                )
            if op == "close":
                return {"closed": self.bash.close(args["session"])}
            return {"sessions": self.bash.list()}
        if tool == "ipython":
            ipy = self.ipython()
            if op == "restart":
                return await ipy.restart()
            return await ipy.run(args["code"], args.get("timeout"), args.get("output_cap", self.output_cap))
        editor = self.editor()
        return await _in_thread(editor.run, args)

    # -- tools -------------------------------------------------------------------------------

    async def forward(self, target: str, port: int) -> Dict[str, Any]:
        """Start (once per socket) a 127.0.0.1 TCP port forwarding to the Unix socket ``target``."""
        from .forward import Forwarder

        forwarder = self._forwarders.get(target)
        if forwarder is None:
            if not target.startswith("/"):
                raise ProtocolError(BAD_REQUEST, "gateway.forward needs an absolute socket path")
            forwarder = Forwarder(target, port=port)
            try:
                await forwarder.start()
            except OSError as exc:
                raise ProtocolError(INTERNAL, "cannot listen on 127.0.0.1:%d: %s" % (port, exc)) from None
            self._forwarders[target] = forwarder
        return forwarder.info()

    def ipython(self) -> Any:
        if self._ipython is None:
            from .ipython import IPythonTool

            self._ipython = IPythonTool(self.workdir, self.env, self.tmpdir, self.reaper)
        return self._ipython

    def editor(self) -> Any:
        if self._editor is None:
            from .editor import Editor

            self._editor = Editor(self.output_cap)
        return self._editor

    def info(self) -> Dict[str, Any]:
        from .ipython import ipython_available

        return {
            "version": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "python": "%d.%d.%d" % sys.version_info[:3],
            "sandbox_id": os.environ.get(SANDBOX_ID_ENV),
            "tools": {
                "bash": find_bash() is not None,
                "ipython": ipython_available(),
                "editor": True,
                "files": True,
            },
        }


async def _in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Blocking file work runs off the loop so a large upload does not stall other requests."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def _remove_stale_socket(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _child_env() -> Dict[str, str]:
    """Environment for shells and kernels: ours, minus the bundle on PYTHONPATH, with the sandbox id."""
    env = dict(os.environ)
    bundle = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if "PYTHONPATH" in env:
        parts = [p for p in env["PYTHONPATH"].split(os.pathsep) if p and os.path.abspath(p) != bundle]
        if parts:
            env["PYTHONPATH"] = os.pathsep.join(parts)
        else:
            del env["PYTHONPATH"]
    return env


def _announce_ready() -> None:
    """Print the ready line, then point stdout at /dev/null so a pipe nobody reads can never block us."""
    sys.stdout.write(READY_LINE + "\n")
    sys.stdout.flush()
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, 1)
        os.close(fd)
    except OSError:
        pass


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="raas_toolserver", description="raas in-sandbox tool server")
    p.add_argument("--socket", required=True, help="Unix socket path to listen on")
    p.add_argument("--workdir", default=None, help="working directory of shells and kernels")
    p.add_argument("--output-cap", type=int, default=DEFAULT_OUTPUT_CAP, help="default output cap (bytes)")
    p.add_argument("--max-frame", type=int, default=DEFAULT_MAX_FRAME, help="largest frame accepted (bytes)")
    p.add_argument("--max-sessions", type=int, default=64, help="most bash sessions at once")
    p.add_argument("--watch-stdin", action="store_true", help="exit when stdin reaches EOF")
    p.add_argument("--listen-fd", type=int, default=None, help="serve on this already listening socket")
    p.add_argument(
        "--max-attachment",
        type=int,
        default=DEFAULT_MAX_ATTACHMENT,
        help="largest attachment accepted (bytes)",
    )
    p.add_argument(
        "--bash-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="seconds after which a bash command given neither timeout is interrupted (0: never)",
    )
    p.add_argument(
        "--bash-input-wait",
        type=float,
        default=DEFAULT_INPUT_WAIT_S,
        help="seconds of silence after which a command waiting for terminal input returns (0: never)",
    )
    return p.parse_args(argv)


def _keep_socket_buffers_on_the_heap() -> None:
    """asyncio reads sockets into 256 KiB buffers. glibc serves allocations that large with mmap unless its
    dynamic threshold was raised by freeing a larger mapped block, so depending on what the process did
    before, every request could cost an mmap, mremap and munmap with their page faults (about a fifth of
    an ``echo``). Freeing one 1 MiB block raises the threshold for good; elsewhere this is harmless."""
    block = bytearray(1 << 20)
    del block


def main(argv: Optional[list] = None) -> int:
    _keep_socket_buffers_on_the_heap()
    args = parse_args(argv)
    if SANDBOX_ID_ENV not in os.environ:
        os.environ[SANDBOX_ID_ENV] = "pid-%d" % os.getpid()
    workdir = os.path.abspath(args.workdir or os.getcwd())
    os.makedirs(workdir, exist_ok=True)
    os.chdir(workdir)
    server = ToolServer(
        args.socket,
        workdir,
        output_cap=max(args.output_cap, 64),
        max_frame=args.max_frame,
        max_sessions=args.max_sessions,
        watch_stdin=args.watch_stdin,
        listen_fd=args.listen_fd,
        max_attachment=args.max_attachment,
        bash_timeout=args.bash_timeout or None,
        bash_input_wait=args.bash_input_wait or None,
    )
    try:
        code = asyncio.run(server.serve())
    except KeyboardInterrupt:
        code = 0
    except OSError as exc:
        # Typically the socket cannot be bound (missing directory, path too long, permissions).
        sys.stderr.write("raas_toolserver: cannot serve on %s: %s\n" % (args.socket, exc))
        code = 2
    sys.stderr.flush()
    # Kernel client threads (zmq) must not hold up the exit; everything we own is already gone.
    os._exit(code)
