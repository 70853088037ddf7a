"""`trainstack validate [PATHS...]`: every recipe and team file resolves and validates (the GitOps gate).
The checks are trainstack.api.validate's; this prints each as it passes and the errors at the end."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from trainstack.cli.commands.plan_options import RecipesDirOpt


def register(app: typer.Typer) -> None:
    app.command("validate")(validate)


def validate(
    paths: Annotated[
        list[Path] | None,
        typer.Argument(
            help="Recipe files, team files or directories (default: every recipe and team file).",
            show_default=False,
        ),
    ] = None,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Print only errors (no ok lines, no warnings).")
    ] = False,
    recipes_dir: RecipesDirOpt = None,
) -> None:
    """Validate recipes and team overrides: schema, layering, cross-field checks, fits in memory.

    A team's defaults.yaml is checked against every recipe the team can run; a base recipe against
    every team override of it. Values that are legal but almost surely wrong (learning rate, warmup,
    batch size, volume) are printed as warnings with their threshold; they do not change the exit status.
    Exit status 0 when all are valid, 2 otherwise (one line per error).

    Examples:

      trainstack validate

      trainstack validate recipes/teams/vision
    """
    from trainstack import api

    def stderr(line: str) -> None:
        typer.echo(line, err=True)

    result = api.validate(
        paths or (),
        recipes_dir=recipes_dir,
        on_progress=None if quiet else typer.echo,
        on_warning=None if quiet else stderr,
    )
    for found in result.invalid:
        where = f" [{', '.join(found.labels)}]" if found.labels else ""
        typer.echo(f"invalid {found.line}{where}", err=True)
    typer.echo(f"{len(result.valid)} valid, {result.invalid_count} invalid", err=not result.ok)
    if not result.ok:
        raise typer.Exit(result.exit_code)
