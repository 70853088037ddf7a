"""`trainstack plan RECIPE`: memory verdict, throughput and cost before any GPU is paid for."""

from __future__ import annotations

import json
import shlex
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
    from trainstack.cli.commands.plan_options import print_plan
    from trainstack.errors import RecipeError
    from trainstack.planner import plan as make_plan
    from trainstack.planner.run_plan import IntervalError
    from trainstack.recipes.loader import resolve

    resolved = resolve(recipe, team=team, overrides=set_ or (), recipes_dir=recipes_dir)
    try:
        result = make_plan(resolved.recipe)
    except IntervalError as error:  # name the file that set the interval
        raise RecipeError(resolved.source_of(error.field), error.field, error.message) from None
    from trainstack.planner import sanity

    sanity.print_warnings(resolved, result, quiet)  # legal but almost surely wrong; exit status unchanged
    if compare:
        _compare(resolved.recipe, result, as_json)
    else:
        if plot is not None:
            from trainstack.cli.commands.plan_plot import write_memory_plot

            write_memory_plot(resolved.recipe, plot)
        measured = _measured(resolved.recipe, local, ranks)
        traced, trace_lines = _traced(resolved.recipe, result, as_json) if trace else (None, ())
        from trainstack.tuning.engine import tuning_estimate_usd

        tuning = {"candidates": 3, "usd": round(tuning_estimate_usd(resolved.recipe, 3), 2)}
        if as_json:
            document = {**result.to_dict(), "measured": measured, "tuning_run": tuning}
            if trace:
                document["memory"]["traced"] = traced
            typer.echo(json.dumps(document, indent=2))
        else:
            title = resolved.recipe.name + (f" (team {team})" if team else "")
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
            print_plan(
                result,
                title,
                _command(recipe, team, set_ or [], result.recommendations.set_flags),
                tuple(lines),
            )
            for line in trace_lines:
                typer.echo(line)
            if plot is not None:
                typer.echo(f"wrote {plot}")
    from trainstack.aws import request_check
    from trainstack.planner import budget

    budget.enforce(resolved, result)  # over a team cap: the plan above, then one line and exit 2
    request_check.enforce(resolved)  # a request AWS would refuse: likewise (trainstack.aws.request_check)
    from trainstack.aws.base_model import check_for_plan

    check_for_plan(resolved.recipe, local)  # model.init_from's config.json against the shape: likewise
    fits = result.fits if not (trace and traced and "fits" in traced) else traced["fits"]
    raise typer.Exit(0 if fits else 1)


def _traced(recipe, result, as_json: bool) -> tuple[dict | None, tuple[str, ...]]:
    """`--trace`: the trace's memory with the modelled terms (trainstack.planner.traced) as
    `memory.traced`, and the lines printed after the plan, the verdict on traced + modelled last. A
    layout the trace cannot follow: the knob named, and the planner's figure stands, labelled so."""
    from trainstack.errors import TrainstackError
    from trainstack.planner.traced import counted_flops, traced_memory
    from trainstack.tuning.trace import run_trace

    outcome = run_trace(recipe)
    if outcome.error is not None:
        raise TrainstackError(outcome.error)
    if outcome.report is None:
        knob, reason = outcome.unsupported["knob"], outcome.unsupported["reason"]
        line = (
            f"trace: could not follow {knob} ({reason}); memory is the planner's, not traced: "
            f"{result.memory.peak_gib:.1f} GiB of {result.memory.usable_gib:.0f}"
        )
        if not as_json:
            typer.echo(line, err=True)
        return {"fallback": "planner", "knob": knob, "reason": reason}, ()
    from trainstack.planner import recipe_memory

    # The unrounded breakdown (the plan's is rounded to MiB: a CPU test's tiny model would plan 0).
    memory = traced_memory(
        recipe, recipe_memory(recipe), result.memory.usable_gib, outcome.report, cached=outcome.cached
    )
    flops = counted_flops(outcome.report, result.throughput)
    document = {**memory.to_json(), "counted_flops": flops}
    categories = ", ".join(f"{k} {v:.1f}" for k, v in memory.by_category_gib.items())
    modelled = ", ".join(f"{k} {v:.2f}" for k, v in memory.modelled.items())
    at = memory.peak_at
    lines = [
        f"traced step ({'cached' if memory.cached else 'run'}, {memory.seconds:.0f} s to trace): "
        f"{categories} GiB; "
        f"peak in {at.get('phase', '?')} of {at.get('module', '?')} (step {at.get('step', '?')}, "
        f"micro-step {at.get('micro_step', '?')}); the planner's same-scope figure "
        f"{memory.planned_same_scope_gib:.1f} GiB "
        f"({memory.planned_same_scope_gib / memory.traced_gib - 1:+.1%})",
        f"modelled (not traceable; docs/planner.md): {modelled} GiB",
        *(f"note: {note}" for note in memory.notes),
    ]
    if flops:
        line = (
            f"FLOPs per token counted on the traced step: {flops['model_per_token'] / 1e9:.2f} G model + "
            f"{flops['recompute_per_token'] / 1e9:.2f} G recompute; formula "
            f"{flops['planned_model_per_token'] / 1e9:.2f}"
            f" + {flops['planned_recompute_per_token'] / 1e9:.2f} ({flops['difference']:+.1%})"
        )
        if flops["used"] == "counted":
            line += (
                f"; with the counted FLOPs: step {flops['step_time_s']:.2f} s, "
                f"{flops['tokens_per_sec_per_gpu']:,.0f} tokens/s per GPU, MFU {flops['mfu']:.1%}"
            )
        lines.append(line)
    lines.append(memory.verdict)
    return document, tuple(lines)


