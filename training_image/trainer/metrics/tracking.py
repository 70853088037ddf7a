"""Experiment tracking from rank 0: every job of a trainstack run appends to one MLflow run, and, with
`tracking.tensorboard`, to TensorBoard event files. docs/tracking.md says what is logged and where.

MLflow's own conventions decide where (and so any MLflow tracking URI works: SageMaker's managed MLflow
by ARN through the sagemaker-mlflow plugin, http(s)://, sqlite:///..., file:...):

- on when MLFLOW_TRACKING_URI is set (the launcher sets it, and SageMaker from the job's MlflowConfig);
- the run is MLFLOW_RUN_ID when set (the run `trainstack launch` created and the registry records);
  otherwise the run tagged `trainstack.run=<TRAINSTACK_RUN>` in experiment MLFLOW_EXPERIMENT_NAME
  (default `<team>/<recipe>`), found, or created by the run's first job; a job with no TRAINSTACK_RUN (a
  plain local run) gets a run of its own;
- only rank 0 logs: one MLflow run per training run, never one per rank (mlflow/mlflow#11782).

Never in the way: nothing here runs on the training thread but an append to a bounded buffer
(trainer.metrics.delivery): the MLflow client is imported, the run found and every value sent on a background
thread; an unreachable or throttling tracker costs retries there, never step time, and never fails or
stops the job; what could not be delivered is counted in the job's log when it ends.

Logged: params = the resolved recipe (flattened dotted keys), the plan (memory, tokens/s and MFU with their
ranges, hours, cost), image, data identity and manifest hash, init_from; tags = team, recipe, job index and
name, why the previous job ended (from the supervisor), how this job ended, the run's state; metrics by
step = loss, val_loss (when validation logs it), lr, grad_norm, tokens_per_sec, mfu, mem_gib,
tflops_per_gpu, step_time_s.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.metrics.delivery import Delivery
from trainstack.protocol import exit_codes
from trainstack.protocol.metrics import parse_line
from trainstack.protocol.tracking import RUN_TAG, default_experiment, run_filter
from trainstack.recipes.schema import Recipe, to_hyperparameters

log = logging.getLogger("trainer.tracking")

# Metric-line fields that are not per-step training metrics (the step is MLflow's own axis; the straggler
# fields say which rank, not how the run is doing).
NOT_LOGGED = ("step", "straggler_host", "straggler_rank", "straggler_compute_s", "straggler_skew")
# MLflow's REST API limits per log-batch request (mlflow.org REST API, Log Batch: at most 1000 metrics,
# 100 params and 100 tags, 1000 entities in all) and on values (param values 6000 characters, tag values
# 8000, keys 250 in MLflow 3's SQL store). The managed MLflow behind SageMaker is the same server.
BATCH_METRICS, BATCH_PARAMS, BATCH_TAGS, BATCH_ENTITIES = 1000, 100, 100, 1000
PARAM_VALUE_MAX, TAG_VALUE_MAX, KEY_MAX = 6000, 8000, 250
CLOSE_TIMEOUT_S = 10.0  # how long the end of a job waits for the tracker at most
STOP_CLOSE_TIMEOUT_S = 5.0  # after SIGTERM or an error: SageMaker's 120 s belong to the checkpoint
MANIFEST_NAMES = ("manifest.json",)


# --- what a run is told (pure) ----------------------------------------------------------------------


@dataclass(frozen=True)
class JobContext:
    """Who this job is, from the environment the launcher gives every job (trainstack.aws.request)."""

    tracking_uri: str | None
    run: str | None  # TRAINSTACK_RUN: the trainstack run's name
    run_id: str | None  # MLFLOW_RUN_ID
    experiment: str
    run_name: str
    team: str
    job_index: int | None
    job_name: str | None
    previous_end: str | None  # why the run's previous job ended, as the supervisor recorded it
    image: str | None
    init_from: str | None = None

    @classmethod
    def from_environment(cls, recipe: Recipe, environ: Mapping[str, str] | None = None) -> JobContext:
        env = os.environ if environ is None else environ

        def get(name: str) -> str | None:
            return env.get(name) or None

        team = get("TRAINSTACK_TEAM") or recipe.tags.team
        run = get("TRAINSTACK_RUN")
        job_name = get("TRAINING_JOB_NAME")  # SageMaker sets it in every training container
        index = get("TRAINSTACK_JOB_INDEX")
        if index is None and job_name and run and job_name.startswith(f"{run}-"):
            index = job_name.rsplit("-", 1)[1]
        return cls(
            tracking_uri=get("MLFLOW_TRACKING_URI"),
            run=run,
            run_id=get("MLFLOW_RUN_ID"),
            experiment=get("MLFLOW_EXPERIMENT_NAME")
            or recipe.tracking.experiment
            or default_experiment(team, recipe.name),
            run_name=get("MLFLOW_RUN_NAME") or run or recipe.name,
            team=team,
            job_index=int(index) if index and index.isdigit() else None,
            job_name=job_name,
            previous_end=get("TRAINSTACK_PREVIOUS_JOB_END"),
            image=get("TRAINSTACK_IMAGE"),
            init_from=get("TRAINSTACK_INIT_FROM"),
        )


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


def recipe_params(recipe: Recipe) -> dict[str, str]:
    """The resolved recipe, flattened: `recipe.training.lr` -> "0.0003" (strings as themselves)."""
    return {f"recipe.{k}": _text(json.loads(v)) for k, v in to_hyperparameters(recipe).items()}


def plan_params(plan: Any) -> dict[str, str]:
    """The plan's figures and their ranges (estimates: three significant figures, no more)."""
    t, cost, memory = plan.throughput, plan.cost, plan.memory
    low, high = t.tokens_per_sec_per_gpu_range
    per_gpu = t.tokens_per_sec_per_gpu or 1.0
    figures = {
        "plan.memory.peak_gib": memory.peak_gib,
        "plan.memory.usable_gib": memory.usable_gib,
        "plan.tokens_per_sec_per_gpu": t.tokens_per_sec_per_gpu,
        "plan.tokens_per_sec_per_gpu.low": low,
        "plan.tokens_per_sec_per_gpu.high": high,
        "plan.mfu": t.mfu,
        "plan.mfu.low": t.mfu * low / per_gpu,
        "plan.mfu.high": t.mfu * high / per_gpu,
        "plan.hours": cost.hours,
        "plan.hours.low": cost.hours_range[0],
        "plan.hours.high": cost.hours_range[1],
        "plan.cost_usd": cost.total_usd,
        "plan.cost_usd.low": cost.total_usd_range[0],
        "plan.cost_usd.high": cost.total_usd_range[1],
    }
    out = {k: f"{v:.3g}" for k, v in figures.items()}
    out["plan.fits"] = str(plan.fits).lower()
    out["plan.price_source"] = str(cost.price_source)
    return out


