"""IPython tool: one Jupyter kernel per server, driven directly with ``jupyter_client`` over IPC sockets.

The kernel starts on the first request (most rollouts never use it). A run that exceeds its timeout
is interrupted; a kernel that stays busy, or dies, is restarted and the result says so.

``jupyter_client`` needs a real asyncio loop, which the tool server does not run (it would cost most of
its start-up): :class:`IPythonThread` runs the tool on an asyncio loop in a thread of its own, created with
the first ipython request, and hands results back to the server's loop.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import subprocess
from typing import Any, Callable, Dict, List, Optional

from .aiothread import AsyncioThread
from .output import OutputBuffer, cap_text, clean_text
from .procs import Reaper, kill_tree
from .protocol import TOOL_ERROR, TOOL_UNAVAILABLE, ProtocolError
from .pysite import ipython_available, load_site

START_TIMEOUT_S = 60.0
INTERRUPT_GRACE_S = 3.0
MAX_IMAGES = 16

__all__ = ["IPythonThread", "IPythonTool", "ipython_available"]


class IPythonThread:
    """:class:`IPythonTool` on an :class:`.aiothread.AsyncioThread`, awaited from the server's loop."""

    def __init__(self, workdir: str, env: Dict[str, str], tmpdir: str, reaper: Reaper) -> None:
        load_site()  # jupyter_client lives in site-packages, which the server skipped at start-up
        self._thread = AsyncioThread("raas-ipython", reaper)
        self._args = (workdir, env, tmpdir, self._thread.reaper)
        self._tool: Optional[IPythonTool] = None

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        async def on_thread() -> Any:
            if self._tool is None:  # created there: asyncio objects bind to that loop on 3.8/3.9
                self._tool = IPythonTool(*self._args)  # type: ignore[arg-type]
            return await fn(self._tool, *args)

        return await self._thread.run(on_thread)

    async def run(self, code: str, timeout_s: Optional[float], cap: int) -> Dict[str, Any]:
        return await self._call(IPythonTool.run, code, timeout_s, cap)

    async def restart(self) -> Dict[str, Any]:
        return await self._call(IPythonTool.restart)

    async def close(self) -> None:
        """Stop the kernel, then the thread."""
        if self._tool is not None:
            try:
                await self._call(IPythonTool.close)
            except Exception:
                pass
        await self._thread.close()


