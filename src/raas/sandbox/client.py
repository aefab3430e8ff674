"""Host-side asyncio client of the in-sandbox tool server: one typed method per tool op.

Every op is checked against its declaration (:mod:`raas.toolserver.ops`) before it is sent
(:meth:`ToolClient.call`); the connection itself (framing, deadlines, liveness, large transfers) is
:class:`raas.sandbox.connection.ToolConnection`.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import tarfile
from pathlib import Path
from typing import Any

from raas.errors import RaasError
from raas.sandbox.connection import CHUNK_BYTES, LARGE_BYTES, Attachment, Reply, ToolConnection
from raas.sandbox.models import (
    BashResult,
    BashSessionInfo,
    EditorResult,
    IPythonResult,
    ServerInfo,
)
from raas.toolserver import ops

__all__ = ["LARGE_BYTES", "ToolClient", "op_args", "tar_directory"]


class ToolClient(ToolConnection):
    """The typed tool calls over one connection (see :class:`ToolConnection` for its options)."""

    async def call(
        self,
        tool: str,
        op: str,
        args: dict[str, Any] | None = None,
        *,
        wait_s: float | None = None,
        attachment: Attachment | None = None,
        deadline: bool | None = None,
    ) -> Reply:
        """One op with its arguments checked against the op declarations (:mod:`raas.toolserver.ops`):
        ``None`` values are dropped; an unknown op or argument, a wrong type or an out-of-range number is a
        ``bad_request`` raised here, with the message the server would answer (so is an attachment sent to
        an op that takes none).

        The wait defaults to the call's ``timeout`` plus ``timeout_grace_s`` (``request_timeout_s`` without
        one). A call with only a ``no_output_timeout`` may run as long as it keeps printing: it has no fixed
        deadline unless ``deadline`` says otherwise; the liveness check guards against a wedged server."""
        checked = op_args(tool, op, args or {})
        if attachment is not None and not ops.OPS[(tool, op)].takes_attachment:
            raise RaasError(f"{tool}.{op} takes no attachment", kind="bad_request")
        timeout = checked.get("timeout")
        if wait_s is None:
            wait_s = self._wait_for(timeout)
        if deadline is None:
            deadline = not (timeout is None and checked.get("no_output_timeout") is not None)
        return await self.request_with_attachment(
            tool, op, checked, wait_s=wait_s, attachment=attachment, deadline=deadline
        )

    async def ping(self) -> ServerInfo:
        result, _ = await self.call("server", "ping", wait_s=self.connect_timeout_s)
        return ServerInfo.model_validate(result)

    async def shutdown(self) -> None:
        """Ask the server to stop (it kills everything it started and removes its socket)."""
        with contextlib.suppress(RaasError):
            await self.call("server", "shutdown", wait_s=self.connect_timeout_s)

    async def bash(
        self,
        command: str,
        *,
        session: str = "default",
        timeout: float | None = None,  # noqa: ASYNC109 - enforced by the server inside the sandbox
        no_output_timeout: float | None = None,
        output_cap: int | None = None,
    ) -> BashResult:
        args: dict[str, Any] = {
            "command": command,
            "session": session,
            "timeout": timeout,
            "no_output_timeout": no_output_timeout,
            "output_cap": output_cap,
        }
        result, _ = await self.call("bash", "run", args)
        return BashResult.model_validate(result)

    async def bash_send(
        self,
        text: str = "",
        *,
        session: str = "default",
        interrupt: bool = False,
        timeout: float | None = None,  # noqa: ASYNC109 - enforced by the server inside the sandbox
        no_output_timeout: float | None = None,
        output_cap: int | None = None,
    ) -> BashResult:
        """Type ``text`` into the command still running in ``session`` and read on (``bash.send``).

        For a command that returned ``waiting_for_input``: ``"y\n"`` answers a prompt, ``""`` just waits
        for more output, ``"C-c"``/``"C-d"``/``"C-z"`` send those keys; ``interrupt=True`` stops the
        command as a timeout would (SIGINT, then SIGKILL). The result has the output since the last call.
        """
        args: dict[str, Any] = {
            "session": session,
            "input": text,
            "interrupt": interrupt or None,
            "timeout": timeout,
            "no_output_timeout": no_output_timeout,
            "output_cap": output_cap,
        }
        result, _ = await self.call("bash", "send", args)
        return BashResult.model_validate(result)

    async def bash_close(self, session: str) -> bool:
        result, _ = await self.call("bash", "close", {"session": session}, wait_s=self._wait_for(0))
        return bool(result.get("closed"))

    async def bash_list(self) -> list[BashSessionInfo]:
        result, _ = await self.call("bash", "list", wait_s=self._wait_for(0))
        return [BashSessionInfo.model_validate(s) for s in result.get("sessions", [])]

    async def ipython(
        self,
        code: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - enforced by the server inside the sandbox
        output_cap: int | None = None,
    ) -> IPythonResult:
        args: dict[str, Any] = {"code": code, "timeout": timeout, "output_cap": output_cap}
        result, _ = await self.call("ipython", "run", args)
        return IPythonResult.model_validate(result)

    async def ipython_restart(self) -> None:
        await self.call("ipython", "restart", wait_s=self._wait_for(0))

    async def editor(self, command: str, path: str, **kwargs: Any) -> EditorResult:
        """``str_replace_editor``: ``view``/``create``/``str_replace``/``insert``/``undo_edit``; ``kwargs``
        are the other ``editor.run`` arguments (``file_text``, ``old_str``, ``new_str``, ``insert_line``,
        ``view_range``).

        User mistakes (missing file, ambiguous ``old_str``...) raise :class:`RaasError` kind ``tool_error``.
        """
        result, _ = await self.call(
            "editor", "run", {"command": command, "path": path, **kwargs}, wait_s=self._wait_for(0)
        )
        return EditorResult.model_validate(result)

    async def gateway_forward(self, socket: str, *, port: int | None = None) -> dict[str, Any]:
        """A 127.0.0.1 TCP port in the sandbox leading to the Unix socket ``socket`` (started once per
        socket): ``{host, port, socket, connections, refused}``."""
        result, _ = await self.call("gateway", "forward", {"socket": socket, "port": port})
        return result

    async def upload_bytes(self, tar_bytes: bytes, dest: str, *, mode: int | None = None) -> int:
        """Extract a tar stream into directory ``dest`` in the sandbox; returns the number of files."""
        args = {"path": dest, "mode": mode}
        result, _ = await self.call("files", "upload", args, attachment=tar_bytes)
        return int(result.get("files", 0))

    async def upload_dir(self, host_dir: str | os.PathLike[str], dest: str) -> int:
        """Copy the contents of ``host_dir`` into ``dest`` in the sandbox."""
        data = await self._off_loop(tar_directory, Path(host_dir))
        return await self.upload_bytes(data, dest)

    async def download(self, path: str) -> bytes:
        """Tar stream of a file (one member) or of a directory's contents (names relative to it)."""
        _, data = await self.call("files", "download", {"path": path})
        return data or b""

    async def write_file(self, path: str, data: bytes | str, *, mode: int | None = None) -> None:
        raw: Attachment = data if not isinstance(data, str) else await _encode_in_pieces(data)
        args = {"path": path, "mode": mode}
        await self.call("files", "write", args, attachment=raw)

    async def read_file(self, path: str) -> bytes:
        _, data = await self.call("files", "read", {"path": path})
        return data or b""


async def _encode_in_pieces(text: str) -> Attachment:
    """UTF-8 of ``text``; a large one as pieces encoded one at a time, yielding to the loop in between
    (code points encode independently, so the pieces together are the encoding of the whole)."""
    if len(text) < LARGE_BYTES:
        return text.encode("utf-8")
    pieces = []
    for start in range(0, len(text), CHUNK_BYTES):
        pieces.append(text[start : start + CHUNK_BYTES].encode("utf-8"))
        await asyncio.sleep(0)
    return pieces


def op_args(tool: str, op: str, args: dict[str, Any]) -> dict[str, Any]:
    """``args`` checked against the declaration of ``tool.op`` (``None`` values dropped); a mismatch is a
    ``bad_request`` with the server's own message."""
    try:
        return ops.validate_args(tool, op, args)
    except ops.ArgumentError as exc:
        raise RaasError(str(exc), kind="bad_request") from None


def tar_directory(root: Path) -> bytes:
    """An uncompressed tar of ``root``'s contents, member names relative to ``root``."""
    if not root.is_dir():
        raise RaasError(f"{root} is not a directory", kind="bad_request")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for child in sorted(root.iterdir()):
            tar.add(child, arcname=child.name, recursive=True)
    return buf.getvalue()
