"""`trainstack status RECIPE [--team T] [--watch] [--local]`: the latest runs against their plan.

For each of the newest training jobs of the recipe: state and secondary state, step with a progress
bar toward the steps the job was launched with, tokens/s per GPU and MFU against the planner's
prediction (slow when below `monitoring.slow_fraction` of plan, the rule the Slow alarm applies), cost
so far and projected, and where its checkpoints go; sparklines of step, tokens/s and loss over the
job's metric history and an ETA against the plan (trainstack.aws.trends). Reads SageMaker and CloudWatch
only. Output fits 120 columns.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any

import typer

from trainstack.cli.commands.plan_options import RecipeArg, RecipesDirOpt, SetOpt, TeamOpt, duration
from trainstack.cli.commands.status_panels import _eta, _pending_panel, _run_panel  # noqa: F401 (tests import)

if TYPE_CHECKING:
    from rich.console import RenderableType

    from trainstack.aws.runs import Execution, RunReport

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
    from trainstack.aws.runs import aws_clients
    from trainstack.planner import plan as make_plan
    from trainstack.recipes.loader import resolve
    from trainstack.recipes.naming import job_name_prefix

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
                    "runs": [
                        _as_dict(
                            r,
                            snapshot.executions.get(r.job.name),
                            snapshot.trends.get(r.job.name),
                            the_plan,
                            snapshot.restarts.get(r.job.name),
                        )
                        for r in snapshot.reports
                    ],
                    "pending_executions": [_execution_dict(e) for e in snapshot.pending],
                    "launcher_deployed": snapshot.launcher_deployed,
                },
                indent=2,
            )
        )
        return

    from trainstack.cli.commands.output import console as narrow_console

    console = narrow_console()  # 120 columns at most, also when piped
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
    executions: dict[str, Execution]  # by the name of the job each starts (its newest attempt)
    pending: list[Execution]  # launcher executions that have not created their job (yet)
    launcher_deployed: bool
    trends: dict[str, dict[str, list]] = field(default_factory=dict)  # job -> metric -> [(t, v)]
    restarts: dict[str, Any] = field(default_factory=dict)  # job -> trainstack.aws.restarts.MeasuredRestart

    @property
    def latest_ended(self) -> bool:
        if self.pending and self.pending[0].status == "RUNNING":
            return False
        return bool(self.reports) and not self.reports[0].job.running


def _collect(clients: Any, prefix: str, recipe: Any, team: str | None, plan: Any, limit: int) -> Snapshot:
    from botocore.exceptions import BotoCoreError, ClientError

    from trainstack.aws.runs import assess, find_executions, find_jobs, latest_metrics, launcher_state_machine
    from trainstack.aws.session import explain
    from trainstack.errors import TrainstackError

    now = datetime.now(UTC)
    try:
        jobs = find_jobs(clients.sagemaker, prefix, limit)
        reports = [
            _with_latest_losses(
                clients.logs, assess(job, latest_metrics(clients.cloudwatch, job, now), recipe, plan, now)
            )
            for job in jobs
        ]
        trends = {job.name: metric_history(clients.cloudwatch, job, now) for job in jobs}
        restarts = measured_restarts(clients.sagemaker, jobs, trends)
        machine = launcher_state_machine(clients, recipe, team)
        executions = (
            find_executions(clients.aws.client("stepfunctions"), machine, prefix, limit) if machine else []
        )
    except (BotoCoreError, ClientError) as error:
        raise TrainstackError(f"reading runs from {clients.where} failed: {explain(error)}") from None
    from trainstack.recipes.naming import job_of_execution

    # An execution is named `<job>-<attempt token>` (naming.execution_name): matched to its job by that,
    # or every execution that did create its job would show as one that did not.
    names = {job.name for job in jobs}
    oldest_job = min((job.created for job in jobs), default=None)
    pending = [
        e
        for e in executions
        if job_of_execution(e.name) not in names and (oldest_job is None or e.started >= oldest_job)
    ]
    by_job: dict[str, Execution] = {}
    for e in sorted(executions, key=lambda e: e.started):  # the newest attempt per job
        by_job[job_of_execution(e.name)] = e
    return Snapshot(reports, by_job, pending, machine is not None, trends, restarts)


# GetLogEvents returns at most 10,000 events (1 MB) a call; the newest 1,000 lines hold the last log
# step's line of any run that logs, and on most runs its last validation's too.
LATEST_LINES = 1000
LATEST_KEYS = ("loss", "val_loss")


def latest_values(messages: list[str], keys: tuple[str, ...] = LATEST_KEYS) -> dict[str, float]:
    """The newest finite value of each metric in log lines given oldest first, as the trainer printed
    it (the MetricDefinitions' own regexes, trainstack.protocol.metrics): pure."""
    import math
    import re

    from trainstack.protocol.metrics import FIELD_BY_KEY

    found: dict[str, float] = {}
    for message in reversed(messages):
        for key in keys:
            if key in found:
                continue
            match = re.search(FIELD_BY_KEY[key].regex, message)
            if match and math.isfinite(value := float(match.group(1))):
                found[key] = value
        if len(found) == len(keys):
            break
    return found


def _with_latest_losses(logs: Any, report: Any) -> Any:
    """The report with loss and val_loss as the trainer last printed them. CloudWatch keeps SageMaker's
    metrics per minute and status asks for each minute's average, which for loss is a mean of every log
    step in that minute, not the latest value; the job's log has the line itself. A value not in the
    newest lines (a validation long ago) stays CloudWatch's."""
    from dataclasses import replace

    from trainstack.aws.runs import LOG_GROUP, log_streams

    found: dict[str, float] = {}
    for stream in log_streams(logs, report.job.name):  # algo-1 first: rank 0 prints the metric line
        events = logs.get_log_events(
            logGroupName=LOG_GROUP, logStreamName=stream, startFromHead=False, limit=LATEST_LINES
        )["events"]
        for key, value in latest_values([e["message"] for e in events]).items():
            found.setdefault(key, value)
        if len(found) == len(LATEST_KEYS):
            break
    return replace(report, **found) if found else report


def measured_restarts(sagemaker: Any, jobs: list, trends: dict[str, dict[str, list]]) -> dict[str, Any]:
    """Each job's measured restart (trainstack.aws.restarts): from the run's previous job's end (described
    when it is not among `jobs`) to the job's first metric line."""
    from botocore.exceptions import ClientError

    from trainstack.aws.restarts import measure_restart, previous_job_name
    from trainstack.aws.runs import job_from_description

    by_name = {job.name: job for job in jobs}
    found = {}
    for job in jobs:
        steps = trends.get(job.name, {}).get("step") or []
        previous, name = None, previous_job_name(job)
        if steps and name is not None:
            previous = by_name.get(name)
            if previous is None:
                try:
                    previous = job_from_description(sagemaker.describe_training_job(TrainingJobName=name))
                except ClientError:  # gone (SageMaker keeps jobs), or another account's: start-up only
                    previous = None
        measured = measure_restart(job, previous, steps[0] if steps else None)
        if measured is not None:
            found[job.name] = measured
    return found


def metric_history(cloudwatch: Any, job: Any, now: datetime) -> dict[str, list]:
    """Every trainer metric point CloudWatch holds for the job, oldest first (trainstack.aws.trends)."""
    from trainstack.aws.runs import metric_data
    from trainstack.aws.trends import series_from_results
    from trainstack.protocol.metrics import FIELDS

    results = metric_data(cloudwatch, job, now, scan_by="TimestampAscending")
    return series_from_results(results, {f.key.lower(): f.key for f in FIELDS})


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
                f"no training job named {prefix}<recipe hash>-... exists.\n"
                f"Start one with `trainstack launch {recipe.name}{hint}`.",
            ),
            *notes,
        ), snapshot
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
    return Group(head, *panels, *notes), snapshot


