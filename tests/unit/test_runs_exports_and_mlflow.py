"""`trainstack runs`' small defects of issue 40: an export is shown as the folder it wrote (`step-120/`,
not `step-N/`), and `runs --mlflow` finds the MLflow run of a run whose recipe was deployed from a
file (the demo's scripts/demo-tiny.yaml: "unknown recipe 'demo-tiny'" before)."""

from __future__ import annotations

import re
from dataclasses import replace
from datetime import UTC, datetime

import pytest
from test_resume_after_a_failure import run as failed_run

from trainstack.aws import run_status
from trainstack.aws.export_job import export_job_request
from trainstack.aws.registry import view
from trainstack.aws.request import checkpoint_uri, create_training_job_request
from trainstack.aws.runs import export_folder
from trainstack.cli.commands import runs as runs_command
from trainstack.protocol.metrics import EXPORTED_STEP_METRIC
from trainstack.recipes import naming
from trainstack.recipes.loader import resolve

pytestmark = pytest.mark.fast

PARENT = "s3://bucket/exports/platform/demo-tiny/demo/"


def described(status: str, step: float | None = None) -> dict:
    metrics = [{"MetricName": EXPORTED_STEP_METRIC, "Value": step}] if step is not None else []
    return {"TrainingJobStatus": status, "FinalMetricDataList": metrics}


@pytest.mark.parametrize(
    ("export", "description", "folder"),
    [
        ({"step": 40, "out_parent": PARENT}, None, f"{PARENT}step-40/"),  # asked for step 40
        ({"step": 0, "out_parent": PARENT}, described("Completed", 120.0), f"{PARENT}step-120/"),
        ({"step": 0, "out_parent": PARENT}, described("InProgress"), f"{PARENT}step-<newest complete"),
        ({"step": 0, "out_parent": PARENT}, described("Failed"), "nothing exported: the job ended Failed"),
    ],
    ids=["asked", "newest-exported", "newest-running", "failed"],
)
def test_an_export_is_shown_as_the_folder_it_wrote(export: dict, description, folder: str) -> None:
    assert export_folder(export, description).startswith(folder) or folder in export_folder(
        export, description
    )
    assert "step-N/" not in export_folder(export, description)


def test_the_export_job_reports_the_step_it_exported_in_a_metric_sagemaker_reads() -> None:
    recipe = resolve("1b-bf16").recipe
    request = export_job_request(
        recipe,
        None,
        job_name="ts-platform-1b-bf16--main-X1",
        checkpoint_uri="s3://b/checkpoints/platform/1b-bf16/main/",
        out_parent="s3://b/exports/platform/1b-bf16/main/",
        step="0",
        role_arn="arn:aws:iam::123456789012:role/x",
        image_uri="img:1",
        bucket_name="b",
    )
    (definition,) = request["AlgorithmSpecification"]["MetricDefinitions"]
    # CreateTrainingJob's MetricDefinition: Name 1-255, Regex 1-500 characters, at most 40 of them
    # (SageMaker API reference; the same in botocore's service model, read here).
    import botocore.session

    model = botocore.session.get_session().get_service_model("sagemaker")
    shape = model.shape_for("MetricDefinition").members
    listed = model.shape_for("MetricDefinitionList").metadata
    assert shape["Name"].metadata["max"] == 255 and shape["Regex"].metadata["max"] == 500
    assert listed["max"] == 40 and len(request["AlgorithmSpecification"]["MetricDefinitions"]) <= 40
    assert definition["Name"] == EXPORTED_STEP_METRIC and 1 <= len(definition["Regex"]) <= 500
    # The export's last line (trainer.export.hf_folder.main).
    line = "exported step 120 to s3://b/exports/x/main/step-120/: 4 file(s), 0.01 GB bf16 in 1.2 s"
    assert re.search(definition["Regex"], line).group(1) == "120"


def test_runs_prints_the_folder_of_each_export(capsys) -> None:
    run = replace(
        failed_run("it failed", "Crashed"),
        exports=(
            {
                "job": "r-X1",
                "step": 0,
                "out_parent": PARENT,
                "reason": "on_complete",
                "folder": f"{PARENT}step-120/",
            },
        ),
    )
    runs_command.render([view(run, {}, None, datetime.now(UTC))], "here", None, None)
    out = " ".join(capsys.readouterr().out.split())
    assert f"export r-X1 (newest step, on_complete) -> {PARENT}step-120/" in out and "step-N/" not in out


def test_runs_mlflow_reads_the_runs_recorded_recipe_not_a_recipe_by_name(monkeypatch) -> None:
    """The demo deploys scripts/demo-tiny.yaml; the registry names its recipe `demo-tiny`, which no
    recipes directory has. The run's recorded request holds the recipe it trained and tracked."""
    recipe = resolve("scripts/demo-tiny.yaml").recipe
    name = naming.run_name(recipe, None, "demo")
    request = create_training_job_request(
        recipe,
        None,
        job_name=naming.job_of_run(name, 1),
        run=name,
        checkpoint_uri=checkpoint_uri("bucket", recipe, None, "demo"),
        role_arn="arn:aws:iam::123456789012:role/exec",
        image_uri="img:1",
        bucket_name="bucket",
        region="us-east-1",
        mlflow_arn="arn:aws:sagemaker:us-east-1:123456789012:mlflow-app/app-x",
    )
    run = replace(failed_run("it failed", "Crashed"), run=name, recipe=recipe.name, request=request)
    seen = []

    def tracking_uri(aws, resolved, team, hint, **_):
        seen.append(resolved)
        return "http://mlflow.local"

    monkeypatch.setattr("trainstack.aws.mlflow_access.tracking_uri", tracking_uri)
    monkeypatch.setattr(
        "trainstack.aws.mlflow_access.describe",
        lambda v, uri, r, team, s3=None: (f"mlflow: {uri}", None),
    )

    class Aws:
        local = True

        def client(self, name):
            return None

    lines = run_status.mlflow_lines(Aws(), [view(run, {}, None, datetime.now(UTC))], None)
    assert lines[name] == ("mlflow: http://mlflow.local", None), lines
    assert [r.name for r in seen] == ["demo-tiny"] and seen[0] == recipe
