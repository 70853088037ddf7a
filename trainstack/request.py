"""Recipe -> CreateTrainingJob request: one pure function, read by the state machine and the CLI.

The launcher's state machine carries this request in a Step Functions task, where a few values exist
only at run time (the job name, step-count overrides for a short tuning run, the warm-pool period).
Those are passed as `Runtime(...)` markers and rendered as Step Functions `"Key.$"` fields; the CLI
passes literal values instead and gets a request it can print or compare. Everything else is fixed by
the recipe, so the deployed state machine is an exact, reviewable image of the recipe.

No AWS or CDK imports here: names and ARNs come in as arguments (CDK tokens are fine as strings).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trainstack import naming
from trainstack.metrics import metric_definitions
from trainstack.recipe import Recipe, to_hyperparameters

# SageMaker's own limits (../shared/README.md section 6).
MAX_RUNTIME_S = 28 * 24 * 3600
CHECKPOINT_LOCAL_PATH = "/opt/ml/checkpoints"
# A short tuning run keeps its instances warm this long for the next try, unless told otherwise.
WARM_POOL_SECONDS = 1800

# The state machine's execution input: what `trainstack launch` and the launch-on-deploy rule send.
INPUT_JOB_NAME = "JobName"
INPUT_HYPERPARAMETER_OVERRIDES = "HyperParameterOverrides"  # {"training.steps": "50"}; {} for none
INPUT_KEEP_ALIVE = "KeepAlivePeriodInSeconds"


@dataclass(frozen=True)
class Runtime:
    """A value the state machine fills in at run time: a JSONPath or an intrinsic function."""

    expression: str


def execution_input(
    job_name: str, overrides: Mapping[str, str] | None = None, keep_alive_seconds: int = 0
) -> dict:
    """The state machine input that starts `job_name` (overrides are hyperparameters, already encoded)."""
    return {
        INPUT_JOB_NAME: job_name,
        INPUT_HYPERPARAMETER_OVERRIDES: dict(overrides or {}),
        INPUT_KEEP_ALIVE: int(keep_alive_seconds),
    }


def job_name(recipe: Recipe, team: str | None, suffix: str) -> str:
    """`<job-name prefix><recipe hash>-<suffix>`: the hash names the run, the suffix the attempt.

    The prefix (`ts-<team>-<recipe>--`, trainstack.naming) already ends in the separator. The suffix is
    short enough to leave room for a capacity retry's `-c<n>` within SageMaker's 63 characters.
    """
    if not suffix or len(suffix) > naming.RUN_SUFFIX_MAX or not suffix.replace("-", "").isalnum():
        raise ValueError(
            f"job name suffix must be 1-{naming.RUN_SUFFIX_MAX} characters of [a-zA-Z0-9-], got {suffix!r}"
        )
    return f"{naming.job_name_prefix(recipe, team)}{naming.recipe_hash(recipe)}-{suffix}"


def output_prefix(recipe: Recipe, team: str | None) -> str:
    """Key prefix for SageMaker's model output (model.tar.gz) next to the checkpoints."""
    return naming.checkpoint_prefix(recipe, team).replace("checkpoints/", "output/", 1)


def environment(recipe: Recipe) -> dict[str, str]:
    """Container environment: EFA/NCCL settings for multi-node B200 and the allocator fix."""
    return {
        # EFA with current libfabric and aws-ofi-nccl needs only this (shared notes section 6).
        "FI_EFA_USE_HUGE_PAGE": "0",
        "FI_PROVIDER": "efa",
        "FI_EFA_USE_DEVICE_RDMA": "1",
        "NCCL_DEBUG": "WARN",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        # Fragmentation OOMs on B200 went away with this (Megatron-Bridge PR #3775).
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "TRAINSTACK_RECIPE": recipe.name,
        "TRAINSTACK_CHECKPOINT_DIR": CHECKPOINT_LOCAL_PATH,
    }


def tags(recipe: Recipe, team: str | None) -> dict[str, str]:
    """The tags every resource and training job of this deployment carries (set once, here)."""
    return {
        "project": naming.PROJECT,
        "team": team or recipe.tags.team,
        "recipe": recipe.name,
        "cost-center": recipe.tags.cost_center,
        **recipe.tags.extra,
    }


def stopping_condition(recipe: Recipe) -> dict[str, int]:
    from trainstack.planner import plan  # the default job limit follows the planned run time

    runtime = min(int(plan(recipe).run.max_runtime_hours * 3600), MAX_RUNTIME_S)
    compute = recipe.compute
    if compute.spot and compute.max_wait_hours is not None and compute.max_runtime_hours is None:
        # SageMaker requires MaxWait >= MaxRuntime: a spot wait the user capped caps the planned limit too
        # (the run's next job continues where this one stopped).
        runtime = min(runtime, int(compute.max_wait_hours * 3600))
    condition = {"MaxRuntimeInSeconds": runtime}
    if compute.spot:
        # By default allow as long again for capacity waits (and interruptions) as for training.
        hours = compute.max_wait_hours
        wait = int(hours * 3600) if hours is not None else min(2 * runtime, MAX_RUNTIME_S)
        condition["MaxWaitTimeInSeconds"] = max(wait, runtime)
    return condition


