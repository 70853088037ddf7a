"""Recipe -> CreateTrainingJob request: one pure function, read by the state machine and the CLI.

The run supervisor's "start job" state machine carries this request in a Step Functions task, where a few
values exist only at run time (the run and the job's index in it, step-count overrides for a short tuning
run, the warm-pool period).
Those are passed as `Runtime(...)` markers and rendered as Step Functions `"Key.$"` fields; the CLI
passes literal values instead and gets a request it can print or compare. Everything else is fixed by
the recipe, so the deployed state machine is an exact, reviewable image of the recipe.

No AWS or CDK imports here: names and ARNs come in as arguments (CDK tokens are fine as strings).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trainstack.aws import tracking
from trainstack.protocol.metrics import metric_definitions
from trainstack.recipes import naming
from trainstack.recipes.schema import Recipe, to_hyperparameters

# SageMaker's own limits (../shared/README.md section 6).
MAX_RUNTIME_S = 28 * 24 * 3600
# A short tuning run keeps its instances warm this long for the next try, unless told otherwise.
WARM_POOL_SECONDS = 1800

# The "start job" state machine's execution input: what `trainstack launch` / `resume`, the
# launch-on-deploy rule, the reconciler and the "job ended" state machine (the run's next job) send.
INPUT_RUN = "Run"  # the run's name, ts-<team>-<recipe>--<run id> (trainstack.recipes.naming.run_name)
INPUT_RUN_ID = "RunId"  # the run id: its checkpoint folder
INPUT_JOB = "Job"  # the index of the job to start, 1-based
INPUT_HYPERPARAMETER_OVERRIDES = "HyperParameterOverrides"  # launch: {"training.steps": "50"}; {} for none
INPUT_KEEP_ALIVE = "KeepAlivePeriodInSeconds"
INPUT_STEPS = "Steps"  # the run's training.steps (the registry keeps it for progress)
INPUT_REASON = "Reason"  # why the job starts: one of START_REASONS
INPUT_MLFLOW_RUN_ID = "MlflowRunId"  # the MLflow run `launch` created ("" when none); the registry records it
# resume and recreate: the run's CreateTrainingJob request as recorded (without TrainingJobName);
# launch builds it from the deployed recipe instead.
INPUT_REQUEST = "Request"
INPUT_JOB_ENVIRONMENT = "JobEnvironment"  # this job only, never recorded: {"TRAINSTACK_RESUME_STEP": "1200"}
INPUT_LIMITS = "Limits"  # resume: {"MaxJobs", "CapacityMinutes", "StopStalled"} of the run's recipe
INPUT_CHANGE = "Change"  # launch: {"Who", "What"}, the first entry of the run's history
INPUT_HISTORY = "History"  # resume: the run's whole history, the resume's own entry last
INPUT_CREATOR = "Creator"  # recreate: the execution that registered the job and did not create it
START_REASONS = ("launch", "resume", "next", "recreate")
RESUME_STEP_ENV = "TRAINSTACK_RESUME_STEP"  # resume --from-step N: the trainer restores step N
# Why the run's previous job ended, for the trainer's tracking tags (a JobEnvironment entry; aws.tracking)
PREVIOUS_JOB_END_ENV = "TRAINSTACK_PREVIOUS_JOB_END"


@dataclass(frozen=True)
class Runtime:
    """A value the state machine fills in at run time: a JSONPath or an intrinsic function."""

    expression: str


def run_limits(recipe: Recipe) -> dict[str, Any]:
    """The limits a launch or resume gives the run, from its recipe (the registry records them)."""
    return {
        "MaxJobs": recipe.compute.max_jobs,
        "CapacityMinutes": round(recipe.compute.capacity_wait_hours * 60),
        "StopStalled": recipe.monitoring.stop_stalled,
    }


def execution_input(
    run: str,
    run_id: str,
    job: int,
    steps: int,
    overrides: Mapping[str, str] | None = None,
    keep_alive_seconds: int = 0,
    reason: str = "launch",
    *,
    mlflow_run_id: str = "",
    request: Mapping[str, Any] | None = None,
    job_environment: Mapping[str, str] | None = None,
    limits: Mapping[str, Any] | None = None,
    change: Mapping[str, str] | None = None,
    history: list[Mapping[str, str]] | None = None,
    creator: str | None = None,
) -> dict:
    """The input that starts job `job` of `run` (overrides are hyperparameters, already encoded)."""
    if reason not in START_REASONS:
        raise ValueError(f"reason must be one of {START_REASONS}, got {reason!r}")
    if not 1 <= job <= naming.JOB_INDEX_MAX:
        raise ValueError(f"need 1 <= job ({job}) <= {naming.JOB_INDEX_MAX}")
    if reason in ("resume", "recreate") and request is None:
        raise ValueError(f"a {reason} carries the run's recorded request")
    if reason == "launch" and request is not None:
        raise ValueError("a launch builds its request from the deployed recipe")
    found = {
        INPUT_RUN: run,
        INPUT_RUN_ID: run_id,
        INPUT_JOB: int(job),
        INPUT_HYPERPARAMETER_OVERRIDES: dict(overrides or {}),
        INPUT_KEEP_ALIVE: int(keep_alive_seconds),
        INPUT_STEPS: int(steps),
        INPUT_REASON: reason,
        INPUT_JOB_ENVIRONMENT: dict(job_environment or {}),
        INPUT_CHANGE: dict(change or {"Who": "unknown", "What": reason}),
        INPUT_MLFLOW_RUN_ID: mlflow_run_id,
    }
    if request is not None:
        found[INPUT_REQUEST] = dict(request)
    if limits is not None:
        found[INPUT_LIMITS] = dict(limits)
    if creator is not None:
        found[INPUT_CREATOR] = creator
    if reason == "resume":
        found[INPUT_HISTORY] = [dict(h) for h in history or []]
    return found


def job_name(recipe: Recipe, team: str | None, suffix: str) -> str:
    """`<job-name prefix><recipe hash>-<suffix>`: the name of the run with the default id for `suffix`
    (`naming.run_name(recipe, team, naming.default_run_id(recipe, suffix))`); its jobs append `-<n>`.

    Kept under this name for the callers that only need a name in this recipe's job namespace.
    """
    return naming.run_name(recipe, team, naming.default_run_id(recipe, suffix))


def checkpoint_uri(bucket_name: str, recipe: Recipe, team: str | None, run_id: str) -> str:
    """`s3://<bucket>/checkpoints/<team>/<recipe>/<run id>/`: where every job of the run saves and resumes."""
    return f"s3://{bucket_name}/{naming.run_checkpoint_prefix(recipe, team, run_id)}"


def output_prefix(recipe: Recipe, team: str | None) -> str:
    """Key prefix for SageMaker's model output (model.tar.gz) next to the checkpoints."""
    return naming.checkpoint_prefix(recipe, team).replace("checkpoints/", "output/", 1)


