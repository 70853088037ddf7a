"""`trainstack show RECIPE --team T`: the resolved recipe and which file set each value."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from trainstack.cli.commands.output import console
from trainstack.cli.commands.plan_options import RecipeArg, RecipesDirOpt, SetOpt, TeamOpt


def register(app: typer.Typer) -> None:
    app.command("show")(show)


def show(
    recipe: RecipeArg,
    team: TeamOpt = None,
    set_: SetOpt = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print {recipe: ..., sources: ...} as JSON.")
    ] = False,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="No warnings about values that look wrong.")
    ] = False,
    recipes_dir: RecipesDirOpt = None,
) -> None:
    """Print the resolved recipe, one value per line, with the file (or --set, or default) that set it.

    Values that are legal but almost surely wrong are warned about on stderr (--quiet: not).
    Exit status: 0, or 2 on invalid input.

    Example: trainstack show 8b-fp8 --team nlp --set training.steps=100
    """
    from trainstack import api

    shown = api.show(
        recipe,
        team=team,
        overrides=set_ or (),
        recipes_dir=recipes_dir,
        warn=not quiet,
        on_warning=lambda line: typer.echo(line, err=True),
    )
    if as_json:
        typer.echo(shown.to_json())
        return
    resolved, values, tuned = shown.resolved, shown.values, shown.tuned
    from rich.table import Table

    table = Table(
        title=f"{resolved.recipe.name}"
        + (f" for team {team}" if team else "")
        + f" (files: {', '.join(resolved.files)})",
        title_justify="left",
    )
    table.add_column("key")
    table.add_column("value", overflow="fold")
    table.add_column("set by")
    for path, value in values.items():
        source = resolved.source_of(path)
        table.add_row(path, json.dumps(value), source, style="dim" if source == "default" else None)
    console().print(table)
    if tuned is not None:
        typer.echo(tuned)
