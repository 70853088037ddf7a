"""The role the deploy workflow assumes through GitHub OIDC: only this repository's deploy environments
may assume it, and its only permission is assuming the CDK bootstrap roles."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainstack.errors import TrainstackError

pytestmark = pytest.mark.fast


def synth(outdir: Path, context: dict) -> dict:
    from aws_cdk import App

    from stacks.pipeline import GITHUB_DEPLOY_STACK, build_github_deploy

    app = App(outdir=str(outdir))
    build_github_deploy(app, context)
    app.synth()  # cdk-nag runs here; any unacknowledged finding raises
    return json.loads((outdir / f"{GITHUB_DEPLOY_STACK}.template.json").read_text())


@pytest.mark.slow
@pytest.mark.xdist_group("cdk-synth")
def test_role_trusts_only_this_repositorys_deploy_environments_and_only_assumes_bootstrap_roles(tmp_path):
    template = synth(tmp_path, {"repository": "acme/trainstack"})
    kinds = sorted(r["Type"] for r in template["Resources"].values())
    assert kinds == ["AWS::IAM::OIDCProvider", "AWS::IAM::Policy", "AWS::IAM::Role"]  # no custom resource

    (role,) = [r for r in template["Resources"].values() if r["Type"] == "AWS::IAM::Role"]
    (trust,) = role["Properties"]["AssumeRolePolicyDocument"]["Statement"]
    assert trust["Action"] == "sts:AssumeRoleWithWebIdentity"
    host = "token.actions.githubusercontent.com"
    assert trust["Condition"] == {
        "StringEquals": {f"{host}:aud": "sts.amazonaws.com"},
        "StringLike": {f"{host}:sub": "repo:acme/trainstack:environment:training*"},
    }
    assert "ManagedPolicyArns" not in role["Properties"] and "Policies" not in role["Properties"]

    (policy,) = [r for r in template["Resources"].values() if r["Type"] == "AWS::IAM::Policy"]
    (statement,) = policy["Properties"]["PolicyDocument"]["Statement"]
    assert statement["Action"] == "sts:AssumeRole"
    assert statement["Condition"] == {
        "StringEquals": {
            "iam:ResourceTag/aws-cdk:bootstrap-role": [
                "deploy",
                "file-publishing",
                "image-publishing",
                "lookup",
            ]
        }
    }

    cfn_lint = str(Path(sys.executable).parent / "cfn-lint")
    templates = map(str, tmp_path.glob("*.template.json"))
    done = subprocess.run([cfn_lint, *templates], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


@pytest.mark.slow
@pytest.mark.xdist_group("cdk-synth")
def test_an_existing_oidc_provider_is_reused(tmp_path):
    arn = "arn:aws:iam::123456789012:oidc-provider/token.actions.githubusercontent.com"
    template = synth(tmp_path, {"repository": "acme/trainstack", "oidc_provider_arn": arn})
    (role,) = [r for r in template["Resources"].values() if r["Type"] == "AWS::IAM::Role"]
    assert role["Properties"]["AssumeRolePolicyDocument"]["Statement"][0]["Principal"] == {"Federated": arn}
    assert not [r for r in template["Resources"].values() if r["Type"] == "AWS::IAM::OIDCProvider"]


@pytest.mark.parametrize(
    ("context", "message"),
    [
        ({}, "repository: expected OWNER/NAME"),
        (
            {"repository": "acme/trainstack", "oidc_provider_arn": "arn:aws:iam::123456789012:role/x"},
            "oidc_provider_arn: 'arn:aws:iam::123456789012:role/x' is not",
        ),
    ],
)
def test_bad_context_is_one_line(context, message):
    from aws_cdk import App

    from stacks.pipeline import build_github_deploy

    with pytest.raises(TrainstackError, match=message):
        build_github_deploy(App(), context)