def environment(
    recipe: Recipe,
    run: str | Runtime | None = None,
    checkpoint_uri: str | Runtime | None = None,
    region: str | None = None,
) -> dict[str, Any]:
    """Container environment: EFA/NCCL settings for multi-node B200, the allocator fix, and the run.

    `TRAINSTACK_CHECKPOINT_URI` is the run's S3 prefix, which every rank writes and reads directly;
    no CheckpointConfig is sent (SageMaker's sync would restore every kept checkpoint onto every node).
    `AWS_REGION` is the bucket's region for those writes: SageMaker's docs do not promise it in a training
    container. NCCL_DEBUG is left to the image's entrypoint: on several hosts it sets INFO for the INIT
    and NET subsystems into a per-process file, which the trainer's comms gate reads to check that NCCL
    runs over EFA (a job-level NCCL_DEBUG would switch that off and the gate would stop every job).
    """
    env: dict[str, Any] = {
        # EFA with current libfabric and aws-ofi-nccl needs only this (shared notes section 6).
        "FI_EFA_USE_HUGE_PAGE": "0",
        "FI_PROVIDER": "efa",
        "FI_EFA_USE_DEVICE_RDMA": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        # Fragmentation OOMs on B200 went away with this (Megatron-Bridge PR #3775).
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "TRAINSTACK_RECIPE": recipe.name,
    }
    if run is not None:
        _put(env, "TRAINSTACK_RUN", run)
    if checkpoint_uri is not None:
        _put(env, "TRAINSTACK_CHECKPOINT_URI", checkpoint_uri)
    if region is not None:
        env["AWS_REGION"] = region
    return env


