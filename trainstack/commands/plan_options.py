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


def console():
    """A rich console; wide enough for the tables when output is piped (rich would assume 80)."""
    import os
    import sys

    from rich.console import Console

    piped = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(width=140 if piped else None)


def gib(value: float) -> str:
    return f"{value:,.1f}"


def duration(hours: float) -> str:
    if hours < 1:
        return f"{hours * 60:.0f} min"
    if hours < 48:
        return f"{hours:.1f} h"
    return f"{hours / 24:.1f} days"


def print_plan(plan: Plan, title: str) -> None:
    from rich.table import Table

    out = console()
    mem, thr, cost, rec = plan.memory, plan.throughput, plan.cost, plan.recommendations
    table = Table(title=f"{title}: memory per GPU", title_justify="left", show_footer=True)
    table.add_column("component", footer="peak / usable")
    table.add_column("GiB", justify="right", footer=f"{gib(mem.peak_gib)} / {gib(mem.usable_gib)}")
    table.add_column("share", justify="right", footer=f"{mem.utilisation:.0%}")
    for name, value in mem.breakdown.items():
        style = "bold red" if name == mem.breaking_component else None
        table.add_row(name, gib(value), f"{value / mem.peak_gib:.0%}", style=style)
    out.print(table)

    perf = Table(title="throughput and cost", title_justify="left", show_header=False)
    perf.add_column("what")
    perf.add_column("value", justify="right")
    rows = [
        ("GPUs", f"{plan.gpus} ({cost.instance_count} x {cost.instance_type})"),
        ("parameters", f"{plan.params / 1e9:.2f} B"),
        ("FLOPs per token", f"{thr.flops_per_token / 1e9:.1f} GFLOP ({thr.flops_formula})"),
        ("recompute FLOPs per token", f"{thr.recompute_flops_per_token / 1e9:.1f} GFLOP"),
        ("tokens/s per GPU", f"{thr.tokens_per_sec_per_gpu:,.0f}"),
        ("tokens/s (job)", f"{thr.tokens_per_sec:,.0f}"),
        ("model TFLOP/s per GPU", f"{thr.model_tflops_per_gpu:,.0f} of {thr.peak_tflops:,.0f} peak"),
        ("MFU", f"{thr.mfu:.1%}"),
        ("step time", f"{thr.step_time_s:.2f} s ({thr.grad_accum_steps} micro-steps)"),
        ("token budget", f"{cost.tokens / 1e9:,.1f} B tokens"),
        ("time", duration(cost.hours)),
        ("cost", f"{cost.usd_per_hour:,.0f} USD/h, {cost.total_usd:,.0f} USD total"),
    ]
    for what, value in rows:
        perf.add_row(what, value)
    out.print(perf)
    out.print(f"price: {cost.price_source}", style="dim", markup=False, highlight=False)

    advice = [
        f"largest micro-batch within {plan.memory.budget_gib:.0f} GiB (10% headroom): "
        f"{rec.max_micro_batch or 'none'}",
        f"lightest checkpointing that fits: {rec.lightest_checkpointing or 'none fits'}",
        f"smallest shard group that fits: {rec.smallest_shard_group or 'none fits'}",
        f"precision: {rec.precision} ({rec.precision_reason})",
        *rec.notes,
    ]
    out.print("recommendations:", style="bold")
    for line in advice:
        out.print(f"  - {line}", markup=False, highlight=False)
    style = "bold green" if plan.fits else "bold red"
    out.print(
        ("FITS" if plan.fits else "DOES NOT FIT") + ": " + plan.verdict,
        style=style,
        markup=False,
        highlight=False,
    )
