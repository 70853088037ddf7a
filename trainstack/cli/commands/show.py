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
    from trainstack.recipes.loader import resolve

    resolved = resolve(recipe, team=team, overrides=set_ or (), recipes_dir=recipes_dir)
    if not quiet:
        from trainstack.planner import plan, sanity

        sanity.print_warnings(resolved, plan(resolved.recipe))
    values = flatten(resolved.recipe.model_dump(mode="json"))
    tuned = tuned_line(resolved.recipe.name, team)
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "recipe": resolved.recipe.model_dump(mode="json"),
                    "sources": {path: resolved.source_of(path) for path in values},
                    "files": list(resolved.files),
                    "tuned": tuned,
                },
                indent=2,
            )
        )
        return
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


def tuned_line(recipe: str, team: str | None) -> str | None:
    """Where the recipe's tuned layout comes from: "chosen by tuning run X on <date>: 1.18x tokens per
    dollar over the recipe's layout (--set ...)", from the tuning store; None when it was never tuned."""
    from trainstack.tuning.store import Store

    result = Store().latest_result(recipe, team)
    if result is None or result.get("overrides") is None:
        return None
    gain = result.get("gain")
    versus = (
        f"{gain:.2f}x tokens per dollar over the recipe's layout"
        if gain
        else "the recipe's layout did not complete"
    )
    flags = " ".join(f"--set {o}" for o in result["overrides"]) or "the recipe's own layout"
    return (
        f"chosen by tuning run {result['run']} on {result['date']} ({result['hardware']['instance_type']}, "
        f"{result['hardware']['gpu']}): {versus} ({flags}); `trainstack launch --tuned` uses it"
    )


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    """Dotted leaf paths, as the loader records sources (tags.extra stays one value)."""
    out: dict[str, object] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and key != "extra":
            out.update(flatten(value, f"{path}."))
        else:
            out[path] = value
    return out
