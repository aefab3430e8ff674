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


def set_trainable_layers(model: Any, layers: int | None) -> int:
    """Train only the top ``layers`` decoder layers and the final norm (None: every parameter); returns
    the number of trainable parameters.

    Why: on 2 CPU cores a multi-turn row of ~800 tokens costs ~4.7 s forward and backward with every
    layer trained, ~2.6 s with the top 20 of SmolLM2's 30 (measured), and the frozen layers keep no
    activations and no optimizer state. The embedding (tied to the LM head) is frozen with them, as the
    layers below read it."""
    for p in model.parameters():
        p.requires_grad_(layers is None)
    if layers is not None:
        blocks = list(model.model.layers)
        if not 1 <= layers <= len(blocks):
            from raas.errors import RaasError

            raise RaasError(f"trainable_layers must be in 1..{len(blocks)}, got {layers}", kind="bad_request")
        for block in blocks[len(blocks) - layers :]:
            for p in block.parameters():
                p.requires_grad_(True)
        for p in model.model.norm.parameters():
            p.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def activation_budget(model: Any, tokens: int, layers: int | None) -> int:
    """Token positions a micro-batch may keep activations for: ``tokens`` when every layer trains, more
    in proportion when only the top ``layers`` do (the frozen ones keep none)."""
    total = len(model.model.layers)
    return tokens * total // (layers or total)
