"""Connection limits uvicorn does not have: a deadline for a request's headers and a cap on open connections.

uvicorn (0.54) arms its keep-alive timer only after a response and cancels it on the next byte, and its
``limit_concurrency`` acts only once a request's headers are complete. A client that opens a connection
and never finishes its headers (slowloris) therefore holds a socket forever, and enough of them exhaust
the process's file descriptors, after which nothing, ``/healthz`` included, is answered.

:func:`guarded_protocol` wraps uvicorn's HTTP protocol (h11 or httptools, whichever uvicorn picks) so that:

* a connection must deliver complete request headers within ``header_timeout_s`` of opening, or of the
  first byte of a later request on a kept-alive connection; otherwise it is closed (with a 408 when part
  of a request had arrived);
* a request that cannot be parsed gets a 400 in the API's error shape (``ErrorBody``), not plain text;
* at most ``max_connections`` connections are open. A new connection over the cap first evicts the
  connection that has waited longest without a request in progress (an unfinished header or an idle
  keep-alive); when every connection is serving a request, the newcomer gets an immediate 503 with
  ``Retry-After`` and is closed. A few more than the cap may be answering their 503 at once; past that
  newcomers are dropped unanswered, so the number of sockets stays bounded whatever the rate of attack.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from dataclasses import dataclass, field
from typing import Any

from raas.api.errors import error_body

log = logging.getLogger("raas.api")

REFUSAL_LINGER_S = 2.0
"""How long a refused connection may stay open so its client can read the 503 (then it is closed)."""

FD_HEADROOM = 512
"""File descriptors kept free for everything but HTTP connections (sandboxes, the ledger, LLM clients)."""


@dataclass(frozen=True)
class HttpLimits:
    header_timeout_s: float
    max_connections: int

    @property
    def refusal_slots(self) -> int:
        """Connections over the cap that may be answering their 503 at the same time."""
        return max(8, self.max_connections // 8)

    @property
    def max_sockets(self) -> int:
        """The most HTTP sockets the server holds at once."""
        return self.max_connections + self.refusal_slots


@dataclass
class ConnectionBook:
    """State shared by every connection of one server: who is waiting, and what the guard has done."""

    limits: HttpLimits
    waiting: dict[Any, None] = field(default_factory=dict)
    """Connections with no request in progress, oldest first (the eviction order)."""
    header_timeouts: int = 0
    evicted: int = 0
    refused: int = 0
    dropped: int = 0
    _warned_at: float = float("-inf")

    def warn(self, what: str) -> None:
        """Log pressure at most once a minute (an attack would otherwise flood the log)."""
        now = time.monotonic()
        if now - self._warned_at >= 60.0:
            self._warned_at = now
            log.warning(
                "HTTP connection cap (%d) reached: %s (so far: %d evicted, %d refused with 503, "
                "%d dropped, %d header timeouts)",
                self.limits.max_connections,
                what,
                self.evicted,
                self.refused,
                self.dropped,
                self.header_timeouts,
            )


def _raw_response(status: int, reason: str, kind: str, message: str, extra: str = "") -> bytes:
    body = json.dumps(error_body(kind, message)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n{extra}\r\n"
    )
    return head.encode("latin-1") + body


def guarded_protocol(
    limits: HttpLimits, base: type[asyncio.Protocol] | None = None
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (``base``, default: the one ``http="auto"`` picks) with the header
    deadline and the connection cap. Use one class per server: the class holds that server's book."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol
    parent: type[asyncio.Protocol] = base
    book = ConnectionBook(limits)
    timeout_response = _raw_response(
        408,
        "Request Timeout",
        "bad_request",
        f"request headers not received within {limits.header_timeout_s:g} s (http_header_timeout_s)",
    )
    refusal = _raw_response(
        503,
        "Service Unavailable",
        "unavailable",
        f"too many open connections (http_max_connections = {limits.max_connections}); retry shortly",
        "retry-after: 1\r\n",
    )

    class GuardedHTTPProtocol(parent):  # type: ignore[valid-type, misc]
        __doc__ = f"{parent.__name__} with a header deadline and a connection cap (see raas.api.limits)."

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._header_timer: asyncio.TimerHandle | None = None
            self._partial = False  # bytes of a request whose headers are not complete yet
            self._refused = False

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections and not self._evict_one():
                self._refuse()
                return
            book.waiting[self] = None
            self._header_timer = self.loop.call_later(limits.header_timeout_s, self._headers_overdue)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return  # the 503 is on its way; the request itself is of no interest
            if not self._busy():
                self._partial = True
                if self._header_timer is None:
                    self._header_timer = self.loop.call_later(limits.header_timeout_s, self._headers_overdue)
            super().data_received(data)
            self._sync()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._partial = False  # a pipelined request's leftover bytes are covered by the keep-alive timer
            self._sync()

        def send_400_response(self, msg: str) -> None:
            # uvicorn answers a request it cannot parse in plain text; raas answers every error as an
            # ErrorBody. The connection is closed either way.
            book.waiting.pop(self, None)
            self._cancel_timer()
            self.transport.write(_raw_response(400, "Bad Request", "bad_request", msg))
            self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_timer()
            book.waiting.pop(self, None)
            super().connection_lost(exc)

        # -- guard -------------------------------------------------------------------------------------

        def _busy(self) -> bool:
            cycle = self.cycle
            return cycle is not None and not cycle.response_complete

        def _sync(self) -> None:
            if self not in self.connections:  # upgraded to another protocol: no longer ours to police
                self._cancel_timer()
                book.waiting.pop(self, None)
            elif self._busy():
                self._cancel_timer()
                self._partial = False
                book.waiting.pop(self, None)
            elif self not in book.waiting and not self.transport.is_closing():
                book.waiting[self] = None

        def _cancel_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_overdue(self) -> None:
            self._header_timer = None
            if self._busy() or self.transport.is_closing() or self not in self.connections:
                return
            book.header_timeouts += 1
            book.waiting.pop(self, None)
            if self._partial:
                self.transport.write(timeout_response)
            self.transport.close()

        def _evict_one(self) -> bool:
            """Close the connection that has waited longest without a request in progress."""
            victim = next(iter(book.waiting), None)
            if victim is None:
                return False
            del book.waiting[victim]
            book.evicted += 1
            book.warn("closing the connections that wait longest without a request")
            victim._cancel_timer()
            victim.transport.close()
            return True

        def _refuse(self) -> None:
            self._refused = True
            if len(self.connections) > limits.max_sockets:
                book.dropped += 1
                book.warn("every connection is serving a request; dropping new ones")
                self.transport.abort()
                return
            book.refused += 1
            book.warn("every connection is serving a request; answering new ones 503")
            self.transport.write(refusal)
            # Half-close so the client reads the 503 and EOF even if its request is still arriving (a full
            # close with unread input would reset the connection and lose the response).
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self._header_timer = self.loop.call_later(REFUSAL_LINGER_S, self.transport.close)

    GuardedHTTPProtocol.book = book
    return GuardedHTTPProtocol


def connection_book(protocol_class: type[asyncio.Protocol]) -> ConnectionBook:
    """The book of a class made by :func:`guarded_protocol` (counters for tests and benchmarks)."""
    return protocol_class.book  # type: ignore[attr-defined]


def fit_to_fd_limit(limits: HttpLimits) -> HttpLimits:
    """Make room for ``limits`` under the process's open-file limit.

    Raises the soft ``RLIMIT_NOFILE`` towards the hard limit when the connection cap needs it (as the Go
    runtime does); if even the hard limit is too low, lowers the cap so that a flood of connections cannot
    take the descriptors the rest of the service needs, and says so."""
    needed = limits.max_sockets + FD_HEADROOM
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit to %d: %s", target, exc)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return limits
    room = max(16, soft - FD_HEADROOM)
    cap = max(8, room * 8 // 9)  # leave the refusal slots inside the room too
    log.warning(
        "the open-file limit (%d) is too low for http_max_connections=%d: serving at most %d connections "
        "(raise it with `ulimit -n` to lift this)",
        soft,
        limits.max_connections,
        cap,
    )
    return HttpLimits(header_timeout_s=limits.header_timeout_s, max_connections=cap)
