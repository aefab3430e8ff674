"""The tool server: a Unix-socket front end that validates requests and routes them to the tools.

One event loop (:mod:`.loop`, a few hundred lines on ``epoll``: ``asyncio`` alone would cost
several times the rest of the start-up) serves every connection; requests on a connection run
concurrently and answer out of order. Blocking file work runs in threads; the IPython tool runs on a
real asyncio loop in a thread of its own, started with the first ipython call.

The server owns everything it starts: on SIGTERM/SIGINT, ``server.shutdown``, losing its parent, or
(with ``--watch-stdin``) EOF on stdin, it kills every process it started, removes its temporary files
and its socket, and exits 0.
"""

from __future__ import annotations

import _signal as signal  # the C modules: signal.py and socket.py import enum (a large part of start-up)
import _socket as socket
import os
import sys

from . import loop as aio
from . import procs
from .options import parse_args
from .protocol import (
    ATTACHMENT_KEY,
    BAD_REQUEST,
    DEFAULT_INPUT_WAIT_S,
    DEFAULT_MAX_ATTACHMENT,
    DEFAULT_MAX_FRAME,
    DEFAULT_OUTPUT_CAP,
    DEFAULT_TIMEOUT_S,
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
)
from .stream import Stream

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Awaitable, Callable, Dict, List, Optional, Set, Tuple


_ARGLESS = (("server", "ping"), ("server", "shutdown"))


