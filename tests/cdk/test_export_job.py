"""The export job's CreateTrainingJob request and the supervisor's on-complete hook, as SageMaker and
Step Functions check them (botocore's model and the documented rules: trainstack.aws.request_check)."""

from __future__ import annotations

import copy

import pytest

from stacks.export import export_on_complete_state
from stacks.supervisor.asl import constants_for
from stacks.supervisor.job_ended import job_ended_definition
from trainstack.aws.export_job import EXPORTS_PER_RUN, export_job_name, export_job_request, is_export_job
from trainstack.aws.request import checkpoint_uri, create_training_job_request
from trainstack.aws.request_check import check_request
from trainstack.aws.runs import is_recipe_job
from trainstack.planner import plan
from trainstack.planner.models_io import plan_export
from trainstack.recipes import naming
from trainstack.recipes.loader import base_recipe_names, resolve
from trainstack.recipes.schema import RECIPE_NAME_MAX, TEAM_NAME_MAX

pytestmark = pytest.mark.fast

ROLE = "arn:aws:iam::123456789012:role/exec"
IMAGE = "123456789012.dkr.ecr.us-west-2.amazonaws.com/trainstack:abc"
KEY = "arn:aws:kms:us-west-2:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab"


@pytest.mark.parametrize("name", base_recipe_names())
def test_every_recipes_export_job_is_a_valid_cpu_job_that_streams(name):
    recipe = resolve(name).recipe
    run = naming.run_name(recipe, None, "main")
    request = export_job_request(
        recipe,
        None,
        job_name=export_job_name(run, 1),
        checkpoint_uri=checkpoint_uri("bucket", recipe, None, "main"),
        out_parent="s3://bucket/exports/platform/x/main/",
        step="0",
        role_arn=ROLE,
        image_uri=IMAGE,
        bucket_name="bucket",
        kms_key_arn=KEY,
        region="us-west-2",
    )
    assert check_request(request) == []
    planned = plan_export(recipe)
    assert request["ResourceConfig"]["InstanceType"] == planned.instance_type
    assert planned.instance_type.startswith("ml.m5.")
    # Memory for one output file and twice the largest FP32 tensor, far below the model itself.
    assert planned.peak_gb * 1e9 < recipe.model.total_params * 4 or recipe.model.total_params < 3e9
    assert request["AlgorithmSpecification"]["ContainerEntrypoint"] == ["python", "-m", "trainer.export"]
    assert "TRAINSTACK_RUN" not in request["Environment"]  # the supervisor leaves it alone
    assert request["TrainingJobName"].startswith(naming.job_name_prefix(recipe, None))  # the role's trust


def test_export_job_names_fit_and_are_never_a_runs_job():
    longest = "ts-" + "t" * TEAM_NAME_MAX + "-" + "r" * RECIPE_NAME_MAX + "--" + "i" * naming.RUN_ID_MAX
    assert len(export_job_name(longest, EXPORTS_PER_RUN)) <= naming.JOB_NAME_MAX == 63
    with pytest.raises(ValueError, match="at most 9 exports"):
        export_job_name(longest, EXPORTS_PER_RUN + 1)
    prefix = "ts-platform-30b-fp8--"
    assert is_export_job(f"{prefix}main-X3") and not is_recipe_job(f"{prefix}main-X3", prefix)
    assert not is_export_job(f"{prefix}main-3") and is_recipe_job(f"{prefix}main-3", prefix)
    # Run ids are lowercase and may end in -x1 (a default id's suffix): that run is not an export.
    assert not is_export_job(f"{prefix}e65969ea-x1") and is_recipe_job(f"{prefix}e65969ea-x1-2", prefix)


def test_only_a_base_in_s3_becomes_an_input_channel():
    cases = {None: [], "s3://models/qwen/": ["base"], "/opt/models/qwen": []}
    for init_from, channels in cases.items():
        recipe = resolve("8b-fp8").recipe
        recipe = recipe.model_copy(update={"model": recipe.model.model_copy(update={"init_from": init_from})})
        request = create_training_job_request(
            recipe, None, job_name="ts-platform-8b-fp8--a-1", role_arn=ROLE, image_uri=IMAGE, bucket_name="b"
        )
        assert [c["ChannelName"] for c in request.get("InputDataConfig", [])] == channels
        assert check_request(request) == []


