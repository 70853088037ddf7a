"""`trainstack export RUN`: a run of the default team (no recipes/teams/<team>/) and of a team with files."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from trainstack.cli.commands import export as export_command
from trainstack.cli.commands.run_access import team_option
from trainstack.cli.main import app

runner = CliRunner()


class _StepFunctions:
    def __init__(self) -> None:
        self.started: list[dict] = []

    def start_execution(self, **kwargs):
        self.started.append(kwargs)
        return {"executionArn": f"arn:aws:states:us-east-1:123456789012:execution:export:{kwargs['name']}"}


def _fake_deployment(monkeypatch, stepfunctions: _StepFunctions) -> None:
    record = SimpleNamespace(
        exports=(), run_id="r1", checkpoint_uri="s3://b/checkpoints/platform/1b-bf16/r1/", overrides={}
    )
    where = SimpleNamespace(launcher={"ExportStateMachineArn": "arn:aws:states:::stateMachine:export"})
    aws = SimpleNamespace(client=lambda service: stepfunctions, where="the emulator", local=True)
    monkeypatch.setattr("trainstack.aws.session.Aws", lambda local: aws)
    monkeypatch.setattr(export_command, "find_run", lambda aws, run: (record, where))


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
