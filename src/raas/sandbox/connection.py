"""The wire side of the host's tool client: one Unix-socket connection to an in-sandbox tool server.

One connection carries any number of concurrent requests, matched to responses by id. A connection that
drops fails every waiting call with ``sandbox_dead``. Tool-level limits (a command's timeout) are enforced
by the server inside the sandbox; the connection adds two things so that a wedged sandbox can never hang
the caller:

* a deadline per call: the call's own timeout plus a grace period, or the client's default for calls
  without one (``tool_timeout`` when it passes); a bash call with only a no-output timeout has no fixed
  deadline, since its output may legitimately keep it going;
* a liveness check: while calls are in flight it pings the server every ``liveness_interval_s``; a server
  that does not answer within ``liveness_timeout_s`` and meanwhile neither sends anything nor takes any
  of a request still being sent (stopped, frozen, or its loop blocked) fails every waiting call with
  ``sandbox_dead`` at once, and further calls are refused.

One connection serves one sandbox, and every sandbox's connection shares the host's event loop: a large
transfer must not stall the others. A thread does not help there (copying bytes, encoding text and
parsing JSON hold the GIL), so large payloads are never handled in one piece: attachments go out in
chunks with back-pressure (the transport never copies the whole) and come in chunk by chunk into their
final buffer (no join). Blocking file work (tarring a host directory) runs on the connection's own
one-thread executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import os
from collections.abc import Callable
from types import TracebackType
from typing import Any, Self, TypeVar

from raas.core.executors import Executor
from raas.errors import RaasError
from raas.toolserver.protocol import (
    ATTACHMENT_KEY,
    BAD_REQUEST,
    DEFAULT_MAX_ATTACHMENT,
    DEFAULT_MAX_FRAME,
    PROTOCOL_VERSION,
    ProtocolError,
    attachment_size,
    decode_body,
    encode_frame,
    read_attachment,
    read_frame,
)

Reply = tuple[dict[str, Any], bytes | None]
Attachment = bytes | list[bytes]
"""Raw bytes sent after a request's frame: one buffer, or pieces sent back to back as one attachment."""

LARGE_BYTES = 1 << 20
"""Payloads from this size on are never copied, encoded or joined in one piece."""
CHUNK_BYTES = 1 << 20
"""Attachments are written in chunks of this size, each after the previous one has drained."""

T = TypeVar("T")

CLOSE_GRACE_S = 2.0
"""How long :meth:`ToolConnection.close` lets a connection flush before it aborts it."""

__all__ = ["CHUNK_BYTES", "CLOSE_GRACE_S", "LARGE_BYTES", "Attachment", "Reply", "ToolConnection"]


