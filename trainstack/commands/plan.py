"""`trainstack plan RECIPE`: memory verdict, throughput and cost before any GPU is paid for."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from trainstack.commands.plan_options import RecipeArg, RecipesDirOpt, SetOpt, TeamOpt


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)


def plan(
    recipe: RecipeArg,
    team: TeamOpt = None,
    set_: SetOpt = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the plan as JSON (same fields as the Plan object).")
    ] = False,
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            metavar="FILE.png",
            help="Also write a PNG of the memory breakdown across micro-batch sizes.",
        ),
    ] = None,
    recipes_dir: RecipesDirOpt = None,
) -> None:
    """Plan a recipe: per-GPU memory breakdown and verdict, tokens/s, MFU, time and cost, advice.

    Exit status: 0 fits, 1 does not fit, 2 invalid input.

    Examples:

      trainstack plan 30b-fp8

      trainstack plan 8b-fp8 --team nlp --set training.micro_batch=4 --json

      trainstack plan 64b-fp8 --plot mem.png
    """
    from trainstack.commands.plan_options import print_plan
    from trainstack.loader import resolve
    from trainstack.planner import plan as make_plan

    resolved = resolve(recipe, team=team, overrides=set_ or (), recipes_dir=recipes_dir)
    result = make_plan(resolved.recipe)
    if plot is not None:
        from trainstack.commands.plan_plot import write_memory_plot

        write_memory_plot(resolved.recipe, plot)
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    else:
        title = resolved.recipe.name + (f" (team {team})" if team else "")
        print_plan(result, title)
        if plot is not None:
            typer.echo(f"wrote {plot}")
    from trainstack import budget, request_check

    budget.enforce(resolved, result)  # over a team cap: the plan above, then one line and exit 2
    request_check.enforce(resolved)  # a request AWS would refuse: likewise (trainstack.request_check)
    raise typer.Exit(0 if result.fits else 1)
