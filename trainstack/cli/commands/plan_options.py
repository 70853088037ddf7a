"""Options and rendering shared by the recipe commands (plan, recipes, show, validate)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from trainstack.planner import Plan

RecipeArg = Annotated[
    str,
    typer.Argument(
        help="A base recipe name (see `trainstack recipes`), a team variant's name with --team, "
        "or a path to a YAML file.",
        show_default=False,
    ),
]
TeamOpt = Annotated[
    str | None,
    typer.Option(
        "--team",
        "-t",
        help="Layer recipes/teams/<TEAM>/defaults.yaml and recipes/teams/<TEAM>/<RECIPE>.yaml on top.",
    ),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        metavar="KEY=VALUE",
        help="Override one value last, e.g. --set training.micro_batch=4 "
        "(repeatable; values parsed as YAML).",
    ),
]
RecipesDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--recipes-dir",
        envvar="TRAINSTACK_RECIPES_DIR",
        exists=True,  # a mistyped directory must not pass `validate` with nothing to check
        file_okay=False,
        help="Directory holding base recipes and teams/ (default: the repository's recipes/).",
    ),
]


PLAN_WIDTH = 120  # every panel of `trainstack plan` (and `recipes`) fits this many columns


def console(max_width: int | None = None):
    """A rich console; wide enough for the tables when output is piped (rich would assume 80), and at
    most `max_width` columns when given."""
    import os
    import shutil
    import sys

    from rich.console import Console

    piped = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    width = 140 if piped else None
    if max_width is not None:
        width = max_width if piped else min(max_width, shutil.get_terminal_size((max_width, 24)).columns)
    return Console(width=width)


def gib(value: float) -> str:
    return f"{value:,.1f}"


def duration(hours: float) -> str:
    if hours < 1:
        return f"{hours * 60:.0f} min"
    if hours < 48:
        return f"{hours:.1f} h"
    return f"{hours / 24:.1f} days"


def duration_range(hours: float, low: float, high: float) -> str:
    """'26.2 days (23.4-29.1 days)', '41.0 h (36.0-48.0 h)', '30 min (25-34 min)'."""
    if hours < 1:
        return f"{hours * 60:.0f} min ({low * 60:.0f}-{high * 60:.0f} min)"
    if hours < 48:
        return f"{hours:.1f} h ({_tenths(low)}-{_tenths(high)} h)"
    return f"{hours / 24:.1f} days ({_tenths(low / 24)}-{_tenths(high / 24)} days)"


def _tenths(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _short(x: float) -> str:
    return f"{x:,.0f}" if x >= 10 else f"{x:.1f}"


def rate(value: float, low: float, high: float) -> str:
    """'29.0k (24-31k)': the figure with one decimal in its unit, the range with two significant digits."""
    unit, scale = ("M", 1e6) if high >= 1e6 else ("k", 1e3) if high >= 1e3 else ("", 1.0)
    return f"{value / scale:,.1f}{unit} ({_short(low / scale)}-{_short(high / scale)}{unit})"


def usd_range(value: float, low: float, high: float) -> str:
    """'286,271 USD (257-319k)'."""
    scale, unit = (1e6, "M") if high >= 1e7 else (1e3, "k") if high >= 1e4 else (1.0, "")
    return f"{value:,.0f} USD ({_short(low / scale)}-{_short(high / scale)}{unit})"


def storage_line(storage) -> str:
    """'0.36 TiB each, 257 written over the run (92 TiB in all), 3 kept, pruned ones removed after 1-2
    days: 5.0 TiB-months (2.2-11), 117 USD (52-254); leaves 1.1 TiB, 25 USD/month'."""
    low, high = storage.tib_months_range
    first, last = storage.pruned_days
    return (
        f"{storage.checkpoint_tib:,.2f} TiB each, {storage.written:,} written over the run "
        f"({storage.written_tib:,.0f} TiB in all), {storage.kept} kept, pruned ones removed after "
        f"{first:.0f}-{last:.0f} days: {storage.tib_months:,.1f} TiB-months ({_short(low)}-{_short(high)}), "
        + usd_range(storage.usd, *storage.usd_range)
        + f"; leaves {storage.left_tib:,.1f} TiB, {storage.left_usd_per_month:,.0f} USD/month"
    )


