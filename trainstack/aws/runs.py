"""A recipe's runs as AWS sees them: training jobs, their metrics and logs, and how they compare to the plan.

`trainstack status` and `trainstack logs` read from here. The AWS calls are thin functions that take a
boto3 client (so the CLI, the tests and the local emulator pass whichever client they have); everything
that decides something (which jobs belong to a recipe, how far a run is, whether it is slow, what it
costs) is a pure function of plain values, tested without AWS.

Where SageMaker puts things (../shared/README.md section 6):
- the trainer's metric lines become metrics named by `trainstack.protocol.metrics` ("train:<key>") in
  namespace `/aws/sagemaker/TrainingJobs`, dimension `TrainingJobName` (the MetricDefinitions of the job);
- per-host utilization metrics live in the same namespace with dimension `Host=<job>/algo-<n>`;
- logs go to log group `/aws/sagemaker/TrainingJobs`, one stream per host named `<job>/algo-<n>-<epoch>`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from trainstack.protocol.metrics import FIELDS

if TYPE_CHECKING:  # planner and recipe are only needed for type names here
    from trainstack.recipes.schema import Recipe

NAMESPACE = "/aws/sagemaker/TrainingJobs"
LOG_GROUP = "/aws/sagemaker/TrainingJobs"
JOB_DIMENSION = "TrainingJobName"  # algorithm (MetricDefinitions) metrics
HOST_DIMENSION = "Host"  # built-in instance metrics: "<job>/algo-<n>"
TERMINAL_STATES = frozenset({"Completed", "Failed", "Stopped"})


# --- Which jobs belong to a recipe ----------------------------------------------------------------


def is_recipe_job(name: str, prefix: str) -> bool:
    """Whether `name` is a job (or launcher execution) of the recipe and team with this job-name prefix.

    The prefix (`ts-<team>-<recipe>--`, trainstack.recipes.naming.job_name_prefix) is exact: the jobs of
    `8b-fp8-128k` do not start with the prefix of `8b-fp8`, nor one team's with another's.
    """
    from trainstack.aws.export_job import is_export_job  # an export is not a training job of a run

    return name.startswith(prefix) and not is_export_job(name)


# --- Training jobs --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """The fields of DescribeTrainingJob that status needs, as plain values."""

    name: str
    status: str
    secondary_status: str
    created: datetime
    started: datetime | None = None
    ended: datetime | None = None
    failure_reason: str | None = None
    checkpoint_uri: str | None = None
    instance_type: str | None = None
    instance_count: int = 1
    steps_target: int | None = None  # training.steps the job was launched with (may be a short run)
    hyperparameters: dict[str, str] = field(default_factory=dict)
    run: str | None = None  # TRAINSTACK_RUN in its environment: the run it belongs to
    # SecondaryStatusTransitions as (Status, StartTime, EndTime); trainstack.aws.restarts reads them
    transitions: tuple[tuple[str, datetime, datetime | None], ...] = ()
    # The local emulator only: the stand-in it trains instead of a recipe too big for the machine, one
    # line (TRAINSTACK_EMULATOR_STAND_IN in the environment it ran with; trainstack.emulator.stand_in).
    stand_in: str | None = None

    @property
    def running(self) -> bool:
        return self.status not in TERMINAL_STATES

    def elapsed_hours(self, now: datetime) -> float:
        """Hours on instances so far (from TrainingStartTime; zero while still starting)."""
        if self.started is None:
            return 0.0
        end = self.ended or now
        return max(0.0, (end - self.started).total_seconds() / 3600.0)


def _as_datetime(value: Any) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    if isinstance(value, int | float):  # epoch seconds (some serializers)
        return datetime.fromtimestamp(value, tz=UTC)
    return datetime.fromisoformat(str(value).replace("Z", "+00:00"))


def job_from_description(desc: dict[str, Any]) -> Job:
    """A `Job` from a DescribeTrainingJob response (pure)."""
    hyper = dict(desc.get("HyperParameters") or {})
    steps: int | None = None
    raw_steps = hyper.get("training.steps")
    if raw_steps is not None:
        try:
            steps = int(float(raw_steps.strip('"')))
        except ValueError:
            steps = None
    resources = desc.get("ResourceConfig") or {}
    return Job(
        name=desc["TrainingJobName"],
        status=desc.get("TrainingJobStatus", "Unknown"),
        secondary_status=desc.get("SecondaryStatus", ""),
        created=_as_datetime(desc.get("CreationTime")) or datetime.now(UTC),
        started=_as_datetime(desc.get("TrainingStartTime")),
        ended=_as_datetime(desc.get("TrainingEndTime")),
        failure_reason=desc.get("FailureReason"),
        # The run's prefix, which every job of a run writes directly (trainstack.aws.request.environment);
        # CheckpointConfig for jobs launched before runs had one.
        checkpoint_uri=(desc.get("Environment") or {}).get("TRAINSTACK_CHECKPOINT_URI")
        or (desc.get("CheckpointConfig") or {}).get("S3Uri"),
        instance_type=resources.get("InstanceType"),
        instance_count=int(resources.get("InstanceCount") or 1),
        steps_target=steps,
        hyperparameters=hyper,
        run=(desc.get("Environment") or {}).get("TRAINSTACK_RUN"),
        stand_in=(desc.get("Environment") or {}).get("TRAINSTACK_EMULATOR_STAND_IN"),
        transitions=tuple(
            (t["Status"], _as_datetime(t["StartTime"]), _as_datetime(t.get("EndTime")))
            for t in desc.get("SecondaryStatusTransitions") or []
            if t.get("Status") and t.get("StartTime")
        ),
    )


def find_jobs(sagemaker: Any, prefix: str, limit: int = 3) -> list[Job]:
    """The newest `limit` training jobs of a recipe, newest first (described in full).

    Every matching summary is read and sorted by CreationTime before the list is cut: the service sorts
    too (SortBy/SortOrder), but an emulator that ignores SortOrder must not make `status --runs 1` show
    the oldest job.
    """
    summaries: list[dict[str, Any]] = []
    paginator = sagemaker.get_paginator("list_training_jobs")
    pages = paginator.paginate(NameContains=prefix, SortBy="CreationTime", SortOrder="Descending")
    for page in pages:
        summaries.extend(
            s for s in page.get("TrainingJobSummaries", []) if is_recipe_job(s["TrainingJobName"], prefix)
        )
    summaries.sort(
        key=lambda s: _as_datetime(s.get("CreationTime")) or datetime.min.replace(tzinfo=UTC), reverse=True
    )
    names = [s["TrainingJobName"] for s in summaries[:limit]]
    jobs = [job_from_description(sagemaker.describe_training_job(TrainingJobName=n)) for n in names]
    return sorted(jobs, key=lambda j: j.created, reverse=True)


# --- The trainer's metrics ------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    value: float
    timestamp: datetime


def metric_queries(job_name: str, period_s: int = 60) -> list[dict[str, Any]]:
    """GetMetricData queries for every trainer metric of one job (Ids are the metric keys)."""
    return [
        {
            "Id": f.key.lower(),
            "MetricStat": {
                "Metric": {
                    "Namespace": NAMESPACE,
                    "MetricName": f.metric_name,
                    "Dimensions": [{"Name": JOB_DIMENSION, "Value": job_name}],
                },
                "Period": period_s,
                "Stat": "Maximum" if f.key == "step" else "Average",
            },
            "ReturnData": True,
        }
        for f in FIELDS
    ]


def latest_from_results(results: list[dict[str, Any]]) -> dict[str, Sample]:
    """The newest finite value of each metric from GetMetricData results (pure)."""
    out: dict[str, Sample] = {}
    ids = {f.key.lower(): f.key for f in FIELDS}
    for result in results:
        key = ids.get(result.get("Id", ""))
        if key is None:
            continue
        pairs = [
            (_as_datetime(t), v)
            for t, v in zip(result.get("Timestamps", []), result.get("Values", []), strict=False)
            if v is not None and math.isfinite(v)
        ]
        if pairs:
            t, v = max(pairs, key=lambda p: p[0])
            out[key] = Sample(float(v), t)
    return out


def metric_data(
    cloudwatch: Any, job: Job, now: datetime | None = None, scan_by: str = "TimestampDescending"
) -> list[dict[str, Any]]:
    """Every GetMetricData result for the trainer metrics of `job` over its lifetime, all pages."""
    now = now or datetime.now(UTC)
    start = (job.started or job.created) - timedelta(minutes=5)
    end = (job.ended or now) + timedelta(minutes=5)
    results: list[dict[str, Any]] = []
    token: str | None = None
    while True:
        kwargs: dict[str, Any] = {
            "MetricDataQueries": metric_queries(job.name),
            "StartTime": start,
            "EndTime": end,
            "ScanBy": scan_by,
        }
        if token:
            kwargs["NextToken"] = token
        response = cloudwatch.get_metric_data(**kwargs)
        results.extend(response.get("MetricDataResults", []))
        token = response.get("NextToken")
        if not token:
            return results


def latest_metrics(cloudwatch: Any, job: Job, now: datetime | None = None) -> dict[str, Sample]:
    """The newest value of each trainer metric SageMaker extracted for `job`."""
    return latest_from_results(metric_data(cloudwatch, job, now))


# --- How a run compares to its plan ---------------------------------------------------------------


@dataclass(frozen=True)
class RunReport:
    """Everything `trainstack status` shows for one run; computed, never fetched."""

    job: Job
    step: int | None
    steps_target: int
    progress: float  # 0..1
    tokens_per_sec: float | None  # measured, per GPU
    planned_tokens_per_sec: float
    throughput_ratio: float | None  # measured / planned
    slow: bool | None  # None: no throughput measured yet
    slow_threshold: float  # tokens/s per GPU below which the run counts as slow
    mfu: float | None
    planned_mfu: float
    mem_gib: float | None
    planned_peak_gib: float
    loss: float | None
    usd_per_hour: float
    cost_so_far_usd: float
    cost_projected_usd: float
    hours_remaining: float | None
    metrics_at: datetime | None
    val_loss: float | None = None  # the newest evaluation's (validation.every_steps; step 0 with at_start)


def assess(job: Job, metrics: dict[str, Sample], recipe: Recipe, plan: Any, now: datetime) -> RunReport:
    """Compare a run's latest metrics with the planner's prediction (pure).

    Slow means measured tokens/s per GPU below `recipe.monitoring.slow_fraction` of the plan, the
    same rule the `Slow` alarm applies. Cost is wall time on instances at the plan's cluster price;
    the projection adds the remaining steps at the measured step time (the planned one until the
    trainer has reported).
    """
    steps_target = job.steps_target or recipe.training.steps
    step = int(metrics["step"].value) if "step" in metrics else None
    progress = min(1.0, (step or 0) / steps_target) if steps_target else 0.0
    if job.status == "Completed" and step is None:
        progress = 1.0
    planned_tps = float(plan.throughput.tokens_per_sec_per_gpu)
    threshold = recipe.monitoring.slow_fraction * planned_tps
    tps = metrics["tokens_per_sec"].value if "tokens_per_sec" in metrics else None
    ratio = tps / planned_tps if tps is not None and planned_tps > 0 else None
    slow = None if tps is None else tps < threshold

    usd_per_hour = float(plan.cost.usd_per_hour)
    so_far = usd_per_hour * job.elapsed_hours(now)
    step_time = metrics["step_time_s"].value if "step_time_s" in metrics else None
    if step_time is None and tps:
        step_time = recipe.tokens_per_step / (tps * recipe.world_size)
    if step_time is None:
        step_time = float(plan.throughput.step_time_s)
    remaining_steps = max(0, steps_target - (step or 0))
    if job.running:
        hours_remaining: float | None = remaining_steps * step_time / 3600.0
        projected = so_far + usd_per_hour * hours_remaining
    else:
        hours_remaining = None
        projected = so_far
    newest = max((s.timestamp for s in metrics.values()), default=None)
    return RunReport(
        job=job,
        step=step,
        steps_target=steps_target,
        progress=progress,
        tokens_per_sec=tps,
        planned_tokens_per_sec=planned_tps,
        throughput_ratio=ratio,
        slow=slow,
        slow_threshold=threshold,
        mfu=metrics["mfu"].value if "mfu" in metrics else None,
        planned_mfu=float(plan.throughput.mfu),
        mem_gib=metrics["mem_gib"].value if "mem_gib" in metrics else None,
        planned_peak_gib=float(plan.memory.peak_gib),
        loss=metrics["loss"].value if "loss" in metrics else None,
        usd_per_hour=usd_per_hour,
        cost_so_far_usd=so_far,
        cost_projected_usd=projected,
        hours_remaining=hours_remaining,
        metrics_at=newest,
        val_loss=metrics["val_loss"].value if "val_loss" in metrics else None,
    )


# --- Logs -----------------------------------------------------------------------------------------


def log_streams(logs: Any, job_name: str) -> list[str]:
    """The job's log streams (one per host), `<job>/algo-<n>-<epoch>`; empty before the job logs."""
    names: list[str] = []
    token: str | None = None
    while True:
        kwargs: dict[str, Any] = {"logGroupName": LOG_GROUP, "logStreamNamePrefix": f"{job_name}/"}
        if token:
            kwargs["nextToken"] = token
        try:
            response = logs.describe_log_streams(**kwargs)
        except logs.exceptions.ResourceNotFoundException:
            return []  # the log group appears with the first training job that logs
        names.extend(s["logStreamName"] for s in response.get("logStreams", []))
        token = response.get("nextToken")
        if not token:
            return sorted(names)


