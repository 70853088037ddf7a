"""The CDK Pipelines stack (`-c pipeline=true`): synthesizes through the real app.py, passes cdk-nag
(synthesis fails on any unacknowledged finding) and cfn-lint with zero findings, holds one stage per
team with a manual approval exactly where a planned run is above the team's approval threshold."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stacks.pipeline import PipelineSettings, TeamRollout, synth_commands
from trainstack.aws.deployment import load
from trainstack.errors import TrainstackError
from trainstack.planner import plan
from trainstack.recipes.loader import base_recipe_names, resolve, team_names, team_recipe_names

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]
CONNECTION = "arn:aws:codeconnections:us-west-2:123456789012:connection/12345678-1234-1234-1234-123456789012"
CONTEXT = {
    "pipeline": "true",
    "recipe": "all",
    "connection_arn": CONNECTION,
    "repository": "acme/trainstack",
    "branch": "main",
    "image_uri": "123456789012.dkr.ecr.us-west-2.amazonaws.com/trainstack:test",
}
ENV = {"CDK_DEFAULT_ACCOUNT": "123456789012", "CDK_DEFAULT_REGION": "us-west-2"}


def synth(tmp: Path, context: dict[str, str]) -> subprocess.CompletedProcess:
    """Run app.py as the CDK CLI does (context and output directory through the environment)."""
    env = {
        **os.environ,
        **ENV,
        "CDK_CONTEXT_JSON": json.dumps(context),
        "CDK_OUTDIR": str(tmp),
        "JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION": "1",
    }
    return subprocess.run(
        [sys.executable, "app.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )


def expected_approvals() -> dict[str, set[str]]:
    """team -> recipes whose planned run cost is above that team's approval threshold (from the planner)."""
    teams: dict[str, set[str]] = {"platform": set()}
    targets = [(n, None) for n in base_recipe_names()]
    targets += [(n, t) for t in team_names() for n in team_recipe_names(t)]
    for name, team in targets:
        recipe = resolve(name, team=team).recipe
        stage = team or recipe.tags.team
        teams.setdefault(stage, set())
        if plan(recipe).cost.total_usd > recipe.budget.approval_usd:
            teams[stage].add(name)
    return teams