def validate_args(tool: str, op: str, args: Any) -> Dict[str, Any]:
    """Check a request's tool, op and arguments against the op declarations (:mod:`.ops`).

    The declarations are imported with the first call that needs them, like the tools: a sandbox's
    readiness ping (no arguments) must not pay for them."""
    if (tool, op) in _ARGLESS and not args:
        return {}
    from . import ops

    try:
        return ops.validate_args(tool, op, args)
    except ops.ArgumentError as exc:
        raise ProtocolError(BAD_REQUEST, str(exc)) from None


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
        self._reaps_orphans = False
        self.max_sessions = max_sessions
        self.tmpdir = _private_tmpdir("raas-ts-")
        self.reaper = procs.Reaper()
        self.env = _child_env()
        self._bash_limits = (bash_timeout, bash_input_wait)
        self._bash: Any = None
        self._ipython: Any = None
        self._editor: Any = None
        self._stop: Optional[aio.Event] = None
        self._listener: Optional[socket.socket] = None
        self._conns: Dict[Stream, Optional[aio.Task]] = {}
        self._tasks: Set[aio.Task] = set()
        self._forwarders: Dict[str, Any] = {}  # gateway socket -> forward.Forwarder
        self._forward_thread: Any = None  # the asyncio thread the forwarders run on (asyncio streams)

    # -- lifecycle -------------------------------------------------------------------------

    async def serve(self) -> int:
        loop = aio.get_running_loop()
        self._stop = aio.Event()
        parent = os.getppid()
        # Every process we start stays our descendant until we reap it (orphans come back to us).
        self._reaps_orphans = procs.become_subreaper() or os.getpid() == 1
        procs.die_with_parent(signal.SIGTERM)
        loop.add_signal_handler(signal.SIGCHLD, self.reaper.reap)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, self._stop.set)
        if os.getppid() != parent:
            self._stop.set()
        try:
            if self.listen_fd is not None:
                # Bound by the sandbox's boot step, before the socket's directory became read-only.
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, 0, self.listen_fd)
            else:
                _remove_stale_socket(self.socket_path)
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.bind(self.socket_path)
                sock.listen(128)
            sock.setblocking(False)
            self._listener = sock
            loop.add_reader(sock.fileno(), self._accept)
            if self.watch_stdin:
                self._watch_stdin(loop)
            _announce_ready()
            await self._stop.wait()
        finally:
            await self._shutdown()
        return 0

    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(64):
            try:
                fd, _addr = self._listener._accept()  # type: ignore[attr-defined] # C socket: a descriptor
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # out of descriptors, or the peer gave up: the next connection may work
            stream = Stream(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, 0, fd))
            self._conns[stream] = aio.ensure_future(self._handle_conn(stream))

    def _watch_stdin(self, loop: aio.Loop) -> None:
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
        if self._listener is not None:
            aio.get_running_loop().remove_reader(self._listener.fileno())
            self._listener.close()
        conn_tasks: List[aio.Future] = [t for t in self._conns.values() if t is not None]
        for stream in list(self._conns):
            stream.close()  # the handler sees EOF and returns by itself
        for task in list(self._tasks):
            task.cancel()
        pending = conn_tasks + list(self._tasks)
        if pending:
            await aio.wait(pending, timeout=2.0)
        if self._forward_thread is not None:
            for forwarder in self._forwarders.values():
                try:
                    await self._forward_thread.run(forwarder.close)
                except Exception:
                    pass
            await self._forward_thread.close()
        if self._bash is not None:
            # When every process the shells started is still our descendant, the sweep below kills them
            # all in one walk of our own process tree; each session's own kill would read all of /proc.
            self._bash.close_all(kill=not self._reaps_orphans)
        if self._ipython is not None:
            await self._ipython.close()
        procs.kill_descendants_and_wait()
        try:
            os.rmdir(self.tmpdir)  # usually empty: then no shutil (and the bz2/lzma it imports) at shutdown
        except OSError:
            import shutil

            shutil.rmtree(self.tmpdir, ignore_errors=True)
        try:
            os.unlink(self.socket_path)
        except OSError:
            pass

    # -- connections ---------------------------------------------------------------------------

    async def _handle_conn(self, writer: Stream) -> None:
        drain_lock = aio.Lock()

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
                    body = await writer.read_frame(self.max_frame)
                    if body is None:
                        break
                    req, attachment = await self._read_request(body, writer)
                except ProtocolError as exc:
                    # The stream position is lost (or the peer is misbehaving): answer, then hang up.
                    await send(error_response(None, exc.kind, exc.message))
                    break
                task = aio.ensure_future(self._serve_one(req, attachment, send))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except (ConnectionError, OSError):
            pass
        finally:
            self._conns.pop(writer, None)
            writer.close()

    async def _read_request(self, body: bytes, reader: Stream) -> Tuple[Any, Optional[bytes]]:
        """Decode a frame and read its attachment; an undecodable frame is answered, not fatal."""
        try:
            req = decode_body(body)
        except ProtocolError as exc:
            return exc, None
        n = attachment_size(req, self.max_attachment)
        return req, (await reader.read_attachment(n) if ATTACHMENT_KEY in req else None)

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
            if attachment is not None:
                from . import ops

                if not ops.OPS[(tool, op)].takes_attachment:
                    raise ProtocolError(BAD_REQUEST, "%s.%s takes no attachment" % (tool, op))
            if tool == "files":
                from . import files

                result, out = await _in_thread(getattr(files, op), args, attachment, self.max_attachment)
            else:
                result = await self._dispatch(tool, op, args)
            response = ok_response(req_id, result)
        except ProtocolError as exc:
            response = error_response(req_id, exc.kind, exc.message)
        except aio.CancelledError:
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
            bash = self.bash()
            if op == "run":
                return await bash.run(
                    args["command"],
                    args.get("session", "default"),
                    args.get("timeout"),
                    args.get("no_output_timeout"),
                    args.get("output_cap", self.output_cap),
                )
            if op == "send":
                return await bash.send(
                    args.get("session", "default"),
                    args.get("input", ""),
                    bool(args.get("interrupt", False)),
                    args.get("timeout"),
                    args.get("no_output_timeout"),
                    args.get("output_cap", self.output_cap),
                )
            if op == "close":
                return {"closed": bash.close(args["session"])}
            return {"sessions": bash.list()}
        if tool == "ipython":
            ipy = self.ipython()
            if op == "restart":
                return await ipy.restart()
            return await ipy.run(args["code"], args.get("timeout"), args.get("output_cap", self.output_cap))
        editor = self.editor()
        return await _in_thread(editor.run, args)

    # -- tools -------------------------------------------------------------------------------

    async def forward(self, target: str, port: int) -> Dict[str, Any]:
        """Start (once per socket) a 127.0.0.1 TCP port forwarding to the Unix socket ``target``.

        The forwarders are asyncio code: they run on an asyncio loop in a thread of its own, started with
        the first forward (the server's own loop is not asyncio)."""
        from .aiothread import AsyncioThread
        from .forward import Forwarder

        forwarder = self._forwarders.get(target)
        if forwarder is None:
            if not target.startswith("/"):
                raise ProtocolError(BAD_REQUEST, "gateway.forward needs an absolute socket path")
            if self._forward_thread is None:
                self._forward_thread = AsyncioThread("raas-forward", self.reaper)
            forwarder = Forwarder(target, port=port)
            try:
                await self._forward_thread.run(forwarder.start)
            except OSError as exc:
                raise ProtocolError(INTERNAL, "cannot listen on 127.0.0.1:%d: %s" % (port, exc)) from None
            self._forwarders[target] = forwarder
        return forwarder.info()

    def bash(self) -> Any:
        """The bash tool, imported with the first bash call (a sandbox that is never used does not pay)."""
        if self._bash is None:
            from .bashtool import BashTool

            timeout, input_wait = self._bash_limits
            self._bash = BashTool(
                self.workdir, self.env, self.tmpdir, self.reaper, self.max_sessions, timeout, input_wait
            )
        return self._bash

    def ipython(self) -> Any:
        if self._ipython is None:
            from .ipython import IPythonThread

            self._ipython = IPythonThread(self.workdir, self.env, self.tmpdir, self.reaper)
        return self._ipython

    def editor(self) -> Any:
        if self._editor is None:
            from .editor import Editor

            self._editor = Editor(self.output_cap)
        return self._editor

    def info(self) -> Dict[str, Any]:
        from .pysite import ipython_available

        return {
            "version": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "python": "%d.%d.%d" % sys.version_info[:3],
            "sandbox_id": os.environ.get(SANDBOX_ID_ENV),
            "tools": {
                "bash": procs.find_bash() is not None,
                "ipython": ipython_available(),
                "editor": True,
                "files": True,
            },
        }


