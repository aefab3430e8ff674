"""The ``raas`` command line: ``run``, ``serve`` and ``status`` (one module each), plus the sub-apps each
layer owns (``image``, ``llm``, ``tokenizer``).

``raas run builtin:math`` is the first command a new user types: with no ``--server`` and no ``--llm`` it
brings up everything in this process (the embedded llama.cpp model server, the rollout service on a free
port), runs the dataset over HTTP exactly as a trainer would, prints a summary, and tears it all down.
"""

from __future__ import annotations

from raas.cli.commands import app

__all__ = ["app"]
