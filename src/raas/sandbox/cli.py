"""``raas image ...`` commands."""

from __future__ import annotations

import typer

image_app = typer.Typer(no_args_is_help=True)
