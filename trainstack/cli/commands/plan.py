"""`trainstack plan RECIPE`: memory verdict, throughput and cost before any GPU is paid for."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from trainstack.cli.commands.plan_options import RecipeArg, RecipesDirOpt, SetOpt, TeamOpt


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)


def plan(
    recipe: RecipeArg,
    team: TeamOpt = None,
    set_: SetOpt = None,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print the plan as JSON (same fields as the Plan object; with --compare, the rows).",
        ),
    ] = False,
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            metavar="FILE.png",
            help="Also write a PNG: memory by component across micro-batch sizes, tokens/s with its range.",
        ),
    ] = None,
    compare: Annotated[
        bool,
        typer.Option(
            "--compare",
            help="Re-plan on every catalogued instance type, each with the layout the recommender picks "
            "there for the same planned time; one row each.",
        ),
    ] = False,
    recipes_dir: RecipesDirOpt = None,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="No warnings about values that look wrong.")
    ] = False,
    local: Annotated[
        bool,
        typer.Option(
            "--local",
            help="Beside the arithmetic, the figures measured by `trainstack tune --local` (CPU jobs) "
            "instead of those measured on the recipe's instance type: a CPU measurement never changes a "
            "GPU plan.",
        ),
    ] = False,
    ranks: Annotated[
        int | None,
        typer.Option(
            "--ranks",
            min=1,
            max=8,
            help="--local: the CPU processes per job measured (default: as many as an emulator job "
            "of the recipe runs, as `tune --local` measures them there, else 1).",
        ),
    ] = None,
    trace: Annotated[
        bool,
        typer.Option(
            "--trace",
            help="Also run the trainer's own step at full size on fake tensors (python -m trainer.trace: "
            "two steps under torch's FSDP memory tracker, about a minute for 8B on a laptop CPU; cached) and "
            "judge memory by it: traced + modelled (what a trace cannot see) against the GPU.",
        ),
    ] = False,
) -> None:
    """Plan a recipe: per-GPU memory breakdown and verdict, tokens/s, MFU, time and cost with their
    ranges, the run (jobs, checkpoints), and one recommendation beside the recipe's own values.

    Every tokens/s, hours and cost figure carries a range from the calibration's leave-one-out errors
    and the published runs that bracket the GPU (docs/planner.md). A recommended change is printed as
    --set flags that can be pasted. Values that are legal but almost surely wrong (learning rate, warmup,
    batch against the token budget, volume) are warned about on stderr (--quiet: not).

    Exit status: 0 fits, 1 does not fit, 2 invalid input (or over a team's budget cap, or a request
    AWS would refuse).

    Examples:

      trainstack plan 30b-fp8

      trainstack plan 8b-fp8 --team nlp --set training.micro_batch=2 --json

      trainstack plan 64b-fp8 --plot mem.png

      trainstack plan 30b-fp8 --compare
    """
    from trainstack import api
    from trainstack.cli.commands.plan_options import print_plan

    warn = None if quiet else _stderr  # legal but almost surely wrong; exit status unchanged
    if compare:
        compared = api.compare(
            recipe,
            team=team,
            overrides=set_ or (),
            local=local,
            recipes_dir=recipes_dir,
            enforce=False,
            on_warning=warn,
        )
        _print_compare(compared, as_json)
        compared.enforce()  # over a team cap, a request AWS would refuse, a base of another shape: exit 2
        raise typer.Exit(0 if compared.fits else 1)
    make = api.trace if trace else api.plan
    planned = make(
        recipe,
        team=team,
        overrides=set_ or (),
        local=local,
        ranks=ranks,
        recipes_dir=recipes_dir,
        enforce=False,
        on_warning=warn,
    )
    if plot is not None:
        from trainstack.cli.commands.plan_plot import write_memory_plot

        write_memory_plot(planned.recipe, plot)
    if trace and planned.trace_note and not as_json:
        typer.echo(planned.trace_note, err=True)
    if as_json:
        typer.echo(planned.to_json())
    else:
        _print_plan_text(planned, recipe, team, set_ or [], print_plan)
        for line in planned.trace_lines:
            typer.echo(line)
        if plot is not None:
            typer.echo(f"wrote {plot}")
    planned.enforce()  # over a team cap: the plan above, then one line and exit 2 (likewise AWS, the base)
    raise typer.Exit(planned.exit_code)


def _stderr(line: str) -> None:
    typer.echo(line, err=True)


def _print_plan_text(planned, recipe: str, team: str | None, sets: list[str], print_plan) -> None:
    tuning, measured = planned.tuning_run, planned.measured
    title = planned.recipe.name + (f" (team {team})" if team else "")
    lines = [
        f"tuning run: 3 candidates cost about {tuning['usd']:,.2f} USD of short jobs on these nodes "
        "(trainstack tune; docs/tuning.md)"
    ]
    if measured is not None:
        lines.append(
            f"measured: step {measured['step_time_s']:.4g} s"
            + (" of CPU time" if measured["clock"] == "cpu" else "")
            + f", {measured['tokens_per_s']:,.0f} tokens/s per GPU on {measured['hardware']} "
            f"(planned {measured['planned_step_time_s']:.4g} s): {measured['source']}"
        )
    lines += planned.fine_tuning_lines  # a fine-tune: its epochs over the chat set, or why not priced
    print_plan(planned.plan, title, planned.rerun_command(recipe, team, sets), tuple(lines))


def _print_compare(compared, as_json: bool) -> None:
    from rich.table import Table

    from trainstack.cli.commands.plan_options import PLAN_WIDTH, console, duration_range, rate, usd_range

    if as_json:
        typer.echo(compared.to_json())
        return
    rows, recipe = compared.rows, compared.resolved.recipe
    table = Table(
        title=f"{recipe.name} on every instance type (each with its recommended layout, for the same time)",
        title_justify="left",
    )
    for column, justify in (
        ("instance type", "left"),
        ("nodes", "right"),
        ("layout", "left"),
        ("fits", "left"),
        ("tokens/s per GPU", "right"),
        ("hours per node", "right"),
        ("total cost", "right"),
    ):
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for row in rows:
        name = row.instance_type + (" (recipe)" if row.is_recipe_instance else "")
        if row.nodes is None:
            table.add_row(name, "-", row.layout, "no", "-", "-", "-", style="red")
            continue
        table.add_row(
            name,
            str(row.nodes),
            row.layout,
            "yes" if row.fits else "NO",
            rate(row.tokens_per_sec_per_gpu, *row.tokens_per_sec_per_gpu_range),
            duration_range(row.hours, *row.hours_range),
            usd_range(row.total_usd, *row.total_usd_range),
        )
    out = console(PLAN_WIDTH)
    out.print(table)
    for row in rows:
        out.print(
            f"{row.instance_type}: {row.usd_per_instance_hour:,.2f} USD per instance-hour "
            f"({row.price_source})" + (f"; {row.note}" if row.note else ""),
            style="dim",
            markup=False,
            highlight=False,
        )
