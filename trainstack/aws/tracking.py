"""Experiment tracking on the AWS side: what a job's request carries (pure) and what the CLI does with MLflow.

Where runs go is the recipe's `tracking.mlflow` (a team sets it in its defaults.yaml): `off`; an MLflow App
or tracking server ARN; or `managed`, the team's own SageMaker MLflow App, which the team's tracking stack
`Trainstack-<team>-Tracking` creates once for all of the team's recipes and exports as
`Trainstack-<team>-MlflowAppArn` (stacks/tracking.py). Every job of a run gets:

- `MlflowConfig {MlflowResourceArn, MlflowExperimentName, MlflowRunName}` (CreateTrainingJob; SageMaker
  links the job to the MLflow resource and returns `MlflowDetails` from DescribeTrainingJob);
- MLFLOW_TRACKING_URI (the ARN; the sagemaker-mlflow plugin in the image signs requests with the job's
  role), MLFLOW_EXPERIMENT_NAME, TRAINSTACK_TEAM, TRAINSTACK_IMAGE and TRAINSTACK_PREVIOUS_JOB_END (why the
  run's previous job ended, as the supervisor decided) in its environment; the trainer
  (trainer.metrics.tracking) appends to the MLflow run tagged `trainstack.run=<run>`, which
  `trainstack launch` creates.

With `tracking.tensorboard`, TensorBoardOutputConfig syncs the trainer's event files to
`s3://<bucket>/output/<team>/<recipe>/tensorboard/` (one folder per run below it).

The MLflow client (mlflow-skinny; sagemaker-mlflow for ARNs) is imported only by the functions that talk
to a tracker, and only when tracking is on.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainstack.protocol.tracking import (
    RUN_TAG,
    default_experiment,
    run_filter,
    sagemaker_headers_for_arns_only,
)
from trainstack.recipes.naming import STACK_PROJECT
from trainstack.recipes.schema import Recipe

TRACKING_STACK_SUFFIX = "Tracking"
MLFLOW_ARN_EXPORT = "MlflowAppArn"
TENSORBOARD_LOCAL_PATH = "/opt/ml/output/tensorboard"  # TensorBoardOutputConfig.LocalPath's default
# CreateTrainingJob Environment values are at most 512 characters (botocore model, TrainingEnvironmentValue):
# the supervisor passes its rule's id there, the CLI's resume at most this much of the run's `why`.
PREVIOUS_JOB_END_MAX = 512


def team_of(recipe: Recipe, team: str | None) -> str:
    return team or recipe.tags.team


def tracking_stack_name(team: str) -> str:
    return f"{STACK_PROJECT}-{team}-{TRACKING_STACK_SUFFIX}"


def mlflow_app_name(team: str) -> str:
    """The team's SageMaker MLflow App (CreateMlflowApp: 1-256 letters, digits and hyphens)."""
    return f"trainstack-{team}"


def mlflow_arn_export(team: str) -> str:
    """The export the team's tracking stack gives its MLflow App ARN under."""
    return f"{STACK_PROJECT}-{team}-{MLFLOW_ARN_EXPORT}"


def experiment_name(recipe: Recipe, team: str | None) -> str:
    return recipe.tracking.experiment or default_experiment(team_of(recipe, team), recipe.name)


def tracks_mlflow(recipe: Recipe) -> bool:
    return recipe.tracking.mlflow != "off"


def _put(target: dict[str, Any], key: str, value: Any) -> None:
    """As trainstack.aws.request does: a run-time value (`Runtime`, with `.expression`) as `"Key.$"`."""
    expression = getattr(value, "expression", None)
    if isinstance(expression, str):
        target[f"{key}.$"] = expression
    else:
        target[key] = value


