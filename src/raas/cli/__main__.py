"""``python -m raas.cli``: the ``raas`` command."""

from __future__ import annotations

import sys

from raas.cli import app

if __name__ == "__main__":
    sys.exit(app())
