"""The trainer process's memory: what it holds now and at most (reported per step), and giving freed
memory back to the system.

glibc's allocator keeps freed memory in per-thread arenas for reuse; a trainer that allocates activations
of changing shapes on worker threads grows its resident set step after step although it frees every
tensor. :func:`release_memory` returns the free pages (``malloc_trim``) after each update.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import resource
import sys
from typing import Any


def rss_mb() -> tuple[float, float]:
    """(resident now, peak resident) of this process in MiB (Linux's ``VmRSS`` / ``VmHWM``; elsewhere the
    peak from ``getrusage`` for both)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024
    except (OSError, KeyError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (
            1024 if sys.platform != "darwin" else 1024**2
        )
        return peak, peak


@functools.cache
def _malloc_trim() -> object | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None)
    except OSError:
        return None


def release_memory() -> None:
    """Collect garbage, then hand the allocator's free pages back to the system (glibc only; a no-op
    elsewhere)."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)  # type: ignore[operator]


def set_checkpointing(model: Any, on: bool) -> None:
    """Activation checkpointing of a transformers model on or off for its next forward/backward: the
    activations of a long row are then recomputed layer by layer in the backward instead of kept."""
    if on and not model.is_activation_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif not on and model.is_activation_checkpointing:
        model.activation_checkpointing_disable()
