"""Every command of trainstack.api's with `--json` prints exactly its API result's `to_json()`: the same
recipe, team and overrides through `trainstack.api` and through the command line give the same bytes.

AWS is stood in for at the layer the API reads it through (trainstack.aws.run_status's collectors and
trainstack.aws.runs.aws_clients), and the clock is held still, so both calls see the same jobs at the
same instant. The trace reads a report the trainer's own `python -m trainer.trace` wrote for
tests/trainer/fixtures/tiny.yaml (fixtures/tiny_trace_report.json), placed in a cache of its own, so no
trace runs here (tests/trace/test_plan_trace.py runs one).
"""

from __future__ import annotations

import json
import os
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainstack import api
from trainstack.aws.registry import JobRecord, Run, view
from trainstack.aws.request import job_name
from trainstack.aws.run_status import Snapshot
from trainstack.aws.runs import Sample, assess, job_from_description
from trainstack.cli.main import app
from trainstack.planner import plan as make_plan
from trainstack.recipes.loader import resolve

pytestmark = pytest.mark.fast

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TINY = str(ROOT / "tests" / "trainer" / "fixtures" / "tiny.yaml")
NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def cli_json(*args: str, exit_code: int = 0) -> str:
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == exit_code, result.output
    return result.stdout


class _Frozen(datetime):
    @classmethod
    def now(cls, tz=None):  # noqa: ANN001, ANN206 (datetime's own signature)
        return NOW if tz is not None else NOW.replace(tzinfo=None)


class _Clients:
    where = "the local emulator (http://localhost:55555)"
    aws = None


@pytest.fixture
def aws_stood_in(monkeypatch):
    monkeypatch.setattr("trainstack.aws.runs.aws_clients", lambda local, environ=None: _Clients())
    monkeypatch.setattr("trainstack.api.monitoring.datetime", _Frozen)


@pytest.mark.parametrize(
    ("recipe", "team", "overrides", "exit_code"),
    [
        ("8b-fp8", None, [], 0),
        ("8b-fp8", "nlp", ["training.micro_batch=2"], 0),
        # does not fit on one node: the plan is still printed, then exit 1
        (
            "64b-fp8",
            None,
            ["compute.instance_count=1", "parallelism.shard_group=8", "activation_checkpointing.mode=none"],
            1,
        ),
    ],
    ids=["base", "team-and-set", "does-not-fit"],
)
def test_plan_json_is_the_api_plan_to_json(recipe, team, overrides, exit_code):
    found = api.plan(recipe, team=team, overrides=overrides, enforce=False)
    args = ["plan", recipe, "-q"] + (["--team", team] if team else [])
    for item in overrides:
        args += ["--set", item]
    printed = CliRunner().invoke(app, [*args, "--json"])
    assert printed.stdout == found.to_json() + "\n"
    assert printed.exit_code in (found.exit_code, 2), printed.output  # 2: a refusal after the plan
    assert found.exit_code == exit_code
    assert json.loads(found.to_json())["memory"]["peak_gib"] == found.plan.memory.peak_gib


def test_plan_compare_json_is_the_api_compare_to_json():
    found = api.compare("30b-fp8")
    assert cli_json("plan", "30b-fp8", "--compare", "-q") == found.to_json() + "\n"
    assert len(json.loads(found.to_json())) == len(found.rows) > 1


def test_plan_trace_json_is_the_api_trace_to_json(tmp_path, monkeypatch):
    from trainstack.tuning.trace import trace_key, trainer_directory

    directory = trainer_directory()
    if directory is None:
        pytest.skip("the trainer package is not installed here")
    recipe = resolve(TINY).recipe
    report = HERE / "fixtures" / "tiny_trace_report.json"
    shutil.copy(report, tmp_path / f"{trace_key(recipe, directory)}.json")
    monkeypatch.setenv("TRAINSTACK_TRACE_CACHE", str(tmp_path))
    found = api.trace(TINY, enforce=False)
    traced = json.loads(found.to_json())["memory"]["traced"]
    assert traced["cached"] and traced["peak_gib"] > 0  # read from the cache: no trace ran
    assert cli_json("plan", TINY, "--trace", "-q", exit_code=found.exit_code) == found.to_json() + "\n"


