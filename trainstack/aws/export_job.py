"""A run's checkpoint -> a Hugging Face folder in S3, as a SageMaker training job (one pure function).

The export job runs the training image on one CPU instance (trainstack.planner.models_io.plan_export
sizes it from the model: memory to stream the largest tensor, not the whole model) with the container
entrypoint `python -m trainer.export`, the run's recipe as its hyperparameters, the run's checkpoint
prefix as input and `s3://<bucket>/exports/<team>/<recipe>/<run id>/` as the parent of its output: the
export writes `step-N/` there, N the step it exported (the newest complete one unless told).

Its name is the run's name with `-X<n>` (n = 1..9, the run's n-th export), so it carries the recipe's
job-name prefix, which the execution role's trust condition requires, and never looks like a run or
a job of one: run ids are lowercase (trainstack.recipes.naming.RUN_ID), so no run name ends in `-X1`
(a default run id may well end in `-x1`), and a run's jobs end in `-<index>`. It has no
TRAINSTACK_RUN in its environment: the run supervisor, which hears about every job of the prefix,
leaves it alone.

Both starts go through the deployment's Export state machine (stacks/export.py), which creates the job
and records it in the run registry: `trainstack export RUN` and, with `export.on_complete`, the run
supervisor when a run completes.
"""

from __future__ import annotations

import re
from typing import Any

from trainstack.aws.request import Runtime, _put, output_prefix, tags
from trainstack.planner.models_io import plan_export
from trainstack.protocol.metrics import export_metric_definitions
from trainstack.recipes import naming
from trainstack.recipes.schema import Recipe, to_hyperparameters

EXPORTS_PER_RUN = 9  # `-X1` .. `-X9`: a run name may be 60 characters, a job name 63
EXPORT_JOB = re.compile(r"-X[1-9]\Z")  # `\Z`: `$` would also match before a trailing newline
ENTRYPOINT = ["python", "-m", "trainer.export"]
STOP_FACTOR = 4.0  # the job's limit: this many times its planned hours, plus an hour
INPUT_STEP = "Step"  # the step to export; 0: the newest complete checkpoint
STEP_ARGUMENT = Runtime("States.Format('{}', $.Step)")  # container arguments are strings
INPUT_REASON = "Reason"
EXPORT_REASONS = ("cli", "on_complete")


def export_job_name(run: str, index: int) -> str:
    if not 1 <= index <= EXPORTS_PER_RUN:
        raise ValueError(f"a run has at most {EXPORTS_PER_RUN} exports, this would be its {index}th")
    name = f"{run}-X{index}"
    assert len(name) <= naming.JOB_NAME_MAX, name
    return name


def is_export_job(name: str) -> bool:
    return bool(EXPORT_JOB.search(name))


def exports_prefix(recipe: Recipe, team: str | None) -> str:
    """`exports/<team>/<recipe>`: beside `checkpoints/<team>/<recipe>` in the deployment's bucket."""
    return naming.checkpoint_prefix(recipe, team).replace("checkpoints/", "exports/", 1)


def export_parent_uri(bucket_name: str, recipe: Recipe, team: str | None, run_id: str) -> str:
    return f"s3://{bucket_name}/{exports_prefix(recipe, team)}/{run_id}/"


def export_input(run: str, run_id: str, step: int | None = None, reason: str = "cli") -> dict[str, Any]:
    """The Export state machine's execution input."""
    if reason not in EXPORT_REASONS:
        raise ValueError(f"reason must be one of {EXPORT_REASONS}, got {reason!r}")
    return {"Run": run, "RunId": run_id, INPUT_STEP: int(step or 0), INPUT_REASON: reason}


def export_job_request(
    recipe: Recipe,
    team: str | None,
    *,
    job_name: str | Runtime,
    checkpoint_uri: str | Runtime,
    out_parent: str | Runtime,
    step: str | Runtime,
    role_arn: str,
    image_uri: str,
    bucket_name: str,
    kms_key_arn: str | None = None,
    region: str | None = None,
) -> dict[str, Any]:
    """The CreateTrainingJob request of one export of a run of `recipe` (Runtime markers allowed)."""
    planned = plan_export(recipe)
    resources: dict[str, Any] = {
        "InstanceType": planned.instance_type,
        "InstanceCount": 1,
        "VolumeSizeInGB": planned.volume_gb,  # ml.m5 types are EBS-only: the key encrypts the volume
    }
    if kms_key_arn:
        resources["VolumeKmsKeyId"] = kms_key_arn
    algorithm: dict[str, Any] = {
        "TrainingImage": image_uri,
        "TrainingInputMode": "File",
        "ContainerEntrypoint": ENTRYPOINT,
        # the step it exported, for `trainstack runs` to name the folder it wrote
        "MetricDefinitions": export_metric_definitions(),
    }
    arguments = ["--checkpoint", checkpoint_uri, "--out-parent", out_parent, "--step", step]
    if all(isinstance(a, str) for a in arguments):
        algorithm["ContainerArguments"] = arguments
    else:  # one array of strings built at run time from the execution's values
        parts = [a.expression if isinstance(a, Runtime) else f"'{a}'" for a in arguments]
        algorithm["ContainerArguments.$"] = f"States.Array({', '.join(parts)})"
    output: dict[str, Any] = {"S3OutputPath": f"s3://{bucket_name}/{output_prefix(recipe, team)}"}
    if kms_key_arn:
        output["KmsKeyId"] = kms_key_arn
    request: dict[str, Any] = {}
    _put(request, "TrainingJobName", job_name)
    request.update(
        {
            "RoleArn": role_arn,
            "AlgorithmSpecification": algorithm,
            "ResourceConfig": resources,
            "StoppingCondition": {"MaxRuntimeInSeconds": int((planned.hours * STOP_FACTOR + 1) * 3600)},
            "HyperParameters": to_hyperparameters(recipe),
            "OutputDataConfig": output,
            "Environment": {"AWS_REGION": region} if region else {},
            "Tags": [{"Key": k, "Value": v} for k, v in tags(recipe, team).items()],
        }
    )
    return request
