"""`trainstack export RUN` against the emulator (issue 40 item 6): a --step that is no complete checkpoint
of the run, and an export while the run's earlier export is still running, are refused in one line
before any job starts; without --step the newest complete checkpoint is the one exported (its step in
the execution's input, so the folder is known before the job runs); `trainstack logs --job` reads an
export job's logs.

The checkpoints are the trainer's own (CheckpointManager through s3torchconnector, as
test_checkpoints_command saves them: step 3 killed before its marker); the run is found through its
registry item and stack outputs as `find_run` reads them; jobs are held (the emulator's `hold` mode), so
an export job stays InProgress as a real one does while it runs."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from typer.testing import CliRunner

from trainstack.cli.main import app
from trainstack.protocol.checkpoint_format import MARKER

pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")

RECIPE = "1b-bf16"
RUN = f"ts-platform-{RECIPE}--exp1"
BUCKET = "trainstack-exports"
PREFIX = f"s3://{BUCKET}/checkpoints/platform/{RECIPE}/exp1/"
TABLE = f"runs-platform-{RECIPE}"
PASS = json.dumps({"StartAt": "Done", "States": {"Done": {"Type": "Pass", "End": True}}})


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    import test_checkpoints_command as saved  # the trainer's CheckpointManager, steps 1-3

    from trainstack.emulator.endpoint import Emulator

    with Emulator(jobs="hold") as running:
        running.client("s3").create_bucket(Bucket=BUCKET)
        saved.PREFIX, saved.RUN = PREFIX, RUN
        saved._save_three(running.env(), tmp_path_factory.mktemp("store"))
        key = f"checkpoints/platform/{RECIPE}/exp1/step-000000003/{MARKER}"
        running.client("s3").delete_object(Bucket=BUCKET, Key=key)  # a save killed before its marker
        machine = running.client("stepfunctions").create_state_machine(
            name="export", definition=PASS, roleArn="arn:aws:iam::123456789012:role/x"
        )["stateMachineArn"]
        register(running, machine)
        yield running, machine


def register(running, machine: str) -> None:
    dynamodb = running.client("dynamodb")
    dynamodb.create_table(
        TableName=TABLE,
        KeySchema=[{"AttributeName": "run", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "run", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )
    now = datetime.now(UTC).isoformat()
    item = {
        "run": RUN, "run_id": "exp1", "recipe": RECIPE, "team": "platform", "run_state": "completed",
        "current_job": f"{RUN}-1", "job_index": 1, "checkpoint_uri": PREFIX, "steps": 3,
        "tokens_per_step": 512, "usd_per_hour": 98.3, "created": now, "updated": now,
    }  # fmt: skip
    typed = {k: {"N": str(v)} if isinstance(v, int | float) else {"S": v} for k, v in item.items()}
    dynamodb.put_item(TableName=TABLE, Item=typed)
    cloudformation = running.client("cloudformation")
    outputs = {
        "Data": {"RunTableName": TABLE},
        "Launcher": {"StateMachineArn": "arn:x", "ExportStateMachineArn": machine},
    }
    for suffix, values in outputs.items():
        template = {
            "Resources": {"Placeholder": {"Type": "AWS::CloudFormation::WaitConditionHandle"}},
            "Outputs": {k: {"Value": v} for k, v in values.items()},
        }
        cloudformation.create_stack(
            StackName=f"Trainstack-platform-{RECIPE}-{suffix}", TemplateBody=json.dumps(template)
        )


def cli(running, *args: str):
    return CliRunner(env={**running.env(), "COLUMNS": "200", "NO_COLOR": "1"}).invoke(app, [*args, "--local"])


def executions(running, machine: str) -> list[dict]:
    sfn = running.client("stepfunctions")
    found = sfn.list_executions(stateMachineArn=machine)["executions"]
    return [json.loads(sfn.describe_execution(executionArn=e["executionArn"])["input"]) for e in found]


def test_a_step_that_is_no_complete_checkpoint_is_refused_listing_the_complete_ones(emulator):
    running, machine = emulator
    missing = cli(running, "export", RUN, "--step", "999")
    assert missing.exit_code == 2
    assert missing.output.strip().splitlines() == [
        f"error: run {RUN}: --step 999: no checkpoint of step 999; complete checkpoints: 2, 1"
    ]
    unfinished = cli(running, "export", RUN, "--step", "3")
    assert unfinished.exit_code == 2
    assert unfinished.output.startswith(f"error: run {RUN}: --step 3: incomplete (")
    assert "complete checkpoints: 2, 1" in unfinished.output
    assert executions(running, machine) == []  # no export was started


def test_an_export_while_the_runs_earlier_export_runs_is_refused_and_logs_reads_it(emulator):
    running, machine = emulator
    started = cli(running, "export", RUN)  # the newest complete checkpoint: step 2, named up front
    assert started.exit_code == 0, started.output
    assert f"exporting run {RUN} (step 2) as job {RUN}-X1" in started.output
    assert f"/exports/platform/{RECIPE}/exp1/step-2/" in started.output
    assert [e["Step"] for e in executions(running, machine)] == [2]
    # What the Export state machine does next (stacks/export.py): the job, and its entry in the registry.
    job = f"{RUN}-X1"
    running.client("sagemaker").create_training_job(
        TrainingJobName=job,
        RoleArn="arn:aws:iam::123456789012:role/x",
        AlgorithmSpecification={"TrainingImage": "img", "TrainingInputMode": "File"},
        OutputDataConfig={"S3OutputPath": f"s3://{BUCKET}/out/"},
        ResourceConfig={"InstanceType": "ml.m5.xlarge", "InstanceCount": 1, "VolumeSizeInGB": 10},
        StoppingCondition={"MaxRuntimeInSeconds": 3600},
    )
    running.client("dynamodb").update_item(
        TableName=TABLE,
        Key={"run": {"S": RUN}},
        UpdateExpression="SET exports = :e",
        ExpressionAttributeValues={":e": {"L": [{"M": {"job": {"S": job}, "step": {"N": "2"}}}]}},
    )
    second = cli(running, "export", RUN, "--step", "1")
    assert second.exit_code == 2
    assert second.output.strip().splitlines() == [
        f"error: run {RUN}: export job {job} is still running (InProgress); wait for it to end "
        f"(`trainstack logs {RECIPE} --job {job}`) before exporting again: two exports of one run would "
        "write one folder"
    ]
    assert len(executions(running, machine)) == 1
    # The command that line suggests reads the export job's logs.
    now_ms = int(datetime.now(UTC).timestamp() * 1000)
    logs = running.client("logs")
    stream = f"{job}/algo-1-{now_ms // 1000}"
    if not logs.describe_log_groups(logGroupNamePrefix="/aws/sagemaker/TrainingJobs")["logGroups"]:
        logs.create_log_group(logGroupName="/aws/sagemaker/TrainingJobs")  # held jobs write no line
    logs.create_log_stream(logGroupName="/aws/sagemaker/TrainingJobs", logStreamName=stream)
    logs.put_log_events(
        logGroupName="/aws/sagemaker/TrainingJobs",
        logStreamName=stream,
        logEvents=[{"timestamp": now_ms, "message": "export: step 2 -> hf folder"}],
    )
    read = cli(running, "logs", RECIPE, "--job", job)
    assert read.exit_code == 0, read.output
    assert "export: step 2 -> hf folder" in read.stdout
