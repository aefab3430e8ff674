"""File transfer: tar streams in and out of the sandbox, and small whole-file reads and writes.

Used to set a task up and to collect its results. Tar members that would land outside the target
directory (absolute names, ``..``, escaping links, device nodes) are refused before anything is written.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import posixpath
import stat
import tarfile
from typing import Any, Dict, List

from .protocol import BAD_REQUEST, NOT_FOUND, PAYLOAD_TOO_LARGE, TOOL_ERROR, ProtocolError


def _abs(path: str) -> str:
    try:
        os.fsencode(path)
    except UnicodeError:
        raise ProtocolError(BAD_REQUEST, "path must be valid Unicode text") from None
    if "\0" in path:
        raise ProtocolError(BAD_REQUEST, "path must not contain NUL characters")
    if not path.startswith("/"):
        raise ProtocolError(BAD_REQUEST, "path must be absolute, got %r" % path)
    return os.path.normpath(path)


def _b64decode(data: str, name: str) -> bytes:
    try:
        return base64.b64decode(data.encode("ascii"), validate=True)
    except (binascii.Error, ValueError, UnicodeEncodeError):
        raise ProtocolError(BAD_REQUEST, "%s is not valid base64" % name) from None


def _check_size(raw_len: int, max_frame: int) -> None:
    # base64 grows data by 4/3; leave room for the JSON envelope.
    if raw_len * 4 // 3 + 1024 > max_frame:
        raise ProtocolError(
            PAYLOAD_TOO_LARGE,
            "%d bytes do not fit in one frame (limit %d bytes after base64)" % (raw_len, max_frame),
        )


class _LimitedBuffer(io.BytesIO):
    """An in-memory tar target that refuses to grow past what one frame can carry."""

    def __init__(self, max_frame: int) -> None:
        super().__init__()
        self.max_frame = max_frame

    def write(self, data: Any) -> int:
        n = super().write(data)
        _check_size(self.tell(), self.max_frame)
        return n


def _safe_members(tar: tarfile.TarFile, dest: str) -> List[tarfile.TarInfo]:
    """Validate every member; any one that could escape ``dest`` rejects the whole archive."""
    members = []
    for m in tar.getmembers():
        name = m.name
        norm = posixpath.normpath(name)
        if name.startswith("/") or norm == ".." or norm.startswith("../"):
            raise ProtocolError(BAD_REQUEST, "tar member %r points outside the destination" % name)
        if m.isdev() or m.isfifo():
            raise ProtocolError(BAD_REQUEST, "tar member %r is a device or fifo; refused" % name)
        if m.issym() or m.islnk():
            target = m.linkname
            if target.startswith("/"):
                raise ProtocolError(
                    BAD_REQUEST, "link %r has an absolute target %r; refused" % (name, target)
                )
            base = posixpath.dirname(norm) if m.issym() else ""
            resolved = posixpath.normpath(posixpath.join(base, target))
            if resolved == ".." or resolved.startswith("../"):
                raise ProtocolError(
                    BAD_REQUEST, "link %r -> %r escapes the destination; refused" % (name, target)
                )
        m.mode &= 0o7777 & ~(stat.S_ISUID | stat.S_ISGID)
        members.append(m)
    return members


def upload(args: Dict[str, Any], max_frame: int) -> Dict[str, Any]:
    """Extract a tar stream into directory ``path`` (created if missing)."""
    dest = _abs(args["path"])
    data = _b64decode(args["data_b64"], "data_b64")
    if os.path.exists(dest) and not os.path.isdir(dest):
        raise ProtocolError(TOOL_ERROR, "%s exists and is not a directory" % dest)
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
            members = _safe_members(tar, dest)
            os.makedirs(dest, exist_ok=True)
            if "mode" in args:
                os.chmod(dest, args["mode"] & 0o7777)
            if hasattr(tarfile, "data_filter"):
                tar.extractall(dest, members=members, filter="data")
            else:  # Python < 3.12 without the extraction-filter backport
                tar.extractall(dest, members=members)
    except tarfile.TarError as exc:
        # Includes the extraction filter's refusals (FilterError) on Python versions that have one.
        raise ProtocolError(BAD_REQUEST, "data_b64 is not a valid or safe tar stream: %s" % exc) from None
    except OSError as exc:
        raise ProtocolError(TOOL_ERROR, "extracting into %s failed: %s" % (dest, exc)) from None
    return {"path": dest, "files": sum(1 for m in members if m.isfile())}


def download(args: Dict[str, Any], max_frame: int) -> Dict[str, Any]:
    """Tar of a file (one member, its base name) or of a directory's contents (names relative to it)."""
    path = _abs(args["path"])
    if not os.path.lexists(path):
        raise ProtocolError(NOT_FOUND, "%s does not exist" % path)
    buf = _LimitedBuffer(max_frame)
    try:
        with tarfile.open(fileobj=buf, mode="w") as tar:
            if os.path.isdir(path):
                for name in sorted(os.listdir(path)):
                    tar.add(os.path.join(path, name), arcname=name, recursive=True)
            else:
                tar.add(path, arcname=os.path.basename(path))
    except OSError as exc:
        raise ProtocolError(TOOL_ERROR, "reading %s failed: %s" % (path, exc)) from None
    data = buf.getvalue()
    _check_size(len(data), max_frame)
    return {"data_b64": base64.b64encode(data).decode("ascii"), "size": len(data)}


def write(args: Dict[str, Any], max_frame: int) -> Dict[str, Any]:
    """Write one whole file, creating parent directories."""
    path = _abs(args["path"])
    data = _b64decode(args["content_b64"], "content_b64")
    if os.path.isdir(path):
        raise ProtocolError(TOOL_ERROR, "%s is a directory" % path)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        if "mode" in args:
            os.chmod(path, args["mode"] & 0o7777)
    except OSError as exc:
        raise ProtocolError(TOOL_ERROR, "writing %s failed: %s" % (path, exc)) from None
    return {"path": path, "size": len(data)}


def read(args: Dict[str, Any], max_frame: int) -> Dict[str, Any]:
    """Read one whole regular file."""
    path = _abs(args["path"])
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ProtocolError(NOT_FOUND, "%s does not exist" % path) from None
    except OSError as exc:
        raise ProtocolError(TOOL_ERROR, "cannot access %s: %s" % (path, exc)) from None
    if not stat.S_ISREG(st.st_mode):
        raise ProtocolError(TOOL_ERROR, "%s is not a regular file" % path)
    _check_size(st.st_size, max_frame)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ProtocolError(TOOL_ERROR, "reading %s failed: %s" % (path, exc)) from None
    return {"content_b64": base64.b64encode(data).decode("ascii"), "size": len(data)}
