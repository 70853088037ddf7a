"""The recipe -> CreateTrainingJob request function: complete, valid for the SageMaker API, faithful."""

from __future__ import annotations

import pytest

from trainstack.aws.request import (
    Runtime,
    checkpoint_uri,
    create_training_job_request,
    execution_input,
    hyperparameter_overrides,
    job_name,
)
from trainstack.aws.request_check import check_request
from trainstack.planner import plan
from trainstack.protocol.metrics import metric_definitions
from trainstack.recipes import naming
from trainstack.recipes.loader import base_recipe_names, resolve, team_names, team_recipe_names
from trainstack.recipes.schema import Recipe, from_hyperparameters, to_hyperparameters

pytestmark = pytest.mark.fast

ARGS = dict(
    role_arn="arn:aws:iam::123456789012:role/exec",
    image_uri="123.dkr.ecr.us-west-2.amazonaws.com/t:1",
    bucket_name="ckpt-bucket",
    kms_key_arn="arn:aws:kms:us-west-2:123456789012:key/abc",
)
ALL = [(n, None) for n in base_recipe_names()] + [(n, t) for t in team_names() for n in team_recipe_names(t)]


def recipe(name: str = "30b-fp8", team: str | None = None, *overrides: str) -> Recipe:
    return resolve(name, team, overrides).recipe


def job_args(r: Recipe, team: str | None = None, run_id: str = "abc-r1", index: int = 1) -> dict:
    """The per-job values: job `index` of run `run_id`, and the run's checkpoint URI."""
    run = naming.run_name(r, team, run_id)
    return dict(
        job_name=naming.job_of_run(run, index),
        run=run,
        checkpoint_uri=checkpoint_uri(ARGS["bucket_name"], r, team, run_id),
    )


def validate_api(request: dict) -> None:
    """The request as SageMaker checks it: botocore's model (names, types, lengths, patterns, enums, ranges)
    and the documented cross-field rules (trainstack.aws.request_check)."""
    assert check_request(request) == []


@pytest.mark.parametrize(("name", "team"), ALL)
def test_every_recipe_gives_a_valid_api_request_carrying_the_recipe(name: str, team: str | None) -> None:
    r = recipe(name, team)
    request = create_training_job_request(
        r, team, **job_args(r, team, naming.default_run_id(r, "r1")), **ARGS
    )
    validate_api(request)
    assert request["ResourceConfig"]["InstanceType"] == r.compute.instance_type
    assert request["ResourceConfig"]["InstanceCount"] == r.compute.instance_count
    if (
        r.instance.has_instance_store
    ):  # local NVMe: no EBS volume to size or encrypt (trainstack.recipes.hardware)
        assert "VolumeSizeInGB" not in request["ResourceConfig"]
        assert "VolumeKmsKeyId" not in request["ResourceConfig"]
    else:
        assert request["ResourceConfig"]["VolumeSizeInGB"] == r.compute.volume_size_gb
    assert from_hyperparameters(request["HyperParameters"]) == r
    assert len(request["TrainingJobName"]) <= 63


def test_every_job_of_a_run_gets_the_runs_checkpoint_prefix_and_no_checkpoint_config() -> None:
    r = recipe()
    requests = [
        create_training_job_request(r, None, **job_args(r, None, "lr-1", i), **ARGS) for i in (1, 2, 3)
    ]
    uris = {req["Environment"]["TRAINSTACK_CHECKPOINT_URI"] for req in requests}
    assert uris == {"s3://ckpt-bucket/checkpoints/platform/30b-fp8/lr-1/"}
    assert [req["TrainingJobName"] for req in requests] == [
        f"ts-platform-30b-fp8--lr-1-{i}" for i in (1, 2, 3)
    ]
    for req in requests:
        # SageMaker's sync would restore every kept checkpoint onto every node: the trainer writes S3 itself.
        assert "CheckpointConfig" not in req
        assert req["Environment"]["TRAINSTACK_RUN"] == "ts-platform-30b-fp8--lr-1"
        assert {"Key": "run", "Value": "ts-platform-30b-fp8--lr-1"} in req["Tags"]
    assert requests[0]["OutputDataConfig"] == {
        "S3OutputPath": "s3://ckpt-bucket/output/platform/30b-fp8",
        "KmsKeyId": ARGS["kms_key_arn"],
    }
    # ml.p6-b200.48xlarge has local NVMe, which its hardware module encrypts: SageMaker refuses a volume key.
    assert all("VolumeKmsKeyId" not in q["ResourceConfig"] for q in requests)
    lone = create_training_job_request(r, None, job_name="ts-platform-30b-fp8--x-1", **ARGS)
    assert (
        "TRAINSTACK_RUN" not in lone["Environment"] and "TRAINSTACK_CHECKPOINT_URI" not in lone["Environment"]
    )
    assert "run" not in {t["Key"] for t in lone["Tags"]}


