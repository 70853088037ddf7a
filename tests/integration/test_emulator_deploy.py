"""End to end against the local AWS emulator: the real `npx cdk bootstrap` / `npx cdk deploy`, the real
`trainstack launch`, a state machine execution the emulator interprets, and the training job it creates.

Two recipes and a team override; the request the execution sent must equal the pure function's output
for the deployed values; a second deploy changes nothing; a changed recipe keeps the bucket, key and
repository; launch_on_deploy starts the recipe-hash run from the deployed rule.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from trainstack import naming
from trainstack.aws import training_job_request_sent
from trainstack.emulator import ACCOUNT, REGION, Emulator, deliver_stack_status
from trainstack.loader import resolve
from trainstack.request import WARM_POOL_SECONDS, create_training_job_request, job_name, stopping_condition

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("emulator")]
ROOT = Path(__file__).resolve().parents[2]
TRAINSTACK = str(Path(sys.executable).parent / "trainstack")


class Cloud:
    def __init__(self, emulator: Emulator, outdir: Path) -> None:
        self.env = {
            **os.environ,
            **emulator.env(),
            "JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION": "1",
            "JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION": "20",
            "CDK_DISABLE_CLI_TELEMETRY": "true",
        }
        self.outdir = outdir
        kw = dict(
            endpoint_url=emulator.endpoint,
            region_name=REGION,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        self.cfn, self.sfn = boto3.client("cloudformation", **kw), boto3.client("stepfunctions", **kw)
        self.sagemaker = boto3.client("sagemaker", **kw)

    def run(self, *cmd: str) -> str:
        result = subprocess.run(
            list(cmd), cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=900
        )
        assert result.returncode == 0, f"{' '.join(cmd)}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        return result.stdout + result.stderr

    def cdk(self, *args: str) -> str:
        return self.run(shutil.which("npx") or "npx", "cdk", *args, "-o", str(self.outdir))

    def deploy(self, recipe: str, team: str | None = None, *sets: str) -> str:
        context = ["-c", f"recipe={recipe}"] + (["-c", f"team={team}"] if team else [])
        context += ["-c", f"set={','.join(sets)}"] if sets else []
        return self.cdk("deploy", "--all", *context, "--method=direct", "--require-approval=never")

    def outputs(self, stack: str) -> dict[str, str]:
        (found,) = self.cfn.describe_stacks(StackName=stack)["Stacks"]
        return {o["OutputKey"]: o["OutputValue"] for o in found.get("Outputs", [])}

    def physical_ids(self, stack: str) -> dict[str, str]:
        summaries = self.cfn.list_stack_resources(StackName=stack)["StackResourceSummaries"]
        return {r["LogicalResourceId"]: r["PhysicalResourceId"] for r in summaries}

    def launch(self, recipe: str, team: str | None = None, *extra: str) -> tuple[str, str]:
        out = self.run(
            TRAINSTACK, "launch", recipe, *(["--team", team] if team else []), "--local", "--wait", *extra
        )
        lines = out.splitlines()
        return lines[0].split()[1], lines[1].split()[-1]

    def sent(self, execution_arn: str) -> dict:
        deadline = time.monotonic() + 60
        while (request := training_job_request_sent(self.sfn, execution_arn)) is None:
            assert time.monotonic() < deadline, f"no CreateTrainingJob in {execution_arn}"
            time.sleep(0.5)
        return request


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cloud]:
    log = tmp_path_factory.mktemp("emulator") / "moto.log"
    with Emulator(log_path=log) as emulator:
        cloud = Cloud(emulator, tmp_path_factory.mktemp("cdk-out"))
        cloud.cdk("bootstrap", f"aws://{ACCOUNT}/{REGION}", "-c", "recipe=1b-bf16")
        yield cloud


def expected_request(
    cloud: Cloud,
    recipe_name: str,
    team: str | None,
    name: str,
    keep_alive: int,
    *sets: str,
    run_sets: tuple[str, ...] = (),
) -> dict:
    """The pure function's request for the deployed values; `run_sets` are the launch's own overrides."""
    deployed = resolve(recipe_name, team, sets).recipe
    recipe = resolve(recipe_name, team, (*sets, *run_sets)).recipe
    prefix = naming.stack_prefix(recipe, team)
    launcher, data = cloud.outputs(f"{prefix}-Launcher"), cloud.outputs(f"{prefix}-Data")
    # EMULATOR: no image is built; the stack references the deployed recipe's tag in its repository.
    image = (
        f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/{data['RepositoryName']}:{naming.recipe_hash(deployed)}"
    )
    request = create_training_job_request(
        recipe,
        team,
        job_name=name,
        role_arn=launcher["ExecutionRoleArn"],
        image_uri=image,
        bucket_name=data["BucketName"],
        kms_key_arn=data["KeyArn"],
        keep_alive_seconds=keep_alive,
    )
    # The job limit is fixed at deploy time by the deployed recipe's plan; a short run just ends sooner.
    return {**request, "StoppingCondition": stopping_condition(deployed)}


@pytest.mark.parametrize(("recipe", "team"), [("1b-bf16", None), ("30b-fp8", None), ("8b-fp8", "nlp")])
def test_deploy_and_launch_sends_the_full_request(cloud: Cloud, recipe: str, team: str | None) -> None:
    cloud.deploy(recipe, team)
    name, execution = cloud.launch(recipe, team)
    resolved = resolve(recipe, team).recipe
    assert name.startswith(f"{naming.job_name_prefix(resolved, team)}{naming.recipe_hash(resolved)}-r")
    sent = cloud.sent(execution)
    assert sent == expected_request(cloud, recipe, team, name, resolved.compute.keep_alive_seconds)
    job = cloud.sagemaker.describe_training_job(TrainingJobName=name)
    assert job["ResourceConfig"]["InstanceType"] == resolved.compute.instance_type
    assert job["ResourceConfig"]["InstanceCount"] == resolved.compute.instance_count
    assert job["CheckpointConfig"] == sent["CheckpointConfig"]
    assert job["HyperParameters"] == sent["HyperParameters"]
    deadline = time.monotonic() + 120
    while (status := cloud.sfn.describe_execution(executionArn=execution)["status"]) == "RUNNING":
        assert time.monotonic() < deadline
        time.sleep(1)
    assert status == "SUCCEEDED"


def test_a_short_run_overrides_steps_on_a_warm_pool(cloud: Cloud) -> None:
    cloud.deploy("1b-bf16")
    name, execution = cloud.launch("1b-bf16", None, "--max-steps", "5")
    sent = cloud.sent(execution)
    assert sent == expected_request(
        cloud, "1b-bf16", None, name, WARM_POOL_SECONDS, run_sets=("training.steps=5",)
    )
    assert sent["HyperParameters"]["training.steps"] == "5"
    assert sent["ResourceConfig"]["KeepAlivePeriodInSeconds"] == WARM_POOL_SECONDS


def test_dry_run_prints_the_request_and_starts_nothing(cloud: Cloud) -> None:
    cloud.deploy("1b-bf16")
    before = cloud.sfn.list_executions(
        stateMachineArn=cloud.outputs("Trainstack-platform-1b-bf16-Launcher")["StateMachineArn"]
    )["executions"]
    dry_run = subprocess.run(
        [TRAINSTACK, "launch", "1b-bf16", "--local", "--dry-run"],
        cwd=ROOT,
        env=cloud.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    printed = json.loads(dry_run.stdout)
    recipe = resolve("1b-bf16").recipe
    assert printed == expected_request(
        cloud, "1b-bf16", None, printed["TrainingJobName"], recipe.compute.keep_alive_seconds
    )
    after = cloud.sfn.list_executions(
        stateMachineArn=cloud.outputs("Trainstack-platform-1b-bf16-Launcher")["StateMachineArn"]
    )["executions"]
    assert len(after) == len(before)


def test_launching_an_undeployed_recipe_is_one_line(cloud: Cloud) -> None:
    result = subprocess.run(
        [TRAINSTACK, "launch", "64b-fp8", "--local"],
        cwd=ROOT,
        env=cloud.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: stack Trainstack-platform-64b-fp8-Launcher is not deployed in the local emulator "
        f"({cloud.env['AWS_ENDPOINT_URL']}): run `npx cdk deploy --all -c recipe=64b-fp8 --method=direct` "
        "with the emulator's AWS_* variables exported"
    ]


def test_redeploy_changes_nothing_and_a_changed_recipe_keeps_the_stateful_resources(cloud: Cloud) -> None:
    cloud.deploy("1b-bf16")
    data_stack, launcher_stack = "Trainstack-platform-1b-bf16-Data", "Trainstack-platform-1b-bf16-Launcher"
    before = cloud.physical_ids(data_stack), cloud.physical_ids(launcher_stack)
    again = cloud.deploy("1b-bf16")
    assert again.count("(no changes)") == 2, again[-2000:]
    assert (cloud.physical_ids(data_stack), cloud.physical_ids(launcher_stack)) == before

    changed = cloud.deploy("1b-bf16", None, "training.steps=123")
    assert "(no changes)" in changed  # the data stack: nothing in it depends on the recipe's knobs
    assert cloud.physical_ids(data_stack) == before[0]
    assert cloud.outputs(launcher_stack)["RecipeHash"] == naming.recipe_hash(
        resolve("1b-bf16", None, ["training.steps=123"]).recipe
    )
    # The launcher refuses to start a recipe that differs from the deployed one.
    result = subprocess.run(
        [TRAINSTACK, "launch", "1b-bf16", "--local"],
        cwd=ROOT,
        env=cloud.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "changed since it was deployed" in result.stderr
    cloud.deploy("1b-bf16")


def test_launch_on_deploy_starts_the_recipe_hash_run(cloud: Cloud) -> None:
    cloud.deploy("3b-bf16", None, "launch_on_deploy=true")
    recipe = resolve("3b-bf16", None, ["launch_on_deploy=true"]).recipe
    # EMULATOR: moto publishes no CloudFormation events; deliver the one real AWS sends on completion.
    (execution,) = deliver_stack_status(cloud.env, "Trainstack-platform-3b-bf16-Launcher", "CREATE_COMPLETE")
    sent = cloud.sent(execution)
    expected_name = job_name(recipe, None, "deploy")
    assert sent["TrainingJobName"] == expected_name
    assert sent == expected_request(
        cloud, "3b-bf16", None, expected_name, recipe.compute.keep_alive_seconds, "launch_on_deploy=true"
    )
    # Another stack's completion starts nothing.
    assert deliver_stack_status(cloud.env, "Trainstack-platform-3b-bf16-Data", "CREATE_COMPLETE") == []