def request_fields(
    recipe: Recipe, team: str | None, *, mlflow_arn: str | None, run: Any, output_s3_uri: str
) -> dict[str, Any]:
    """CreateTrainingJob's MlflowConfig and TensorBoardOutputConfig for `recipe` (`run` a literal name or a
    trainstack.aws.request.Runtime; event files go to `<output_s3_uri>/tensorboard/`); {} when the recipe
    tracks nothing."""
    fields: dict[str, Any] = {}
    if tracks_mlflow(recipe):
        if not mlflow_arn:
            raise ValueError(f"tracking.mlflow is {recipe.tracking.mlflow}: no MLflow ARN given")
        config: dict[str, Any] = {
            "MlflowResourceArn": mlflow_arn,
            "MlflowExperimentName": experiment_name(recipe, team),
        }
        if run is not None:
            _put(config, "MlflowRunName", run)
        fields["MlflowConfig"] = config
    if recipe.tracking.tensorboard:
        fields["TensorBoardOutputConfig"] = {
            "LocalPath": TENSORBOARD_LOCAL_PATH,
            "S3OutputPath": f"{output_s3_uri.rstrip('/')}/tensorboard/",
        }
    return fields


def environment(
    recipe: Recipe,
    team: str | None,
    *,
    mlflow_arn: str | None,
    image_uri: str | None,
    previous_job_end: Any = None,
) -> dict[str, Any]:
    """The job's tracking environment (MLflow's own variables, and what the trainer tags runs with)."""
    if not tracks_mlflow(recipe):
        return {}
    env: dict[str, Any] = {
        "MLFLOW_TRACKING_URI": mlflow_arn,
        "MLFLOW_EXPERIMENT_NAME": experiment_name(recipe, team),
        "TRAINSTACK_TEAM": team_of(recipe, team),
    }
    if image_uri:
        env["TRAINSTACK_IMAGE"] = image_uri
    if previous_job_end is not None:
        _put(env, "TRAINSTACK_PREVIOUS_JOB_END", previous_job_end)
    return env


# --- the CLI's MLflow (launch creates the run; runs --mlflow prints where it is) -------------------


@dataclass(frozen=True)
class MlflowRun:
    tracking_uri: str
    experiment_id: str
    run_id: str
    status: str
    tags: Mapping[str, str]

    @property
    def url(self) -> str:
        return run_url(self.tracking_uri, self.experiment_id, self.run_id)


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """Where a person opens the run: the server's UI page, or, for SageMaker's managed MLflow (whose UI
    needs a presigned URL), the ARN and the page inside it."""
    page = f"#/experiments/{experiment_id}/runs/{run_id}"
    if tracking_uri.startswith("arn:"):
        kind = "app" if ":mlflow-app/" in tracking_uri else "tracking-server"
        return (
            f"{tracking_uri} {page} (open the UI with `aws sagemaker create-presigned-mlflow-{kind}-url "
            f"--arn {tracking_uri}`)"
        )
    return f"{tracking_uri.rstrip('/')}/{page}"


def client(tracking_uri: str) -> Any:
    """An MLflow client for `tracking_uri`. The sagemaker-mlflow plugin reads the process's tracking URI
    (not the client's) for its routing header, so for an ARN that is set too. Only then:
    `mlflow.set_tracking_uri` also exports MLFLOW_TRACKING_URI to os.environ, where it would outlive
    this call and switch tracking on for whatever runs next in the process. The plugin's header provider
    is consulted for ARNs only (protocol.tracking.sagemaker_headers_for_arns_only)."""
    import mlflow
    from mlflow.tracking import MlflowClient

    sagemaker_headers_for_arns_only()
    if tracking_uri.startswith("arn:"):
        mlflow.set_tracking_uri(tracking_uri)
    return MlflowClient(tracking_uri=tracking_uri)


def _experiment_id(mlflow_client: Any, name: str, create: bool) -> str | None:
    found = mlflow_client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    return mlflow_client.create_experiment(name) if create else None


def find_run(tracking_uri: str, experiment: str, run: str, run_id: str = "") -> MlflowRun | None:
    """The MLflow run of trainstack run `run` (by its id when known, else by its tag)."""
    mlflow_client = client(tracking_uri)
    if run_id:
        found = mlflow_client.get_run(run_id)
    else:
        experiment_id = _experiment_id(mlflow_client, experiment, create=False)
        if experiment_id is None:
            return None
        hits = mlflow_client.search_runs(
            [experiment_id],
            filter_string=run_filter(run),
            max_results=1,
            order_by=["attributes.start_time ASC"],
        )
        if not hits:
            return None
        found = hits[0]
    info = found.info
    return MlflowRun(tracking_uri, info.experiment_id, info.run_id, info.status, dict(found.data.tags))