def test_metrics_retries_infra_checks_environment_and_tags() -> None:
    r = recipe()
    request = create_training_job_request(r, "nlp", **job_args(r, "nlp"), **ARGS)
    assert request["AlgorithmSpecification"]["MetricDefinitions"] == metric_definitions()
    assert request["RetryStrategy"] == {"MaximumRetryAttempts": r.compute.max_retry_attempts}
    assert request["InfraCheckConfig"] == {"EnableInfraCheck": True}
    # No compute.max_runtime_hours in the recipe: the job limit follows the planned run.
    limit_hours = plan(r).run.max_runtime_hours
    assert r.compute.max_runtime_hours is None and limit_hours >= plan(r).run.hours
    assert request["StoppingCondition"] == {"MaxRuntimeInSeconds": int(limit_hours * 3600)}
    assert request["EnableManagedSpotTraining"] is False
    env = request["Environment"]
    assert env["FI_EFA_USE_HUGE_PAGE"] == "0"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    tags = {t["Key"]: t["Value"] for t in request["Tags"]}
    assert tags["team"] == "nlp" and tags["recipe"] == "30b-fp8" and tags["cost-center"] == r.tags.cost_center
    assert "VpcConfig" not in request
    # No data channel (synthetic tokens); the base model 30b-fp8 continues from comes as its own channel.
    assert [c["ChannelName"] for c in request["InputDataConfig"]] == ["base"]
    assert "TrainingPlanArn" not in request["ResourceConfig"]


def test_fp8_recipes_carry_fp8_hyperparameters() -> None:
    hp = create_training_job_request(recipe("30b-fp8"), None, **job_args(recipe()), **ARGS)["HyperParameters"]
    assert hp["precision.dtype"] == '"fp8"' and hp["precision.fp8_recipe"] == '"mxfp8"'


def test_spot_sets_max_wait_and_a_training_plan_its_arn() -> None:
    plan_arn = "arn:aws:sagemaker:us-west-2:123456789012:training-plan/p6"
    r = recipe(
        "30b-fp8",
        None,
        "compute.spot=true",
        "compute.max_wait_hours=100",
        f"compute.training_plan_arn={plan_arn}",
    )
    request = create_training_job_request(r, None, **job_args(r), **ARGS)
    validate_api(request)
    assert request["EnableManagedSpotTraining"] is True
    assert request["StoppingCondition"]["MaxWaitTimeInSeconds"] == 100 * 3600
    assert request["ResourceConfig"]["TrainingPlanArn"] == plan_arn
    spot = recipe("30b-fp8", None, "compute.spot=true")
    default_wait = create_training_job_request(spot, None, **job_args(spot), **ARGS)["StoppingCondition"]
    assert default_wait["MaxWaitTimeInSeconds"] >= default_wait["MaxRuntimeInSeconds"]


def test_data_channel_and_vpc_mode() -> None:
    r = recipe("30b-fp8", None, "data.train_s3_uri=s3://corpus/tokens/v1")
    request = create_training_job_request(
        r,
        None,
        **job_args(r),
        subnet_ids=["subnet-1", "subnet-2"],
        security_group_ids=["sg-1"],
        network_isolation=True,
        inter_container_encryption=True,
        **ARGS,
    )
    validate_api(request)
    channel, base = request["InputDataConfig"]
    assert channel["ChannelName"] == "train"
    assert channel["DataSource"]["S3DataSource"]["S3Uri"] == "s3://corpus/tokens/v1"
    # The base model is copied whole (File mode, its own channel), the tokens streamed (the job's mode).
    assert (base["ChannelName"], base["InputMode"]) == ("base", "File")
    assert request["AlgorithmSpecification"]["TrainingInputMode"] == "FastFile"
    assert request["VpcConfig"] == {"SecurityGroupIds": ["sg-1"], "Subnets": ["subnet-1", "subnet-2"]}
    assert (
        request["EnableNetworkIsolation"] is True and request["EnableInterContainerTrafficEncryption"] is True
    )


