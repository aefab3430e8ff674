"""IPython tool (placeholder until the kernel driver lands)."""

from __future__ import annotations


def ipython_available() -> bool:
    return False