def manifest_hash(data_dir: Path | None) -> str | None:
    """sha256 of the data set's manifest, when the data folder has one."""
    if data_dir is None:
        return None
    for name in MANIFEST_NAMES:
        path = Path(data_dir) / name
        if path.is_file():
            return hashlib.sha256(path.read_bytes()).hexdigest()
    return None


def run_params(
    recipe: Recipe, plan: Any, job: JobContext, data_source: str, data_dir: Path | None
) -> dict[str, str]:
    params = {**recipe_params(recipe), **(plan_params(plan) if plan is not None else {})}
    params["data.source"] = data_source
    if (digest := manifest_hash(data_dir)) is not None:
        params["data.manifest_sha256"] = digest
    if job.image:
        params["image"] = job.image
    init_from = job.init_from or next((v for k, v in params.items() if k.endswith(".init_from")), None)
    if init_from and init_from != "null":
        params["init_from"] = init_from
    return {k[:KEY_MAX]: v[:PARAM_VALUE_MAX] for k, v in params.items()}


def job_tags(recipe: Recipe, job: JobContext) -> dict[str, str]:
    """The tags every job sets at its start (the latest job's values win)."""
    tags = {
        "trainstack.team": job.team,
        "trainstack.recipe": recipe.name,
        "trainstack.state": "running",
    }
    if job.run:
        tags[RUN_TAG] = job.run
    if job.job_index is not None:
        tags["trainstack.job"] = str(job.job_index)
        if job.job_name:
            tags[f"trainstack.job.{job.job_index}.name"] = job.job_name
        if job.previous_end and job.job_index > 1:
            tags[f"trainstack.job.{job.job_index - 1}.ended"] = job.previous_end
    elif job.job_name:
        tags["trainstack.job_name"] = job.job_name
    return tags


@dataclass(frozen=True)
class Outcome:
    """How this job ended, as the tracker records it."""

    ended: str  # words for the job's `exit` tag
    status: str  # MLflow run status: FINISHED, KILLED, FAILED
    run_state: str | None  # the trainstack run's state when this job decides it, else None