@dataclass
class LogCursor:
    """Where reading each stream got to, so `--follow` prints every line once."""

    tokens: dict[str, str] = field(default_factory=dict)


def read_new_lines(logs: Any, streams: list[str], cursor: LogCursor) -> Iterator[tuple[str, int, str]]:
    """(stream, timestamp ms, message) for lines not yet read, oldest first within each stream."""
    for stream in streams:
        while True:
            kwargs: dict[str, Any] = {
                "logGroupName": LOG_GROUP,
                "logStreamName": stream,
                "startFromHead": True,
            }
            if stream in cursor.tokens:
                kwargs["nextToken"] = cursor.tokens[stream]
            response = logs.get_log_events(**kwargs)
            events = response.get("events", [])
            for event in events:
                yield stream, int(event.get("timestamp", 0)), event.get("message", "")
            next_token = response.get("nextForwardToken")
            done = not events or next_token == cursor.tokens.get(stream)
            if next_token:
                cursor.tokens[stream] = next_token
            if done:
                break


# --- Clients --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Clients:
    sagemaker: Any
    cloudwatch: Any
    logs: Any
    aws: Any  # trainstack.aws.session.Aws: more clients and stack outputs
    where: str  # "region us-east-1" or "the local emulator (http://localhost:PORT)", for messages