async def _in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Blocking file work runs off the loop so a large upload does not stall other requests."""
    return await aio.get_running_loop().run_in_thread(fn, *args)


def _private_tmpdir(prefix: str) -> str:
    """``tempfile.mkdtemp`` without importing ``tempfile`` (and ``random``): mode 0700, a fresh name."""
    bases = [os.environ.get(k) for k in ("TMPDIR", "TEMP", "TMP")] + ["/tmp", "/var/tmp", "/usr/tmp"]
    error: Optional[OSError] = None
    for base in [b for b in bases if b] + [os.getcwd()]:
        for _ in range(100):
            path = os.path.join(base, prefix + os.urandom(6).hex())
            try:
                os.mkdir(path, 0o700)
                return path
            except FileExistsError:
                continue
            except OSError as exc:
                error = exc
                break
    raise error or FileExistsError("no free temporary directory name")


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


def _keep_socket_buffers_on_the_heap() -> None:
    """Requests are read in chunks of up to 256 KiB. glibc serves allocations that large with mmap unless its
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
        code = aio.run(server.serve())
    except KeyboardInterrupt:
        code = 0
    except OSError as exc:
        # Typically the socket cannot be bound (missing directory, path too long, permissions).
        sys.stderr.write("raas_toolserver: cannot serve on %s: %s\n" % (args.socket, exc))
        code = 2
    sys.stderr.flush()
    # Kernel client threads (zmq) must not hold up the exit; everything we own is already gone.
    os._exit(code)
