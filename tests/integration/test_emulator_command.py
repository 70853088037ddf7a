"""`trainstack emulator start|status|stop|env` as a user runs them, and the "where" line: an emulator
that outlives the command that started it, recorded with the server's own PID, stopped by one command;
`status` without --local but with the emulator's AWS_ENDPOINT_URL exported says it went there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from trainstack.aws.session import where_line
from trainstack.emulator.endpoint import is_emulator_process
from trainstack.emulator.mlflow_server import is_mlflow_server

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("emulator")]
ROOT = Path(__file__).resolve().parents[2]
TRAINSTACK = str(Path(sys.executable).parent / "trainstack")


def cli(cwd: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "CDK_"))}
    return subprocess.run(
        [TRAINSTACK, *args],
        cwd=cwd,
        env={**base, "COLUMNS": "120", **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_start_status_env_and_stop(tmp_path: Path) -> None:
    assert cli(tmp_path, "emulator", "status").returncode == 1  # none yet

    started = cli(tmp_path, "emulator", "start", "--timeout", "240")
    assert started.returncode == 0, started.stderr
    state = json.loads((tmp_path / ".emulator" / "endpoint.json").read_text())
    try:
        # the command has exited; the server it started runs on, recorded under its own PID
        assert is_emulator_process(state["pid"]) and "supervisor_pid" not in state
        # and MLflow's own server beside it (trainstack.emulator.mlflow_server), recorded the same way
        assert state["mlflow"].startswith("http://127.0.0.1:") and is_mlflow_server(state["mlflow_pid"])
        urllib.request.urlopen(f"{state['endpoint']}/moto-api/data.json", timeout=5).close()
        assert started.stdout.splitlines()[0].startswith(
            f"started the local AWS emulator on {state['endpoint']}"
        )
        assert "stop it with `trainstack emulator stop`" in started.stdout

        again = cli(tmp_path, "emulator", "start")
        assert again.returncode == 0 and "already running" in again.stdout
        assert json.loads((tmp_path / ".emulator" / "endpoint.json").read_text())["pid"] == state["pid"]

        status = cli(tmp_path, "emulator", "status")
        assert (
            status.returncode == 0 and f"running on {state['endpoint']} (pid {state['pid']}" in status.stdout
        )

        exported = cli(tmp_path, "emulator", "env")
        assert exported.returncode == 0
        env = dict(item.split("=", 1) for item in exported.stdout.strip().removeprefix("export ").split())
        assert env["AWS_ENDPOINT_URL"] == state["endpoint"] and env["AWS_ACCESS_KEY_ID"] == "testing"

        # The "where" line names the endpoint used, also without --local (boto3 honours the variable).
        shown = cli(tmp_path, "status", "1b-bf16", "--recipes-dir", str(ROOT / "recipes"), env=env)
        assert shown.returncode == 0, shown.stderr
        assert f"1b-bf16 (team platform) on the local emulator ({state['endpoint']})" in shown.stdout
        assert "region us-east-1" not in shown.stdout
    finally:
        stopped = cli(tmp_path, "emulator", "stop")
    assert (
        stopped.returncode == 0 and f"stopped the local AWS emulator on {state['endpoint']}" in stopped.stdout
    )
    assert not is_emulator_process(state["pid"])
    assert not is_mlflow_server(state["mlflow_pid"])  # stopped with it
    assert not (tmp_path / ".emulator" / "endpoint.json").exists()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{state['endpoint']}/moto-api/data.json", timeout=5).close()
    assert cli(tmp_path, "emulator", "status").returncode == 1
    gone = cli(tmp_path, "emulator", "env")
    assert gone.returncode == 2 and gone.stderr.startswith("error: no local emulator is running")
    assert cli(tmp_path, "emulator", "stop").stdout.strip() == "no local AWS emulator was running here"


@pytest.mark.parametrize(
    ("endpoint", "region", "expected"),
    [
        ("https://api.sagemaker.us-west-2.amazonaws.com", "us-west-2", "region us-west-2"),
        (None, "eu-west-1", "region eu-west-1"),
        ("http://localhost:5000", "us-east-1", "the local emulator (http://localhost:5000)"),
        (
            "https://proxy.corp.example:8443",
            "us-west-2",
            "https://proxy.corp.example:8443 (region us-west-2)",
        ),
    ],
)
def test_the_where_line_names_the_endpoint_unless_it_is_aws_own(endpoint, region, expected):
    assert where_line(endpoint, region) == expected


def test_status_draws_the_metric_history_cloudwatch_holds(tmp_path: Path) -> None:
    """The trend rows come from GetMetricData over the job's whole history (here: six points)."""
    from datetime import UTC, datetime, timedelta

    from trainstack.aws.request import job_name
    from trainstack.emulator.endpoint import Emulator
    from trainstack.protocol.metrics import FIELD_BY_KEY
    from trainstack.recipes.loader import resolve

    recipe = resolve("1b-bf16").recipe
    name = job_name(recipe, None, "trend1")
    # jobs="complete": a made-up job whose metrics the test writes itself; nothing is to run.
    with Emulator(log_path=tmp_path / "moto.log", jobs="complete").start(timeout_s=240) as emulator:
        env = emulator.env()
        emulator.client("sagemaker").create_training_job(
            TrainingJobName=name,
            AlgorithmSpecification={
                "TrainingImage": "123456789012.dkr.ecr.us-east-1.amazonaws.com/t:1",
                "TrainingInputMode": "File",
            },
            RoleArn="arn:aws:iam::123456789012:role/trainstack-sagemaker",
            OutputDataConfig={"S3OutputPath": "s3://b/output/"},
            ResourceConfig={
                "InstanceType": recipe.compute.instance_type,
                "InstanceCount": 1,
                "VolumeSizeInGB": 50,
            },
            StoppingCondition={"MaxRuntimeInSeconds": 3600},
            HyperParameters={"training.steps": "1000"},
        )
        now = datetime.now(UTC)
        emulator.client("cloudwatch").put_metric_data(
            Namespace="/aws/sagemaker/TrainingJobs",
            MetricData=[
                {
                    "MetricName": FIELD_BY_KEY[key].metric_name,
                    "Dimensions": [{"Name": "TrainingJobName", "Value": name}],
                    "Timestamp": now - timedelta(minutes=4 - i),  # within the job's window
                    "Value": value,
                }
                for i in range(6)
                for key, value in (("step", 10.0 * (i + 1)), ("loss", 9.0 - i))
            ],
        )
        shown = cli(tmp_path, "status", "1b-bf16", "--local", "--recipes-dir", str(ROOT / "recipes"), env=env)
    assert shown.returncode == 0, shown.stderr
    assert "step trend" in shown.stdout and "10 -> 60 over 5 min" in shown.stdout
    assert "loss trend" in shown.stdout and "9 -> 4 over 5 min" in shown.stdout
    assert max(len(line) for line in shown.stdout.splitlines()) <= 120