class ToolConnection:
    """Talks framed JSON to one tool server; safe to share between tasks of one event loop. The typed tool
    calls are :class:`raas.sandbox.client.ToolClient`'s."""

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        *,
        connect_timeout_s: float = 10.0,
        request_timeout_s: float | None = 600.0,
        timeout_grace_s: float = 30.0,
        liveness_interval_s: float = 1.0,
        liveness_timeout_s: float = 5.0,
        max_frame: int = DEFAULT_MAX_FRAME,
        max_attachment: int = DEFAULT_MAX_ATTACHMENT,
    ) -> None:
        """``request_timeout_s`` bounds calls that carry no timeout of their own (None: no fixed deadline,
        only the liveness check); ``liveness_interval_s`` 0 turns the liveness check off."""
        self.socket_path = str(socket_path)
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self.timeout_grace_s = timeout_grace_s
        self.liveness_interval_s = liveness_interval_s
        self.liveness_timeout_s = liveness_timeout_s
        self.max_frame = max_frame
        self.max_attachment = max_attachment
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[Reply]] = {}
        self._calls = 0  # calls in flight that the liveness check guards (pings excluded)
        self._ids = itertools.count(1)
        self._connect_lock = asyncio.Lock()
        self._write_lock = asyncio.Lock()
        self._transfers = Executor("raas-transfer", 1)
        self._last_rx = 0.0  # loop time the server's last bytes arrived (liveness: a long download is life)
        self._tx_queued = 0  # request bytes handed to the transport, pings' not (liveness: an upload is life)
        self._writes: set[asyncio.Task[None]] = set()
        self._closed = False
        self._dead: RaasError | None = None

    # -- connection ------------------------------------------------------------------------------

    @classmethod
    async def open(cls, socket_path: str | os.PathLike[str], **kwargs: Any) -> Self:
        client = cls(socket_path, **kwargs)
        await client.connect()
        return client

    @property
    def connected(self) -> bool:
        return self._writer is not None and not self._writer.is_closing()

    def socket_fileno(self) -> int | None:
        """The connection's file descriptor (for a non-blocking hang-up check), or None when not connected."""
        writer = self._writer
        if writer is None or writer.is_closing():
            return None
        sock = writer.get_extra_info("socket")
        return None if sock is None else int(sock.fileno())

    async def connect(self) -> None:
        """Open the connection (again, if it dropped); a server that is not there is ``sandbox_dead``."""
        if self._closed:
            raise RaasError("tool client is closed", kind="sandbox_dead")
        if self._dead is not None:
            raise RaasError(self._dead.message, kind=self._dead.kind)
        async with self._connect_lock:
            if self.connected:
                return
            try:
                async with asyncio.timeout(self.connect_timeout_s):
                    reader, writer = await asyncio.open_unix_connection(self.socket_path, limit=2**16)
            except TimeoutError:
                raise RaasError(
                    f"connecting to the tool server at {self.socket_path} timed out", kind="sandbox_dead"
                ) from None
            except OSError as exc:
                raise RaasError(
                    f"cannot reach the tool server at {self.socket_path}: {exc.strerror or exc}",
                    kind="sandbox_dead",
                ) from None
            self._reader, self._writer = reader, writer
            self._tx_queued = 0
            self._reader_task = asyncio.create_task(self._read_loop(reader))

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        error = RaasError("the tool server closed the connection", kind="sandbox_dead")
        try:
            while True:
                try:
                    body = await read_frame(reader, self.max_frame + 1024)
                except ProtocolError as exc:
                    error = RaasError(f"bad frame from the tool server: {exc.message}", kind="sandbox_dead")
                    break
                if body is None:
                    break
                self._last_rx = asyncio.get_running_loop().time()
                try:
                    msg = decode_body(body)
                    n = attachment_size(msg, self.max_attachment)
                    attachment = await self._read_attachment(reader, n) if ATTACHMENT_KEY in msg else None
                except ProtocolError as exc:
                    error = RaasError(f"bad frame from the tool server: {exc.message}", kind="sandbox_dead")
                    break
                req_id = msg.get("id")
                if not isinstance(req_id, int | None):
                    continue  # not an answer to anything we sent
                if req_id is None:
                    # A connection-level refusal (e.g. an oversize frame): the server hangs up next.
                    err = msg.get("error") or {}
                    error = RaasError(
                        str(err.get("message", "connection refused by the tool server")),
                        kind=str(err.get("kind", "sandbox_dead")),
                    )
                    continue
                fut = self._pending.pop(req_id, None)
                if fut is not None and not fut.done():
                    fut.set_result((msg, attachment))
        except (ConnectionError, OSError) as exc:
            error = RaasError(f"the connection to the tool server broke: {exc}", kind="sandbox_dead")
        finally:
            self._drop_connection(error)

    async def _read_attachment(self, reader: asyncio.StreamReader, n: int) -> bytes:
        """``n`` raw bytes. A large attachment is filled in place chunk by chunk: a BytesIO over a fresh
        zeroed ``bytes`` that only it holds writes into that object, and ``getvalue()`` hands the same
        object back, so the whole is never copied (nor joined) in one piece."""
        if n < LARGE_BYTES:
            return await read_attachment(reader, n)
        buf = io.BytesIO(bytes(n))
        left = n
        while left:
            chunk = await reader.read(min(left, CHUNK_BYTES))
            if not chunk:
                raise ProtocolError(BAD_REQUEST, "connection closed inside an attachment")
            buf.write(chunk)
            left -= len(chunk)
            self._last_rx = asyncio.get_running_loop().time()
        return buf.getvalue()

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on this client's transfer thread (the loop stays free for the other sandboxes)."""
        if self._transfers.closed:
            raise RaasError("tool client is closed", kind="sandbox_dead")
        return await self._transfers.run(fn, *args)

    def _drop_connection(self, error: RaasError) -> None:
        writer, self._writer, self._reader = self._writer, None, None
        if writer is not None:
            writer.close()
        for write in list(self._writes):
            write.cancel()  # an attachment half sent to a server that may never read the rest
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(RaasError(error.message, kind=error.kind))
                fut.exception()  # retrieved: a call still sending has nobody awaiting its reply yet

    async def close(self) -> None:
        """Close the connection; waiting calls fail with ``sandbox_dead``. Idempotent."""
        self._closed = True
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None and watchdog is not asyncio.current_task():
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watchdog
        task, self._reader_task = self._reader_task, None
        writer = self._writer
        self._drop_connection(RaasError("tool client closed", kind="sandbox_dead"))
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if writer is not None:
            # A graceful close first flushes what is buffered; a server that stopped reading (frozen, or
            # busy with something else) would make that wait forever, and the sandbox's close would never
            # reach the kill. Past a short grace the connection is aborted, its buffer dropped.
            try:
                await asyncio.wait_for(asyncio.shield(writer.wait_closed()), CLOSE_GRACE_S)
            except Exception:
                writer.transport.abort()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
        for write in list(self._writes):
            with contextlib.suppress(BaseException):
                await write
        await self._transfers.aclose()

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    # -- requests ----------------------------------------------------------------------------

    async def request(
        self,
        tool: str,
        op: str,
        args: dict[str, Any] | None = None,
        *,
        wait_s: float | None = None,
        attachment: bytes | None = None,
        deadline: bool = True,
    ) -> dict[str, Any]:
        """Send one request and return its ``result``; errors become :class:`RaasError` with the server's kind.

        ``wait_s`` bounds the wait for the answer (default: ``request_timeout_s``); with ``deadline``
        False there is none and only the liveness check applies.
        """
        result, _ = await self.request_with_attachment(
            tool, op, args, wait_s=wait_s, attachment=attachment, deadline=deadline
        )
        return result

    async def request_with_attachment(
        self,
        tool: str,
        op: str,
        args: dict[str, Any] | None = None,
        *,
        wait_s: float | None = None,
        attachment: Attachment | None = None,
        deadline: bool = True,
    ) -> Reply:
        """Like :meth:`request`, also sending ``attachment`` and returning the reply's attachment."""
        if self._dead is not None:
            raise RaasError(self._dead.message, kind=self._dead.kind)
        if not self.connected:
            await self.connect()
        req_id = next(self._ids)
        header: dict[str, Any] = {
            "v": PROTOCOL_VERSION,
            "id": req_id,
            "tool": tool,
            "op": op,
            "args": args or {},
        }
        pieces = None if attachment is None else attachment if isinstance(attachment, list) else [attachment]
        size = 0 if pieces is None else sum(len(p) for p in pieces)
        if pieces is not None:
            header[ATTACHMENT_KEY] = size
        frame = encode_frame(header)
        if len(frame) - 4 > self.max_frame:
            raise RaasError(
                f"request of {len(frame) - 4} bytes exceeds the frame limit of {self.max_frame} bytes",
                kind="payload_too_large",
            )
        if size > self.max_attachment:
            raise RaasError(
                f"{size} bytes exceed the attachment limit of {self.max_attachment} bytes",
                kind="payload_too_large",
            )
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[req_id] = fut
        guarded = not (tool == "server" and op == "ping")
        if guarded:
            self._calls += 1
            self._ensure_watchdog()
        writer = self._writer
        try:
            if writer is None:
                raise RaasError("the tool server connection is gone", kind="sandbox_dead")
            try:
                await self._send(writer, frame, pieces or [], size, counted=guarded)
            except (ConnectionError, OSError) as exc:
                raise RaasError(f"sending to the tool server failed: {exc}", kind="sandbox_dead") from None
            limit = (self.request_timeout_s if wait_s is None else wait_s) if deadline else None
            try:
                async with asyncio.timeout(limit):
                    msg, reply_attachment = await fut
            except TimeoutError:
                raise RaasError(
                    f"{tool}.{op} got no answer from the tool server within {limit:g}s", kind="tool_timeout"
                ) from None
        finally:
            self._pending.pop(req_id, None)
            if guarded:
                self._calls -= 1
        if msg.get("ok"):
            result = msg.get("result")
            return (result if isinstance(result, dict) else {}), reply_attachment
        err = msg.get("error") or {}
        raise RaasError(str(err.get("message", "tool server error")), kind=str(err.get("kind", "internal")))

    async def _send(
        self, writer: asyncio.StreamWriter, frame: bytes, pieces: list[bytes], size: int, *, counted: bool
    ) -> None:
        """Write one message under the write lock. A small one goes into the transport whole; a large
        attachment goes chunk by chunk, each after the previous one drained, in a task of its own that a
        cancelled caller does not stop, so the connection never carries half a message and the transport
        never holds a copy of the whole attachment. ``counted``: the bytes count as the server taking a
        request (a ping's own do not, or the ping would prove itself alive)."""
        if size < LARGE_BYTES:
            async with self._write_lock:
                writer.writelines([frame, *pieces])
                if counted:
                    self._tx_queued += len(frame) + size
                await writer.drain()
            return
        task = asyncio.create_task(self._write_chunked(writer, frame, pieces))
        self._writes.add(task)
        task.add_done_callback(self._write_done)
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not task.cancelled() or (current is not None and current.cancelling()):
                raise
            # The write was stopped because the connection was dropped, not this call.
            raise RaasError("the tool server connection is gone", kind="sandbox_dead") from None

    async def _write_chunked(self, writer: asyncio.StreamWriter, frame: bytes, pieces: list[bytes]) -> None:
        async with self._write_lock:
            writer.write(frame)
            self._tx_queued += len(frame)
            for piece in pieces:
                view = memoryview(piece)
                for start in range(0, len(view), CHUNK_BYTES):
                    chunk = view[start : start + CHUNK_BYTES]
                    writer.write(chunk)
                    self._tx_queued += len(chunk)
                    await writer.drain()

    def _write_done(self, task: asyncio.Task[None]) -> None:
        self._writes.discard(task)
        if task.cancelled() or task.exception() is not None:
            # Part of a message may be on the wire: the connection cannot carry another one.
            why = "cancelled" if task.cancelled() else str(task.exception())
            self._drop_connection(RaasError(f"sending to the tool server failed: {why}", kind="sandbox_dead"))

    # -- liveness ----------------------------------------------------------------------------------

    def _ensure_watchdog(self) -> None:
        if self.liveness_interval_s <= 0 or (self._watchdog is not None and not self._watchdog.done()):
            return
        self._watchdog = asyncio.create_task(self._watch_liveness(), name=f"raas-liveness-{self.socket_path}")

    def _bytes_taken(self) -> int:
        """Request bytes the server's socket has taken so far (queued minus still buffered; pings' excluded)."""
        writer = self._writer
        return self._tx_queued - (writer.transport.get_write_buffer_size() if writer is not None else 0)

    async def _watch_liveness(self) -> None:
        """Ping while calls are in flight; a server that stops answering fails them all, fast.

        The ping's whole round trip is timed, its send too: behind a large upload it waits for the write
        lock, and a server that stopped reading mid-upload would otherwise hold it (and the upload) forever.
        A ping that times out while bytes still move either way (a long download arriving, a long upload
        being read) is not a death."""
        while self._calls > 0 and self.connected:
            await asyncio.sleep(self.liveness_interval_s)
            if self._calls <= 0 or not self.connected:
                return
            sent = asyncio.get_running_loop().time()
            taken = self._bytes_taken()
            try:
                async with asyncio.timeout(self.liveness_timeout_s):
                    await self.request("server", "ping", wait_s=self.liveness_timeout_s)
                continue
            except TimeoutError:
                pass
            except RaasError as exc:
                if exc.kind != "tool_timeout":
                    return  # the connection broke: the read loop already failed every call
            if not self.connected:
                return  # the connection broke meanwhile: every call has failed already
            if self._last_rx > sent or self._bytes_taken() > taken:
                continue  # the answer waits behind a large attachment that is still moving
            self._declare_dead(
                RaasError(
                    f"the tool server stopped answering: no reply to a liveness ping within "
                    f"{self.liveness_timeout_s:g}s (stopped, frozen or overloaded)",
                    kind="sandbox_dead",
                )
            )
            return

    def _declare_dead(self, error: RaasError) -> None:
        self._dead = error
        task, self._reader_task = self._reader_task, None
        if task is not None:
            task.cancel()
        self._drop_connection(error)

    def _wait_for(self, timeout: float | None) -> float | None:
        if timeout is None:
            return self.request_timeout_s
        return timeout + self.timeout_grace_s

    @property
    def dead(self) -> RaasError | None:
        """Why the client gave up on the server (a failed liveness check), or None."""
        return self._dead
