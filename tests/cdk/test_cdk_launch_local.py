"""`trainstack launch --local` without an emulator, and the base-image cache: fast, no AWS."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from trainstack import config
from trainstack.loader import resolve

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
    assert result.stderr.strip().splitlines() == [
        "error: no local emulator is running: AWS_ENDPOINT_URL is unset and no live one is recorded in "
        ".emulator/endpoint.json under this directory (start one here with `trainstack emulator start`, "
        "or export the AWS_ENDPOINT_URL it printed)"
    ]


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
    from trainstack.commands import launch

    monkeypatch.setattr(launch.time, "sleep", lambda s: None)
    launch._wait_for_job(_FakeClients(job_after=2), "arn:execution", "ts-x--abc-r1", timeout_s=60)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("  ... launcher execution RUNNING, no training job yet (")
    assert lines[-1] == "training job ts-x--abc-r1: InProgress"


def test_launch_wait_that_runs_out_says_the_run_started_and_exits_1(monkeypatch, capsys) -> None:
    import pytest

    from trainstack.commands import launch
    from trainstack.errors import TrainstackError

    monkeypatch.setattr(launch.time, "sleep", lambda s: None)
    with pytest.raises(
        TrainstackError, match="^the launch started but no training job ts-x--abc-r1"
    ) as caught:
        launch._wait_for_job(_FakeClients(), "arn:execution", "ts-x--abc-r1", timeout_s=0.2)
    assert caught.value.exit_code == 1
    assert "no training job yet" in capsys.readouterr().out
