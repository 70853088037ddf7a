"""What `status` and `runs` read from AWS (moved from trainstack/cli/commands so that trainstack.api can
compose it): a recipe's newest training jobs with their metrics, trends, measured restarts and launcher
executions (`status`), and every run of the registries with SageMaker's job states (`runs`); each also
as the dict its command's `--json` prints."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from trainstack.errors import TrainstackError

if TYPE_CHECKING:
    from trainstack.aws.registry import RunView
    from trainstack.aws.runs import Execution, RunReport


# --- status ------------------------------------------------------------------------------------------


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


def collect_status(
    clients: Any, prefix: str, recipe: Any, team: str | None, plan: Any, limit: int
) -> Snapshot:
    """The newest `limit` jobs named `prefix`... with their metrics against `plan`, and the launcher's
    executions; one line when AWS cannot be read."""
    from botocore.exceptions import BotoCoreError, ClientError

    from trainstack.aws.runs import assess, find_executions, find_jobs, latest_metrics, launcher_state_machine
    from trainstack.aws.session import explain

    now = datetime.now(UTC)
    try:
        jobs = find_jobs(clients.sagemaker, prefix, limit)
        reports = [
            with_latest_losses(
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


def with_latest_losses(logs: Any, report: Any) -> Any:
    """The report with loss and val_loss as the trainer last printed them. CloudWatch keeps SageMaker's
    metrics per minute and status asks for each minute's average, which for loss is a mean of every log
    step in that minute, not the latest value; the job's log has the line itself. A value not in the
    newest lines (a validation long ago) stays CloudWatch's."""
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


def run_eta(report: RunReport, plan: Any, now: datetime) -> Any:
    """When a running job's run finishes at its measured pace, against the plan (trainstack.aws.trends)."""
    from trainstack.aws.trends import eta

    if plan is None or not report.job.running:
        return None
    return eta(
        report.job.started,
        report.steps_target,
        report.hours_remaining,
        float(plan.throughput.step_time_s),
        now,
    )


def execution_dict(execution: Execution) -> dict[str, Any]:
    return {
        "name": execution.name,
        "status": execution.status,
        "started": execution.started.isoformat(),
        "stopped": execution.stopped.isoformat() if execution.stopped else None,
    }


def report_dict(
    report: RunReport,
    execution: Execution | None = None,
    trends: dict[str, list] | None = None,
    plan: Any = None,
    restart: Any = None,
    now: datetime | None = None,
) -> dict[str, Any]:
    """One job as `status --json` prints it; its ETA counted from `now` (default: this instant)."""
    job = report.job
    eta = run_eta(report, plan, now or datetime.now(UTC))
    return {
        "restart": restart.as_dict() if restart is not None else None,
        "execution": execution_dict(execution) if execution else None,
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
        "eta": eta.finish.isoformat() if eta else None,
        "planned_finish": eta.planned_finish.isoformat() if eta else None,
        "behind_plan_hours": eta.behind_hours if eta else None,
        "trends": {k: [[t.isoformat(), v] for t, v in points] for k, points in (trends or {}).items()},
    }


# --- runs --------------------------------------------------------------------------------------------


def collect_runs(clients: Any, stack_prefix: str | None, team: str | None) -> list[RunView]:
    """Every run of the registries found, with SageMaker's job states and the newest step, newest first."""
    from botocore.exceptions import ClientError

    from trainstack.aws.registry import deployed_recipe_hash, registries, scan_runs, view
    from trainstack.aws.runs import job_from_description, latest_metrics

    now = datetime.now(UTC)
    dynamodb = clients.aws.client("dynamodb")
    cloudformation = clients.aws.client("cloudformation")
    found, deployed = [], {}
    for registry in registries(cloudformation, stack_prefix):
        if team is not None and not registry.stack.startswith(f"Trainstack-{team}-"):
            continue
        runs_here = scan_runs(dynamodb, registry.table)
        found.extend(runs_here)
        deployed_hash = deployed_recipe_hash(cloudformation, registry)
        deployed.update({r.run: deployed_hash for r in runs_here})
    views = []
    for run in sorted(found, key=lambda r: r.created, reverse=True):
        described = {}
        for record in run.jobs:
            try:
                described[record.name] = job_from_description(
                    clients.sagemaker.describe_training_job(TrainingJobName=record.name)
                )
            except ClientError as error:
                if error.response.get("Error", {}).get("Code") not in (
                    "ValidationException",
                    "ResourceNotFound",
                ):
                    raise  # a job not created yet (or never) is simply not described
        step = None
        for record in sorted(run.jobs, key=lambda j: j.index, reverse=True):
            if record.name in described:
                metrics = latest_metrics(clients.cloudwatch, described[record.name], now)
                if "step" in metrics:
                    step = int(metrics["step"].value)
                    break
        if run.exports:  # the folder each export wrote (or will): its step, asked or reported
            run = replace(run, exports=tuple(_with_folder(clients.sagemaker, e) for e in run.exports))
        found_view = view(run, described, step, now, deployed.get(run.run))
        stand_ins = sorted({j.stand_in for j in described.values() if j.stand_in})
        if stand_ins:  # the local emulator trained a scaled-down stand-in (trainstack.emulator.stand_in)
            found_view = replace(found_view, notes=(*found_view.notes, *(f"emulator {s}" for s in stand_ins)))
        views.append(found_view)
    return views


def _with_folder(sagemaker: Any, export: dict[str, Any]) -> dict[str, Any]:
    from botocore.exceptions import ClientError

    from trainstack.aws.runs import export_folder

    try:
        described = (
            sagemaker.describe_training_job(TrainingJobName=export["job"]) if export.get("job") else None
        )
    except ClientError as error:
        if error.response.get("Error", {}).get("Code") not in ("ValidationException", "ResourceNotFound"):
            raise
        described = None  # not created (yet)
    return {**export, "folder": export_folder(export, described)}


def mlflow_lines(aws: Any, views: list[RunView], recipes_dir: str | None) -> dict[str, tuple[str, Any]]:
    """run -> (where its MLflow run is, the MLflow run or None) (trainstack.aws.mlflow_access)."""
    from trainstack.aws import mlflow_access
    from trainstack.aws.run_access import deploy_hint, team_option
    from trainstack.aws.run_request import recipe_of
    from trainstack.recipes.loader import resolve

    out = {}
    for v in views:
        # The registry names the deployment's team; the default team's recipes deploy without `--team`.
        team = team_option(v.run.team, recipes_dir)
        try:
            # The run's own recorded recipe: what it trained and tracked, whatever is deployed or on disk
            # now; a recipe deployed from a file (the demo's scripts/demo-tiny.yaml) has no name that
            # `resolve` finds ("unknown recipe 'demo-tiny'", issue 40). By name only for a run recorded
            # before runs recorded their request.
            resolved = (
                recipe_of(v.run.request)
                if v.run.request
                else resolve(v.run.recipe, team=team, recipes_dir=recipes_dir).recipe
            )
            uri = mlflow_access.tracking_uri(aws, resolved, team, deploy_hint(v.run.recipe, team, aws.local))
        except TrainstackError as error:
            out[v.run.run] = (f"mlflow: {error}", None)
            continue
        out[v.run.run] = mlflow_access.describe(v, uri, resolved, team, s3=aws.client("s3"))
    return out