def _measured(recipe, local: bool, ranks: int) -> dict | None:
    """What tuning runs measured for this layout on the hardware planned for (trainstack.tuning.store):
    the recipe's instance type and GPU, or with --local the emulator's CPU jobs; None when nothing was."""
    from trainstack.tuning.store import Store, recipe_hardware, refit

    store = Store()
    if local:
        from trainstack.tuning.local import local_hardware

        # Without --ranks: the ranks an emulator job of the recipe runs (what `tune --local` measures
        # on the emulator), else 1 (`tune --local` without an emulator, its --ranks default).
        counts = [ranks] if ranks is not None else list(dict.fromkeys((_emulator_ranks(recipe), 1)))
        for count in counts:
            hardware = local_hardware(count)
            found = refit(recipe, hardware, store)
            if found is not None:
                break
    else:
        hardware = recipe_hardware(recipe)
        found = refit(recipe, hardware, store)
    if found is None:
        return None
    return {
        "step_time_s": found.step_time_s,
        "tokens_per_s": found.tokens_per_s,
        "peak_mem_gib": found.peak_gib,
        "planned_step_time_s": found.planned_step_time_s,
        "exact": found.exact,
        "clock": found.clock,
        "source": found.source,
        "hardware": hardware.describe(),
        "run": found.run,
        "date": found.date,
    }


def _emulator_ranks(recipe) -> int:
    """The ranks an emulator job of `recipe` runs (the count `tune --local` measured on the emulator
    records its figures under): a default of 1 found nothing after a tuning run on the emulator."""
    from trainstack.emulator import jobs as emulator_jobs
    from trainstack.emulator import stand_in

    nodes = recipe.compute.instance_count
    return stand_in.ranks_per_node(recipe, nodes, emulator_jobs.RANKS_PER_NODE) * nodes


def _command(recipe: str, team: str | None, sets: list[str], new_flags: tuple[str, ...]) -> str:
    """How to re-run this plan, keeping the user's own --set flags the recommendation does not replace."""
    replaced = {flag.split(" ", 1)[1].split("=", 1)[0] for flag in new_flags}
    words = ["trainstack", "plan", recipe] + (["--team", team] if team else [])
    for item in sets:
        if item.split("=", 1)[0].strip() not in replaced:
            words += ["--set", item]
    return shlex.join(words)


def _compare(recipe, own_plan, as_json: bool) -> None:
    from rich.table import Table

    from trainstack.cli.commands.plan_options import PLAN_WIDTH, console, duration_range, rate, usd_range
    from trainstack.planner.compare import compare

    rows = compare(recipe, own_plan)
    if as_json:
        typer.echo(json.dumps([row.to_dict() for row in rows], indent=2))
        return
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
