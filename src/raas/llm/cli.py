"""``raas llm ...`` and ``raas tokenizer ...`` commands."""

from __future__ import annotations

import typer

llm_app = typer.Typer(no_args_is_help=True)
tokenizer_app = typer.Typer(no_args_is_help=True)
