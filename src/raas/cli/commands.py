"""The Typer application: each subcommand lives in its own module and registers itself here."""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="raas: Rollout-as-a-Service")


def _mount() -> None:
    """Attach the commands; a layer owns its own ``cli.py``."""
    from raas.cli import run, serve, status, swe_cmd, train, view
    from raas.cli.cluster import cluster_app
    from raas.llm.cli import llm_app, tokenizer_app
    from raas.sandbox.cli import image_app
    from raas.tasks.swe.cli import app as swe_app
    from raas.tasks.swe.images_cli import images_app

    app.command()(run.run)
    app.command()(serve.serve)
    app.command()(status.status)
    app.command()(train.train)
    app.command()(view.view)
    app.add_typer(image_app, name="image", help="Build sandbox images.")
    app.add_typer(llm_app, name="llm", help="The embedded model server and LLM utilities.")
    app.add_typer(tokenizer_app, name="tokenizer", help="Chat-template checks.")
    swe_app.command("eval")(swe_cmd.swe_eval)
    app.add_typer(
        swe_app, name="swe", help="SWE tasks: grade patches (eval), build instances offline (build)."
    )
    app.add_typer(images_app, name="images", help="Pre-build the images a dataset's tasks need.")
    app.add_typer(cluster_app, name="cluster", help="raas on a Ray cluster: node services and the router.")


_mount()
