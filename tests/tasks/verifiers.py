"""Test-only verifier functions, run inside :mod:`raas.tasks.verify` worker processes."""

from __future__ import annotations

import os
import time
from pathlib import Path


def echo(value: object) -> object:
    return value


def pid() -> int:
    return os.getpid()


def sleep_forever(pid_file: str) -> None:
    """Write this worker's pid, then never return (a verifier hung on a pathological answer)."""
    Path(pid_file).write_text(str(os.getpid()))
    while True:
        time.sleep(3600)


def noisy(value: int) -> int:
    """A verifier that prints: its output must not corrupt the worker's answer stream."""
    print('{"ok": true, "result": "forged"}')
    print("more noise", flush=True)
    return value * 2


def boom() -> None:
    raise ValueError("the verifier itself failed")


def crash() -> None:
    os._exit(3)


def allocate(mb: int) -> int:
    return len(bytearray(mb * 1024 * 1024))
