"""`trainstack launch --local` without an emulator, and the base-image cache: fast, no AWS."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainstack.aws import deployment as config
from trainstack.recipes.loader import resolve

pytestmark = pytest.mark.fast

TRAINSTACK = str(Path(sys.executable).parent / "trainstack")


def test_launch_local_without_an_emulator_says_so_in_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [TRAINSTACK, "launch", "30b-fp8", "--local", "--recipes-dir", str(root / "recipes")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    # Emulators other tests (or the user) started elsewhere on this machine are named when running.
    assert re.fullmatch(
        re.escape(
            "error: no local emulator is running: AWS_ENDPOINT_URL is unset and no live one is recorded in "
            ".emulator/endpoint.json in this directory or above it"
        )
        + r"(; running elsewhere: http://localhost:\d+ \(started in /\S+: cd there\)(, .+)?)?"
        + re.escape(
            " (start one here with `trainstack emulator start`, or export the AWS_ENDPOINT_URL it printed)"
        ),
        line,
    ), line


def test_base_image_answers_are_cached(tmp_path: Path, monkeypatch) -> None:
    cache = tmp_path / "base-images.json"
    recipe = resolve("30b-fp8").recipe
    first = config.resolve_base_image("eu-west-1", recipe, cache=cache)
    assert first == "763104351884.dkr.ecr.eu-west-1.amazonaws.com/pytorch-training:2.9-gpu-py312"
    assert first in cache.read_text()

    def unreachable(*args: object) -> str:
        raise AssertionError("the cache should have answered")

    monkeypatch.setattr(config, "_retrieve", unreachable)
    assert config.resolve_base_image("eu-west-1", recipe, cache=cache) == first


class _FakeClients:
    """Step Functions and SageMaker as `launch --wait` sees them before the launcher creates the job."""

    def __init__(self, status: str = "RUNNING", job_after: int | None = None) -> None:
        self.status, self.job_after, self.polls = status, job_after, 0

    def client(self, service: str) -> _FakeClients:
        return self

    def describe_execution(self, executionArn: str) -> dict:  # noqa: N803 (boto3's spelling)
        return {"status": self.status}

    def describe_training_job(self, TrainingJobName: str) -> dict:  # noqa: N803
        from botocore.exceptions import ClientError

        self.polls += 1
        if self.job_after is not None and self.polls > self.job_after:
            return {"TrainingJobStatus": "InProgress"}
        raise ClientError({"Error": {"Code": "ValidationException", "Message": "not found"}}, "Describe")


def test_launch_wait_shows_progress_then_the_job(monkeypatch, capsys) -> None:
    from trainstack.aws import launching

    monkeypatch.setattr(launching.time, "sleep", lambda s: None)
    launching.wait_for_job(_FakeClients(job_after=2), "arn:execution", "ts-x--abc-r1", timeout_s=60)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("  ... supervisor execution RUNNING, no training job yet (")
    assert lines[-1] == "training job ts-x--abc-r1: InProgress"


def test_launch_wait_that_runs_out_says_the_run_started_and_exits_1(monkeypatch, capsys) -> None:
    import pytest

    from trainstack.aws import launching
    from trainstack.errors import TrainstackError

    monkeypatch.setattr(launching.time, "sleep", lambda s: None)
    with pytest.raises(
        TrainstackError, match="^the launch started but no training job ts-x--abc-r1"
    ) as caught:
        launching.wait_for_job(_FakeClients(), "arn:execution", "ts-x--abc-r1", timeout_s=0.2)
    assert caught.value.exit_code == 1
    assert "no training job yet" in capsys.readouterr().out


def test_launch_wait_says_so_when_the_supervisor_started_no_job(monkeypatch) -> None:
    """An execution that ended without creating the job (the run changed meanwhile) is an error, not a
    two-minute wait."""
    import pytest

    from trainstack.aws import launching
    from trainstack.errors import TrainstackError

    monkeypatch.setattr(launching.time, "sleep", lambda s: None)
    with pytest.raises(TrainstackError, match="^the supervisor started no job ts-x--abc-r1-1") as caught:
        launching.wait_for_job(
            _FakeClients(status="SUCCEEDED"), "arn:execution", "ts-x--abc-r1-1", timeout_s=60
        )
    assert caught.value.exit_code == 2


def clean_env() -> dict[str, str]:
    """No AWS at all: no endpoint, no region, no credentials, no profile."""
    drop = ("AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE", "AWS_ACCESS_KEY_ID")
    return {
        **{k: v for k, v in os.environ.items() if k not in drop},
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
    }


def test_dry_run_prints_the_full_request_without_aws_with_marked_placeholders(tmp_path: Path) -> None:
    import json

    from trainstack.aws.request import create_training_job_request

    result = subprocess.run(
        [TRAINSTACK, "launch", "30b-fp8", "--dry-run", "--json", "--name", "try-1"],
        cwd=Path(__file__).resolve().parents[2],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert set(printed) == {"request", "placeholders", "input"}
    assert printed["input"] == {"mode": "", "reason": printed["input"]["reason"]}  # 30b-fp8: synthetic
    assert printed["placeholders"] == ["bucket_name", "image_uri", "kms_key_arn", "region", "role_arn"]
    body = printed["request"]
    assert body["TrainingJobName"] == "ts-platform-30b-fp8--try-1-1"
    assert body["RoleArn"].startswith("<placeholder: the execution role ARN of Trainstack-platform-30b-fp8")
    assert body["Environment"]["TRAINSTACK_RUN"] == "ts-platform-30b-fp8--try-1"
    uri = body["Environment"]["TRAINSTACK_CHECKPOINT_URI"]
    assert uri.startswith("s3://<placeholder: ") and uri.endswith("/checkpoints/platform/30b-fp8/try-1/")
    recipe = resolve("30b-fp8").recipe
    assert body == create_training_job_request(
        recipe,
        None,
        job_name=body["TrainingJobName"],
        run="ts-platform-30b-fp8--try-1",
        checkpoint_uri=uri,
        role_arn=body["RoleArn"],
        image_uri=body["AlgorithmSpecification"]["TrainingImage"],
        bucket_name=uri.removeprefix("s3://").split("/checkpoints/")[0],
        kms_key_arn=body["OutputDataConfig"]["KmsKeyId"],
        region="<placeholder: the deployment's region>",
    )
    note, data_input = result.stderr.strip().splitlines()
    assert data_input.startswith("data input: no data channel")
    assert note.startswith("note: bucket_name, image_uri, kms_key_arn, region, role_arn are placeholders")


def test_bad_input_to_launch_is_one_line_and_exit_2_before_any_aws(tmp_path: Path) -> None:
    zero = tmp_path / "zero-jobs.yaml"
    zero.write_text("extends: 1b-bf16\nname: zero-jobs\ncompute:\n  max_jobs: 0\n")
    root = Path(__file__).resolve().parents[2]
    for args, expected in (
        ([str(zero)], "error: zero-jobs.yaml: compute.max_jobs: Input should be greater than 0"),
        (["1b-bf16", "--name", "Bad_Name"], "error: --name: invalid run name 'Bad_Name': a run name is 1-16"),
    ):
        result = subprocess.run(
            [TRAINSTACK, "launch", *args, "--local", "--recipes-dir", str(root / "recipes")],
            cwd=tmp_path,  # no emulator recorded here: an AWS call would fail differently
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 2, result.stderr
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith(expected), line