@pytest.fixture
def snapshot() -> Snapshot:
    recipe = resolve("30b-fp8").recipe
    the_plan = make_plan(recipe)
    name = job_name(recipe, None, "r1")
    job = job_from_description(
        {
            "TrainingJobName": name,
            "TrainingJobStatus": "InProgress",
            "SecondaryStatus": "Training",
            "CreationTime": NOW - timedelta(hours=3),
            "TrainingStartTime": NOW - timedelta(hours=2),
            "CheckpointConfig": {"S3Uri": "s3://b/checkpoints/platform/30b-fp8/" + name},
            "ResourceConfig": {"InstanceType": recipe.compute.instance_type, "InstanceCount": 4},
            "HyperParameters": {"training.steps": "1000"},
        }
    )
    points = {
        "step": [(NOW - timedelta(minutes=60 - 10 * i), 20.0 * i) for i in range(6)],
        "loss": [(NOW - timedelta(minutes=60 - 10 * i), 9.0 - i) for i in range(6)],
    }
    latest = {key: Sample(values[-1][1], values[-1][0]) for key, values in points.items()}
    report = assess(job, latest, recipe, the_plan, NOW)
    return Snapshot([report], {}, [], True, {name: points})


def test_status_json_is_the_api_status_to_json(aws_stood_in, snapshot, monkeypatch):
    monkeypatch.setattr("trainstack.aws.run_status.collect_status", lambda *a: snapshot)
    found = api.status("30b-fp8")
    assert cli_json("status", "30b-fp8") == found.to_json() + "\n"
    (shown,) = json.loads(found.to_json())["runs"]
    assert shown["step"] == 100 and shown["eta"] and shown["trends"]["loss"][-1][1] == 4.0


def test_runs_json_is_the_api_runs_to_json(aws_stood_in, monkeypatch):
    run = Run(
        run="ts-platform-1b-bf16--main",
        run_id="main",
        recipe="1b-bf16",
        team="platform",
        state="failed",
        current_job="ts-platform-1b-bf16--main-2",
        job_index=2,
        jobs=(
            JobRecord("ts-platform-1b-bf16--main-1", 1, "Stopped", "MaxRuntimeExceeded", "MaxRuntime"),
            JobRecord("ts-platform-1b-bf16--main-2", 2, "Failed", "Failed", "Crashed"),
        ),
        checkpoint_uri="s3://bucket/checkpoints/platform/1b-bf16/main/",
        steps=100,
        tokens_per_step=1,
        usd_per_hour=1.0,
        overrides={},
        keep_alive=0,
        stop_requested=False,
        why="it failed",
        next_step="a person must look at it",
        recipe_hash="h",
        max_jobs=20,
        creator="",
        created=NOW,
        updated=NOW,
    )
    monkeypatch.setattr("trainstack.aws.run_status.collect_runs", lambda *a: [view(run, {}, 40, NOW)])
    found = api.runs()
    assert cli_json("runs") == found.to_json() + "\n"
    (row,) = json.loads(found.to_json())
    assert row["run"] == run.run and row["state"] == "failed"


def test_checkpoints_json_is_the_api_checkpoints_to_json(aws_stood_in, tmp_path):
    (tmp_path / "step-000000010").mkdir()  # a save that never finished: no COMPLETE.json
    (tmp_path / "step-000000020").mkdir()
    (tmp_path / "step-000000020" / "COMPLETE.json").write_text("{not json")  # damaged
    found = api.checkpoints(str(tmp_path))
    assert cli_json("checkpoints", str(tmp_path)) == found.to_json() + "\n"
    assert [(c["step"], c["state"]) for c in json.loads(found.to_json())] == [
        (20, "damaged"),
        (10, "incomplete"),
    ]


SFT = [
    "training.objective=sft",
    "model.init_from=s3://chat-sets/base/",
    "data.train_s3_uri=s3://chat-sets/support/v1/",
]


@pytest.fixture
def s3(monkeypatch):
    from moto import mock_aws

    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    with mock_aws():
        import boto3

        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket="chat-sets")
        yield client


