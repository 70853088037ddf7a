"""Watching what runs: `runs` (every run of the registries), `status` (a recipe's newest jobs against
their plan), `logs` (a job's CloudWatch logs) and `checkpoints` (a run's kept checkpoints and their
states). Each reads AWS, or the local emulator with `local=True`; `region` overrides AWS_REGION for the
call. Nothing here prints: log lines and progress go to the callbacks."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainstack.api.results import OnProgress, Result, report
from trainstack.errors import TrainstackError

if TYPE_CHECKING:
    from trainstack.aws.checkpoints import CheckpointView, Location
    from trainstack.aws.registry import RunView
    from trainstack.aws.run_status import Snapshot
    from trainstack.planner import Plan
    from trainstack.recipes.schema import Recipe

PROGRESS_EVERY_S = 2.0  # checkpoints(verify=True): at most one "read so far" line this often


def _environ(region: str | None) -> dict[str, str] | None:
    """The environment the AWS clients read, with `region` as AWS_REGION (None: the process's own)."""
    return None if region is None else {**os.environ, "AWS_REGION": region}


def _clients(local: bool, region: str | None) -> Any:
    from trainstack.aws import runs as aws_runs

    # Called through the module, with no environ unless a region is asked for: tests stand in for it.
    return aws_runs.aws_clients(local) if region is None else aws_runs.aws_clients(local, _environ(region))


# --- runs --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunsResult(Result):
    """Every run found, newest first; `to_json()` is `trainstack runs --json`."""

    views: tuple[RunView, ...]
    where: str
    recipe: str | None = None
    team: str | None = None
    # run -> (one line: where its MLflow run is, the MLflow run or None); only with mlflow=True
    mlflow: dict[str, tuple[str, Any]] = field(default_factory=dict)

    def to_document(self) -> list[dict[str, Any]]:
        rows = [v.as_dict() for v in self.views]
        for row in rows if self.mlflow else ():
            line, found = self.mlflow[row["run"]]
            row["mlflow"] = {"url": found.url, "run_id": found.run_id} if found is not None else line
        return rows


def runs(
    recipe: str | None = None,
    *,
    team: str | None = None,
    local: bool = False,
    region: str | None = None,
    recipes_dir: str | Path | None = None,
    mlflow: bool = False,
) -> RunsResult:
    """Every run of every deployed recipe (or of `recipe`, or of `team`'s deployments), newest first:
    state, step, tokens, jobs, cost so far, checkpoint URI, history and notes (`trainstack runs`).
    `mlflow`: also find each run's MLflow run (and write an ended run's final state into it)."""
    from botocore.exceptions import BotoCoreError, ClientError

    from trainstack.aws import run_status
    from trainstack.aws.session import explain

    stack_prefix = None
    if recipe is not None:
        from trainstack.recipes.loader import resolve
        from trainstack.recipes.naming import stack_prefix as make_prefix

        stack_prefix = make_prefix(resolve(recipe, team=team, recipes_dir=recipes_dir).recipe, team)
    elif team is not None:
        from trainstack.recipes.schema import team_name_problem

        if (problem := team_name_problem(team)) is not None:
            raise TrainstackError(f"--team: {problem}")
    clients = _clients(local, region)
    try:
        views = run_status.collect_runs(clients, stack_prefix, team if recipe is None else None)
    except (BotoCoreError, ClientError) as error:
        raise TrainstackError(f"reading runs from {clients.where} failed: {explain(error)}") from None
    recipes = None if recipes_dir is None else str(recipes_dir)
    tracked = run_status.mlflow_lines(clients.aws, views, recipes) if mlflow else {}
    return RunsResult(tuple(views), clients.where, recipe, team, tracked)


# --- status ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StatusResult(Result):
    """A recipe's newest jobs against its plan, and the launcher executions still waiting for their job;
    `to_json()` is `trainstack status --json`."""

    recipe: Recipe
    team: str | None
    plan: Plan
    job_prefix: str
    where: str
    snapshot: Snapshot
    now: datetime  # when it was read: the ETAs count from it, so to_json() is the same at every call

    @property
    def latest_ended(self) -> bool:
        return self.snapshot.latest_ended

    def to_document(self) -> dict[str, Any]:
        from trainstack.aws.run_status import execution_dict, report_dict

        snapshot = self.snapshot
        return {
            "recipe": self.recipe.name,
            "team": self.team or self.recipe.tags.team,
            "job_prefix": self.job_prefix,
            "runs": [
                report_dict(
                    r,
                    snapshot.executions.get(r.job.name),
                    snapshot.trends.get(r.job.name),
                    self.plan,
                    snapshot.restarts.get(r.job.name),
                    self.now,
                )
                for r in snapshot.reports
            ],
            "pending_executions": [execution_dict(e) for e in snapshot.pending],
            "launcher_deployed": snapshot.launcher_deployed,
        }


def status(
    recipe: str,
    *,
    team: str | None = None,
    overrides: Sequence[str] = (),
    local: bool = False,
    region: str | None = None,
    runs: int = 3,
    recipes_dir: str | Path | None = None,
) -> StatusResult:
    """The newest `runs` training jobs of `recipe`: state, step toward the steps launched with, tokens/s
    and MFU against the plan (slow below monitoring.slow_fraction of it), loss, cost so far and
    projected, trends and ETA (`trainstack status`). Reads SageMaker, CloudWatch and Step Functions."""
    from trainstack.aws import run_status
    from trainstack.planner import plan as make_plan
    from trainstack.recipes.loader import resolve
    from trainstack.recipes.naming import job_name_prefix

    if not 1 <= runs <= 20:
        raise TrainstackError(f"--runs {runs}: expected 1 to 20")
    resolved = resolve(recipe, team=team, overrides=tuple(overrides), recipes_dir=recipes_dir)
    the_recipe = resolved.recipe
    the_plan = make_plan(the_recipe)
    prefix = job_name_prefix(the_recipe, team)
    clients = _clients(local, region)
    snapshot = run_status.collect_status(clients, prefix, the_recipe, team, the_plan, runs)
    return StatusResult(the_recipe, team, the_plan, prefix, clients.where, snapshot, datetime.now(UTC))


# --- logs --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LogsResult(Result):
    """The lines read from a job's log streams (`trainstack logs`); `job` None: no run of the recipe
    yet, `no_run` says so in one line. `to_json()`: this object's fields (logs has no --json)."""

    job: str | None
    status: str | None
    lines: tuple[str, ...]
    where: str
    ended: bool = False  # follow=True: the job ended while being followed
    failure_reason: str | None = None
    no_run: str | None = None

    def to_document(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "status": self.status,
            "failure_reason": self.failure_reason,
            "ended": self.ended,
            "lines": list(self.lines),
            "no_run": self.no_run,
        }


def logs(
    recipe: str,
    *,
    team: str | None = None,
    overrides: Sequence[str] = (),
    job: str | None = None,
    follow: bool = False,
    interval: float = 5.0,
    timeout: float | None = None,
    local: bool = False,
    region: str | None = None,
    recipes_dir: str | Path | None = None,
    on_line: Callable[[str], None] | None = None,
    on_progress: OnProgress = None,
) -> LogsResult:
    """The CloudWatch logs of the newest job of `recipe` (or of `job`, one of its training or export
    jobs): every line, prefixed `[algo-<n>]` when the job has several hosts. `follow`: keep reading
    every `interval` seconds until the job ends (or `timeout` seconds pass). `on_line` gets each line
    as it is read; `on_progress` the `# ...` lines the command prints on stderr."""
    from botocore.exceptions import BotoCoreError, ClientError

    from trainstack.aws.runs import LogCursor, find_jobs, job_from_description, log_streams, read_new_lines
    from trainstack.aws.session import explain
    from trainstack.recipes.loader import resolve
    from trainstack.recipes.naming import job_name_prefix

    resolved = resolve(recipe, team=team, overrides=tuple(overrides), recipes_dir=recipes_dir)
    prefix = job_name_prefix(resolved.recipe, team)
    clients = _clients(local, region)
    hint = f" --team {team}" if team else ""
    lines: list[str] = []

    def emit(line: str) -> None:
        lines.append(line)
        if on_line is not None:
            on_line(line)

    try:
        if job is not None:
            # A run's jobs and its exports (`<run>-X<n>`, trainstack.aws.export_job) carry the prefix.
            if not job.startswith(prefix):
                raise TrainstackError(
                    f"--job {job} is not a run of {resolved.recipe.name}{hint} nor an export of one "
                    f"(its jobs and exports are named {prefix}<run id>-...)"
                )
            target = job_from_description(clients.sagemaker.describe_training_job(TrainingJobName=job))
        else:
            jobs = find_jobs(clients.sagemaker, prefix, limit=1)
            if not jobs:
                no_run = (
                    f"No run of {resolved.recipe.name}{hint} yet on {clients.where}: no training job named "
                    f"{prefix}<recipe hash>-... exists. Start one with "
                    f"`trainstack launch {resolved.recipe.name}{hint}`."
                )
                return LogsResult(None, None, (), clients.where, no_run=no_run)
            target = jobs[0]
        report(
            on_progress,
            f"# {target.name}: {target.status} / {target.secondary_status or '-'} "
            f"(log group /aws/sagemaker/TrainingJobs on {clients.where})",
        )
        cursor = LogCursor()
        deadline = None if timeout is None else time.monotonic() + timeout
        ended = False
        while True:
            streams = log_streams(clients.logs, target.name)
            several = len(streams) > 1
            for stream, _ts, message in read_new_lines(clients.logs, streams, cursor):
                host = stream.removeprefix(f"{target.name}/").rsplit("-", 1)[0]
                emit(f"[{host}] {message}" if several else message)
            if not follow or (deadline is not None and time.monotonic() >= deadline):
                break
            target = job_from_description(
                clients.sagemaker.describe_training_job(TrainingJobName=target.name)
            )
            if not target.running:
                # One last read: SageMaker flushes the final lines as the job ends.
                for _stream, _ts, message in read_new_lines(
                    clients.logs, log_streams(clients.logs, target.name), cursor
                ):
                    emit(message)
                report(
                    on_progress,
                    f"# {target.name} ended: {target.status}"
                    + (f" ({target.failure_reason})" if target.failure_reason else ""),
                )
                ended = True
                break
            time.sleep(interval)
        if not lines and not follow:
            report(
                on_progress,
                f"# no log lines yet for {target.name} (SageMaker creates the streams once the "
                "container starts; the local emulator runs no container, so it never has any)",
            )
    except (BotoCoreError, ClientError) as error:
        raise TrainstackError(f"reading logs from {clients.where} failed: {explain(error)}") from None
    return LogsResult(
        target.name, target.status, tuple(lines), clients.where, ended, target.failure_reason or None
    )


# --- checkpoints -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointsResult(Result):
    """Every kept checkpoint of a run, newest first; `to_json()` is `trainstack checkpoints --json`."""

    run: str
    where: str
    views: tuple[CheckpointView, ...]
    now: datetime  # what the ages are counted from
    verified: bool = False

    @property
    def damaged(self) -> bool:
        return any(v.state == "damaged" for v in self.views)

    @property
    def exit_code(self) -> int:
        """What `trainstack checkpoints` exits with: 1 when --verify found a damaged checkpoint."""
        return 1 if self.verified and self.damaged else 0

    def to_document(self) -> list[dict[str, Any]]:
        return [v.as_dict(self.now) for v in self.views]


def checkpoints(
    run: str,
    *,
    verify: bool = False,
    local: bool = False,
    region: str | None = None,
    on_progress: OnProgress = None,
) -> CheckpointsResult:
    """Every kept checkpoint of `run` (a run's name, its s3:// checkpoint prefix, or a local checkpoint
    directory), newest first, each complete, incomplete or damaged by the trainer's own checks. `verify`:
    read every file of every complete checkpoint against the SHA-256 recorded when it was written,
    reporting what was read through `on_progress`."""
    from botocore.exceptions import BotoCoreError, ClientError

    from trainstack.aws.checkpoints import list_checkpoints
    from trainstack.aws.session import explain

    location = open_location(run, local, region)
    try:
        views = list_checkpoints(location)
        if verify and views:
            views = verify_all(location, views, on_progress)
    except (ClientError, BotoCoreError) as error:
        raise TrainstackError(f"could not read checkpoints in {location.where}: {explain(error)}") from None
    return CheckpointsResult(run, location.where, tuple(views), datetime.now(UTC), verify)


def open_location(run: str, local: bool = False, region: str | None = None) -> Location:
    """RUN as a place to list: a local directory, an s3:// prefix, or a run's own checkpoint prefix."""
    from trainstack.aws.checkpoints import LocalLocation, S3Location

    if not run.startswith("s3://") and ("/" in run or Path(run).is_dir()):
        if not Path(run).is_dir():
            raise TrainstackError(f"{run}: no such checkpoint directory")
        return LocalLocation(Path(run))
    from trainstack.aws.session import Aws

    aws = Aws(local=local, environ=_environ(region))
    if run.startswith("s3://"):
        return S3Location(aws.client("s3"), run)
    from trainstack.aws.run_access import find_run

    record, _ = find_run(aws, run)
    return S3Location(aws.client("s3"), record.checkpoint_uri)


def verify_all(location: Location, views: list[CheckpointView], on_progress: OnProgress = None) -> list:
    """Each complete checkpoint read whole against its recorded digests; progress at most every
    PROGRESS_EVERY_S seconds, and one line per checkpoint with its state."""
    from trainstack.aws.checkpoints import verify

    todo = [v for v in views if v.state == "complete"]
    total = sum(v.inspection.size for v in todo if v.inspection is not None)
    done, last = 0, 0.0
    report(on_progress, f"verifying {len(todo)} checkpoint(s), {size_text(total)}: reading every byte")

    def progress(name: str, count: int) -> None:
        nonlocal done, last
        done += count
        if time.monotonic() - last >= PROGRESS_EVERY_S or done == total:
            last = time.monotonic()
            report(on_progress, f"  {size_text(done)} of {size_text(total)} read ({name})")

    checked = []
    for item in views:
        result = verify(location, item, progress) if item.state == "complete" else item
        if item.state == "complete":
            report(on_progress, f"  {_folder(item.step)}: {state_text(result)}")
        checked.append(result)
    return checked


def _folder(step: int) -> str:
    from trainstack.protocol.checkpoint_format import step_dir_name

    return step_dir_name(step)


def state_text(item: CheckpointView) -> str:
    """'complete, verified', 'complete', or the state and its problem."""
    if item.state == "complete":
        return "complete, verified" if item.verified else "complete"
    return f"{item.state}: {item.problem}"


def size_text(count: int) -> str:
    """A byte count in the largest binary unit it reaches: '1.5 GiB', '512 B'."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"