def aws_clients(local: bool = False, environ: dict[str, str] | None = None) -> Clients:
    """boto3 clients for real AWS (the usual credential chain) or the local emulator (aws.session)."""
    from botocore.exceptions import BotoCoreError

    from trainstack.aws.session import Aws, explain
    from trainstack.errors import TrainstackError

    try:
        aws = Aws(local=local, environ=environ)
        return Clients(aws.client("sagemaker"), aws.client("cloudwatch"), aws.client("logs"), aws, aws.where)
    except BotoCoreError as error:
        raise TrainstackError(f"AWS client setup failed: {explain(error)}") from None


# --- Launcher executions --------------------------------------------------------------------------


@dataclass(frozen=True)
class Execution:
    """A launcher state machine execution; `trainstack launch` names it after the job it creates."""

    name: str
    status: str  # RUNNING | SUCCEEDED | FAILED | TIMED_OUT | ABORTED
    started: datetime
    stopped: datetime | None = None


def launcher_state_machine(clients: Clients, recipe: Recipe, team: str | None) -> str | None:
    """The deployed launcher's state machine ARN, or None when the launcher stack is not deployed."""
    from trainstack.errors import TrainstackError
    from trainstack.recipes.naming import stack_prefix

    try:
        outputs = clients.aws.stack_outputs(f"{stack_prefix(recipe, team)}-Launcher", "cdk deploy")
    except TrainstackError:
        return None
    return outputs.get("StateMachineArn")