def test_runtime_values_become_step_functions_paths() -> None:
    r = recipe()
    request = create_training_job_request(
        r,
        None,
        job_name=Runtime("$.Names.JobName"),
        run=Runtime("$.Run"),
        checkpoint_uri=Runtime("$.Names.CheckpointUri"),
        hyperparameters=Runtime("States.JsonMerge($.a, $.b, false)"),
        keep_alive_seconds=Runtime("$.KeepAlivePeriodInSeconds"),
        **ARGS,
    )
    assert request["TrainingJobName.$"] == "$.Names.JobName" and "TrainingJobName" not in request
    assert request["HyperParameters.$"] == "States.JsonMerge($.a, $.b, false)"
    assert request["ResourceConfig"]["KeepAlivePeriodInSeconds.$"] == "$.KeepAlivePeriodInSeconds"
    assert request["Environment"]["TRAINSTACK_CHECKPOINT_URI.$"] == "$.Names.CheckpointUri"
    assert request["Environment"]["TRAINSTACK_RUN.$"] == "$.Run"
    assert {"Key": "run", "Value.$": "$.Run"} in request["Tags"]


def test_a_short_run_overrides_only_the_steps_and_gets_its_own_hash() -> None:
    base = recipe()
    short = recipe("30b-fp8", None, "training.steps=50")
    assert hyperparameter_overrides(base, short) == {"training.steps": "50"}
    assert job_name(short, None, "t1") != job_name(base, None, "t1")
    merged = {**to_hyperparameters(base), **hyperparameter_overrides(base, short)}
    assert from_hyperparameters(merged) == short
    change = {"Who": "arn:aws:iam::123456789012:user/a", "What": "launch"}
    assert execution_input("ts-x--r", "r", 1, 50, {"training.steps": "50"}, 1800, change=change) == {
        "Run": "ts-x--r",
        "RunId": "r",
        "Job": 1,
        "HyperParameterOverrides": {"training.steps": "50"},
        "KeepAlivePeriodInSeconds": 1800,
        "Steps": 50,
        "Reason": "launch",
        "JobEnvironment": {},
        "Change": change,
        "MlflowRunId": "",  # the MLflow run launch created, recorded in the registry
    }


def test_a_start_is_within_the_run_names_jobs_and_carries_the_request_it_needs() -> None:
    execution_input("ts-x--r", "r", naming.JOB_INDEX_MAX, 1)  # the last name a run has
    with pytest.raises(ValueError, match="job"):
        execution_input("ts-x--r", "r", naming.JOB_INDEX_MAX + 1, 1)
    with pytest.raises(ValueError, match="reason"):
        execution_input("ts-x--r", "r", 1, 1, reason="again")
    with pytest.raises(ValueError, match="recorded request"):
        execution_input("ts-x--r", "r", 2, 1, reason="resume")  # a resume trains the run's own request
    with pytest.raises(ValueError, match="deployed recipe"):
        execution_input("ts-x--r", "r", 1, 1, request={"RoleArn": "x"})


@pytest.mark.parametrize("suffix", ["", "x" * 8, "x" * 11, "bad_suffix", "a.b"])
def test_job_name_suffix_is_checked(suffix: str) -> None:
    with pytest.raises(ValueError, match="suffix"):
        job_name(recipe(), None, suffix)


def test_a_multi_node_jobs_environment_lets_the_comms_gate_read_nccls_log() -> None:
    """The request leaves NCCL_DEBUG to the image's entrypoint, which on several hosts turns on the INIT and
    NET log the trainer's comms gate reads; a job-level NCCL_DEBUG would make the gate stop every job."""
    from trainer.distributed.comms import local_problem
    from trainer.entrypoint import ResourceConfig, build_environment

    r = recipe("30b-fp8")
    body = create_training_job_request(r, None, **job_args(r), region="us-west-2", **ARGS)
    assert "NCCL_DEBUG" not in body["Environment"]
    assert body["Environment"]["AWS_REGION"] == "us-west-2"  # the checkpoint bucket's, for direct S3 writes
    hosts = tuple(f"algo-{n}" for n in range(1, r.compute.instance_count + 1))
    env = build_environment(ResourceConfig("algo-2", hosts, "eth0"), dict(body["Environment"]))
    assert env["NCCL_DEBUG"] == "INFO" and "NET" in env["NCCL_DEBUG_SUBSYS"].split(",")
    assert "cannot check" not in (local_problem(env, 1234) or "")
