"""One client connection of the tool server on :mod:`.loop`: framed reads, buffered writes, flow control.

Reads try the socket first and wait for readability only when it is empty (a request usually arrives
whole); writes go out with one ``sendmsg`` of all buffers and are queued only when the peer is slow.
"""

from __future__ import annotations

import _socket

from . import loop as aio
from .protocol import BAD_REQUEST, HEADER, PAYLOAD_TOO_LARGE, ProtocolError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import List, Optional

READ_CHUNK = 1 << 18
HIGH_WATER = 1 << 16


class Stream:
    """Reader and writer of one accepted Unix socket."""

    def __init__(self, sock: _socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.fd = sock.fileno()
        self._loop = aio.get_running_loop()
        self._rbuf = bytearray()
        self._eof = False
        self._read_waiter: Optional[aio.Future] = None
        self._wbuf: List[bytes] = []
        self._wsize = 0
        self._drained: List[aio.Future] = []
        self._closing = False
        self._closed = False

    # -- reading ------------------------------------------------------------------------------------

    async def readexactly(self, n: int) -> bytes:
        """``n`` bytes, or fewer if the peer closed the connection first."""
        buf = self._rbuf
        while len(buf) < n and not self._eof:
            try:
                data = self.sock.recv(max(n - len(buf), READ_CHUNK))
            except (BlockingIOError, InterruptedError):
                await self._readable()
                continue
            except OSError:
                data = b""
            if not data:
                self._eof = True
            buf += data
        out = bytes(buf[:n])
        del buf[:n]
        return out

    async def _readable(self) -> None:
        if self._closing:
            self._eof = True
            return
        fut = self._loop.create_future()
        self._read_waiter = fut
        self._loop.add_reader(self.fd, _resolve, fut)
        try:
            await fut
        finally:
            self._read_waiter = None
            if not self._closed:
                self._loop.remove_reader(self.fd)

    async def read_frame(self, max_frame: int) -> Optional[bytes]:
        """One frame body; None on a clean end of stream between frames (see :mod:`.protocol`)."""
        header = await self.readexactly(HEADER.size)
        if not header:
            return None
        if len(header) < HEADER.size:
            raise ProtocolError(BAD_REQUEST, "connection closed inside a frame header")
        (length,) = HEADER.unpack(header)
        if length > max_frame:
            raise ProtocolError(
                PAYLOAD_TOO_LARGE, "frame of %d bytes exceeds the limit of %d bytes" % (length, max_frame)
            )
        body = await self.readexactly(length)
        if len(body) < length:
            raise ProtocolError(BAD_REQUEST, "connection closed inside a frame body")
        return body

    async def read_attachment(self, n: int) -> bytes:
        data = await self.readexactly(n)
        if len(data) < n:
            raise ProtocolError(BAD_REQUEST, "connection closed inside an attachment")
        return data

    # -- writing ------------------------------------------------------------------------------------

    def is_closing(self) -> bool:
        return self._closing

    def writelines(self, parts: List[bytes]) -> None:
        if self._closing:
            return
        parts = [p for p in parts if len(p)]  # an empty buffer would never leave the queue
        if self._wbuf:
            self._wbuf.extend(parts)
            self._wsize += sum(len(p) for p in parts)
            return
        self._wbuf = parts
        self._wsize = sum(len(p) for p in parts)
        self._flush()
        if self._wbuf:
            self._loop.add_writer(self.fd, self._on_writable)

    def _flush(self) -> None:
        while self._wbuf:
            try:
                n = self.sock.sendmsg(self._wbuf[:64])
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._wbuf, self._wsize = [], 0  # the peer is gone: nothing more will be read
                break
            self._wsize -= n
            while n:
                first = self._wbuf[0]
                if n >= len(first):
                    n -= len(first)
                    self._wbuf.pop(0)
                else:
                    self._wbuf[0] = memoryview(first)[n:]  # type: ignore[call-overload]
                    n = 0
        self._wake_drained()

    def _on_writable(self) -> None:
        self._flush()
        if not self._wbuf:
            self._loop.remove_writer(self.fd)
            if self._closing:
                self._really_close()

    def _wake_drained(self) -> None:
        if self._wsize <= HIGH_WATER:
            for fut in self._drained:
                _resolve(fut)
            self._drained = []

    async def drain(self) -> None:
        """Wait while more than :data:`HIGH_WATER` bytes are queued for a slow reader."""
        if self._wsize > HIGH_WATER and not self._closed:
            fut = self._loop.create_future()
            self._drained.append(fut)
            await fut
            if self._closed and self._wbuf:
                raise ConnectionResetError("connection closed with unsent data")

    # -- closing ------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop reading (a waiting reader sees EOF); queued output is still sent, then the socket closes."""
        if self._closing:
            return
        self._closing = True
        self._eof = True
        if self._read_waiter is not None:
            _resolve(self._read_waiter)
        if not self._wbuf:
            self._really_close()

    def abort(self) -> None:
        self._closing = True
        self._eof = True
        if self._read_waiter is not None:
            _resolve(self._read_waiter)
        self._really_close()

    def _really_close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self.fd)
        self._loop.remove_writer(self.fd)
        for fut in self._drained:
            _resolve(fut)
        self._drained = []
        self.sock.close()


def _resolve(fut: aio.Future, *_: object) -> None:
    if not fut.done():
        fut.set_result(None)
