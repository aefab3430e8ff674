"""File transfer: tar streams in and out of the sandbox, and whole-file reads and writes.

Contents travel as message attachments (raw bytes). Uploads are extracted by our own walker, not by
``tarfile.extractall``, so safety does not depend on the image's Python having ``tarfile.data_filter``:
every path component below the destination is opened with ``O_NOFOLLOW`` relative to its parent's
descriptor, so no member can be written through a symlink, whatever earlier members (or the sandbox's own
code) put there. Absolute names, ``..``, links that point outside the destination, devices and fifos are
refused; the whole archive is checked before anything is written.
"""

from __future__ import annotations

import io
import os
import posixpath
import stat
import tarfile
from typing import Any, Dict, List, Optional, Tuple

from .protocol import BAD_REQUEST, NOT_FOUND, PAYLOAD_TOO_LARGE, TOOL_ERROR, ProtocolError

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Permission bits kept from an archive: no setuid/setgid.
MODE_MASK = 0o1777
Result = Tuple[Dict[str, Any], Optional[bytes]]


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


def _need(attachment: Optional[bytes], what: str) -> bytes:
    if attachment is None:
        raise ProtocolError(BAD_REQUEST, "%s needs its content as the message attachment" % what)
    return attachment


class _LimitedBuffer(io.BytesIO):
    """An in-memory tar target that refuses to grow past what one attachment may carry."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def write(self, data: Any) -> int:
        n = super().write(data)
        if self.tell() > self.limit:
            raise ProtocolError(
                PAYLOAD_TOO_LARGE, "the archive grew past the attachment limit of %d bytes" % self.limit
            )
        return n


# -- checking an archive -------------------------------------------------------------------------------


def _member_parts(name: str) -> List[str]:
    """The path components of a member name, or a refusal when it could leave the destination."""
    if "\0" in name:
        raise ProtocolError(BAD_REQUEST, "tar member name contains NUL")
    if name.startswith("/"):
        raise ProtocolError(BAD_REQUEST, "tar member %r points outside the destination" % name)
    norm = posixpath.normpath(name)
    if norm == ".." or norm.startswith("../"):
        raise ProtocolError(BAD_REQUEST, "tar member %r points outside the destination" % name)
    parts = [p for p in norm.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ProtocolError(BAD_REQUEST, "tar member %r points outside the destination" % name)
    return parts


def _check_members(tar: tarfile.TarFile) -> List[Tuple[tarfile.TarInfo, List[str]]]:
    """Validate every member before anything is written; one bad member rejects the archive."""
    out = []
    for m in tar.getmembers():
        parts = _member_parts(m.name)
        if m.isdev() or m.isfifo():
            raise ProtocolError(BAD_REQUEST, "tar member %r is a device or fifo; refused" % m.name)
        if not (m.isdir() or m.isreg() or m.issym() or m.islnk()):
            raise ProtocolError(BAD_REQUEST, "tar member %r has an unsupported type; refused" % m.name)
        if not parts and not m.isdir():
            raise ProtocolError(BAD_REQUEST, "tar member %r has no name" % m.name)
        if m.issym() or m.islnk():
            target = m.linkname
            if target.startswith("/") or "\0" in target:
                raise ProtocolError(
                    BAD_REQUEST, "link %r has an absolute target %r; refused" % (m.name, target)
                )
            base = "/".join(parts[:-1]) if m.issym() else ""
            resolved = posixpath.normpath(posixpath.join(base, target))
            if resolved == ".." or resolved.startswith("../"):
                raise ProtocolError(
                    BAD_REQUEST, "link %r -> %r escapes the destination; refused" % (m.name, target)
                )
        out.append((m, parts))
    return out


# -- writing below a directory descriptor ----------------------------------------------------------------


class _Tree:
    """Creates entries below ``root_fd`` by walking components with O_NOFOLLOW; never follows a symlink."""

    def __init__(self, root_fd: int) -> None:
        self.root_fd = root_fd
        self._opened: List[int] = []

    def close(self) -> None:
        for fd in self._opened:
            os.close(fd)
        self._opened = []

    def _open_dir(self, parent: int, name: str, create: bool) -> int:
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                raise
            os.mkdir(name, 0o755, dir_fd=parent)
            fd = os.open(name, DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            raise ProtocolError(
                BAD_REQUEST, "%r is a symlink or not a directory; archives may not write through it" % name
            ) from exc
        self._opened.append(fd)
        return fd

    def parent(self, parts: List[str], create: bool = True) -> int:
        """The descriptor of the directory that holds ``parts[-1]``."""
        fd = self.root_fd
        for name in parts[:-1]:
            fd = self._open_dir(fd, name, create)
        return fd

    def directory(self, parts: List[str]) -> int:
        fd = self.root_fd
        for name in parts:
            fd = self._open_dir(fd, name, True)
        return fd

    @staticmethod
    def clear(parent: int, name: str) -> None:
        """Remove a non-directory entry that a member replaces (a symlink is removed, not followed)."""
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            raise ProtocolError(
                TOOL_ERROR, "%r is an existing directory; an archive member cannot replace it" % name
            )
        os.unlink(name, dir_fd=parent)


def _extract(tar: tarfile.TarFile, members: List[Tuple[tarfile.TarInfo, List[str]]], root_fd: int) -> int:
    tree = _Tree(root_fd)
    files = 0
    dirs: List[Tuple[List[str], tarfile.TarInfo]] = []
    try:
        for m, parts in members:
            if m.isdir():
                tree.directory(parts)
                dirs.append((parts, m))
                continue
            parent = tree.parent(parts)
            name = parts[-1]
            tree.clear(parent, name)
            if m.issym():
                os.symlink(m.linkname, name, dir_fd=parent)
            elif m.islnk():
                src_parts = _member_parts(m.linkname)
                src_parent = tree.parent(src_parts, create=False)
                st = os.stat(src_parts[-1], dir_fd=src_parent, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    raise ProtocolError(BAD_REQUEST, "hard link %r must point to a regular file" % m.name)
                os.link(src_parts[-1], name, src_dir_fd=src_parent, dst_dir_fd=parent, follow_symlinks=False)
                files += 1
            else:
                fd = os.open(
                    name,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    0o600,
                    dir_fd=parent,
                )
                with os.fdopen(fd, "wb") as out:
                    src = tar.extractfile(m)
                    if src is not None:
                        while True:
                            chunk = src.read(1 << 20)
                            if not chunk:
                                break
                            out.write(chunk)
                    os.fchmod(out.fileno(), m.mode & MODE_MASK & ~0o1000)
                    os.utime(out.fileno(), (m.mtime, m.mtime))
                files += 1
        # Directory modes last, deepest first: a read-only directory must not block its own contents.
        for parts, m in sorted(dirs, key=lambda d: -len(d[0])):
            fd = tree.directory(parts)
            os.fchmod(fd, m.mode & MODE_MASK)
            os.utime(fd, (m.mtime, m.mtime))
    finally:
        tree.close()
    return files


def upload(args: Dict[str, Any], attachment: Optional[bytes], limit: int) -> Result:
    """Extract the attached tar stream into directory ``path`` (created if missing)."""
    dest = _abs(args["path"])
    data = _need(attachment, "files.upload")
    try:
        tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:*")
    except tarfile.TarError as exc:
        raise ProtocolError(BAD_REQUEST, "the attachment is not a valid tar stream: %s" % exc) from None
    with tar:
        try:
            members = _check_members(tar)
        except tarfile.TarError as exc:
            raise ProtocolError(BAD_REQUEST, "the attachment is not a valid tar stream: %s" % exc) from None
        try:
            os.makedirs(dest, exist_ok=True)
            root_fd = os.open(dest, DIR_FLAGS)
        except OSError as exc:
            raise ProtocolError(TOOL_ERROR, "cannot open the destination %s: %s" % (dest, exc)) from None
        try:
            if "mode" in args:
                os.fchmod(root_fd, args["mode"] & MODE_MASK)
            files = _extract(tar, members, root_fd)
        except tarfile.TarError as exc:
            raise ProtocolError(BAD_REQUEST, "the attachment is not a valid tar stream: %s" % exc) from None
        except OSError as exc:
            raise ProtocolError(TOOL_ERROR, "extracting into %s failed: %s" % (dest, exc)) from None
        finally:
            os.close(root_fd)
    return {"path": dest, "files": files}, None


def download(args: Dict[str, Any], attachment: Optional[bytes], limit: int) -> Result:
    """Tar of a file (one member, its base name) or of a directory's contents (names relative to it)."""
    path = _abs(args["path"])
    if not os.path.lexists(path):
        raise ProtocolError(NOT_FOUND, "%s does not exist" % path)
    buf = _LimitedBuffer(limit)
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
    return {"size": len(data)}, data


def write(args: Dict[str, Any], attachment: Optional[bytes], limit: int) -> Result:
    """Write one whole file, creating parent directories."""
    path = _abs(args["path"])
    data = _need(attachment, "files.write")
    if os.path.isdir(path):
        raise ProtocolError(TOOL_ERROR, "%s is a directory" % path)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        if "mode" in args:
            os.chmod(path, args["mode"] & MODE_MASK)
    except OSError as exc:
        raise ProtocolError(TOOL_ERROR, "writing %s failed: %s" % (path, exc)) from None
    return {"path": path, "size": len(data)}, None


def read(args: Dict[str, Any], attachment: Optional[bytes], limit: int) -> Result:
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
    if st.st_size > limit:
        raise ProtocolError(
            PAYLOAD_TOO_LARGE, "%s has %d bytes, over the limit of %d" % (path, st.st_size, limit)
        )
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ProtocolError(TOOL_ERROR, "reading %s failed: %s" % (path, exc)) from None
    return {"size": len(data)}, data
