"""The ``raas`` command line: one typer app composed of the sub-apps each layer owns."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="raas: Rollout-as-a-Service")


def _mount() -> None:
    """Attach each layer's commands; a layer owns its own ``cli.py``."""
    from raas.llm.cli import llm_app, tokenizer_app
    from raas.sandbox.cli import image_app

    app.add_typer(image_app, name="image", help="Build sandbox images.")
    app.add_typer(llm_app, name="llm", help="The embedded model server and LLM utilities.")
    app.add_typer(tokenizer_app, name="tokenizer", help="Chat-template checks.")


_mount()

if __name__ == "__main__":
    app()
