"""`tracking.mlflow: managed`: the team's MLflow App stack and what the launcher gets from it, on the
templates (the emulator accepts an MLflow App as a placeholder and checks no IAM, so these are the gate;
cdk-nag ran at synthesis, test_iam_policies.py checks the same templates' principals and conditions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cdk_helpers import launcher_state_machine, resources

from stacks.tracking import MLFLOW_APP_ACTIONS, MLFLOW_JOB_ACTIONS

pytestmark = [pytest.mark.fast, pytest.mark.xdist_group("cdk-synth")]
TRACKING = "Trainstack-platform-Tracking"
LAUNCHER = "Trainstack-platform-1b-bf16-Launcher"


def test_the_team_stack_holds_a_retained_mlflow_app_with_a_kms_artifact_store(vpc_tracking_templates):
    template = vpc_tracking_templates[TRACKING]
    (app,) = resources(template, "AWS::SageMaker::MlflowApp").values()
    assert app["DeletionPolicy"] == app["UpdateReplacePolicy"] == "Retain"
    assert app["Properties"]["Name"] == "trainstack-platform"
    buckets = resources(template, "AWS::S3::Bucket")
    store = buckets[app["Properties"]["ArtifactStoreUri"]["Fn::Join"][1][1]["Ref"]]
    (rule,) = store["Properties"]["BucketEncryption"]["ServerSideEncryptionConfiguration"]
    assert rule["ServerSideEncryptionByDefault"]["SSEAlgorithm"] == "aws:kms"
    (key_id,) = resources(template, "AWS::KMS::Key")
    assert rule["ServerSideEncryptionByDefault"]["KMSMasterKeyID"] == {"Fn::GetAtt": [key_id, "Arn"]}
    assert all(b["DeletionPolicy"] == "Retain" for b in buckets.values())
    assert resources(template, "AWS::KMS::Key")[key_id]["Properties"]["EnableKeyRotation"] is True
    export = template["Outputs"]["MlflowAppArn"]
    assert export["Export"]["Name"] == "Trainstack-platform-MlflowAppArn"


def test_the_apps_role_reaches_only_its_artifact_prefix(vpc_tracking_templates):
    template = vpc_tracking_templates[TRACKING]
    (role,) = resources(template, "AWS::IAM::Role").values()
    (trust,) = role["Properties"]["AssumeRolePolicyDocument"]["Statement"]
    assert trust["Principal"] == {"Service": "sagemaker.amazonaws.com"}
    assert set(trust["Condition"]) == {"StringEquals", "ArnLike"}  # this account's MLflow Apps only
    (policy,) = resources(template, "AWS::IAM::Policy").values()
    actions = [a for s in policy["Properties"]["PolicyDocument"]["Statement"] for a in s["Action"]]
    assert not any("*" in a for a in actions)


def test_the_execution_role_gets_the_listed_mlflow_actions_on_that_app_only(vpc_tracking_templates):
    template = vpc_tracking_templates[LAUNCHER]
    mlflow = [
        s
        for p in resources(template, "AWS::IAM::Policy").values()
        for s in p["Properties"]["PolicyDocument"]["Statement"]
        if any("mlflow" in a.lower() for a in s["Action"])
    ]
    (statement,) = mlflow
    assert statement["Action"] == [*MLFLOW_JOB_ACTIONS, *MLFLOW_APP_ACTIONS]
    assert not any("*" in a for a in statement["Action"])
    assert statement["Resource"] == {"Fn::ImportValue": "Trainstack-platform-MlflowAppArn"}


def test_every_job_gets_mlflow_config_and_tensorboard_output(vpc_tracking_templates):
    machine = launcher_state_machine(vpc_tracking_templates[LAUNCHER])
    text = json.dumps(machine["Properties"]["DefinitionString"])
    for expected in (
        "MlflowConfig",
        "MlflowResourceArn",
        "Trainstack-platform-MlflowAppArn",
        "MlflowRunName.$",
        "TensorBoardOutputConfig",
        "/opt/ml/output/tensorboard",
        "MLFLOW_TRACKING_URI",
    ):
        assert expected in text, expected
    # Why the previous job ended is the next job's own environment, set where JobEnded decides it.
    ended = json.dumps(launcher_state_machine(vpc_tracking_templates[LAUNCHER], "JobEnded")["Properties"])
    assert "TRAINSTACK_PREVIOUS_JOB_END.$" in ended


def test_cfn_lint_reports_nothing_on_the_tracking_stack(vpc_tracking_outdir: Path):
    done = subprocess.run(
        [
            str(Path(sys.executable).parent / "cfn-lint"),
            "--format",
            "parseable",
            "--",
            str(vpc_tracking_outdir / f"{TRACKING}.template.json"),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and done.stdout == "", done.stdout + done.stderr