def test_on_complete_runs_after_a_completed_run_when_the_runs_recorded_request_asks_and_nothing_else():
    """The hook is deployed for every recipe; the run's recorded request's export.on_complete decides
    (what the run was launched or resumed with), and a start that fails is recorded and notified."""
    recipe = resolve("30b-fp8").recipe
    c = constants_for(
        recipe, None, plan(recipe), table_name="runs", topic_arn="arn:aws:sns:us-west-2:1:t", bucket_name="b"
    )
    plain = job_ended_definition(c)
    hooked = job_ended_definition(
        c, on_complete=export_on_complete_state("arn:aws:states:us-west-2:1:stateMachine:Export")
    )
    added = set(hooked["States"]) - set(plain["States"])
    hook = {
        "Ended",
        "RecordedExport",
        "ExportWanted",
        "OnComplete",
        "ExportNotStarted",
        "RecordExportNotStarted",
    }
    assert added == hook
    state = hooked["States"]["OnComplete"]
    assert state["Resource"] == "arn:aws:states:::states:startExecution" and state["Next"] == "Notify"
    assert state["Parameters"]["Input"]["Reason"] == "on_complete"
    assert state["Catch"][0]["Next"] == "ExportNotStarted"  # recorded, then the run's end is notified
    assert hooked["States"]["RecordExportNotStarted"]["Next"] == "Notify"
    (choice,) = hooked["States"]["Ended"]["Choices"]
    assert choice == {"Variable": "$.Decision.Outcome", "StringEquals": "completed", "Next": "RecordedExport"}
    assert hooked["States"]["Ended"]["Default"] == "Notify"
    (wanted,) = hooked["States"]["ExportWanted"]["Choices"]
    assert "Recorded.Request.HyperParameters.`export.on_complete` = 'true'" in wanted["Condition"]
    assert hooked["States"]["ExportWanted"]["Default"] == "Notify"
    unhooked = copy.deepcopy(hooked)
    for name in hook:
        del unhooked["States"][name]
    unhooked["States"]["RecordEnd"]["Next"] = "Notify"
    assert unhooked == plain


def test_a_refused_export_job_is_recorded_then_published_then_the_execution_fails():
    """SageMaker refusing CreateTrainingJob for an export (an on-complete export has no one waiting on
    it): the refusal goes to the run's export_failures, then to the deployment's topic, and the
    execution fails (ExportNotCreated). Structural: moto accepts any export request (a duplicate name
    included), and a malformed one is a States.Runtime error that no Catch takes."""
    from stacks.export import export_definition

    states = export_definition({}, "runs", "s3://b/exports/t/r/", "arn:aws:sns:us-west-2:1:t", "x {} {} {}")[
        "States"
    ]
    (catch,) = states["CreateExportJob"]["Catch"]
    assert catch == {"ErrorEquals": ["States.ALL"], "Next": "RecordNotCreated", "ResultPath": "$.Error"}
    record = states["RecordNotCreated"]["Parameters"]
    assert record["ExpressionAttributeNames"] == {"#failures": "export_failures"}
    entry = record["ExpressionAttributeValues"][":failure"]["L"][0]["M"]
    assert entry["status"] == {"S": "NotCreated"} and entry["reason"] == {"S.$": "$.Error.Cause"}
    assert states["RecordNotCreated"]["Next"] == "NotifyNotCreated"
    assert states["NotifyNotCreated"]["Parameters"]["TopicArn"] == "arn:aws:sns:us-west-2:1:t"
    assert states["NotifyNotCreated"]["Next"] == "NotCreated"
    assert states["NotCreated"] == {"Type": "Fail", "Error": "ExportNotCreated", "CausePath": "$.Error.Cause"}
    without = export_definition({}, "runs", "s3://b/exports/t/r/")["States"]
    assert "NotifyNotCreated" not in without and without["RecordNotCreated"]["Next"] == "NotCreated"
