"""`trainstack export RUN`: a run of the default team (no recipes/teams/<team>/) and of a team with files."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from trainstack.aws import run_control as export_command
from trainstack.cli.commands.run_access import team_option
from trainstack.cli.main import app

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parents[2]

runner = CliRunner()


class _StepFunctions:
    def __init__(self) -> None:
        self.started: list[dict] = []

    def start_execution(self, **kwargs):
        self.started.append(kwargs)
        return {"executionArn": f"arn:aws:states:us-east-1:123456789012:execution:export:{kwargs['name']}"}


def _fake_deployment(monkeypatch, stepfunctions: _StepFunctions, request: dict | None = None) -> None:
    record = SimpleNamespace(
        exports=(),
        run_id="r1",
        checkpoint_uri="s3://b/checkpoints/platform/1b-bf16/r1/",
        overrides={},
        request=request or {},
    )
    where = SimpleNamespace(launcher={"ExportStateMachineArn": "arn:aws:states:::stateMachine:export"})
    aws = SimpleNamespace(client=lambda service: stepfunctions, where="the emulator", local=True)
    monkeypatch.setattr("trainstack.aws.session.Aws", lambda local: aws)
    monkeypatch.setattr("trainstack.aws.run_access.find_run", lambda aws, run: (record, where))
    # The run's checkpoints and earlier exports are read from S3 and SageMaker (the emulator tests,
    # tests/integration/test_export_refusals_emulator.py): here, one complete checkpoint, no export.
    monkeypatch.setattr(export_command, "refuse_a_running_export", lambda *args: None)
    monkeypatch.setattr(export_command, "exportable_step", lambda s3, run, uri, step: step or 7)


@pytest.mark.parametrize("run", ["ts-platform-1b-bf16--r1", "ts-nlp-8b-fp8--r1"])
def test_export_starts_for_the_default_team_and_for_a_team_with_files(monkeypatch, run):
    stepfunctions = _StepFunctions()
    _fake_deployment(monkeypatch, stepfunctions)
    result = runner.invoke(app, ["export", run, "--json"])
    assert result.exit_code == 0, result.output
    assert "unknown team" not in result.output
    (started,) = stepfunctions.started
    assert started["name"] == f"{run}-X1"
    assert json.loads(started["input"])["Run"] == run
    assert json.loads(result.output)["job"] == f"{run}-X1"


def test_the_default_team_deploys_without_team_files_and_a_team_with_files_with_them():
    assert team_option("platform") is None  # recipes/teams/platform does not exist
    assert team_option("nlp") == "nlp"


def test_a_recipe_files_run_is_sized_from_the_recipe_its_request_records(monkeypatch):
    """`make demo` launches a recipe file (demo-tiny), whose name recipes/ does not know."""
    from trainstack.recipes.loader import resolve
    from trainstack.recipes.schema import to_hyperparameters

    recipe = resolve(str(REPO / "tests/trainer/fixtures/tiny.yaml"), None).recipe
    stepfunctions = _StepFunctions()
    _fake_deployment(monkeypatch, stepfunctions, request={"HyperParameters": to_hyperparameters(recipe)})
    run = f"ts-platform-{recipe.name}--r1"
    result = runner.invoke(app, ["export", run])
    assert result.exit_code == 0, result.output
    assert "unknown recipe" not in result.output
    assert f"exporting run {run}" in result.output