def create_run(tracking_uri: str, experiment: str, run: str, tags: Mapping[str, str]) -> MlflowRun:
    """The MLflow run of trainstack run `run`, created at launch (or the one already tagged with it)."""
    existing = find_run(tracking_uri, experiment, run)
    if existing is not None:
        return existing
    mlflow_client = client(tracking_uri)
    experiment_id = _experiment_id(mlflow_client, experiment, create=True)
    created = mlflow_client.create_run(experiment_id, run_name=run, tags={RUN_TAG: run, **tags})
    # Created and waiting for its first job: the trainer sets it RUNNING when a job starts.
    mlflow_client.update_run(created.info.run_id, status="SCHEDULED")
    return MlflowRun(tracking_uri, experiment_id, created.info.run_id, "SCHEDULED", {RUN_TAG: run, **tags})


def record_state(found: MlflowRun, state: str, why: str, ended: Mapping[str, str]) -> dict[str, str]:
    """Write the run registry's final word into the MLflow run: `trainstack.state`, why the newest job ended
    and every ended job's SageMaker status (`trainstack.job.<n>.status`); returns the tags that changed."""
    tags = {"trainstack.state": state, "trainstack.why": why}
    tags.update({f"trainstack.job.{index}.status": status for index, status in ended.items()})
    changed = {k: v for k, v in tags.items() if found.tags.get(k) != v}
    if changed:
        from mlflow.entities import RunTag

        client(found.tracking_uri).log_batch(found.run_id, tags=[RunTag(k, v) for k, v in changed.items()])
    return changed


def register_export(
    tracking_uri: str,
    run: MlflowRun | None,
    model_name: str,
    artifact_uri: str,
    tags: Mapping[str, str] | None = None,
) -> str:
    """Register an exported model (its S3 location, e.g. `trainstack export`'s output) as a new version of
    registered model `model_name`, linked to the MLflow run it came from; returns the version number."""
    from mlflow.exceptions import MlflowException

    mlflow_client = client(tracking_uri)
    try:
        mlflow_client.create_registered_model(model_name)
    except MlflowException as error:
        if getattr(error, "error_code", "") != "RESOURCE_ALREADY_EXISTS":
            raise
    version = mlflow_client.create_model_version(
        model_name,
        source=artifact_uri,
        run_id=run.run_id if run is not None else None,
        tags=dict(tags or {}),
    )
    return str(version.version)


