"""Gates on the synthesized templates of every base recipe, with and without a team (`-c recipe=all`):
cdk-nag (synthesis fails on an unacknowledged finding), cfn-lint with zero errors and warnings, and
per-recipe assertions that the deployed state machine carries exactly the recipe's request."""

from __future__ import annotations

import fnmatch
import json
import subprocess
import sys
from pathlib import Path

import pytest
from cdk_helpers import ENV, flatten_join, resources, state_machine_definition, synth

from trainstack.aws.deployment import load
from trainstack.protocol.metrics import metric_definitions
from trainstack.recipes import naming
from trainstack.recipes.loader import base_recipe_names, resolve, team_names, team_recipe_names
from trainstack.recipes.schema import to_hyperparameters

pytestmark = [pytest.mark.fast, pytest.mark.xdist_group("cdk-synth")]
ALL = [(n, None) for n in base_recipe_names()] + [(n, t) for t in team_names() for n in team_recipe_names(t)]


def names(name: str, team: str | None) -> tuple[str, str]:
    prefix = naming.stack_prefix(resolve(name, team).recipe, team)
    return f"{prefix}-Data", f"{prefix}-Launcher"


def test_every_recipe_and_team_variant_has_a_data_and_a_launcher_stack(all_templates: dict) -> None:
    expected = {stack for name, team in ALL for stack in names(name, team)}
    assert set(all_templates) == expected


def test_cdk_nag_passed_with_every_acknowledgment_reasoned(all_outdir: Path) -> None:
    # Reaching here means app.synth() passed validation; the report lists only failing plugins.
    report = json.loads((all_outdir / "validation-report.json").read_text())
    assert all(r["conclusion"] == "success" and not r["violations"] for r in report["pluginReports"])
    from stacks.nag import REASONS

    assert all(len(reason.strip()) > 40 for reason in REASONS.values())


def test_cdk_nag_fails_synthesis_on_an_unacknowledged_finding(tmp_path: Path) -> None:
    """The gate is live: one bucket without SSL enforcement in a stack fails the whole synthesis."""
    from aws_cdk import App, Stack
    from aws_cdk import aws_s3 as s3

    from stacks.app import build

    app = App(outdir=str(tmp_path))
    build(
        app, load({"recipe": "1b-bf16", "image_uri": "123456789012.dkr.ecr.us-west-2.amazonaws.com/x:1"}, ENV)
    )
    s3.Bucket(Stack(app, "Careless"), "Open")
    with pytest.raises(RuntimeError, match=r"ValidationFailed(.|\n)*AwsSolutions-S10"):
        app.synth()