def _restart_text(run, cost) -> str:
    """'16 min (7-41) from a job's end to the next job's first step (decision 1, ...); 7 min of it
    billed: 105 USD (50-272) per restart, 0.5 expected'. Each part's source: `plan --json`, run.restart."""
    low, high = cost.usd_per_restart_range
    return (
        f"{run.restart.describe()}; {run.restart.billed_seconds / 60:.0f} min of it billed: "
        f"{usd_range(cost.usd_per_restart, low, high)} per restart, {run.restarts:.1f} expected"
    )


def set_command(command: str, flags: tuple[str, ...]) -> list[str]:
    """A shell command with one `--set` per line (continued with a backslash), so it pastes whole."""
    if not flags:
        return [command]
    last = len(flags) - 1
    return [f"{command} \\"] + [f"    {flag}" + (" \\" if i < last else "") for i, flag in enumerate(flags)]


def verdict_word(plan: Plan) -> str:
    if not plan.fits:
        return "DOES NOT FIT"
    return "TIGHT" if plan.memory.peak_gib > plan.memory.budget_gib else "FITS"


def print_plan(plan: Plan, title: str, command: str, measured: tuple[str, ...] = ()) -> None:
    """The plan as tables, each within PLAN_WIDTH columns. `command` is how to re-run it (for fixes);
    `measured`: lines of what tuning runs measured (trainstack.tuning), printed before the verdict."""
    from rich.table import Table

    from trainstack.planner.run_plan import EXIT_MARGIN_S

    out = console(PLAN_WIDTH)
    mem, thr, cost, run = plan.memory, plan.throughput, plan.cost, plan.run
    table = Table(title=f"{title}: memory per GPU", title_justify="left", show_footer=True)
    table.add_column("component", footer="peak / usable")
    table.add_column("GiB", justify="right", footer=f"{gib(mem.peak_gib)} / {gib(mem.usable_gib)}")
    table.add_column("share", justify="right", footer=f"{mem.utilisation:.0%}")
    for name, value in mem.breakdown.items():
        style = "bold red" if name == mem.breaking_component else None
        table.add_row(name, gib(value), f"{value / mem.peak_gib:.0%}", style=style)
    out.print(table)

    perf = Table(title="throughput, time and cost", title_justify="left", show_header=False)
    perf.add_column("what", no_wrap=True)
    perf.add_column("value", overflow="fold")
    low, high = thr.tokens_per_sec_per_gpu_range
    share = ", ".join(
        f"{kind} {seconds / thr.step_time_s:.0%}"
        for kind, seconds in sorted(thr.seconds_by_kind.items(), key=lambda kv: -kv[1])
        if seconds / thr.step_time_s >= 0.02
    )
    gain = ""
    if thr.fp8_gain is not None:
        capped = " (capped at the published gain for this size)" if "FP8 gain cap" in thr.limited_by else ""
        gain = f"{thr.fp8_gain - 1:+.0%} over BF16, cap {thr.fp8_gain_cap - 1:+.0%}{capped}"
    bound = "; at the bound" if "sanity bound" in thr.limited_by else ""
    ck = run.checkpoint
    rows = [
        ("GPUs", f"{plan.gpus} ({cost.instance_count} x {cost.instance_type})"),
        ("parameters", f"{plan.params / 1e9:.2f} B"),
        (
            "FLOPs per token",
            f"{thr.flops_per_token / 1e9:.1f} GFLOP model + {thr.recompute_flops_per_token / 1e9:.1f} "
            f"recompute ({thr.flops_formula})",
        ),
        ("tokens/s per GPU", rate(thr.tokens_per_sec_per_gpu, low, high)),
        ("tokens/s (job)", rate(thr.tokens_per_sec, low * plan.gpus, high * plan.gpus)),
        (
            "TFLOP/s per GPU",
            f"{thr.model_tflops_per_gpu:,.0f} model, {thr.achieved_tflops_per_gpu:,.0f} with recompute "
            f"(bound {thr.bound_tflops:,.0f}: best published B200 run{bound})",
        ),
        ("MFU", f"{thr.mfu:.1%} of {thr.peak_tflops:,.0f} TFLOP/s dense peak"),
        *([("FP8", gain)] if gain else []),
        ("step", f"{thr.step_time_s:.2f} s, {thr.grad_accum_steps} micro-steps: {share}"),
        ("token budget", f"{cost.tokens / 1e9:,.1f} B tokens, {cost.tokens / plan.params:,.0f} per param"),
        ("run", run.summary()),
        (
            "final save after SIGTERM",
            ("fits" if ck.sigterm_fits else "DOES NOT FIT")
            + f" SageMaker's 120 s: {ck.sigterm_seconds - ck.save_seconds:.0f} s of the step in flight + "
            f"{ck.save_seconds:.0f} s save, of {ck.sigterm_budget_seconds:.0f} s "
            f"({EXIT_MARGIN_S:.0f} s kept for the exit)",
        ),
        *([("restart", _restart_text(run, cost))] if run.restart else []),
        ("instance hours", duration_range(cost.hours, *cost.hours_range) + " per node, overheads included"),
        (
            "cost",
            f"{cost.usd_per_hour:,.0f} USD/h, "
            + usd_range(cost.total_usd, *cost.total_usd_range)
            + (f", checkpoint storage included ({cost.storage_usd:,.0f} USD)" if plan.storage else ""),
        ),
        *([("checkpoint storage", storage_line(plan.storage))] if plan.storage else []),
    ]
    if plan.validation is not None:
        rows.append(("validation", plan.validation.summary() + ", counted in the hours and cost"))
    if plan.inputs is not None:
        rows.append(("data input", plan.inputs.summary()))
    if run.expected_failures >= 0.05:
        rows.append(
            (
                "failures",
                f"{run.expected_failures:.1f} expected ({run.spot_interruptions:.1f} from spot), "
                f"{run.failure_hours:.1f} h of restarts and lost work",
            )
        )
    for what, value in rows:
        perf.add_row(what, value)
    out.print(perf)
    out.print(f"price: {cost.price_source} ({cost.price_date})", style="dim", markup=False, highlight=False)
    for line in plan.assumptions:
        if not line.startswith("price:"):
            out.print(line, style="dim", markup=False, highlight=False)

    _print_recommendation(out, plan, command)
    for line in measured:
        out.print(line, markup=False, highlight=False)
    style = {"FITS": "bold green", "TIGHT": "bold yellow"}.get(verdict_word(plan), "bold red")
    detail = plan.verdict.split(": ", 1)[1].split("; fix: ", 1)[0]
    out.print(f"{verdict_word(plan)}: {detail}", style=style, markup=False, highlight=False)
    if not plan.fits:
        flags = plan.recommendations.set_flags
        fix = " ".join(flags) if flags else plan.memory.fix
        out.print(f"fix: {fix}", style=style, markup=False, highlight=False)