def outcome_of(error: BaseException | None, stopped: bool) -> Outcome:
    """The job's end: finished its steps, stopped by SIGTERM, or failed (fatal ends the run, as the
    supervisor decides on the same exit codes: trainstack.protocol.exit_codes)."""
    if error is None:
        if stopped:
            return Outcome("stopped by SIGTERM (saved)", "KILLED", None)
        return Outcome("completed", "FINISHED", "completed")
    code = getattr(error, "exit_code", None)
    summary = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
    if code in exit_codes.FATAL:
        return Outcome(f"failed (exit {code}, fatal): {summary}", "FAILED", "failed")
    if type(error).__name__ == "AbandonedSave":
        return Outcome("stopped by SIGTERM (save abandoned)", "KILLED", None)
    return Outcome(f"failed: {summary}", "FAILED", None)


# --- MLflow (client imported on the delivery thread, only when tracking is on) ----------------------


class MlflowSink:
    """Finds or creates the run, logs params and tags (prepare), then sends metric batches (send)."""

    def __init__(self, job: JobContext, params: dict[str, str], tags: dict[str, str]) -> None:
        self.job, self.params, self.tags = job, params, tags
        self.client: Any = None
        self.run_id: str | None = None
        self.experiment_id: str | None = None

    def prepare(self) -> None:
        # The client's own HTTP retries would hold a batch for minutes; the delivery thread retries instead.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        if self.client is None:
            from mlflow.tracking import MlflowClient

            if not self.job.tracking_uri.startswith("arn:"):
                # sagemaker-mlflow's request-header plugin reads ARNs only and warns on every request to any
                # other tracking URI (http, sqlite, file): noise, not a fault.
                logging.getLogger("mlflow.tracking.request_header.registry").setLevel(logging.ERROR)

            self.client = MlflowClient(tracking_uri=self.job.tracking_uri)
        if self.run_id is None:
            self.run_id = self._find_or_create()
            log.info(
                "tracking mlflow: run %s in %s (%s)", self.run_id, self.job.tracking_uri, self.job.experiment
            )
        self._log_params_and_tags()

    def _experiment_id(self) -> str:
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(self.job.experiment)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(self.job.experiment)
        except MlflowException:  # another job created it meanwhile
            found = self.client.get_experiment_by_name(self.job.experiment)
            if found is None:
                raise
            return found.experiment_id

    def _find_or_create(self) -> str:
        if self.job.run_id:
            return self.client.get_run(self.job.run_id).info.run_id
        experiment = self._experiment_id()
        if self.job.run:
            found = self.client.search_runs(
                [experiment],
                filter_string=run_filter(self.job.run),
                max_results=1,
                order_by=["attributes.start_time ASC"],
            )
            if found:
                return found[0].info.run_id
        created = self.client.create_run(experiment, run_name=self.job.run_name, tags=dict(self.tags))
        return created.info.run_id

    def _log_params_and_tags(self) -> None:
        from mlflow.entities import Param, RunTag

        existing = self.client.get_run(self.run_id).data.params
        new = {k: v for k, v in self.params.items() if k not in existing}
        # Params are immutable in MLflow: a value a later job changed (`resume --set`, a safe change) is
        # recorded as a tag of the job that changed it.
        changed = {k: v for k, v in self.params.items() if k in existing and existing[k] != v}
        tags = dict(self.tags)
        where = f"job.{self.job.job_index}" if self.job.job_index is not None else "job"
        tags.update(
            {f"trainstack.{where}.changed.{k}"[:KEY_MAX]: v[:TAG_VALUE_MAX] for k, v in changed.items()}
        )
        params = [Param(k, v) for k, v in new.items()]
        run_tags = [RunTag(k, v[:TAG_VALUE_MAX]) for k, v in tags.items()]
        for start in range(0, max(len(params), len(run_tags)), BATCH_PARAMS):
            self.client.log_batch(
                self.run_id,
                params=params[start : start + BATCH_PARAMS],
                tags=run_tags[start : start + BATCH_TAGS],
            )
        self.client.update_run(self.run_id, status="RUNNING")

    def send(self, records: list[Any]) -> None:
        from mlflow.entities import Metric, RunTag

        metrics, tags, end = [], {}, None
        for record in records:
            kind = record[0]
            if kind == "metrics":
                _, step, values, wall_ms = record
                metrics.extend(Metric(k, float(v), wall_ms, step) for k, v in values.items())
            elif kind == "tags":
                tags.update(record[1])
            elif kind == "end":
                end = record[1]
        run_tags = [RunTag(k, str(v)[:TAG_VALUE_MAX]) for k, v in tags.items()]
        for start in range(0, len(metrics), BATCH_METRICS):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + BATCH_METRICS])
        for start in range(0, len(run_tags), BATCH_TAGS):
            self.client.log_batch(self.run_id, tags=run_tags[start : start + BATCH_TAGS])
        if end is not None:
            self.client.set_terminated(self.run_id, status=end)


