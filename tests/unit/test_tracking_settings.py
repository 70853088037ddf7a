"""`tracking:` in a recipe or a team's defaults, and what it puts into CreateTrainingJob: MlflowConfig and
TensorBoardOutputConfig checked against the pinned botocore model (its patterns and lengths, which the
emulator does not enforce)."""

from __future__ import annotations

import os

import pytest
import yaml

from trainstack.aws.request import Runtime, create_training_job_request
from trainstack.aws.request_check import PLACEHOLDERS, check_request, longest_job_name
from trainstack.errors import RecipeError
from trainstack.recipes.loader import resolve

pytestmark = pytest.mark.fast

APP = "arn:aws:sagemaker:us-west-2:123456789012:mlflow-app/app-0123456789ab"


def recipe(*overrides: str):
    return resolve("1b-bf16", None, overrides).recipe


def request(r, **kwargs):
    return create_training_job_request(
        r, None, job_name=longest_job_name(r, None), **{**PLACEHOLDERS, **kwargs}
    )


def test_off_by_default_and_nothing_is_sent():
    body = request(recipe())
    assert "MlflowConfig" not in body and "TensorBoardOutputConfig" not in body
    assert not any(k.startswith("MLFLOW_") for k in body["Environment"])


def test_a_bare_yaml_off_means_off():
    parsed = yaml.safe_load("tracking: {mlflow: off}")  # YAML 1.1: `off` is false
    assert parsed["tracking"]["mlflow"] is False
    from trainstack.recipes.schema import Tracking

    assert Tracking.model_validate(parsed["tracking"]).mlflow == "off"


@pytest.mark.parametrize(
    "value",
    ["on", "arn:aws:sagemaker:us-west-2:123456789012:notebook-instance/x", "http://mlflow.example:5000"],
)
def test_anything_else_is_refused_naming_the_field(value):
    with pytest.raises(RecipeError) as refused:
        recipe(f"tracking.mlflow={value}")
    assert "tracking.mlflow" in str(refused.value) and refused.value.exit_code == 2


def test_a_recipes_arn_goes_to_mlflow_config_and_the_environment():
    body = request(recipe(f"tracking.mlflow={APP}", "tracking.experiment=nlp/sweeps"), run="ts-p-1b--a")
    assert body["MlflowConfig"] == {
        "MlflowResourceArn": APP,
        "MlflowExperimentName": "nlp/sweeps",
        "MlflowRunName": "ts-p-1b--a",
    }
    env = body["Environment"]
    assert env["MLFLOW_TRACKING_URI"] == APP and env["MLFLOW_EXPERIMENT_NAME"] == "nlp/sweeps"
    assert check_request(body) == []


def test_managed_uses_the_teams_app_and_tensorboard_syncs_under_the_recipes_output():
    body = request(
        recipe("tracking.mlflow=managed", "tracking.tensorboard=true"),
        run=Runtime("$.Run"),
        previous_job_end=Runtime("$.PreviousJobEnd"),
    )
    assert body["MlflowConfig"]["MlflowResourceArn"] == PLACEHOLDERS["mlflow_arn"]
    assert body["MlflowConfig"]["MlflowExperimentName"] == "platform/1b-bf16"  # default: <team>/<recipe>
    assert body["MlflowConfig"]["MlflowRunName.$"] == "$.Run"
    assert body["Environment"]["TRAINSTACK_PREVIOUS_JOB_END.$"] == "$.PreviousJobEnd"
    tb = body["TensorBoardOutputConfig"]
    assert tb["LocalPath"] == "/opt/ml/output/tensorboard"  # the documented default the trainer writes
    assert tb["S3OutputPath"] == f"{body['OutputDataConfig']['S3OutputPath']}/tensorboard/"


def test_botocores_model_refuses_what_sagemaker_would():
    # MlflowResourceArn's pattern and MlflowRunName's 256 characters (SageMaker API reference,
    # MlflowConfig); moto takes any value.
    body = request(recipe(f"tracking.mlflow={APP}"), run="r")
    body["MlflowConfig"]["MlflowResourceArn"] = "arn:aws:s3:::not-mlflow"
    body["MlflowConfig"]["MlflowRunName"] = "r" * 257
    found = {f.path for f in check_request(body)}
    assert {"MlflowConfig.MlflowResourceArn", "MlflowConfig.MlflowRunName"} <= found
    long_end = request(recipe(f"tracking.mlflow={APP}"), previous_job_end="x" * 513)
    assert [f.path for f in check_request(long_end)] == ["Environment[TRAINSTACK_PREVIOUS_JOB_END]"]


def test_a_team_sets_it_once_for_all_of_its_recipes(tmp_path):
    import shutil
    from pathlib import Path

    recipes = tmp_path / "recipes"
    shutil.copytree(Path(__file__).resolve().parents[2] / "recipes", recipes)
    defaults = recipes / "teams" / "nlp" / "defaults.yaml"
    defaults.write_text(defaults.read_text() + "tracking: {mlflow: managed, tensorboard: true}\n")
    for name in ("8b-fp8", "14b-fp8"):
        tracking = resolve(name, "nlp", recipes_dir=recipes).recipe.tracking
        assert (tracking.mlflow, tracking.tensorboard) == ("managed", True)
    assert resolve("8b-fp8", None, recipes_dir=recipes).recipe.tracking.mlflow == "off"  # other teams


def test_an_mlflow_client_leaves_the_process_tracking_uri_alone(monkeypatch):
    # mlflow.set_tracking_uri exports MLFLOW_TRACKING_URI; left behind, it switched tracking on (against
    # a server long gone) for every trainer run later in the same process.
    from trainstack.aws import tracking as aws_tracking

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    aws_tracking.client("http://127.0.0.1:9")
    assert "MLFLOW_TRACKING_URI" not in os.environ


def test_the_sagemaker_header_provider_is_asked_for_arns_only_and_no_request_warns(monkeypatch):
    """sagemaker-mlflow's provider parsed every tracking URI as an ARN: MLflow warned "Encountered
    unexpected error during resolving request headers" on each call to the emulator's http:// MLflow."""
    import logging

    import mlflow
    from mlflow.tracking.request_header.registry import _request_header_provider_registry as registry
    from mlflow.tracking.request_header.registry import resolve_request_headers

    from trainstack.aws.tracking import client

    class Recorded(logging.Handler):  # MLflow's loggers do not propagate to the root (caplog)
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    logger = logging.getLogger("mlflow.tracking.request_header.registry")
    recorded = Recorded()
    logger.addHandler(recorded)
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # restored after the test
        client("http://127.0.0.1:9")
        headers = resolve_request_headers()
        assert recorded.messages == [] and not any(h.startswith("x-sm") for h in headers)
        assert logger.isEnabledFor(logging.WARNING)  # not silenced: asked only where it applies
        monkeypatch.setattr(mlflow.tracking._tracking_service.utils, "_tracking_uri", None)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", APP)
        assert resolve_request_headers()["x-sm-mlflow-app-arn"] == APP  # an ARN still gets its header
        monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")

        class Broken:
            def in_context(self):
                raise RuntimeError("broken provider")

        monkeypatch.setattr(registry, "_registry", [*registry._registry, Broken()])
        resolve_request_headers()
        assert any("broken provider" in m for m in recorded.messages)  # other failures still reported
    finally:
        logger.removeHandler(recorded)
