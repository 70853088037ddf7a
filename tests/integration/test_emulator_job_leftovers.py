"""A real tiny training job on the emulator (issue 40 item 6): once it has ended, the emulator keeps what a
user needs of it (the node's log, config, failure and model folders) and not its copies of S3 (input
channels, the restored checkpoint folder); `trainstack status` shows the loss as the trainer last printed
it, not CloudWatch's per-minute average of every log step; and a new emulator says that it starts empty.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainstack.aws.runs import LogCursor, job_from_description, latest_metrics, log_streams, read_new_lines
from trainstack.cli.main import app
from trainstack.emulator import events
from trainstack.emulator.endpoint import Emulator
from trainstack.protocol.metrics import metric_definitions

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("emulator-jobs")]

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "tests" / "trainer" / "fixtures" / "tiny.yaml"
BUCKET = "leftovers"
JOB = "ts-platform-tiny-cpu--left1-1"  # the name `trainstack status tiny.yaml` finds (its job prefix)
ROLE = "arn:aws:iam::123456789012:role/trainstack-sagemaker"


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """The emulator, after the tiny trainer ran 40 steps as JOB with a 4 MB input channel and a restored
    checkpoint folder; (emulator, jobs_dir, the job's description)."""
    from trainstack.recipes.loader import resolve
    from trainstack.recipes.schema import to_hyperparameters

    jobs_dir = tmp_path_factory.mktemp("jobs")
    recipe = resolve(str(TINY), overrides=("training.steps=40", "checkpointing.interval_steps=1000")).recipe
    with Emulator(jobs_dir=jobs_dir).start(timeout_s=180) as emu:
        s3 = emu.client("s3")
        s3.create_bucket(Bucket=BUCKET)
        for i in range(2):
            s3.put_object(Bucket=BUCKET, Key=f"extra/part{i}.bin", Body=os.urandom(2 << 20))
        s3.put_object(Bucket=BUCKET, Key="restored/left-by-an-earlier-job.txt", Body=b"x" * 1000)
        emu.client("sagemaker").create_training_job(
            TrainingJobName=JOB,
            RoleArn=ROLE,
            AlgorithmSpecification={
                "TrainingImage": "123456789012.dkr.ecr.us-east-1.amazonaws.com/trainstack:1",
                "TrainingInputMode": "File",
                "MetricDefinitions": metric_definitions(()),
            },
            InputDataConfig=[
                {
                    "ChannelName": "extra",
                    "DataSource": {
                        "S3DataSource": {"S3DataType": "S3Prefix", "S3Uri": f"s3://{BUCKET}/extra/"}
                    },
                }
            ],
            CheckpointConfig={"S3Uri": f"s3://{BUCKET}/restored/", "LocalPath": "/opt/ml/checkpoints"},
            ResourceConfig={"InstanceType": "ml.p5.48xlarge", "InstanceCount": 1, "VolumeSizeInGB": 50},
            StoppingCondition={"MaxRuntimeInSeconds": 900},
            OutputDataConfig={"S3OutputPath": f"s3://{BUCKET}/output/"},
            HyperParameters=to_hyperparameters(recipe),
            Environment={"TRAINSTACK_CHECKPOINT_URI": f"s3://{BUCKET}/checkpoints/left1/"},
        )
        described = events.wait_for_status(emu.env(), JOB, ("Completed", "Failed", "Stopped"), timeout_s=600)
        yield emu, jobs_dir, described


def test_an_ended_job_keeps_its_log_and_outputs_not_its_copies_of_s3(finished):
    emu, jobs_dir, described = finished
    assert described["TrainingJobStatus"] == "Completed", described.get("FailureReason")
    node = jobs_dir / JOB / "algo-1"
    deadline = time.monotonic() + 30  # the job's thread deletes them right after its last status
    while ((node / "input" / "data" / "extra").exists() or (node / "checkpoints").exists()) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.2)
    assert not (node / "input" / "data" / "extra").exists()  # 4 MB copied from S3, gone
    assert not (node / "checkpoints").exists()  # the restored folder, synced back to S3 first
    listed = emu.client("s3").list_objects_v2(Bucket=BUCKET, Prefix="restored/")["Contents"]
    assert [o["Key"] for o in listed] == ["restored/left-by-an-earlier-job.txt"]
    log = (jobs_dir / JOB / "algo-1.log").read_text()
    assert "EMULATOR: File input extra: 2 object(s)" in log and "loss=" in log
    assert json.loads((node / "input" / "config" / "hyperparameters.json").read_text())
    assert (node / "model").is_dir() and (node / "output").is_dir()
    kept = sum(p.stat().st_size for p in (jobs_dir / JOB).rglob("*") if p.is_file())
    assert kept < 1 << 20, f"{kept:,} bytes kept for one tiny job"


def test_status_shows_the_last_loss_the_trainer_printed_not_a_minutes_average(finished):
    emu, _, described = finished
    logs = emu.client("logs")
    losses = [
        float(m.group(1))
        for _, _, message in read_new_lines(logs, log_streams(logs, JOB), LogCursor())
        if (m := re.search(r"(?:^|\s)loss=([-+0-9.e]+)(?=\s|$)", message))
    ]
    assert len(losses) == 40
    last = losses[-1]
    # What status read before: CloudWatch's average over the period holding the last point (60 s, in
    # which this job logged many steps). The test means something only where that differs from the last.
    job = job_from_description(emu.client("sagemaker").describe_training_job(TrainingJobName=JOB))
    averaged = latest_metrics(emu.client("cloudwatch"), job)["loss"].value
    assert abs(averaged - last) > 1e-4, (averaged, losses[-10:])
    final = {m["MetricName"]: m["Value"] for m in described["FinalMetricDataList"]}
    assert final["train:loss"] == pytest.approx(last)

    result = CliRunner(env={**emu.env(), "COLUMNS": "200", "NO_COLOR": "1"}).invoke(
        app, ["status", str(TINY), "--local", "--json"]
    )
    assert result.exit_code == 0, result.output
    (run,) = json.loads(result.stdout)["runs"]
    assert run["loss"] == pytest.approx(last, abs=1e-4)


def _emulator_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "CDK_"))}
    trainstack = str(Path(sys.executable).parent / "trainstack")
    return subprocess.run(
        [trainstack, "emulator", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_a_new_emulator_says_it_starts_empty_and_names_the_one_that_died(tmp_path):
    started = _emulator_cli(tmp_path, "start", "--timeout", "240")
    assert started.returncode == 0, started.stderr
    first = json.loads((tmp_path / ".emulator" / "endpoint.json").read_text())
    try:
        assert started.stdout.splitlines()[1].startswith(
            "note: the emulator keeps its state in memory only: buckets, deployed stacks, runs and jobs"
        )
        os.kill(first["pid"], signal.SIGKILL)  # it dies (a crash, a reboot): its record stays behind
        if first.get("mlflow_pid"):
            os.kill(first["mlflow_pid"], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while _emulator_cli(tmp_path, "status").returncode == 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        again = _emulator_cli(tmp_path, "start", "--timeout", "240")
        assert again.returncode == 0, again.stderr
        assert again.stdout.splitlines()[1].startswith(
            f"note: the emulator that ran here before ({first['endpoint']}, pid {first['pid']}) is gone, "
            "and its state with it: the emulator keeps its state in memory only"
        )
    finally:
        stopped = _emulator_cli(tmp_path, "stop")
    assert "its state (buckets, stacks, runs, jobs) was in its memory and is gone" in stopped.stdout
