"""``python -m raas.cli``: the ``raas`` command."""

from __future__ import annotations

import sys

from raas.cli import app

sys.exit(app())