def test_cfn_lint_reports_nothing_on_any_template(all_outdir: Path) -> None:
    files = sorted(str(p) for p in all_outdir.glob("*.template.json"))
    lint = subprocess.run(
        [str(Path(sys.executable).parent / "cfn-lint"), "--format", "parseable", "--", *files],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert lint.stdout.strip() == "" and lint.returncode == 0, lint.stdout[-5000:] + lint.stderr[-2000:]


@pytest.mark.parametrize(("name", "team"), ALL)
def test_state_machine_request_matches_the_recipe(all_templates: dict, name: str, team: str | None) -> None:
    """A launch builds the run's request from the deployed recipe (BuildRequest) and records it; every
    job, the launch's and JobEnded's next ones, is created from the run's request (JSONata: the whole
    request, so a field a deployment adds or drops changes no running run)."""
    from stacks.supervisor.start_job import CREATE_ARGUMENTS

    recipe = resolve(name, team).recipe
    _, launcher = names(name, team)
    start = state_machine_definition(all_templates[launcher], "StartJob")
    request = start["States"]["BuildRequest"]["Parameters"]
    assert "TrainingJobName" not in request and "TrainingJobName.$" not in request
    assert request["ResourceConfig"]["InstanceType"] == recipe.compute.instance_type
    assert request["ResourceConfig"]["InstanceCount"] == recipe.compute.instance_count
    assert request["ResourceConfig"]["KeepAlivePeriodInSeconds.$"] == "$.KeepAlivePeriodInSeconds"
    assert "CheckpointConfig" not in request
    environment = request["Environment"]
    assert environment["TRAINSTACK_RUN.$"] == "$.Run"
    assert environment["TRAINSTACK_CHECKPOINT_URI.$"] == "$.Names.CheckpointUri"
    # Every job of a run: s3://<bucket>/checkpoints/<team>/<recipe>/<run id>/.
    uri = start["States"]["Names"]["Parameters"]["CheckpointUri.$"]
    assert uri.startswith("States.Format('s3://${") and uri.endswith(
        f"/{naming.checkpoint_prefix(recipe, team)}/{{}}/', $.RunId)"
    )
    assert "BucketName" in uri  # the imported checkpoint bucket's name
    assert request["AlgorithmSpecification"]["MetricDefinitions"] == metric_definitions()
    assert (
        request["HyperParameters.$"]
        == "States.JsonMerge($.Recipe.HyperParameters, $.HyperParameterOverrides, false)"
    )
    hyper = start["States"]["LoadRecipe"]["Result"]["HyperParameters"]
    assert hyper == to_hyperparameters(recipe)
    if recipe.precision.dtype == "fp8":
        assert hyper["precision.dtype"] == '"fp8"' and json.loads(hyper["precision.fp8_recipe"])
    assert request["RetryStrategy"]["MaximumRetryAttempts"] == recipe.compute.max_retry_attempts
    assert environment["FI_EFA_USE_HUGE_PAGE"] == "0"
    assert start["States"]["RegisterRun"]["Parameters"]["Item"]["request"] == {
        "S.$": "States.JsonToString($.Request)"
    }
    job_limit = start["States"]["RegisterRun"]["Parameters"]["Item"]["max_jobs"]
    assert job_limit == {"N": str(recipe.compute.max_jobs)}
    ended = state_machine_definition(all_templates[launcher], "JobEnded")
    assert "BuildRequest" not in ended["States"]  # nothing of the deployed recipe reaches a next job
    assert ended["States"]["NextInput"]["Parameters"]["Request.$"] == (
        "States.StringToJson($.Registry.Item.request.S)"
    )
    for definition in (start, ended):
        create = definition["States"]["CreateTrainingJob"]
        assert create["Resource"] == "arn:aws:states:::aws-sdk:sagemaker:createTrainingJob"
        assert (create["QueryLanguage"], create["Arguments"]) == ("JSONata", CREATE_ARGUMENTS)
        assert {e for r in create["Retry"] for e in r["ErrorEquals"]} >= {
            "SageMaker.ResourceLimitExceededException",
            "SageMaker.ThrottlingException",
        }
        assert create["Catch"][0]["ErrorEquals"] == ["SageMaker.ResourceInUseException"]


def test_the_supervisor_rule_starts_job_ended_on_this_recipes_job_ends(all_templates: dict) -> None:
    from stacks.monitoring.patterns import job_state_pattern

    for name, team in ALL:
        template = all_templates[names(name, team)[1]]
        rules = [
            r["Properties"]
            for k, r in resources(template, "AWS::Events::Rule").items()
            if k.startswith("SupervisorJobStateChanged")
        ]
        (rule,) = rules
        prefix = naming.job_name_prefix(resolve(name, team).recipe, team)
        assert rule["EventPattern"] == job_state_pattern(prefix)
        (target,) = rule["Targets"]
        ended = [k for k in resources(template, "AWS::StepFunctions::StateMachine") if "JobEnded" in k]
        assert target["Arn"] == {"Ref": ended[0]}
        # EventBridge retries delivery for up to a day (its documented maximum: 185 attempts, 24 h).
        assert target["RetryPolicy"] == {"MaximumRetryAttempts": 185, "MaximumEventAgeInSeconds": 86400}


def test_state_machine_logs_all_and_traces(all_templates: dict) -> None:
    for name, template in all_templates.items():
        if name.endswith("-Launcher"):
            machines = resources(template, "AWS::StepFunctions::StateMachine").values()
            assert len(machines) == 6, name  # StartJob, JobEnded, Reconcile, StopStalled, alarms, Export
            for machine in machines:
                props = machine["Properties"]
                assert props["LoggingConfiguration"]["Level"] == "ALL", name
                assert props["TracingConfiguration"] == {"Enabled": True}, name


def test_stateful_resources_are_retained_and_encrypted(all_templates: dict) -> None:
    for name, template in all_templates.items():
        if not name.endswith("-Data"):
            continue
        stateful = {
            **resources(template, "AWS::S3::Bucket"),
            **resources(template, "AWS::KMS::Key"),
            **resources(template, "AWS::ECR::Repository"),
            **resources(template, "AWS::DynamoDB::Table"),
        }
        assert len(stateful) == 5, name  # checkpoints, access logs, key, repository, run registry
        for logical, resource in stateful.items():
            assert resource["DeletionPolicy"] == "Retain" and resource["UpdateReplacePolicy"] == "Retain", (
                logical
            )
        (key,) = resources(template, "AWS::KMS::Key").values()
        assert key["Properties"]["EnableKeyRotation"] is True
        (key_id,) = resources(template, "AWS::KMS::Key")
        buckets = resources(template, "AWS::S3::Bucket")
        checkpoints = next(b for k, b in buckets.items() if k.startswith("CheckpointsBucket"))
        props = checkpoints["Properties"]
        sse = props["BucketEncryption"]["ServerSideEncryptionConfiguration"][0][
            "ServerSideEncryptionByDefault"
        ]
        assert sse == {"SSEAlgorithm": "aws:kms", "KMSMasterKeyID": {"Fn::GetAtt": [key_id, "Arn"]}}
        assert props["VersioningConfiguration"] == {"Status": "Enabled"}
        assert props["PublicAccessBlockConfiguration"] == {
            "BlockPublicAcls": True,
            "BlockPublicPolicy": True,
            "IgnorePublicAcls": True,
            "RestrictPublicBuckets": True,
        }
        assert "DestinationBucketName" in props["LoggingConfiguration"]
        rules = props["LifecycleConfiguration"]["Rules"]
        assert any("AbortIncompleteMultipartUpload" in r for r in rules)
        assert any("NoncurrentVersionExpiration" in r for r in rules)
        ssl_only = [
            s
            for p in resources(template, "AWS::S3::BucketPolicy").values()
            for s in p["Properties"]["PolicyDocument"]["Statement"]
            if s["Effect"] == "Deny" and s.get("Condition") == {"Bool": {"aws:SecureTransport": "false"}}
        ]
        assert len(ssl_only) == 2, name
        (table,) = resources(template, "AWS::DynamoDB::Table").values()
        props = table["Properties"]
        assert props["SSESpecification"] == {
            "KMSMasterKeyId": {"Fn::GetAtt": [key_id, "Arn"]},
            "SSEEnabled": True,
            "SSEType": "KMS",
        }
        assert props["PointInTimeRecoverySpecification"] == {"PointInTimeRecoveryEnabled": True}
        assert props["DeletionProtectionEnabled"] is True and props["BillingMode"] == "PAY_PER_REQUEST"
        assert props["KeySchema"] == [{"AttributeName": "run", "KeyType": "HASH"}]
        (repo,) = resources(template, "AWS::ECR::Repository").values()
        assert repo["Properties"]["ImageScanningConfiguration"] == {"ScanOnPush": True}
        assert repo["Properties"]["ImageTagMutability"] == "IMMUTABLE"
        assert repo["Properties"]["EncryptionConfiguration"]["EncryptionType"] == "KMS"
        assert "LifecyclePolicy" in repo["Properties"]
        assert "RepositoryName" not in repo["Properties"]  # generated physical name (outside the emulator)


def test_no_iam_statement_grants_wildcard_actions(all_templates: dict) -> None:
    def statements(template: dict):
        for resource in template["Resources"].values():
            props = resource.get("Properties", {})
            docs = [
                props.get("PolicyDocument"),
                props.get("AssumeRolePolicyDocument"),
                props.get("KeyPolicy"),
            ]
            docs += [p.get("PolicyDocument") for p in props.get("Policies", [])]
            for doc in filter(None, docs):
                yield from doc["Statement"]

    checked = 0
    for name, template in all_templates.items():
        for statement in statements(template):
            if statement["Effect"] != "Allow":
                continue  # e.g. the SSL-only Deny on s3:* for everyone
            actions = statement.get("Action", [])
            actions = [actions] if isinstance(actions, str) else actions
            checked += 1
            if statement.get("Principal", {}).get("AWS") is not None and actions == ["kms:*"]:
                continue  # the key policy's account-root statement: IAM policies decide, as AWS recommends
            assert all(a != "*" and not a.endswith(":*") for a in actions), (name, statement)
    assert checked > 100


def test_each_launcher_may_touch_only_its_own_recipes_training_jobs(all_templates: dict) -> None:
    """The IAM resource `training-job/<job-name prefix>*` of one recipe and team matches none of the job
    names of another (`8b-fp8` vs `8b-fp8-128k`, one team vs another), and all of its own."""
    from trainstack.aws.request import job_name

    def as_list(value):
        return value if isinstance(value, list) else [value]

    jobs = {(n, t): job_name(resolve(n, t).recipe, t, "deploy") for n, t in ALL}
    assert len(set(jobs.values())) == len(ALL)
    for (name, team), own_job in jobs.items():
        _, launcher = names(name, team)
        granted = {
            flatten_join(resource).rpartition(":training-job/")[2]
            for policy in resources(all_templates[launcher], "AWS::IAM::Policy").values()
            for statement in policy["Properties"]["PolicyDocument"]["Statement"]
            # ListTrainingJobs has no resource-level permissions (the reconciler's, on "*").
            if any(
                a.startswith("sagemaker:") and "TrainingJob" in a and a != "sagemaker:ListTrainingJobs"
                for a in as_list(statement["Action"])
            )
            for resource in as_list(statement["Resource"])
        }
        prefix = naming.job_name_prefix(resolve(name, team).recipe, team)
        assert granted == {f"{prefix}*"}, (launcher, granted)
        (pattern,) = granted
        matched = {key for key, job in jobs.items() if fnmatch.fnmatchcase(job, pattern)}
        assert matched == {(name, team)}, (pattern, matched)
        assert fnmatch.fnmatchcase(own_job, pattern)


def test_termination_protection_and_tags_once(all_outdir: Path) -> None:
    manifest = json.loads((all_outdir / "manifest.json").read_text())
    for name, artifact in manifest["artifacts"].items():
        if artifact["type"] != "aws:cloudformation:stack":
            continue
        assert artifact["properties"].get("terminationProtection", False) is name.endswith("-Data"), name
        tags = artifact["properties"].get("tags", {})
        assert {"project", "team", "recipe", "cost-center"} <= set(tags), name


def test_launch_on_deploy_rule_starts_the_recipe_hash_run(tmp_path: Path, all_templates: dict) -> None:
    outdir = synth(
        {
            "recipe": "1b-bf16",
            "set": "launch_on_deploy=true",
            "image_uri": "123456789012.dkr.ecr.us-west-2.amazonaws.com/x:1",
        },
        tmp_path,
    )
    template = json.loads((outdir / "Trainstack-platform-1b-bf16-Launcher.template.json").read_text())
    rules = [
        r
        for r in resources(template, "AWS::Events::Rule").values()
        if r["Properties"]["EventPattern"].get("source") == ["aws.cloudformation"]
    ]
    (rule,) = rules
    pattern = rule["Properties"]["EventPattern"]
    assert pattern["detail-type"] == ["CloudFormation Stack Status Change"]
    assert pattern["detail"] == {
        "stack-id": [{"Ref": "AWS::StackId"}],
        "status-details": {"status": ["CREATE_COMPLETE", "UPDATE_COMPLETE"]},
    }
    (target,) = rule["Properties"]["Targets"]
    recipe = resolve("1b-bf16", None, ["launch_on_deploy=true"]).recipe
    run_id = f"{naming.recipe_hash(recipe)}-deploy"
    assert json.loads(target["Input"]) == {
        "Run": f"{naming.job_name_prefix(recipe, None)}{run_id}",
        "RunId": run_id,
        "Job": 1,
        "HyperParameterOverrides": {},
        "KeepAlivePeriodInSeconds": recipe.compute.keep_alive_seconds,
        "Steps": recipe.training.steps,
        "Reason": "launch",
        "JobEnvironment": {},
        "Change": {"Who": "launch on deploy", "What": f"launch of recipe {naming.recipe_hash(recipe)}"},
        "MlflowRunId": "",
    }
    starts = [k for k in resources(template, "AWS::StepFunctions::StateMachine") if "StartJob" in k]
    assert target["Arn"] == {"Ref": starts[0]}
    # Without the flag (no base recipe sets it) there is no such rule.
    for name, other in all_templates.items():
        assert not [
            r
            for r in resources(other, "AWS::Events::Rule").values()
            if r["Properties"]["EventPattern"].get("source") == ["aws.cloudformation"]
        ], name


def test_vpc_mode_isolates_jobs_with_an_efa_group_and_endpoints(tmp_path: Path) -> None:
    outdir = synth(
        {"recipe": "1b-bf16", "vpc": "true", "image_uri": "123456789012.dkr.ecr.us-west-2.amazonaws.com/x:1"},
        tmp_path,
    )
    template = json.loads((outdir / "Trainstack-platform-1b-bf16-Launcher.template.json").read_text())
    request = state_machine_definition(template)["States"]["BuildRequest"]["Parameters"]
    assert (
        request["EnableNetworkIsolation"] is True
        and request["EnableInterContainerTrafficEncryption"] is False
    )
    assert len(request["VpcConfig"]["Subnets"]) == 2 and len(request["VpcConfig"]["SecurityGroupIds"]) == 1
    assert not resources(template, "AWS::EC2::NatGateway") and not resources(
        template, "AWS::EC2::InternetGateway"
    )
    endpoints = resources(template, "AWS::EC2::VPCEndpoint").values()
    services = {flatten_join(e["Properties"]["ServiceName"]).rsplit(".", 1)[-1] for e in endpoints}
    assert {"s3", "api", "dkr", "logs", "monitoring", "sts"} <= services
    ingress = resources(template, "AWS::EC2::SecurityGroupIngress").values()
    assert any(
        i["Properties"]["IpProtocol"] == "-1"
        and i["Properties"]["SourceSecurityGroupId"] == i["Properties"]["GroupId"]
        for i in ingress
    )
    subprocess.run(
        [
            str(Path(sys.executable).parent / "cfn-lint"),
            "--",
            str(outdir / "Trainstack-platform-1b-bf16-Launcher.template.json"),
        ],
        check=True,
        capture_output=True,
    )


def test_emulator_quirks_only_in_emulator_mode(tmp_path: Path, all_templates: dict) -> None:
    """What the emulator needs (no BootstrapVersion rule, a named repository, an untagged key) appears
    only with -c emulator=true; every real-AWS template keeps CDK's defaults."""
    real = all_templates["Trainstack-platform-1b-bf16-Data"]
    assert "CheckBootstrapVersion" in real["Rules"]
    (key,) = resources(real, "AWS::KMS::Key").values()
    assert {t["Key"] for t in key["Properties"]["Tags"]} >= {"team", "recipe", "cost-center", "project"}

    outdir = synth({"recipe": "1b-bf16", "emulator": "true"}, tmp_path)
    emulated = json.loads((outdir / "Trainstack-platform-1b-bf16-Data.template.json").read_text())
    assert "CheckBootstrapVersion" not in emulated.get("Rules", {})
    (repo,) = resources(emulated, "AWS::ECR::Repository").values()
    assert repo["Properties"]["RepositoryName"] == "trainstack-platform-1b-bf16-images"
    (key,) = resources(emulated, "AWS::KMS::Key").values()
    assert "Tags" not in key["Properties"]
    launcher = json.loads((outdir / "Trainstack-platform-1b-bf16-Launcher.template.json").read_text())
    request = state_machine_definition(launcher)["States"]["BuildRequest"]["Parameters"]
    recipe = resolve("1b-bf16").recipe
    assert request["AlgorithmSpecification"]["TrainingImage"].endswith(f":{naming.recipe_hash(recipe)}")


def test_the_image_is_built_from_training_image_on_the_regions_dlc(all_outdir: Path) -> None:
    assets = json.loads((all_outdir / "Trainstack-platform-30b-fp8-Launcher.assets.json").read_text())
    (image,) = assets["dockerImages"].values()
    source = image["source"]
    assert source["dockerFile"] == "training_image/Dockerfile"
    assert source["dockerBuildArgs"] == {
        "BASE_IMAGE": "763104351884.dkr.ecr.us-west-2.amazonaws.com/pytorch-training:2.9-gpu-py312"
    }
    context = all_outdir / source["directory"]
    sent = {p.name for p in context.iterdir()}
    assert {"training_image", "trainstack", "recipes"} <= sent
    assert not sent & {".venv", "node_modules", "tests", ".git"}  # .dockerignore keeps the context small