class IPythonTool:
    """Owns the kernel process and serializes executions on it."""

    def __init__(self, workdir: str, env: Dict[str, str], tmpdir: str, reaper: Reaper) -> None:
        self.workdir = workdir
        self.env = env
        self.tmpdir = tmpdir
        self.reaper = reaper
        self._lock = asyncio.Lock()
        self._km: Any = None
        self._kc: Any = None
        self._pid = -1
        self._dead: Optional[asyncio.Future] = None

    # -- kernel lifecycle ------------------------------------------------------------------------

    async def _ensure(self) -> None:
        if self._km is not None:
            if self._dead is not None and self._dead.done():
                await self._restart()
            return
        if not ipython_available():
            raise ProtocolError(
                TOOL_UNAVAILABLE, "ipython is unavailable: the sandbox python has no ipykernel/jupyter_client"
            )
        from jupyter_client.manager import AsyncKernelManager

        self._ensure_tmpdir()
        km = AsyncKernelManager(
            kernel_name="python3",
            transport="ipc",
            ip=os.path.join(self.tmpdir, "kernel"),
            connection_file=os.path.join(self.tmpdir, "kernel.json"),
        )
        try:
            await km.start_kernel(
                cwd=self.workdir,
                env=dict(self.env),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        except Exception as exc:
            raise ProtocolError(TOOL_UNAVAILABLE, "the ipython kernel failed to start: %s" % exc) from None
        self._km = km
        self._watch()
        kc = km.client()
        kc.start_channels()
        self._kc = kc
        try:
            await kc.wait_for_ready(timeout=START_TIMEOUT_S)
        except Exception as exc:
            await self.close()
            raise ProtocolError(
                TOOL_UNAVAILABLE, "the ipython kernel did not become ready: %s" % exc
            ) from None

    def _ensure_tmpdir(self) -> None:
        """The kernel's connection file and sockets live in the server's temp dir, inside the TMPDIR the
        agent sees; agents clean up with ``rm -rf $TMPDIR/*``. A kernel that runs keeps its connections,
        but a (re)start needs the directory back."""
        try:
            os.mkdir(self.tmpdir, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise ProtocolError(
                TOOL_UNAVAILABLE, "the ipython kernel's directory is gone: %s" % exc
            ) from None

    def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        dead = loop.create_future()
        self._dead = dead
        provisioner = getattr(self._km, "provisioner", None)
        pid = getattr(provisioner, "pid", None)
        if pid is None:
            return
        self._pid = pid

        def on_exit(code: int) -> None:
            if not dead.done():
                dead.set_result(code)

        self.reaper.watch(pid, on_exit)
        # It may have died before we started watching.
        if not os.path.exists("/proc/%d" % pid):
            on_exit(-1)

    def _reaped(self) -> bool:
        """Whether the kernel's exit was collected (its pid may then belong to someone else)."""
        return self._dead is not None and self._dead.done()

    async def _restart(self) -> None:
        assert self._km is not None
        if self._pid > 0:
            self.reaper.unwatch(self._pid)
            kill_tree(self._pid, include_root=not self._reaped())
        try:
            self._ensure_tmpdir()
            await self._km.restart_kernel(now=True)
        except Exception as exc:
            await self.close()
            raise ProtocolError(TOOL_ERROR, "restarting the ipython kernel failed: %s" % exc) from None
        self._watch()
        try:
            await self._kc.wait_for_ready(timeout=START_TIMEOUT_S)
        except Exception as exc:
            await self.close()
            raise ProtocolError(TOOL_ERROR, "the restarted ipython kernel is not ready: %s" % exc) from None

    async def restart(self) -> Dict[str, Any]:
        async with self._lock:
            if self._km is None:
                await self._ensure()
            else:
                await self._restart()
            return {"restarted": True}

    async def close(self) -> None:
        """Stop the kernel and its client; whatever survives is killed by the server's final sweep."""
        kc, km = self._kc, self._km
        self._kc = self._km = None
        if kc is not None:
            try:
                kc.stop_channels()
            except Exception:
                pass
        if km is not None:
            if self._pid > 0:
                self.reaper.unwatch(self._pid)
                try:
                    os.killpg(self._pid, signal.SIGKILL)
                except OSError:
                    pass
                kill_tree(self._pid, include_root=not self._reaped())
            try:
                await asyncio.wait_for(km.shutdown_kernel(now=True), timeout=5.0)
            except Exception:
                pass
        self._pid = -1

    # -- execution -------------------------------------------------------------------------------

    async def run(self, code: str, timeout_s: Optional[float], cap: int) -> Dict[str, Any]:
        try:
            code.encode("utf-8")
        except UnicodeEncodeError:
            raise ProtocolError(
                TOOL_ERROR, "the code is not valid Unicode (it contains lone surrogates)"
            ) from None
        async with self._lock:
            await self._ensure()
            return await self._execute(code, timeout_s, cap)

    async def _execute(self, code: str, timeout_s: Optional[float], cap: int) -> Dict[str, Any]:
        loop = asyncio.get_running_loop()
        kc = self._kc
        msg_id = kc.execute(code, store_history=True, allow_stdin=False, stop_on_error=False)
        if inspect.isawaitable(msg_id):
            msg_id = await msg_id
        collector = _Collector(msg_id, cap)
        deadline = None if timeout_s is None else loop.time() + timeout_s
        timed_out = restarted = False
        outcome = await self._collect(collector, deadline)
        if outcome == "timeout":
            timed_out = True
            try:
                await self._km.interrupt_kernel()
            except Exception:
                pass
            outcome = await self._collect(collector, loop.time() + INTERRUPT_GRACE_S)
            if outcome == "timeout":
                await self._restart()
                restarted = True
                collector.kernel_lost("the kernel did not stop after an interrupt and was restarted")
        if outcome == "dead":
            await self._restart()
            restarted = True
            collector.kernel_lost("the kernel died and was restarted; its state is lost")
        if not restarted:
            await self._drain_shell(msg_id)
        result = collector.result()
        result["timed_out"] = timed_out
        result["restarted"] = restarted
        return result

    async def _collect(self, collector: "_Collector", deadline: Optional[float]) -> str:
        """Read iopub until our execution is idle (``done``), the deadline (``timeout``) or kernel death."""
        loop = asyncio.get_running_loop()
        kc = self._kc
        dead = self._dead
        while True:
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return "timeout"
            getter = asyncio.ensure_future(kc.get_iopub_msg())
            waiters = {getter}
            if dead is not None:
                waiters.add(dead)
            done, _ = await asyncio.wait(waiters, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                try:
                    await getter
                except BaseException:
                    pass
                if dead is not None and dead in done:
                    return "dead"
                return "timeout"
            if collector.feed(getter.result()):
                return "done"

    async def _drain_shell(self, msg_id: str) -> None:
        """Consume the execute_reply so replies do not pile up in the client."""
        from queue import Empty

        for _ in range(8):
            try:
                msg = await self._kc.get_shell_msg(timeout=2.0)
            except Empty:
                return
            if msg.get("parent_header", {}).get("msg_id") == msg_id:
                return


class _Collector:
    """Accumulates one execution's iopub messages, bounded by the output cap."""

    def __init__(self, msg_id: str, cap: int) -> None:
        self.msg_id = msg_id
        self.cap = cap
        self.stdout = OutputBuffer(cap)
        self.stderr = OutputBuffer(cap)
        self.value: Optional[str] = None
        self.error: Optional[Dict[str, Any]] = None
        self.images: List[str] = []

    def feed(self, msg: Dict[str, Any]) -> bool:
        """Take one message; True once the kernel reports our execution finished."""
        if msg.get("parent_header", {}).get("msg_id") != self.msg_id:
            return False
        kind = msg.get("msg_type") or msg.get("header", {}).get("msg_type")
        content = msg.get("content", {})
        if kind == "stream":
            target = self.stderr if content.get("name") == "stderr" else self.stdout
            target.feed(str(content.get("text", "")).encode("utf-8", "replace"))
        elif kind == "execute_result":
            self.value = str(content.get("data", {}).get("text/plain", ""))
        elif kind in ("display_data", "update_display_data"):
            data = content.get("data", {})
            png = data.get("image/png")
            if isinstance(png, str) and len(self.images) < MAX_IMAGES:
                self.images.append(png.replace("\n", ""))
            elif "text/plain" in data:
                self.stdout.feed((str(data["text/plain"]) + "\n").encode("utf-8", "replace"))
        elif kind == "error":
            self.error = {
                "ename": str(content.get("ename", "")),
                "evalue": str(content.get("evalue", "")),
                "traceback": [
                    clean_text(str(line).encode("utf-8", "replace")) for line in content.get("traceback", [])
                ],
            }
        elif kind == "status" and content.get("execution_state") == "idle":
            return True
        return False

    def kernel_lost(self, message: str) -> None:
        if self.error is None:
            self.error = {"ename": "KernelRestarted", "evalue": message, "traceback": []}

    def result(self) -> Dict[str, Any]:
        stdout, _ = self.stdout.text()
        stderr, _ = self.stderr.text()
        value = None
        if self.value is not None:
            value, _ = cap_text(clean_text(self.value.encode("utf-8", "replace")), self.cap)
        error = self.error
        if error is not None:
            tb, _ = cap_text("\n".join(error["traceback"]), self.cap)
            error = dict(error, traceback=tb.split("\n") if tb else [])
        return {
            "stdout": stdout,
            "stderr": stderr,
            "result": value,
            "error": error,
            "images": list(self.images),
        }
