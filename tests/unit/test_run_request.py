"""A run's recorded request and its deliberate changes (trainstack.aws.run_request), and `resume`'s
refusals that need no AWS: what may change mid-run is trainstack.recipes.changes' table."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from trainstack.aws import run_request
from trainstack.aws.request import RESUME_STEP_ENV, checkpoint_uri, create_training_job_request
from trainstack.cli.main import app
from trainstack.errors import RecipeError
from trainstack.recipes import naming
from trainstack.recipes.loader import resolve

pytestmark = pytest.mark.fast

RECIPE = resolve("1b-bf16").recipe
RUN = naming.run_name(RECIPE, None, "main")


def recorded(**extra) -> dict:
    """A request as a launch records it: deployed values, and something another engineer's builder
    added that this module does not know (it must survive a change)."""
    request = create_training_job_request(
        RECIPE,
        None,
        job_name=naming.job_of_run(RUN, 1),
        run=RUN,
        checkpoint_uri=checkpoint_uri("bucket", RECIPE, None, "main"),
        role_arn="arn:aws:iam::123456789012:role/exec",
        image_uri="123456789012.dkr.ecr.us-east-1.amazonaws.com/repo:abc",
        bucket_name="bucket",
        kms_key_arn="arn:aws:kms:us-east-1:123456789012:key/k",
        region="us-east-1",
        keep_alive_seconds=1800,
    )
    request.pop("TrainingJobName")
    return {**request, **extra}


def test_a_safe_change_changes_exactly_the_fields_it_touches() -> None:
    before_request = recorded(MlflowConfig={"MlflowResourceArn": "arn:aws:sagemaker:x"})
    before = run_request.recipe_of(before_request)
    after = run_request.apply_sets(before, ["training.lr=0.0001", "compute.instance_count=2"])
    changed = run_request.changed_request(before_request, before, after, "platform")
    assert changed["HyperParameters"]["training.lr"] == "0.0001"
    assert changed["HyperParameters"]["compute.instance_count"] == "2"
    assert changed["ResourceConfig"]["InstanceCount"] == 2
    # Everything else as recorded: the warm pool of the launch, the deployed image, others' fields.
    assert changed["ResourceConfig"]["KeepAlivePeriodInSeconds"] == 1800
    assert changed["AlgorithmSpecification"] == before_request["AlgorithmSpecification"]
    assert changed["MlflowConfig"] == before_request["MlflowConfig"]
    assert changed["Environment"] == before_request["Environment"]
    assert "TrainingJobName" not in changed
    sent = run_request.job_request(changed, naming.job_of_run(RUN, 2), run_request.resume_step_environment(7))
    assert sent["Environment"][RESUME_STEP_ENV] == "7" and RESUME_STEP_ENV not in changed["Environment"]


@pytest.mark.parametrize(
    "assignment,field",
    [("model.layers=4", "model.layers"), ("training.seq_len=2048", "training.seq_len")],
)
def test_an_unsafe_change_is_refused_in_one_line(assignment: str, field: str) -> None:
    with pytest.raises(RecipeError) as error:
        run_request.apply_sets(RECIPE, [assignment])
    assert error.value.field == field and "cannot change in a running run" in str(error.value)


def test_a_safe_key_with_a_bad_value_names_the_override() -> None:
    with pytest.raises(RecipeError) as error:
        run_request.apply_sets(RECIPE, ["compute.instance_count=3"])  # the shard group does not divide
    assert "--set compute.instance_count=3" in str(error.value)


def test_resume_refuses_an_unsafe_set_before_any_aws_call(monkeypatch) -> None:
    """No endpoint, no credentials: the refusal must come first (a call would fail otherwise)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://localhost:1")  # nothing listens: any call would fail
    result = CliRunner().invoke(app, ["resume", RUN, "--set", "training.global_batch=64"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "training.global_batch: cannot change in a running run" in lines[0]
    assert "Traceback" not in result.output
