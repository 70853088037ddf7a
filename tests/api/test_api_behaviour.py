"""What the API does besides its JSON: mistakes raise trainstack.errors exceptions carrying the very line
the command prints after `error:`, long operations report through their callbacks, and results are
frozen."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainstack import api
from trainstack.cli.main import app

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


@pytest.mark.parametrize(
    ("call", "args"),
    [
        (lambda: api.plan("no-such-recipe"), ["plan", "no-such-recipe"]),
        (
            lambda: api.plan("8b-fp8", overrides=["training.micro_batch=zero"]),
            ["plan", "8b-fp8", "--set", "training.micro_batch=zero"],
        ),
        (lambda: api.status("8b-fp8", team="no-such-team"), ["status", "8b-fp8", "--team", "no-such-team"]),
        (lambda: api.runs(team="Bad!"), ["runs", "--team", "Bad!"]),
        (lambda: api.checkpoints("./no/such/dir"), ["checkpoints", "./no/such/dir"]),
        (
            lambda: api.data_prepare(["a.txt"], tokenizer="bytes", out="/tmp/x", workers=0),
            ["data", "prepare", "a.txt", "--tokenizer", "bytes", "--out", "/tmp/x", "--workers", "0"],
        ),
    ],
    ids=["unknown-recipe", "bad-set", "unknown-team", "bad-team-name", "no-checkpoint-dir", "workers-0"],
)
def test_a_mistake_raises_the_line_the_command_prints(call, args):
    with pytest.raises(api.TrainstackError) as raised:
        call()
    printed = CliRunner().invoke(app, args)
    assert printed.exit_code == raised.value.exit_code == 2
    assert printed.stderr == f"error: {one_line(raised.value)}\n"


def test_validate_returns_each_distinct_error_with_the_checks_that_hit_it(tmp_path):
    recipe = (ROOT / "recipes" / "1b-bf16.yaml").read_text()
    (tmp_path / "1b-bf16.yaml").write_text(recipe)
    (tmp_path / "bad.yaml").write_text(recipe)  # its name says 1b-bf16
    progress: list[str] = []
    found = api.validate([tmp_path], on_progress=progress.append)
    assert found.exit_code == 2 and not found.ok
    (invalid,) = found.invalid
    assert "does not match the file name 'bad'" in invalid.line and invalid.labels == (
        str(tmp_path / "bad.yaml"),
    )
    assert progress == [f"ok      {label}" for label in found.valid]
    printed = CliRunner().invoke(app, ["validate", str(tmp_path)])
    assert printed.exit_code == 2
    assert f"invalid {invalid.line} [{invalid.labels[0]}]" in printed.stderr
    assert f"{len(found.valid)} valid, {found.invalid_count} invalid" in printed.stderr


def test_results_are_frozen_and_hand_out_copies():
    found = api.plan("8b-fp8", enforce=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        found.measured = {}  # type: ignore[misc]
    document = found.to_document()
    document["memory"]["peak_gib"] = -1
    assert found.to_document()["memory"]["peak_gib"] == found.plan.memory.peak_gib


def test_checkpoints_verify_reports_progress_and_exit_status(tmp_path):
    (tmp_path / "step-000000010").mkdir()  # a save that never finished: nothing to verify
    progress: list[str] = []
    found = api.checkpoints(str(tmp_path), verify=True, on_progress=progress.append)
    assert progress == ["verifying 0 checkpoint(s), 0 B: reading every byte"]
    assert found.verified and not found.damaged and found.exit_code == 0


@pytest.fixture
def aws(monkeypatch):
    """moto in this process, standing in for AWS at boto3's level (`local=False`: the usual chain)."""
    import os

    from moto import mock_aws

    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    with mock_aws():
        yield


IMAGE = {"TrainingImage": "123456789012.dkr.ecr.us-east-1.amazonaws.com/t:1", "TrainingInputMode": "File"}


def _job(region: str) -> str:
    """A training job of 30b-fp8 in `region`, with two log lines on one host."""
    import boto3

    from trainstack.aws.request import job_name
    from trainstack.recipes.loader import resolve

    recipe = resolve("30b-fp8").recipe
    name = job_name(recipe, None, "api1")
    boto3.client("sagemaker", region_name=region).create_training_job(
        TrainingJobName=name,
        AlgorithmSpecification={
            "TrainingImage": "1.dkr.ecr.us-east-1.amazonaws.com/t:1",
            "TrainingInputMode": "File",
        },
        RoleArn="arn:aws:iam::123456789012:role/t",
        OutputDataConfig={"S3OutputPath": "s3://b/o/"},
        ResourceConfig={"InstanceType": "ml.p5.48xlarge", "InstanceCount": 1, "VolumeSizeInGB": 100},
        StoppingCondition={"MaxRuntimeInSeconds": 3600},
    )
    logs = boto3.client("logs", region_name=region)
    now_ms = int(time.time() * 1000)  # CloudWatch refuses events over 14 days old
    logs.create_log_group(logGroupName="/aws/sagemaker/TrainingJobs")
    stream = f"{name}/algo-1-1700000000"
    logs.create_log_stream(logGroupName="/aws/sagemaker/TrainingJobs", logStreamName=stream)
    logs.put_log_events(
        logGroupName="/aws/sagemaker/TrainingJobs",
        logStreamName=stream,
        logEvents=[{"timestamp": now_ms + i, "message": m} for i, m in enumerate(["hello", "step=1"])],
    )
    return name


def test_logs_hands_each_line_to_on_line_and_returns_them(aws):
    name = _job("us-east-1")
    seen: list[str] = []
    notes: list[str] = []
    found = api.logs("30b-fp8", on_line=seen.append, on_progress=notes.append)
    assert found.job == name and found.lines == ("hello", "step=1") and seen == list(found.lines)
    assert notes and notes[0].startswith(f"# {name}: ")
    printed = CliRunner().invoke(app, ["logs", "30b-fp8"])
    assert printed.exit_code == 0 and printed.stdout == "hello\nstep=1\n"


def test_region_reads_that_region_instead_of_aws_region(aws):
    name = _job("eu-west-1")
    assert api.logs("30b-fp8").job is None  # AWS_REGION (us-east-1) has no job of it
    found = api.logs("30b-fp8", region="eu-west-1")
    assert found.job == name and "eu-west-1" in found.where
    assert [r["job"] for r in api.status("30b-fp8", region="eu-west-1").to_document()["runs"]] == [name]


def test_a_base_plan_cannot_read_is_a_warning_to_the_caller_not_a_line_on_stderr(monkeypatch, capsys):
    """A notebook's plan of a fine-tune whose base sits in S3, without AWS configured: the plan stands, and
    the note that the base was not checked reaches on_warning (the command prints it on stderr)."""
    for name in ("AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/dev/null")
    warned: list[str] = []
    planned = api.plan("8b-sft", on_warning=warned.append)
    assert planned.fits
    assert any(line.startswith("note: model.init_from: s3://") and "not checked" in line for line in warned)
    assert "not checked" not in capsys.readouterr().err
    result = CliRunner().invoke(app, ["plan", "8b-sft", "-q"])
    assert result.exit_code == 0 and "note: model.init_from: s3://" in result.stderr