RUN_TAG = "run"  # training jobs also carry their run's name (cost allocation per run)


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
    run: str | Runtime | None = None,
    checkpoint_uri: str | Runtime | None = None,
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
    region: str | None = None,
    mlflow_arn: str | None = None,
    previous_job_end: str | Runtime | None = None,
) -> dict[str, Any]:
    """The full CreateTrainingJob request for `recipe` as `team` runs it.

    `hyperparameters` defaults to the recipe's own encoding; `keep_alive_seconds` to the recipe's.
    Every job of `run` gets the run's `checkpoint_uri` (trainstack.aws.request.checkpoint_uri) in its
    environment, so each resumes from the newest checkpoint any job of the run saved. The supervisor and
    the CLI always pass both; without them the request is a lone job's, with no run to resume.
    With `subnet_ids` the job runs in a VPC (VpcConfig; network isolation and inter-container
    encryption are explicit choices). Keys whose value is a `Runtime` are emitted as `"Key.$"`.
    `mlflow_arn`: the team's managed MLflow App when `tracking.mlflow` is `managed` (a recipe's own ARN wins);
    MlflowConfig, TensorBoardOutputConfig and the tracking environment: trainstack.aws.tracking.
    """
    from trainstack.planner.input_mode import input_plan  # how the shards reach the nodes, and why

    compute = recipe.compute
    inputs = input_plan(recipe)

    resource_config: dict[str, Any] = {
        "InstanceType": compute.instance_type,
        "InstanceCount": compute.instance_count,
    }
    if not recipe.instance.has_instance_store:
        # An EBS volume only where there is one: on local NVMe SageMaker provisions no EBS volume, refuses
        # VolumeKmsKeyId (a hardware module encrypts the instance store) and a size above the NVMe
        # capacity (SageMaker API reference, ResourceConfig; trainstack.recipes.hardware).
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
        "TrainingInputMode": inputs.mode or "File",
        "MetricDefinitions": metric_definitions(recipe.data.source_names),
        "EnableSageMakerMetricsTimeSeries": True,
    }
    output: dict[str, Any] = {"S3OutputPath": f"s3://{bucket_name}/{output_prefix(recipe, team)}"}
    if kms_key_arn:
        output["KmsKeyId"] = kms_key_arn
    run_tags: list[dict[str, Any]] = []
    if run is not None:
        run_tags.append({"Key": RUN_TAG})
        _put(run_tags[0], "Value", run)

    request: dict[str, Any] = {}
    _put(request, "TrainingJobName", job_name)
    request.update(
        {
            "RoleArn": role_arn,
            "AlgorithmSpecification": algorithm,
            "ResourceConfig": resource_config,
            "StoppingCondition": stopping_condition(recipe),
            "OutputDataConfig": output,
            "RetryStrategy": {"MaximumRetryAttempts": compute.max_retry_attempts},
            # Health checks on the nodes before the job starts paying for a multi-day run.
            "InfraCheckConfig": {"EnableInfraCheck": True},
            "EnableManagedSpotTraining": compute.spot,
            "Environment": {
                **environment(recipe, run, checkpoint_uri, region),
                **tracking.environment(
                    recipe,
                    team,
                    mlflow_arn=recipe.tracking.mlflow_arn or mlflow_arn,
                    image_uri=image_uri,
                    previous_job_end=previous_job_end,
                ),
            },
            "Tags": [{"Key": k, "Value": v} for k, v in tags(recipe, team).items()] + run_tags,
        }
    )
    _put(
        request, "HyperParameters", to_hyperparameters(recipe) if hyperparameters is None else hyperparameters
    )
    if inputs.channels:  # data.train_s3_uri as channel "train", or one train_<name> per blend source
        request["InputDataConfig"] = [
            {
                "ChannelName": channel,
                "DataSource": {
                    "S3DataSource": {
                        "S3DataType": "S3Prefix",
                        "S3Uri": uri,
                        "S3DataDistributionType": "FullyReplicated",
                    }
                },
                "InputMode": inputs.mode,
            }
            for channel, uri in inputs.channels
        ]
    if recipe.model.init_from and recipe.model.init_from.startswith("s3://"):
        from trainstack.aws.channels import base_channel  # models in and out (docs/models.md)

        request.setdefault("InputDataConfig", []).append(base_channel(recipe.model.init_from))
    arn = recipe.tracking.mlflow_arn or mlflow_arn
    request.update(
        tracking.request_fields(recipe, team, mlflow_arn=arn, run=run, output_s3_uri=output["S3OutputPath"])
    )
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
