"""`trainstack recipes`: every base recipe and team variant with its size, layout and verdict."""

from __future__ import annotations

from typing import Annotated

import typer

from trainstack.cli.commands.plan_options import PLAN_WIDTH, RecipesDirOpt, console, duration, rate


def register(app: typer.Typer) -> None:
    app.command("recipes")(recipes)


def recipes(
    team: Annotated[
        str | None, typer.Option("--team", "-t", help="Only this team's view of the recipes.")
    ] = None,
    recipes_dir: RecipesDirOpt = None,
) -> None:
    """List base recipes (and each team's overrides and variants) with size, precision, nodes and verdict.

    Example: trainstack recipes --team nlp

    Exit status 2 if any recipe is invalid (it is listed with its error).
    """
    from rich.table import Table

    from trainstack.cli.commands.plan_options import verdict_word
    from trainstack.errors import TrainstackError
    from trainstack.planner import plan
    from trainstack.recipes.loader import (
        TEAM_DEFAULTS,
        base_recipe_names,
        recipes_dir_or_default,
        resolve,
        team_names,
        team_recipe_names,
    )

    root = recipes_dir_or_default(recipes_dir)
    if team is not None and team not in team_names(root):
        raise TrainstackError(
            f"{root / 'teams'}: team: unknown team {team!r} (known: {', '.join(team_names(root))})"
        )
    entries: list[tuple[str, str | None]] = [(name, None) for name in base_recipe_names(root)]
    for t in [team] if team else team_names(root):
        # Without --team, list only what a team changed per recipe; with it, everything the team deploys
        # (the base recipes its defaults select with `recipes:`, and its own variants).
        if team:
            entries += [(name, t) for name in team_recipe_names(t, root)]
        else:
            own = sorted(p.stem for p in (root / "teams" / t).glob("*.yaml") if p.name != TEAM_DEFAULTS)
            entries += [(name, t) for name in own]

    table = Table(title=f"recipes in {root}", title_justify="left")
    for column, justify in (
        ("recipe", "left"),
        ("team", "left"),
        ("params", "right"),
        ("prec", "left"),
        ("nodes", "right"),
        ("mb", "right"),
        ("ckpt", "left"),
        ("shard", "right"),
        ("GiB", "right"),
        ("tok/s/GPU", "right"),
        ("time", "right"),
        ("verdict", "left"),
    ):
        table.add_column(column, justify=justify, no_wrap=column not in ("verdict",))  # type: ignore[arg-type]
    invalid = 0
    rows = []
    for name, t in entries:
        try:
            r = resolve(name, team=t, recipes_dir=root).recipe
        except TrainstackError as error:
            invalid += 1
            rows.append((float("inf"), (name, t or "", *[""] * 10, f"invalid: {error}"), "red"))
            continue
        try:
            p = plan(r)
        except TrainstackError as error:  # e.g. a checkpoint interval shorter than one save
            invalid += 1
            rows.append((float("inf"), (name, t or "", *[""] * 10, f"invalid: {error}"), "red"))
            continue
        thr = p.throughput
        rows.append(
            (
                r.model.total_params,
                (
                    name,
                    t or "",
                    f"{r.model.total_params / 1e9:.1f}B",
                    r.precision.fp8_recipe or r.precision.dtype,
                    f"{r.compute.instance_count}x{r.instance.gpus}",
                    str(r.training.micro_batch),
                    activation_label(r),
                    str(r.parallelism.shard_group),
                    f"{p.memory.peak_gib:.1f}",
                    rate(thr.tokens_per_sec_per_gpu, *thr.tokens_per_sec_per_gpu_range),
                    duration(p.run.hours).replace(" days", " d"),
                    verdict_word(p).lower() if p.fits else "DOES NOT FIT",
                ),
                None if p.fits else "red",
            )
        )
    for _, cells, style in sorted(rows, key=lambda row: (row[1][1], row[0], row[1][0])):
        table.add_row(*cells, style=style)
    console(PLAN_WIDTH).print(table)
    if invalid:
        raise typer.Exit(2)


def activation_label(recipe) -> str:
    from trainstack.planner import checkpointing_label

    return checkpointing_label(recipe.activation_checkpointing)