def create_training_job_request(
    recipe: Recipe,
    team: str | None,
    *,
    job_name: str | Runtime,
    checkpoint_name: str | Runtime | None = None,
    role_arn: str,
    image_uri: str,
    bucket_name: str,
    kms_key_arn: str | None = None,
    hyperparameters: Mapping[str, str] | Runtime | None = None,
    keep_alive_seconds: int | Runtime | None = None,
    subnet_ids: Sequence[str] = (),
    security_group_ids: Sequence[str] = (),
    network_isolation: bool = False,
    inter_container_encryption: bool = False,
) -> dict[str, Any]:
    """The full CreateTrainingJob request for `recipe` as `team` runs it.

    `hyperparameters` defaults to the recipe's own encoding; `keep_alive_seconds` to the recipe's.
    Checkpoints go under `checkpoint_name` (default: the job name), so retries of one run share them.
    With `subnet_ids` the job runs in a VPC (VpcConfig; network isolation and inter-container
    encryption are explicit choices). Keys whose value is a `Runtime` are emitted as `"Key.$"`.
    """
    compute = recipe.compute
    checkpoint_base = f"s3://{bucket_name}/{naming.checkpoint_prefix(recipe, team)}"
    run_name = job_name if checkpoint_name is None else checkpoint_name
    if isinstance(run_name, Runtime):
        # Each job checkpoints under its own name; SageMaker syncs /opt/ml/checkpoints there.
        checkpoint_uri: str | Runtime = Runtime(
            f"States.Format('{checkpoint_base}/{{}}', {run_name.expression})"
        )
    else:
        checkpoint_uri = f"{checkpoint_base}/{run_name}"

    resource_config: dict[str, Any] = {
        "InstanceType": compute.instance_type,
        "InstanceCount": compute.instance_count,
    }
    if not recipe.instance.has_instance_store:
        # An EBS volume only where there is one: on local NVMe SageMaker provisions no EBS volume, refuses
        # VolumeKmsKeyId (a hardware module encrypts the instance store) and a size above the NVMe
        # capacity (SageMaker API reference, ResourceConfig; trainstack.hardware).
        resource_config["VolumeSizeInGB"] = compute.volume_size_gb
        if kms_key_arn:
            resource_config["VolumeKmsKeyId"] = kms_key_arn
    if not compute.spot:
        # "SageMaker Managed Warm Pools cannot be used with spot instances" (developer guide, warm pools,
        # Considerations): a spot recipe's jobs never ask for one, whatever the launch passes.
        _put(
            resource_config,
            "KeepAlivePeriodInSeconds",
            compute.keep_alive_seconds if keep_alive_seconds is None else keep_alive_seconds,
        )
    if compute.training_plan_arn:
        resource_config["TrainingPlanArn"] = compute.training_plan_arn

    algorithm: dict[str, Any] = {
        "TrainingImage": image_uri,
        "TrainingInputMode": "FastFile" if recipe.data.train_s3_uri else "File",
        "MetricDefinitions": metric_definitions(),
        "EnableSageMakerMetricsTimeSeries": True,
    }
    output: dict[str, Any] = {"S3OutputPath": f"s3://{bucket_name}/{output_prefix(recipe, team)}"}
    if kms_key_arn:
        output["KmsKeyId"] = kms_key_arn
    checkpoint: dict[str, Any] = {"LocalPath": CHECKPOINT_LOCAL_PATH}
    _put(checkpoint, "S3Uri", checkpoint_uri)

    request: dict[str, Any] = {}
    _put(request, "TrainingJobName", job_name)
    request.update(
        {
            "RoleArn": role_arn,
            "AlgorithmSpecification": algorithm,
            "ResourceConfig": resource_config,
            "StoppingCondition": stopping_condition(recipe),
            "CheckpointConfig": checkpoint,
            "OutputDataConfig": output,
            "RetryStrategy": {"MaximumRetryAttempts": compute.max_retry_attempts},
            # Health checks on the nodes before the job starts paying for a multi-day run.
            "InfraCheckConfig": {"EnableInfraCheck": True},
            "EnableManagedSpotTraining": compute.spot,
            "Environment": environment(recipe),
            "Tags": [{"Key": k, "Value": v} for k, v in tags(recipe, team).items()],
        }
    )
    _put(
        request, "HyperParameters", to_hyperparameters(recipe) if hyperparameters is None else hyperparameters
    )
    if recipe.data.train_s3_uri:
        request["InputDataConfig"] = [
            {
                "ChannelName": "train",
                "DataSource": {
                    "S3DataSource": {
                        "S3DataType": "S3Prefix",
                        "S3Uri": recipe.data.train_s3_uri,
                        "S3DataDistributionType": "FullyReplicated",
                    }
                },
            }
        ]
    if subnet_ids:
        request["VpcConfig"] = {"SecurityGroupIds": list(security_group_ids), "Subnets": list(subnet_ids)}
        request["EnableNetworkIsolation"] = network_isolation
        request["EnableInterContainerTrafficEncryption"] = inter_container_encryption
    return request


def _put(target: dict[str, Any], key: str, value: Any) -> None:
    if isinstance(value, Runtime):
        target[f"{key}.$"] = value.expression
    else:
        target[key] = dict(value) if isinstance(value, Mapping) else value


def hyperparameter_overrides(base: Recipe, changed: Recipe) -> dict[str, str]:
    """The encoded hyperparameters that differ between two resolutions of one recipe."""
    old, new = to_hyperparameters(base), to_hyperparameters(changed)
    return {k: v for k, v in new.items() if old.get(k) != v}