def deliver_kept(found: MlflowRun, checkpoint_uri: str, s3: Any = None) -> int:
    """Deliver the tracking records the run's jobs could not (kept beside its checkpoints,
    trainstack.protocol.kept_metrics) into its MLflow run, oldest file first, each in step order, each
    file deleted once delivered; the number of records. `s3` is a boto3 S3 client for an s3:// location.
    A record the run already holds (delivered by the run's next job meanwhile) adds nothing."""
    from mlflow.entities import Metric, RunTag

    from trainstack.protocol.kept_metrics import decode

    files = _KeptFiles(checkpoint_uri, s3)
    mlflow_client, delivered = client(found.tracking_uri), 0
    for name in files.names():
        metrics, tags = decode(files.read(name))
        batch = [Metric(k, v, wall_ms, step) for step, values, wall_ms in metrics for k, v in values.items()]
        for start in range(0, len(batch), MLFLOW_BATCH_METRICS):
            mlflow_client.log_batch(found.run_id, metrics=batch[start : start + MLFLOW_BATCH_METRICS])
        if tags:
            mlflow_client.log_batch(found.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        files.delete(name)
        delivered += len(metrics) + (1 if tags else 0)
    return delivered


# Log Batch's limit per request (mlflow.org REST API), as trainer.metrics.tracking
MLFLOW_BATCH_METRICS = 1000


class _KeptFiles:
    """The kept files of a run's checkpoint location: an s3:// prefix (boto3: ListObjectsV2 paginated,
    GetObject, DeleteObject) or a local directory."""

    def __init__(self, checkpoint_uri: str, s3: Any) -> None:
        from urllib.parse import urlsplit

        from trainstack.protocol.kept_metrics import KEPT_DIR

        self.s3 = s3
        parts = urlsplit(checkpoint_uri)
        if parts.scheme == "s3":
            prefix = parts.path.strip("/")
            self.bucket, self.prefix = parts.netloc, f"{prefix}/{KEPT_DIR}/" if prefix else f"{KEPT_DIR}/"
            self.root = None
        else:
            from pathlib import Path

            self.bucket, self.prefix, self.root = None, "", Path(checkpoint_uri) / KEPT_DIR

    def names(self) -> list[str]:
        from trainstack.protocol.kept_metrics import is_kept_name

        if self.root is not None:
            found = [p.name for p in self.root.iterdir()] if self.root.is_dir() else []
        else:
            found = []
            pages = self.s3.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix, Delimiter="/"
            )
            for page in pages:
                found.extend(item["Key"][len(self.prefix) :] for item in page.get("Contents", []))
        return sorted(name for name in found if is_kept_name(name))

    def read(self, name: str) -> bytes:
        if self.root is not None:
            path = self.root / name
            return path.read_bytes() if path.is_file() else b""
        try:
            return self.s3.get_object(Bucket=self.bucket, Key=self.prefix + name)["Body"].read()
        except self.s3.exceptions.NoSuchKey:  # delivered and deleted by the run's next job meanwhile
            return b""

    def delete(self, name: str) -> None:
        if self.root is not None:
            (self.root / name).unlink(missing_ok=True)
        else:
            self.s3.delete_object(Bucket=self.bucket, Key=self.prefix + name)


def record_tuning(
    tracking_uri: str,
    experiment: str,
    tuning_run: str,
    tags: Mapping[str, str],
    summary: Mapping[str, Any],
    candidates: list[Mapping[str, Any]],
) -> MlflowRun:
    """A tuning run in MLflow: one parent run (tag `trainstack.tuning`, the choice as tags) and one
    child per candidate (MLflow's `mlflow.parentRunId` tag) with its planned and measured figures as
    metrics (`planned.*`, `measured.*`), its overrides and status as tags."""
    from mlflow.entities import Metric, Param

    mlflow_client = client(tracking_uri)
    experiment_id = _experiment_id(mlflow_client, experiment, create=True)
    parent_tags = {
        "trainstack.tuning": tuning_run,
        **tags,
        **{f"trainstack.{k}": str(v) for k, v in summary.items()},
    }
    parent = mlflow_client.create_run(experiment_id, run_name=tuning_run, tags=parent_tags)
    now = int(time.time() * 1000)
    for c in candidates:
        child = mlflow_client.create_run(
            experiment_id,
            run_name=f"{tuning_run}/{c['name']}",
            tags={
                "mlflow.parentRunId": parent.info.run_id,
                "trainstack.tuning": tuning_run,
                "trainstack.status": c["status"],
                "trainstack.layout": c["layout"],
                **({"trainstack.why": str(c["why"])[:5000]} if c.get("why") else {}),
            },
        )
        metrics = [
            Metric(f"{kind}.{key}", float(value), now, 0)
            for kind in ("planned", "measured")
            for key, value in (c.get(kind) or {}).items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        ]
        params = [Param("overrides", " ".join(c["overrides"]) or "(the recipe's own layout)")]
        mlflow_client.log_batch(child.info.run_id, metrics=metrics, params=params)
        mlflow_client.set_terminated(child.info.run_id, "FINISHED" if c["status"] == "ok" else "FAILED")
    mlflow_client.set_terminated(parent.info.run_id, "FINISHED")
    return MlflowRun(tracking_uri, experiment_id, parent.info.run_id, "FINISHED", parent_tags)
