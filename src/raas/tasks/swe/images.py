"""The image of each SWE instance: which reference it is, its one-time conversion, and gated starts.

A record names its image (``image``: a rootfs dir, a SIF, ``docker://...``, ``docker-archive:...``; an
R2E ``docker_image``), or it is derived from SWE-bench's naming convention through a template
(``image_template``, default ``docker://docker.io/swebench/{name}`` with ``{name}`` =
``sweb.eval.x86_64.<id>:latest`` as SWE-bench writes it, ``{instance_id}`` the raw id; e.g.
``/shared/sifs/{name}.sif`` for a directory of SIFs). Non-directory sources are converted once into an
unpacked directory in the image cache (``raas.sandbox.images.ensure_sandbox_dir``: a file lock per image
across processes; here also one asyncio lock per image, so waiting jobs hold no threads).

Starts are gated: at most ``starts_per_image`` sandboxes of one image and ``starts_per_node`` of all images
start at once in one service process (a start copies the repository into the sandbox, so a burst of
starts of one big image would thrash the disk).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raas.core.executors import Executor
from raas.errors import RaasError
from raas.sandbox.images import (
    SOURCE_PREFIXES,
    ensure_sandbox_dir,
    image_cache_dir,
    is_convertible_source,
    source_key,
)

from .instance import SweTask
from .specs import swebench_image_name

DEFAULT_IMAGE_TEMPLATE = "docker://docker.io/swebench/{name}"
SWE_SOURCES = frozenset(
    (
        "swebench",
        "swe-bench",
        "swebench-verified",
        "swe-bench-verified",
        "swe-gym",
        "swegym",
        "r2e",
        "r2e-gym",
        "swe-mini",
    )
)
"""The data sources of SWE records: the SWE handler's name and aliases, and ``swe-mini`` (the same records
with a small policy's scaffold, :mod:`raas.tasks.swe.mini.handler`)."""


def image_reference(task: SweTask, template: str = DEFAULT_IMAGE_TEMPLATE) -> str:
    """The image source for ``task``: its own reference, or the SWE-bench name through ``template``."""
    ref = task.image
    if ref is None:
        try:
            ref = template.format(name=swebench_image_name(task.instance_id), instance_id=task.instance_id)
        except (KeyError, IndexError, ValueError) as e:
            raise RaasError(f"bad image_template {template!r}: {e}", kind="bad_request") from e
    if ref.startswith(("/", "./", "../")) or ref.startswith(SOURCE_PREFIXES) or ref.endswith(".sif"):
        return ref
    # A bare registry name (SWE-bench 5 records: "swebench/sweb.eval.x86_64...:latest").
    return f"docker://{ref}"


class ImageGates:
    """Conversions (one per image at a time), start slots and grading, for one service's event loop.

    Conversions run on a pool of their own (``convert_workers`` threads): a burst of slow conversions
    waits there and never holds the threads sandbox starts and closes need. Grading (parsing test logs
    of up to the log cap with SWE-bench's parsers) has its own small pool, so neither waits on the other
    or on the loop's default pool. The pools are shut down with the gates (they live as long as their
    event loop)."""

    def __init__(self, starts_per_image: int, starts_per_node: int, convert_workers: int = 2) -> None:
        self.converts = Executor("raas-image-convert", convert_workers)
        weakref.finalize(self, self.converts.shutdown)
        self.grading = Executor("raas-swe-grade", 2)
        weakref.finalize(self, self.grading.shutdown)
        self.starts_per_image = starts_per_image
        self._node = asyncio.Semaphore(starts_per_node)
        self._per_image: dict[str, asyncio.Semaphore] = {}
        self._convert: dict[str, asyncio.Lock] = {}
        self._resolved: dict[str, Path] = {}
        self._repo_mb: dict[tuple[Path, str], float] = {}

    async def resolve(self, ref: str) -> Path:
        """The unpacked directory of ``ref``, converting it once (typed error when it cannot be had)."""
        known = self._resolved.get(ref)
        if known is not None and known.is_dir():
            return known
        lock = self._convert.setdefault(ref, asyncio.Lock())
        async with lock:
            known = self._resolved.get(ref)
            if known is not None and known.is_dir():
                return known
            try:
                path = await self.converts.run(ensure_sandbox_dir, ref)
            except RaasError as e:
                if e.kind == "bad_request":  # from the record: a missing path is not the policy's
                    e.kind = "sandbox_start_failed"
                e.message = f"image {ref}: {e.message}"
                raise
            self._resolved[ref] = path
            return path

    @contextlib.asynccontextmanager
    async def start_slot(self, ref: str) -> AsyncIterator[None]:
        """Hold a start slot for ``ref`` (per image, then per node) while a sandbox starts."""
        image_gate = self._per_image.setdefault(ref, asyncio.Semaphore(self.starts_per_image))
        async with image_gate, self._node:
            yield

    async def repo_mb(self, image_dir: Path, workdir: str) -> float:
        """Size of the repository in the image (MB, apparent size), measured once per image."""
        key = (image_dir, workdir)
        if key not in self._repo_mb:
            self._repo_mb[key] = await self.converts.run(_tree_mb, image_dir / workdir.lstrip("/"))
        return self._repo_mb[key]