def _execution_dict(execution: Execution) -> dict[str, Any]:
    return {
        "name": execution.name,
        "status": execution.status,
        "started": execution.started.isoformat(),
        "stopped": execution.stopped.isoformat() if execution.stopped else None,
    }


def _as_dict(
    report: RunReport,
    execution: Execution | None = None,
    trends: dict[str, list] | None = None,
    plan: Any = None,
    restart: Any = None,
) -> dict[str, Any]:
    job = report.job
    run_eta = _eta(report, plan, datetime.now(UTC))
    return {
        "restart": restart.as_dict() if restart is not None else None,
        "execution": _execution_dict(execution) if execution else None,
        "job": job.name,
        "status": job.status,
        "secondary_status": job.secondary_status,
        "failure_reason": job.failure_reason,
        "stand_in": job.stand_in,
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
        "val_loss": report.val_loss,
        "cost_so_far_usd": report.cost_so_far_usd,
        "cost_projected_usd": report.cost_projected_usd,
        "hours_remaining": report.hours_remaining,
        "eta": run_eta.finish.isoformat() if run_eta else None,
        "planned_finish": run_eta.planned_finish.isoformat() if run_eta else None,
        "behind_plan_hours": run_eta.behind_hours if run_eta else None,
        "trends": {k: [[t.isoformat(), v] for t, v in points] for k, points in (trends or {}).items()},
    }