@pytest.fixture(scope="module")
def assembly(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline-cdk-out")
    done = synth(out, CONTEXT)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    return out


def templates(out: Path) -> list[Path]:
    return sorted(out.glob("*.template.json")) + sorted(out.glob("assembly-*/*.template.json"))


def resources(template: dict, kind: str) -> list[dict]:
    return [r for r in template["Resources"].values() if r["Type"] == kind]


@pytest.mark.slow
@pytest.mark.xdist_group("cdk-synth")
def test_pipeline_synthesizes_and_passes_cfn_lint(assembly):
    files = templates(assembly)
    assert (assembly / "Trainstack-Pipeline.template.json") in files
    done = subprocess.run(
        [str(Path(sys.executable).parent / "cfn-lint"), *map(str, files)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-4000:]
    report = assembly / "validation-report.json"
    if report.exists():  # synthesis fails on any cdk-nag finding; a report, if written, lists none
        assert all(r["conclusion"] == "success" for r in json.loads(report.read_text())["pluginReports"])


@pytest.mark.slow
@pytest.mark.xdist_group("cdk-synth")
def test_cdk_nag_checks_the_pipeline_and_its_acknowledgments_are_needed(monkeypatch, tmp_path):
    """Drop the self-mutation acknowledgment and synthesis fails on exactly those findings."""
    from aws_cdk import App

    from stacks import nag, pipeline

    acknowledge = nag.acknowledge

    def all_but_self_mutation(construct, key, findings=()):
        if key != "AwsSolutions-IAM5:pipeline-self-mutation":
            acknowledge(construct, key, findings)

    monkeypatch.setattr(nag, "acknowledge", all_but_self_mutation)
    app = App(outdir=str(tmp_path))
    pipeline.build_pipeline(app, load({**CONTEXT, "recipe": "1b-bf16"}, ENV))
    with pytest.raises(RuntimeError, match="^ValidationFailed: "):
        app.synth()
    report = json.loads((tmp_path / "validation-report.json").read_text())
    found = {
        (v["ruleName"], c["constructPath"])
        for r in report["pluginReports"]
        for v in r["violations"]
        for c in v["violatingConstructs"]
    }
    assert {rule for rule, _ in found} == {
        "AwsSolutions-IAM5[Resource::*]",
        "AwsSolutions-IAM5[Resource::arn:*:iam::123456789012:role/*]",
    }
    self_mutation = "Trainstack-Pipeline/Pipeline/UpdatePipeline/SelfMutation/"
    assert all(path.startswith(self_mutation) for _, path in found)


@pytest.mark.slow
@pytest.mark.xdist_group("cdk-synth")
def test_one_stage_per_team_with_approval_above_the_cost_threshold(assembly):
    template = json.loads((assembly / "Trainstack-Pipeline.template.json").read_text())
    (pipeline,) = resources(template, "AWS::CodePipeline::Pipeline")
    stages = {s["Name"]: s for s in pipeline["Properties"]["Stages"]}
    approvals = expected_approvals()
    team_stage = {f"Trainstack-Pipeline-{TeamRollout(t, (), None, None, ()).stage_id}": t for t in approvals}
    assert list(stages)[:3] == ["Source", "Build", "UpdatePipeline"]
    assert set(stages) - {"Source", "Build", "UpdatePipeline", "Assets"} == set(team_stage)

    (source,) = stages["Source"]["Actions"]
    assert source["ActionTypeId"]["Provider"] == "CodeStarSourceConnection"
    assert source["Configuration"]["ConnectionArn"] == CONNECTION
    assert source["Configuration"]["FullRepositoryId"] == "acme/trainstack"
    assert source["Configuration"]["BranchName"] == "main"

    for name, team in team_stage.items():
        actions = stages[name]["Actions"]
        manual = [a for a in actions if a["ActionTypeId"]["Category"] == "Approval"]
        assert bool(manual) == bool(approvals[team]), (team, approvals[team])
        for action in manual:
            for recipe in approvals[team]:
                assert f" {recipe} $" in action["Configuration"]["CustomData"]
        # The approval comes before any deploy action of the stage.
        deploy_orders = [a["RunOrder"] for a in actions if a["ActionTypeId"]["Category"] == "Deploy"]
        assert deploy_orders and all(m["RunOrder"] < min(deploy_orders) for m in manual)
        # The stage deploys the same stacks `cdk deploy -c team=...` would, under the same names.
        deployed = {
            a["Configuration"]["StackName"] for a in actions if a["ActionTypeId"]["Category"] == "Deploy"
        }
        assert all(
            n.startswith(f"Trainstack-{team}-") and n.endswith(("-Data", "-Launcher")) for n in deployed
        )
        assert len(deployed) == 2 * (
            len(team_recipe_names(team)) if team in team_names() else len(base_recipe_names())
        )


@pytest.mark.slow
@pytest.mark.xdist_group("cdk-synth")
def test_every_service_principal_of_the_pipeline_is_bound_to_its_source(assembly):
    """The roles CDK Pipelines generates (CodePipeline, CodeBuild) and the artifact bucket's policies name
    their service principals only together with aws:SourceAccount or aws:SourceArn."""
    template = json.loads((assembly / "Trainstack-Pipeline.template.json").read_text())
    checked = []
    for logical_id, resource in template["Resources"].items():
        props = resource.get("Properties", {})
        for key in ("AssumeRolePolicyDocument", "PolicyDocument"):
            for statement in props.get(key, {}).get("Statement", []):
                principal = statement.get("Principal")
                if (
                    not (isinstance(principal, dict) and "Service" in principal)
                    or statement["Effect"] != "Allow"
                ):
                    continue
                keys = {k.lower() for operator in statement.get("Condition", {}).values() for k in operator}
                assert keys & {"aws:sourceaccount", "aws:sourcearn"}, (logical_id, statement)
                checked.append(logical_id)
    assert sum("Role" in lid for lid in checked) >= 3  # the pipeline role and two CodeBuild roles at least


@pytest.mark.slow
@pytest.mark.xdist_group("cdk-synth")
def test_synth_step_runs_the_gates_and_the_store_is_encrypted_and_retained(assembly):
    template = json.loads((assembly / "Trainstack-Pipeline.template.json").read_text())
    specs = [
        json.loads(p["Properties"]["Source"]["BuildSpec"])
        for p in resources(template, "AWS::CodeBuild::Project")
        if "BuildSpec" in p["Properties"]["Source"]
    ]
    synth_spec = next(s for s in specs if "make test-all" in s["phases"]["build"]["commands"])
    commands = "\n".join(synth_spec["phases"]["build"]["commands"])
    for gate in (
        "trainstack validate",
        "make test-all",
        "npx cdk synth -c recipe=all",
        "cfn-lint",
        f"-c connection_arn={CONNECTION}",
        "-c pipeline=true",
    ):
        assert gate in commands
    assert synth_spec["phases"]["install"]["commands"] == ["make setup"]
    cli = json.loads((ROOT / "package.json").read_text())["devDependencies"]["aws-cdk"]
    installs = [c for spec in specs for c in spec["phases"]["install"].get("commands", []) if "aws-cdk" in c]
    assert installs and all(c.endswith(f"aws-cdk@{cli}") for c in installs)  # the pinned CLI, never latest

    buckets = resources(template, "AWS::S3::Bucket")
    artifact = next(b for b in buckets if "KMSMasterKeyID" in json.dumps(b))
    assert artifact["DeletionPolicy"] == "Retain" and artifact["Properties"]["VersioningConfiguration"]
    assert all(b["DeletionPolicy"] == "Retain" for b in buckets)
    assert all(k["Properties"]["EnableKeyRotation"] for k in resources(template, "AWS::KMS::Key"))
    policies = resources(template, "AWS::S3::BucketPolicy")
    assert len(policies) == len(buckets)
    assert all('"aws:SecureTransport": "false"' in json.dumps(p) for p in policies)
    for policy in resources(template, "AWS::IAM::Policy"):
        for statement in policy["Properties"]["PolicyDocument"]["Statement"]:
            actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
            assert not any(a == "*" or a.endswith(":*") for a in actions), statement


@pytest.mark.slow
@pytest.mark.xdist_group("cdk-synth")
def test_pipeline_without_a_connection_is_one_line_and_exit_2(tmp_path):
    done = synth(
        tmp_path, {k: v for k, v in CONTEXT.items() if k != "connection_arn"} | {"recipe": "1b-bf16"}
    )
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cdk context: connection_arn: required, as a CodeConnections")
    assert "Traceback" not in done.stderr
    assert not list(tmp_path.glob("*.template.json"))


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        (
            "connection_arn",
            "arn:aws:iam::123456789012:role/x",
            "connection_arn: 'arn:aws:iam::123456789012:role/x' is not",
        ),
        ("repository", "no-owner", "repository: expected OWNER/NAME"),
        ("branch", "bad branch", "branch: 'bad branch' is not a branch name"),
    ],
)
def test_pipeline_settings_are_validated(key, value, message):
    with pytest.raises(TrainstackError, match=message):
        PipelineSettings.from_context({**CONTEXT, key: value})


def test_synth_step_reproduces_this_apps_context():
    config = load({**CONTEXT, "recipe": "1b-bf16", "set": "training.steps=10"}, ENV)
    last = synth_commands(config)[-1]
    assert last.startswith("npx cdk synth -c pipeline=true ")
    assert "-c recipe=1b-bf16" in last and "-c set=training.steps=10" in last
    assert f"-c connection_arn={CONNECTION}" in last and "--output cdk.out" in last