def test_a_fine_tunes_plan_json_carries_its_fine_tuning_block_as_the_api_does(s3):
    found = api.plan("8b-fp8", overrides=SFT, enforce=False)
    assert found.fine_tuning is not None and not found.fine_tuning["priced"]
    assert "no such object" in found.fine_tuning["reason"]
    args = ["plan", "8b-fp8", "-q"] + [word for item in SFT for word in ("--set", item)]
    assert cli_json(*args, exit_code=found.exit_code) == found.to_json() + "\n"
    assert "fine_tuning" not in json.loads(api.plan("8b-fp8", enforce=False).to_json())  # pretraining


def test_a_fine_tune_over_a_pretraining_set_is_refused_in_the_same_line_by_the_api_and_the_cli(s3):
    manifest = {"format": "trainstack-dataset-v1", "tokens": 1000, "documents": 3}
    s3.put_object(Bucket="chat-sets", Key="support/v1/manifest.json", Body=json.dumps(manifest).encode())
    with pytest.raises(api.TrainstackError) as raised:
        api.plan("8b-fp8", overrides=SFT, enforce=False)
    line = " ".join(str(raised.value).split())
    assert line.startswith("data.train_s3_uri: ") and "not a chat dataset" in line
    args = ["plan", "8b-fp8", "-q"] + [word for item in SFT for word in ("--set", item)]
    printed = CliRunner().invoke(app, [*args, "--json"])
    assert printed.exit_code == 2 and printed.stdout == ""
    assert f"error: {line}" in printed.output


def test_data_prepare_dry_run_prints_the_plan_then_the_api_request(s3, monkeypatch):
    """`data prepare` has no --json; its --dry-run prints the plan's line, then the checked
    CreateProcessingJob request, which is the API result's to_json()."""
    from types import SimpleNamespace

    monkeypatch.setattr("trainstack.api.data.datetime", SimpleNamespace(datetime=_Frozen, UTC=UTC))
    s3.put_object(Bucket="chat-sets", Key="web/a.jsonl", Body=b'{"text": "hello"}\n')
    ask = dict(tokenizer="bytes", out="s3://chat-sets/tokens/", recipe="8b-fp8", dry_run=True)
    steps: list[str] = []
    found = api.data_prepare(["s3://chat-sets/web/"], on_step=steps.append, **ask)
    assert found.where == "aws" and not found.started and steps == [f"plan: {found.plan}"]
    assert json.loads(found.to_json())["ProcessingJobName"] == found.job
    printed = CliRunner().invoke(
        app,
        ["data", "prepare", "s3://chat-sets/web/", "--tokenizer", "bytes", "--out", "s3://chat-sets/tokens/"]
        + ["--recipe", "8b-fp8", "--dry-run"],
    )
    assert printed.exit_code == 0, printed.output
    assert printed.stdout == f"plan: {found.plan}\n{found.to_json()}\n"


def test_show_json_is_the_api_show_to_json():
    found = api.show("8b-fp8", team="nlp", overrides=["training.steps=100"], warn=False)
    args = ["show", "8b-fp8", "--team", "nlp", "--set", "training.steps=100", "-q"]
    assert cli_json(*args) == found.to_json() + "\n"
    assert json.loads(found.to_json())["sources"]["training.steps"] == "--set"


def test_diff_json_is_the_api_diff_to_json(tmp_path):
    import subprocess

    root = tmp_path / "repo"
    (root / "recipes").mkdir(parents=True)
    shutil.copy(ROOT / "recipes" / "1b-bf16.yaml", root / "recipes" / "1b-bf16.yaml")

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)

    git("init", "--quiet")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "--quiet", "-m", "recipes")
    recipe = root / "recipes" / "1b-bf16.yaml"
    recipe.write_text(recipe.read_text().replace("steps: 24000,", "steps: 12000,", 1))
    found = api.diff("HEAD", repo=root, synth=False)
    assert cli_json("diff", "--base", "HEAD", "--repo", str(root), "--no-synth") == found.to_json() + "\n"
    assert json.loads(found.to_json())["deploy_count"] == 1