class TensorBoardSink:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.writer: Any = None

    def prepare(self) -> None:
        from trainer.metrics.tensorboard import EventWriter

        self.writer = EventWriter(self.directory)
        log.info("tracking tensorboard: writing %s", self.writer.path)

    def send(self, records: list[Any]) -> None:
        for record in records:
            if record[0] == "metrics":
                _, step, values, wall_ms = record
                self.writer.scalars(step, values, wall_time=wall_ms / 1000.0)


# --- the trainer's side -----------------------------------------------------------------------------


@dataclass
class Tracking:
    """What the training loop calls: `log` on log steps (rank 0), `session` around the loop."""

    deliveries: list[Delivery] = field(default_factory=list)
    sinks: list[Any] = field(default_factory=list)

    @classmethod
    def off(cls) -> Tracking:
        return cls()

    @property
    def on(self) -> bool:
        return bool(self.deliveries)

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """Queue metrics for `step` (a non-blocking append per tracker)."""
        if not self.deliveries:
            return
        record = ("metrics", int(step), {k: float(v) for k, v in values.items()}, int(time.time() * 1000))
        for delivery in self.deliveries:
            delivery.put(record)

    def log_line(self, step: int, line: str, **extra: float) -> None:
        """The metric line's values (parsed by its one definition) plus `extra`, e.g. grad_norm."""
        if not self.deliveries:
            return
        values = {k: v for k, v in parse_line(line).items() if k not in NOT_LOGGED}
        self.log(step, {**values, **extra})

    def tag(self, tags: Mapping[str, str]) -> None:
        for delivery in self.deliveries:
            delivery.put(("tags", dict(tags)))

    def close(
        self, outcome: Outcome, job_index: int | None = None, timeout_s: float = CLOSE_TIMEOUT_S
    ) -> None:
        if not self.deliveries:
            return
        # The trainer's own view of its end; `trainstack.job.<n>.ended` is the supervisor's (set by job n+1,
        # or by `trainstack runs --mlflow` for a run's last job).
        where = f"trainstack.job.{job_index}.exit" if job_index is not None else "trainstack.job.exit"
        tags = {where: outcome.ended}
        if outcome.run_state is not None:
            tags["trainstack.state"] = outcome.run_state
        deadline = time.monotonic() + timeout_s
        for delivery in self.deliveries:
            delivery.put(("tags", tags))
            delivery.put(("end", outcome.status))
        for delivery in self.deliveries:
            delivery.close(max(deadline - time.monotonic(), 0.0))
        for sink in self.sinks:
            writer = getattr(sink, "writer", None)
            if writer is not None:
                writer.close()
        self.deliveries = []

    @contextmanager
    def session(self, stop: Any, job_index: int | None = None) -> Iterator[Tracking]:
        """Around the training loop: on the way out, record how the job ended and drain (bounded)."""
        try:
            yield self
        except BaseException as error:
            self.close(outcome_of(error, False), job_index, STOP_CLOSE_TIMEOUT_S)
            raise
        stopped = bool(getattr(stop, "requested", False))
        self.close(outcome_of(None, stopped), job_index, STOP_CLOSE_TIMEOUT_S if stopped else CLOSE_TIMEOUT_S)


def open_tracking(
    recipe: Recipe,
    rank: int,
    *,
    plan: Any,
    data_source: str,
    data_dir: Path | None,
    environ: Mapping[str, str] | None = None,
    capacity: int = 10_000,
) -> tuple[Tracking, JobContext]:
    """The trackers this job logs to: MLflow when MLFLOW_TRACKING_URI is set, TensorBoard when the recipe
    says so; nothing on other ranks. Never raises: a tracker that cannot be set up is logged and skipped."""
    job = JobContext.from_environment(recipe, environ)
    tracking = Tracking()
    if rank != 0:
        return tracking, job
    try:
        if job.tracking_uri:
            sink = MlflowSink(
                job, run_params(recipe, plan, job, data_source, data_dir), job_tags(recipe, job)
            )
            tracking.sinks.append(sink)
            tracking.deliveries.append(Delivery("mlflow", sink.send, prepare=sink.prepare, capacity=capacity))
        if recipe.tracking.tensorboard:
            from trainer.metrics.tensorboard import default_directory

            sink = TensorBoardSink(default_directory(job.run, recipe.name, dict(environ or os.environ)))
            tracking.sinks.append(sink)
            tracking.deliveries.append(
                Delivery("tensorboard", sink.send, prepare=sink.prepare, capacity=capacity)
            )
    except Exception as exc:  # tracking must never stop a job
        log.warning("tracking is off for this job: %s: %s", type(exc).__name__, exc)
    return tracking, job
