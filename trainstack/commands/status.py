"""`trainstack status RECIPE [--team T] [--watch] [--local]`: the latest runs against their plan.

For each of the newest training jobs of the recipe: state and secondary state, step with a progress
bar toward the steps the job was launched with, tokens/s per GPU and MFU against the planner's
prediction (slow when below `monitoring.slow_fraction` of plan, the rule the Slow alarm applies), cost
so far and projected, and where its checkpoints go. Reads SageMaker and CloudWatch only.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any

import typer

from trainstack.commands.plan_options import RecipeArg, RecipesDirOpt, SetOpt, TeamOpt, duration

if TYPE_CHECKING:
    from rich.console import RenderableType

    from trainstack.runs import Execution, RunReport

LocalOpt = Annotated[
    bool,
    typer.Option(
        "--local",
        help="Use the local AWS emulator instead of AWS: AWS_ENDPOINT_URL, or the one "
        "`python -m trainstack.emulator` started in this directory.",
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
    from trainstack.loader import resolve
    from trainstack.naming import job_name_prefix
    from trainstack.planner import plan as make_plan
    from trainstack.runs import aws_clients

    if as_json and watch:
        from trainstack.errors import TrainstackError

        raise TrainstackError("--json prints one snapshot and cannot --watch: use one or the other")
    resolved = resolve(recipe, team=team, overrides=set_ or (), recipes_dir=recipes_dir)
    the_recipe = resolved.recipe
    the_plan = make_plan(the_recipe)
    prefix = job_name_prefix(the_recipe, team)
    clients = aws_clients(local)

    if as_json:
        snapshot = _collect(clients, prefix, the_recipe, team, the_plan, runs)
        typer.echo(
            json.dumps(
                {
                    "recipe": the_recipe.name,
                    "team": team or the_recipe.tags.team,
                    "job_prefix": prefix,
                    "runs": [_as_dict(r, snapshot.executions.get(r.job.name)) for r in snapshot.reports],
                    "pending_executions": [_execution_dict(e) for e in snapshot.pending],
                    "launcher_deployed": snapshot.launcher_deployed,
                },
                indent=2,
            )
        )
        return

    from trainstack.commands.plan_options import console as make_console

    console = make_console()  # piped: wide enough that panels do not cut the checkpoint URI
    if not watch:
        console.print(_view(clients, prefix, the_recipe, team, the_plan, runs))
        return
    from rich.console import Group
    from rich.live import Live
    from rich.text import Text

    refreshes = 0
    try:
        with Live(console=console, auto_refresh=False) as live:
            while True:
                view, snapshot = _view_and_snapshot(clients, prefix, the_recipe, team, the_plan, runs)
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


@dataclass(frozen=True)
class Snapshot:
    reports: list[RunReport]
    executions: dict[str, Execution]  # by name (= job name)
    pending: list[Execution]  # launcher executions that have not created their job (yet)
    launcher_deployed: bool

    @property
    def latest_ended(self) -> bool:
        if self.pending and self.pending[0].status == "RUNNING":
            return False
        return bool(self.reports) and not self.reports[0].job.running


def _collect(clients: Any, prefix: str, recipe: Any, team: str | None, plan: Any, limit: int) -> Snapshot:
    from botocore.exceptions import BotoCoreError, ClientError

    from trainstack.aws import explain
    from trainstack.errors import TrainstackError
    from trainstack.runs import assess, find_executions, find_jobs, latest_metrics, launcher_state_machine

    now = datetime.now(UTC)
    try:
        jobs = find_jobs(clients.sagemaker, prefix, limit)
        reports = [
            assess(job, latest_metrics(clients.cloudwatch, job, now), recipe, plan, now) for job in jobs
        ]
        machine = launcher_state_machine(clients, recipe, team)
        executions = (
            find_executions(clients.aws.client("stepfunctions"), machine, prefix, limit) if machine else []
        )
    except (BotoCoreError, ClientError) as error:
        raise TrainstackError(f"reading runs from {clients.where} failed: {explain(error)}") from None
    names = {job.name for job in jobs}
    oldest_job = min((job.created for job in jobs), default=None)
    pending = [
        e for e in executions if e.name not in names and (oldest_job is None or e.started >= oldest_job)
    ]
    return Snapshot(reports, {e.name: e for e in executions}, pending, machine is not None)


def _view(clients: Any, prefix: str, recipe: Any, team: str | None, plan: Any, limit: int) -> RenderableType:
    return _view_and_snapshot(clients, prefix, recipe, team, plan, limit)[0]


def _view_and_snapshot(
    clients: Any,
    prefix: str,
    recipe: Any,
    team: str | None,
    plan: Any,
    limit: int,
) -> tuple[RenderableType, Snapshot]:
    from rich.console import Group
    from rich.text import Text

    snapshot = _collect(clients, prefix, recipe, team, plan, limit)
    reports = snapshot.reports
    team_name = team or recipe.tags.team
    thr, cost = plan.throughput, plan.cost
    head = Text.assemble(
        (f"{recipe.name}", "bold"),
        f" (team {team_name}) on {clients.where}\n",
        f"{recipe.compute.instance_count} x {recipe.compute.instance_type}, {recipe.world_size} GPUs. ",
        f"Plan: {thr.tokens_per_sec_per_gpu:,.0f} tokens/s per GPU, MFU {thr.mfu:.1%}, "
        f"${cost.usd_per_hour:,.0f}/h, {recipe.training.steps:,} steps in {duration(cost.hours)} "
        f"for ${cost.total_usd:,.0f}.",
    )
    hint = f" --team {team}" if team else ""
    notes = []
    if not snapshot.launcher_deployed:
        notes.append(
            Text(f"(launcher stack not deployed in {clients.where}: no execution history shown)", style="dim")
        )
    if not reports and not snapshot.pending:
        return Group(
            head,
            Text.assemble(
                ("\nNo run yet: ", "bold yellow"),
                f"no training job named {prefix}<recipe hash>-... exists. "
                f"Start one with `trainstack launch {recipe.name}{hint}`.",
            ),
            *notes,
        ), snapshot
    panels = [_pending_panel(e) for e in snapshot.pending]
    panels += [_run_panel(r, recipe, snapshot.executions.get(r.job.name)) for r in reports]
    return Group(head, *panels, *notes), snapshot


def _pending_panel(execution: Execution) -> RenderableType:
    from rich.panel import Panel

    now = datetime.now(UTC)
    ago = duration(max(0.0, (now - execution.started).total_seconds()) / 3600)
    if execution.status == "RUNNING":
        text = (
            f"launcher execution RUNNING since {execution.started:%Y-%m-%d %H:%M} UTC ({ago} ago); "
            "no training job yet (creating it, or retrying on insufficient capacity)"
        )
    else:
        text = (
            f"launcher execution {execution.status} at "
            f"{(execution.stopped or execution.started):%Y-%m-%d %H:%M} UTC without creating the "
            "training job (see the execution history in the Step Functions console)"
        )
    return Panel(
        text,
        title=execution.name,
        title_align="left",
        border_style="yellow" if execution.status == "RUNNING" else "red",
    )


def _state_style(status: str) -> str:
    return {"Completed": "green", "Failed": "bold red", "Stopped": "yellow", "Stopping": "yellow"}.get(
        status, "cyan"
    )


def _run_panel(report: RunReport, recipe: Any, execution: Execution | None = None) -> RenderableType:
    from rich.panel import Panel
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    from trainstack.runs import TERMINAL_STATES

    job = report.job
    now = datetime.now(UTC)
    table = Table.grid(padding=(0, 2))
    table.add_column(style="dim", no_wrap=True)
    table.add_column(overflow="fold")  # long S3 URIs wrap rather than lose their end
    state = f"[{_state_style(job.status)}]{job.status}[/] / {job.secondary_status or '-'}"
    if job.failure_reason:
        state += f"\n[red]{job.failure_reason}[/red]"
    table.add_row("state", state)
    started = job.started or job.created
    table.add_row(
        "started",
        f"{started:%Y-%m-%d %H:%M} UTC ({duration(max(0.0, (now - started).total_seconds()) / 3600)} ago)",
    )
    bar = Table.grid(padding=(0, 1))
    bar.add_column(width=40)
    bar.add_column()
    if report.step is not None:
        step_text = f"{report.step:,}"
    else:  # an ended job will not report one (in the emulator, nothing ever trains)
        step_text = "no step metric" if job.status in TERMINAL_STATES else "no step reported yet"
    bar.add_row(
        ProgressBar(total=1.0, completed=report.progress, width=40),
        f"{step_text} / {report.steps_target:,} steps ({report.progress:.1%})",
    )
    table.add_row("progress", bar)
    if report.tokens_per_sec is None:
        table.add_row("tokens/s per GPU", f"no metric yet (plan {report.planned_tokens_per_sec:,.0f})")
    else:
        verdict = (
            f"[bold red]SLOW[/]: below {recipe.monitoring.slow_fraction:g} x plan "
            f"= {report.slow_threshold:,.0f}"
            if report.slow
            else "[green]on plan[/]"
        )
        table.add_row(
            "tokens/s per GPU",
            f"{report.tokens_per_sec:,.0f} vs plan {report.planned_tokens_per_sec:,.0f} "
            f"({report.throughput_ratio:.0%} of plan)  {verdict}",
        )
    mfu = f"{report.mfu:.1%}" if report.mfu is not None else "-"
    table.add_row("MFU", f"{mfu} vs plan {report.planned_mfu:.1%}")
    if report.mem_gib is not None:
        table.add_row("peak memory", f"{report.mem_gib:,.1f} GiB vs plan {report.planned_peak_gib:,.1f} GiB")
    if report.loss is not None:
        table.add_row("loss", f"{report.loss:.4g}")
    remaining = f", {duration(report.hours_remaining)} to go" if report.hours_remaining is not None else ""
    table.add_row(
        "cost",
        f"${report.cost_so_far_usd:,.0f} so far, ${report.cost_projected_usd:,.0f} projected "
        f"at ${report.usd_per_hour:,.0f}/h{remaining}",
    )
    table.add_row("checkpoints", job.checkpoint_uri or "-")
    if execution is not None:
        table.add_row("launcher", f"execution {execution.status}")
    if report.metrics_at is not None:
        table.add_row("metrics as of", f"{report.metrics_at:%H:%M:%S} UTC")
    return Panel(
        table,
        title=job.name,
        title_align="left",
        border_style="red" if report.slow or job.status == "Failed" else "blue",
    )


def _execution_dict(execution: Execution) -> dict[str, Any]:
    return {
        "name": execution.name,
        "status": execution.status,
        "started": execution.started.isoformat(),
        "stopped": execution.stopped.isoformat() if execution.stopped else None,
    }


def _as_dict(report: RunReport, execution: Execution | None = None) -> dict[str, Any]:
    job = report.job
    return {
        "execution": _execution_dict(execution) if execution else None,
        "job": job.name,
        "status": job.status,
        "secondary_status": job.secondary_status,
        "failure_reason": job.failure_reason,
        "created": job.created.isoformat(),
        "started": job.started.isoformat() if job.started else None,
        "checkpoint_uri": job.checkpoint_uri,
        "step": report.step,
        "steps_target": report.steps_target,
        "progress": report.progress,
        "tokens_per_sec_per_gpu": report.tokens_per_sec,
        "planned_tokens_per_sec_per_gpu": report.planned_tokens_per_sec,
        "throughput_ratio": report.throughput_ratio,
        "slow": report.slow,
        "slow_threshold": report.slow_threshold,
        "mfu": report.mfu,
        "planned_mfu": report.planned_mfu,
        "mem_gib": report.mem_gib,
        "loss": report.loss,
        "cost_so_far_usd": report.cost_so_far_usd,
        "cost_projected_usd": report.cost_projected_usd,
        "hours_remaining": report.hours_remaining,
    }
