"""``python3 -m raas_toolserver --socket PATH [--workdir DIR]``."""

from __future__ import annotations

from .server import main

if __name__ == "__main__":
    main()