def _tree_mb(root: Path) -> float:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return total / 1e6


_GATES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, ImageGates] = weakref.WeakKeyDictionary()


def gates_for_loop(starts_per_image: int, starts_per_node: int) -> ImageGates:
    """The gates of the running event loop (one service, whatever alias its jobs came under)."""
    loop = asyncio.get_running_loop()
    gates = _GATES.get(loop)
    if gates is None:
        gates = _GATES[loop] = ImageGates(starts_per_image, starts_per_node)
    return gates


def dataset_references(rows: list[dict[str, Any]], template: str = DEFAULT_IMAGE_TEMPLATE) -> list[str]:
    """The distinct image references of a dataset's rows, in first-seen order: SWE records through
    :func:`image_reference`, other rows by their ``image`` field (rows with neither are skipped)."""
    from raas.tasks.datasets import infer_data_source

    from .instance import parse_task

    refs: dict[str, None] = {}
    for row in rows:
        source = str(row.get("data_source") or infer_data_source(row) or "")
        if source in SWE_SOURCES:
            refs[image_reference(parse_task(row), template)] = None
        elif isinstance(row.get("image"), str) and row["image"]:
            refs[row["image"]] = None
    return list(refs)


@dataclass
class PullResult:
    reference: str
    path: str | None = None
    seconds: float = 0.0
    cached: bool = False
    error: str | None = None


async def pull_images(
    refs: list[str], *, jobs: int = 2, on_done: Callable[[PullResult], None] | None = None
) -> list[PullResult]:
    """Convert every reference into the image cache (``jobs`` at a time; each image once, the file lock of
    :func:`raas.sandbox.images.ensure_sandbox_dir` also guards against other processes)."""
    converts = Executor("raas-image-pull", max(1, jobs))

    gate = asyncio.Semaphore(jobs)

    async def one(ref: str) -> PullResult:
        async with gate:
            started = time.monotonic()
            res = PullResult(ref)
            try:
                res.cached = await converts.run(_is_ready, ref)
                res.path = str(await converts.run(ensure_sandbox_dir, ref))
            except RaasError as e:
                res.error = f"{e.kind}: {e.message}"
            res.seconds = time.monotonic() - started
        if on_done is not None:
            on_done(res)
        return res

    try:
        return list(await asyncio.gather(*(one(r) for r in refs)))
    finally:
        await converts.aclose()


def _is_ready(ref: str) -> bool:
    """True when ``ref`` needs no conversion (a directory, or already in the cache)."""
    if not is_convertible_source(ref):
        return True
    try:
        return (image_cache_dir() / f"unpacked-{source_key(ref)}" / ".raas").is_dir()
    except RaasError:
        return False