def _print_recommendation(out, plan: Plan, command: str) -> None:
    from rich.table import Table

    rec = plan.recommendations
    within = (
        ""
        if rec.deadline_hours == float("inf")
        else f" and finish training within {rec.deadline_hours:,.0f} h"
    )
    out.print(
        f"recommendation: the most tokens per dollar among {rec.considered} layouts that fit{within}; "
        "ties (within 3%) go to fewer nodes, then a shard group inside one node, then the larger micro-batch",
        style="bold",
        markup=False,
        highlight=False,
    )
    if rec.recommended is not None:
        table = Table()
        table.add_column("knob")
        table.add_column("recipe", justify="right")
        table.add_column("recommended", justify="right")
        table.add_column("", justify="center")
        for change in rec.changes:
            mark, style = ("matches", "green") if change.matches else ("change", "yellow")
            table.add_row(
                change.field, change.recipe, change.recommended, mark, style=None if change.matches else style
            )
        out.print(table)
        mine, best = rec.recipe_layout, rec.recommended
        if rec.set_flags:
            out.print(
                f"tokens per dollar {rec.tokens_per_usd_gain:+.1%} ({mine.tokens_per_sec_per_gpu:,.0f} -> "
                f"{best.tokens_per_sec_per_gpu:,.0f} tokens/s per GPU, {mine.hours:,.0f} -> "
                f"{best.hours:,.0f} h of training); to apply:",
                markup=False,
                highlight=False,
            )
            for line in set_command(command, rec.set_flags):
                out.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)
        else:
            out.print("the recipe already matches the recommendation", style="green")
    out.print(f"precision: {rec.precision} ({rec.precision_reason})", markup=False, highlight=False)
    for note in rec.notes:
        out.print(f"note: {note}", markup=False, highlight=False)
