"""`trainstack status RECIPE [--team T] [--watch] [--local]`: the latest runs against their plan.

For each of the newest training jobs of the recipe: state and secondary state, step with a progress
bar toward the steps the job was launched with, tokens/s per GPU and MFU against the planner's
prediction (slow when below `monitoring.slow_fraction` of plan, the rule the Slow alarm applies), cost
so far and projected, and where its checkpoints go; sparklines of step, tokens/s and loss over the
job's metric history and an ETA against the plan (trainstack.aws.trends). Reads SageMaker and CloudWatch
only. Output fits 120 columns.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any

import typer

from trainstack.aws.run_status import (  # noqa: F401 (tests and other commands import them from here)
    Snapshot,
    latest_values,
    measured_restarts,
    metric_history,
)
from trainstack.cli.commands.plan_options import RecipeArg, RecipesDirOpt, SetOpt, TeamOpt, duration
from trainstack.cli.commands.status_panels import _eta, _pending_panel, _run_panel  # noqa: F401 (tests import)

if TYPE_CHECKING:
    from rich.console import RenderableType

LocalOpt = Annotated[
    bool,
    typer.Option(
        "--local",
        help="Use the local AWS emulator instead of AWS: AWS_ENDPOINT_URL, or the one "
        "`trainstack emulator start` (or `make demo`) started in this directory.",
    ),
]


def register(app: typer.Typer) -> None:
    app.command("status")(status)


def status(
    recipe: RecipeArg,
    team: TeamOpt = None,
    set_: SetOpt = None,
    watch: Annotated[
        bool, typer.Option("--watch", "-w", help="Refresh until the latest run ends (Ctrl-C stops).")
    ] = False,
    interval: Annotated[
        float, typer.Option("--interval", min=1.0, help="Seconds between refreshes with --watch.")
    ] = 30.0,
    count: Annotated[
        int,
        typer.Option("--count", min=0, help="With --watch: stop after this many refreshes (0: no limit)."),
    ] = 0,
    runs: Annotated[
        int, typer.Option("--runs", min=1, max=20, help="How many of the newest runs to show.")
    ] = 3,
    local: LocalOpt = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the runs as JSON (no --watch).")] = False,
    recipes_dir: RecipesDirOpt = None,
) -> None:
    """Show the newest runs of RECIPE: state, progress, throughput and MFU against plan, cost.

    Reads SageMaker and CloudWatch in AWS_REGION with your usual AWS credentials (or, with --local,
    the emulator). Exit status 0, or 2 when the recipe is invalid or AWS cannot be read.

    Examples:

      trainstack status 30b-fp8 --team nlp --watch

      trainstack status 30b-fp8 --json
    """
    from trainstack import api
    from trainstack.errors import TrainstackError

    if as_json and watch:
        raise TrainstackError("--json prints one snapshot and cannot --watch: use one or the other")
    ask = dict(team=team, overrides=set_ or (), local=local, runs=runs, recipes_dir=recipes_dir)
    if as_json:
        typer.echo(api.status(recipe, **ask).to_json())
        return

    from trainstack.cli.commands.output import console as narrow_console

    console = narrow_console()  # 120 columns at most, also when piped
    if not watch:
        console.print(_view(recipe, ask))
        return
    from rich.console import Group
    from rich.live import Live
    from rich.text import Text

    refreshes = 0
    try:
        with Live(console=console, auto_refresh=False) as live:
            while True:
                view, snapshot = _view_and_snapshot(recipe, ask)
                refreshes += 1
                done = snapshot.latest_ended or (count and refreshes >= count)
                when = f"refreshed {datetime.now(UTC):%H:%M:%S} UTC"
                note = "the latest run has ended" if snapshot.latest_ended else f"next in {interval:g} s"
                if not done:
                    note += "; Ctrl-C stops"
                live.update(Group(view, Text(f"({when}; {note})", style="dim")), refresh=True)
                if done:
                    break
                time.sleep(interval)
    except KeyboardInterrupt:
        if not console.is_terminal:
            console.line()
        console.print("[dim]stopped watching[/dim]")
        return
    if not console.is_terminal:
        console.line()  # Live leaves the last frame without a newline when piped


def _view(recipe: str, ask: dict[str, Any]) -> RenderableType:
    return _view_and_snapshot(recipe, ask)[0]


def _view_and_snapshot(recipe: str, ask: dict[str, Any]) -> tuple[RenderableType, Snapshot]:
    """The panels of one refresh (trainstack.api.status read afresh) and what they were drawn from."""
    from trainstack import api

    found = api.status(recipe, **ask)
    return render(found), found.snapshot


def render(found: Any) -> RenderableType:
    """A StatusResult as `trainstack status` draws it: the plan's line, then one panel per run."""
    from rich.console import Group
    from rich.text import Text

    snapshot, recipe, plan, team = found.snapshot, found.recipe, found.plan, found.team
    reports = snapshot.reports
    team_name = team or recipe.tags.team
    thr, cost = plan.throughput, plan.cost
    head = Text.assemble(
        (f"{recipe.name}", "bold"),
        f" (team {team_name}) on {found.where}\n",
        f"{recipe.compute.instance_count} x {recipe.compute.instance_type}, {recipe.world_size} GPUs. ",
        f"Plan: {thr.tokens_per_sec_per_gpu:,.0f} tokens/s per GPU, MFU {thr.mfu:.1%}, "
        f"${cost.usd_per_hour:,.0f}/h, {recipe.training.steps:,} steps in {duration(cost.hours)} "
        f"for ${cost.total_usd:,.0f}.",
    )
    hint = f" --team {team}" if team else ""
    notes = []
    if not snapshot.launcher_deployed:
        notes.append(
            Text(f"(launcher stack not deployed in {found.where}: no execution history shown)", style="dim")
        )
    if not reports and not snapshot.pending:
        return Group(
            head,
            Text.assemble(
                ("\nNo run yet: ", "bold yellow"),
                f"no training job named {found.job_prefix}<recipe hash>-... exists.\n"
                f"Start one with `trainstack launch {recipe.name}{hint}`.",
            ),
            *notes,
        )
    panels = [_pending_panel(e) for e in snapshot.pending]
    panels += [
        _run_panel(
            r,
            recipe,
            snapshot.executions.get(r.job.name),
            snapshot.trends.get(r.job.name),
            plan,
            snapshot.restarts.get(r.job.name),
        )
        for r in reports
    ]
    return Group(head, *panels, *notes)