def find_executions(
    stepfunctions: Any, state_machine_arn: str, prefix: str, limit: int = 10
) -> list[Execution]:
    """The newest executions of the launcher that start this recipe's jobs, newest first."""
    response = stepfunctions.list_executions(stateMachineArn=state_machine_arn, maxResults=100)
    found = [
        Execution(
            e["name"],
            e["status"],
            _as_datetime(e["startDate"]) or datetime.now(UTC),
            _as_datetime(e.get("stopDate")),
        )
        for e in response.get("executions", [])
        if is_recipe_job(e["name"], prefix)
    ]
    return sorted(found, key=lambda e: e.started, reverse=True)[:limit]


def exported_step(description: dict[str, Any] | None) -> int | None:
    """The step an export job exported (its `export:step` in FinalMetricDataList), None before it said."""
    from trainstack.protocol.metrics import EXPORTED_STEP_METRIC

    values = [
        m["Value"]
        for m in (description or {}).get("FinalMetricDataList") or []
        if m.get("MetricName") == EXPORTED_STEP_METRIC
    ]
    return int(values[-1]) if values else None


def export_folder(export: dict[str, Any], description: dict[str, Any] | None) -> str:
    """Where an export's Hugging Face folder is, as a user would load it: `<parent>step-<N>/` with N the
    step asked for, else the one the job reports it exported; until then, what it will be (issue 40:
    `trainstack runs` printed `step-N/` for every export)."""
    parent = export.get("out_parent", "")
    step = int(export.get("step") or 0) or exported_step(description)
    if step:
        return f"{parent}step-{step}/"
    status = (description or {}).get("TrainingJobStatus")
    if status in ("Failed", "Stopped"):
        return f"{parent} (nothing exported: the job ended {status})"
    return f"{parent}step-<newest complete checkpoint>/ (named when the job has exported it)"
