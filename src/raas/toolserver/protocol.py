"""Wire protocol of the tool server: constants and length-prefixed JSON framing.

Shared by the server (inside the sandbox, Python >= 3.8) and the host client, so both sides agree on
one definition of a frame.

A message is a frame (4-byte big-endian length, then that many bytes of UTF-8 JSON). A message whose JSON
object carries ``"att": N`` is followed by exactly N raw bytes, its *attachment*: file contents and tar
streams travel as bytes, never as base64 inside JSON, so moving 100 MB costs a copy, not an encoding pass.
"""

from __future__ import annotations

import struct

from . import jsonc

TYPE_CHECKING = False
if TYPE_CHECKING:  # the tool server imports neither typing nor asyncio (the host client reads with it)
    import asyncio
    from typing import Any, Dict, List, Optional

PROTOCOL_VERSION = 1
READY_LINE = "RAAS_TOOLSERVER_READY 1"
DEFAULT_MAX_FRAME = 64 * 1024 * 1024
DEFAULT_MAX_ATTACHMENT = 1024 * 1024 * 1024
ATTACHMENT_KEY = "att"
DEFAULT_OUTPUT_CAP = 30000
# bash: seconds until a command given no timeout is interrupted; of silence until one waiting for input returns.
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_INPUT_WAIT_S = 10.0
SANDBOX_ID_ENV = "RAAS_SANDBOX_ID"

HEADER = struct.Struct(">I")
TRUNCATION_MARKER = "\n[... {n} bytes truncated ...]\n"

# Error kinds that travel on the wire (a subset of raas.errors.ErrorKind).
BAD_REQUEST = "bad_request"
NOT_FOUND = "not_found"
PAYLOAD_TOO_LARGE = "payload_too_large"
TOOL_TIMEOUT = "tool_timeout"
TOOL_UNAVAILABLE = "tool_unavailable"
TOOL_ERROR = "tool_error"
INTERNAL = "internal"


class ProtocolError(Exception):
    """A request or frame that cannot be served; carries the wire error ``kind``."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


def truncation_marker(n: int) -> str:
    """The text put between head and tail of a capped output."""
    return TRUNCATION_MARKER.format(n=n)


def encode_frame(obj: Dict[str, Any]) -> bytes:
    """Serialize one message into a single frame (header + body) so it is written with one call.

    Text with lone surrogates (possible in JSON input) cannot be UTF-8: it is sent \\u-escaped.
    """
    text = jsonc.dumps(obj, ensure_ascii=False)
    try:
        body = text.encode("utf-8")
    except UnicodeEncodeError:
        body = jsonc.dumps(obj, ensure_ascii=True).encode("ascii")
    return HEADER.pack(len(body)) + body


def encode_message(obj: Dict[str, Any], attachment: Optional[bytes] = None) -> List[bytes]:
    """The buffers of one message (frame, then the attachment if any), for ``writer.writelines``."""
    if attachment is None:
        return [encode_frame(obj)]
    obj = dict(obj)
    obj[ATTACHMENT_KEY] = len(attachment)
    return [encode_frame(obj), attachment]


def attachment_size(obj: Dict[str, Any], max_attachment: int) -> int:
    """How many raw bytes follow this message (0 if none); a bad or oversize count is refused."""
    n = obj.get(ATTACHMENT_KEY, 0)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ProtocolError(BAD_REQUEST, "'att' must be a non-negative integer")
    if n > max_attachment:
        raise ProtocolError(
            PAYLOAD_TOO_LARGE, "attachment of %d bytes exceeds the limit of %d bytes" % (n, max_attachment)
        )
    return n


async def read_attachment(reader: asyncio.StreamReader, n: int) -> bytes:
    import asyncio

    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError:
        raise ProtocolError(BAD_REQUEST, "connection closed inside an attachment") from None


def decode_body(body: bytes) -> Dict[str, Any]:
    """Parse a frame body; anything but a JSON object is a ``bad_request``."""
    try:
        obj = jsonc.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(BAD_REQUEST, "frame is not valid UTF-8 JSON: %s" % exc) from None
    if not isinstance(obj, dict):
        raise ProtocolError(BAD_REQUEST, "frame must hold a JSON object, got %s" % type(obj).__name__)
    return obj


async def read_frame(reader: asyncio.StreamReader, max_frame: int) -> Optional[bytes]:
    """Read one frame body; ``None`` on a clean end of stream between frames.

    A header announcing more than ``max_frame`` bytes raises ``payload_too_large`` before the body
    is read, so a bad peer cannot make us allocate an arbitrary amount of memory.
    """
    import asyncio

    try:
        header = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ProtocolError(BAD_REQUEST, "connection closed inside a frame header") from None
    (length,) = HEADER.unpack(header)
    if length > max_frame:
        raise ProtocolError(
            PAYLOAD_TOO_LARGE, "frame of %d bytes exceeds the limit of %d bytes" % (length, max_frame)
        )
    try:
        return await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise ProtocolError(BAD_REQUEST, "connection closed inside a frame body") from None


def ok_response(req_id: Any, result: Dict[str, Any]) -> Dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": req_id, "ok": True, "result": result}


def error_response(req_id: Any, kind: str, message: str) -> Dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": req_id, "ok": False, "error": {"kind": kind, "message": message}}
