"""`trainstack status` and `trainstack logs` against the local AWS emulator (moto server), end to end.

A fake run: a training job created through the SageMaker API with the name the launcher would give it,
the trainer's metrics put where SageMaker would publish them (namespace /aws/sagemaker/TrainingJobs,
dimension TrainingJobName, names from the MetricDefinitions) at 55% of the planned tokens/s, and log
lines in the job's stream. The CLI, run as a user would (a subprocess with --local), must report the
run as slow relative to the plan. The emulator runs no container, so the metrics are put by the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from trainstack.aws.request import job_name
from trainstack.emulator.endpoint import Emulator
from trainstack.planner import plan
from trainstack.protocol.metrics import FIELD_BY_KEY
from trainstack.recipes.loader import resolve

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("monitoring-emulator")]
REPO = Path(__file__).resolve().parents[2]
RECIPE = "30b-fp8"


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    # A generous start timeout: CI machines are shared and moto's first import is slow under load.
    # jobs="complete": these jobs are made-up requests whose metrics and logs the tests write themselves;
    # nothing is to run (trainstack.emulator.events, the test-only modes).
    emu = Emulator(log_path=tmp_path_factory.mktemp("moto") / "moto.log", jobs="complete").start(
        timeout_s=180
    )
    try:
        yield emu
    finally:
        emu.stop()


def cli(emu: Emulator, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **emu.env(), "COLUMNS": "160", "NO_COLOR": "1"}
    return subprocess.run(
        [sys.executable, "-m", "trainstack.cli.main", *args, "--local"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def create_job(emu: Emulator, name: str, recipe) -> None:
    emu.client("sagemaker").create_training_job(
        TrainingJobName=name,
        AlgorithmSpecification={
            "TrainingImage": "123456789012.dkr.ecr.us-east-1.amazonaws.com/trainstack:1",
            "TrainingInputMode": "File",
            "MetricDefinitions": [{"Name": f.metric_name, "Regex": f.regex} for f in FIELD_BY_KEY.values()],
        },
        RoleArn="arn:aws:iam::123456789012:role/trainstack-sagemaker",
        OutputDataConfig={"S3OutputPath": "s3://trainstack-checkpoints/output/"},
        ResourceConfig={
            "InstanceType": recipe.compute.instance_type,
            "InstanceCount": recipe.compute.instance_count,
            "VolumeSizeInGB": recipe.compute.volume_size_gb,
        },
        StoppingCondition={"MaxRuntimeInSeconds": 3600},
        CheckpointConfig={
            "S3Uri": f"s3://trainstack-checkpoints/checkpoints/platform/{recipe.name}/{name}",
            "LocalPath": "/opt/ml/checkpoints",
        },
        HyperParameters={"training.steps": "1000", "name": json.dumps(recipe.name)},
    )


def test_no_run_yet_is_said_plainly(emulator):
    result = cli(emulator, "status", RECIPE)
    assert result.returncode == 0, result.stderr
    assert "No run yet" in result.stdout
    assert "trainstack launch 30b-fp8" in result.stdout
    # the prefix already ends in `--`: the pattern shown is the exact job name shape
    assert "ts-platform-30b-fp8--<recipe hash>-..." in " ".join(result.stdout.split())
    logs = cli(emulator, "logs", RECIPE)
    assert logs.returncode == 0 and "No run of 30b-fp8" in logs.stdout
    assert "ts-platform-30b-fp8--<recipe hash>-..." in logs.stdout


def test_status_reports_a_run_below_the_slow_threshold_as_slow(emulator):
    recipe = resolve(RECIPE).recipe
    the_plan = plan(recipe)
    name = job_name(recipe, None, "slow1")
    create_job(emulator, name, recipe)
    # Another recipe's job must not be mistaken for this one's.
    other = resolve("8b-fp8").recipe
    create_job(emulator, job_name(other, None, "x1"), other)

    planned = the_plan.throughput.tokens_per_sec_per_gpu
    measured = 0.55 * planned  # below slow_fraction (0.7) x plan
    now = datetime.now(UTC)
    values = {
        "step": 420,
        "tokens_per_sec": measured,
        "mfu": 0.55 * the_plan.throughput.mfu,
        "loss": 2.31,
        "mem_gib": the_plan.memory.peak_gib,
        "step_time_s": the_plan.throughput.step_time_s / 0.55,
    }
    emulator.client("cloudwatch").put_metric_data(
        Namespace="/aws/sagemaker/TrainingJobs",
        MetricData=[
            {
                "MetricName": FIELD_BY_KEY[key].metric_name,
                "Dimensions": [{"Name": "TrainingJobName", "Value": name}],
                "Timestamp": now - timedelta(seconds=30),
                "Value": value,
            }
            for key, value in values.items()
        ],
    )

    result = cli(emulator, "status", RECIPE, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [r["job"] for r in report["runs"]] == [name]
    (run,) = report["runs"]
    assert run["slow"] is True
    assert run["tokens_per_sec_per_gpu"] == pytest.approx(measured)
    assert run["planned_tokens_per_sec_per_gpu"] == pytest.approx(planned)
    assert run["throughput_ratio"] == pytest.approx(0.55)
    assert run["step"] == 420 and run["steps_target"] == 1000 and run["progress"] == pytest.approx(0.42)
    assert run["checkpoint_uri"].endswith(f"/{name}")

    shown = cli(emulator, "status", RECIPE)
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    assert name in text and "SLOW" in text
    assert f"{measured:,.0f} vs plan {planned:,.0f}" in text
    assert "55% of plan" in text and "420 / 1,000 steps" in text


def test_logs_prints_the_jobs_stream(emulator):
    recipe = resolve(RECIPE).recipe
    name = job_name(recipe, None, "logs1")
    create_job(emulator, name, recipe)
    logs = emulator.client("logs")
    try:
        logs.create_log_group(logGroupName="/aws/sagemaker/TrainingJobs")
    except logs.exceptions.ResourceAlreadyExistsException:
        pass
    stream = f"{name}/algo-1-1764500000"
    logs.create_log_stream(logGroupName="/aws/sagemaker/TrainingJobs", logStreamName=stream)
    now_ms = int(datetime.now(UTC).timestamp() * 1000)
    lines = ["entrypoint: host algo-1 (node 0 of 4)", "step=10 loss=9.1 lr=1e-05 tokens_per_sec=5000"]
    logs.put_log_events(
        logGroupName="/aws/sagemaker/TrainingJobs",
        logStreamName=stream,
        logEvents=[{"timestamp": now_ms + i, "message": m} for i, m in enumerate(lines)],
    )
    result = cli(emulator, "logs", RECIPE, "--job", name)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == lines
    # --follow stops by itself once the job has ended, printing every line exactly once.
    followed = cli(emulator, "logs", RECIPE, "--job", name, "--follow", "--interval", "0.5")
    assert followed.returncode == 0, followed.stderr
    assert followed.stdout.splitlines() == lines
    assert f"# {name} ended: Completed" in followed.stderr
    wrong = cli(emulator, "logs", RECIPE, "--job", job_name(resolve("8b-fp8").recipe, None, "x1"))
    assert wrong.returncode == 2 and "is not a run of 30b-fp8" in wrong.stderr
    assert "Traceback" not in wrong.stderr


def test_a_launch_still_waiting_for_its_job_shows_as_pending(emulator):
    """The launcher stack's StateMachineArn output leads status to executions that have no job yet."""
    from trainstack.recipes.naming import stack_prefix

    recipe = resolve(RECIPE).recipe
    machine = emulator.client("stepfunctions").create_state_machine(
        name="launcher",
        roleArn="arn:aws:iam::123456789012:role/launcher",
        definition=json.dumps(
            {
                "StartAt": "WaitForCapacity",
                "States": {"WaitForCapacity": {"Type": "Wait", "Seconds": 600, "End": True}},
            }
        ),
    )["stateMachineArn"]
    # Only the output matters to status: the launcher stack says where its state machine is.
    template = {
        "Resources": {"Placeholder": {"Type": "AWS::CloudFormation::WaitConditionHandle"}},
        "Outputs": {"StateMachineArn": {"Value": machine}},
    }
    emulator.client("cloudformation").create_stack(
        StackName=f"{stack_prefix(recipe, None)}-Launcher", TemplateBody=json.dumps(template)
    )
    pending = job_name(recipe, None, "pend1")
    emulator.client("stepfunctions").start_execution(stateMachineArn=machine, name=pending, input="{}")

    result = cli(emulator, "status", RECIPE, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["launcher_deployed"] is True
    assert [e["name"] for e in report["pending_executions"]] == [pending]
    assert report["pending_executions"][0]["status"] == "RUNNING"
    shown = cli(emulator, "status", RECIPE)
    assert "no training job yet" in shown.stdout and pending in shown.stdout
