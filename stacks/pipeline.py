"""The GitOps pipeline for teams that stay inside AWS: `npx cdk deploy -c pipeline=true -c recipe=all
-c connection_arn=ARN -c repository=OWNER/NAME [-c branch=main]`.

A CDK Pipelines `CodePipeline` fed by a CodeConnections source. Its synth step runs the same gates as
the pull-request workflow (validate with budget caps, tests, synth with cdk-nag, cfn-lint) before it
synthesizes the pipeline's own app; then one stage per team deploys that team's recipe stacks
(stacks.app.build), behind a manual approval when any of its runs is planned above the team's
`budget.approval_usd`. The pipeline updates itself first (self-mutation), so a merged change to
recipes, teams or this file takes effect on the same run.

Also here, the AWS side of the GitHub Actions pipeline: the role its deploy jobs assume through GitHub
OIDC (`GitHubDeployStack`, its own app: `python -m stacks.pipeline`; see docs/gitops.md).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from aws_cdk import App, CfnOutput, Duration, Environment, RemovalPolicy, Stack, Stage, Token, pipelines
from aws_cdk import aws_codebuild as codebuild
from aws_cdk import aws_codepipeline as codepipeline
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from constructs import Construct

from stacks import nag
from stacks.storage import add_logged_kms_bucket
from trainstack.aws.deployment import CONTEXT, CONTEXT_KEYS, Deployment, DeploymentConfig
from trainstack.errors import TrainstackError
from trainstack.planner import budget

PIPELINE_STACK = "Trainstack-Pipeline"
CONNECTION_ARN = re.compile(
    r"^arn:aws[a-z\-]*:(codeconnections|codestar-connections):[a-z0-9\-]+:[0-9]{12}:connection/[0-9a-f\-]{36}\Z"
)
REPOSITORY = re.compile(r"^[A-Za-z0-9_.\-]+/[A-Za-z0-9_.\-]+\Z")
BRANCH = re.compile(r"^[A-Za-z0-9_./\-]{1,200}\Z")
# Context the synth step passes on to the pipeline's own synthesis, so it rebuilds the same app: all of
# the app's context but the switches that select what is built (the step sets `pipeline` itself, and a
# pipeline never targets the emulator). Derived, so a context key added to the app is never dropped.
FORWARDED_CONTEXT = tuple(key for key in CONTEXT_KEYS if key not in ("emulator", "pipeline"))
ARTIFACT_EXPIRY_DAYS = 90
PACKAGE_JSON = Path(__file__).resolve().parent.parent / "package.json"
# The CDK CLI pinned in package.json, also for the pipeline's self-mutation (else it installs latest 2.x).
CDK_CLI_VERSION = json.loads(PACKAGE_JSON.read_text())["devDependencies"]["aws-cdk"]
SYNTH_TIMEOUT = Duration.minutes(120)  # `make test-all` runs every test (about 26 min on 2 cores)


@dataclass(frozen=True)
class PipelineSettings:
    connection_arn: str
    repository: str  # owner/name, as CodeConnections names it
    branch: str = "main"

    @classmethod
    def from_context(cls, context: Mapping[str, str]) -> PipelineSettings:
        """Validated pipeline context; one TrainstackError line naming the key otherwise."""
        arn = (context.get("connection_arn") or "").strip()
        repository = (context.get("repository") or "").strip()
        branch = (context.get("branch") or "main").strip()
        if not CONNECTION_ARN.match(arn):
            problem = "required, as" if not arn else f"{arn!r} is not"
            raise TrainstackError(
                f"{CONTEXT}: connection_arn: {problem} a CodeConnections connection ARN "
                "(arn:aws:codeconnections:REGION:ACCOUNT:connection/ID) with -c pipeline=true"
            )
        if not REPOSITORY.match(repository):
            raise TrainstackError(
                f"{CONTEXT}: repository: expected OWNER/NAME with -c pipeline=true, got {repository!r}"
            )
        if not BRANCH.match(branch):
            raise TrainstackError(f"{CONTEXT}: branch: {branch!r} is not a branch name")
        return cls(connection_arn=arn, repository=repository, branch=branch)


@dataclass(frozen=True)
class TeamRollout:
    """One pipeline stage: every deployment of one team, where it goes, and which runs need approval."""

    team: str
    deployments: tuple[Deployment, ...]
    account: str | None
    region: str | None
    approvals: tuple[tuple[str, float, float], ...]  # (recipe, planned run USD, approval threshold USD)

    @property
    def stage_id(self) -> str:
        return "".join(part.capitalize() for part in re.split(r"[^a-z0-9]+", self.team) if part)


def rollouts(config: DeploymentConfig) -> list[TeamRollout]:
    """Group the app's deployments into one rollout per team (pure; the stage order is sorted by team)."""
    by_team: dict[str, list[Deployment]] = {}
    for d in config.deployments:
        by_team.setdefault(d.team or d.recipe.tags.team, []).append(d)
    out = []
    for team, deployments in sorted(by_team.items()):
        targets = {(d.recipe.deploy.account, d.recipe.deploy.region) for d in deployments}
        if len(targets) > 1:
            raise TrainstackError(
                f"{CONTEXT}: team {team!r} deploys to more than one account/region "
                f"{sorted(map(str, targets))}; set deploy.account and deploy.region once, in defaults.yaml"
            )
        account, region = targets.pop()
        approvals = []
        for d in deployments:
            check = budget.check(d.recipe, d.plan)
            if check.needs_approval:
                approvals.append((d.recipe.name, check.run_usd, check.approval_usd))
        out.append(
            TeamRollout(
                team, tuple(deployments), account or config.account, region or config.region, tuple(approvals)
            )
        )
    return out


def synth_commands(config: DeploymentConfig) -> list[str]:
    """The gates of the pull-request workflow, then the synthesis of this same app (with the pipeline)."""
    forwarded = " ".join(
        f"-c {key}={shlex.quote(config.context[key])}" for key in FORWARDED_CONTEXT if config.context.get(key)
    )
    return [
        ".venv/bin/trainstack validate --quiet",
        "make test-all",
        "npx cdk synth -c recipe=all --quiet --output cdk.out.gates",
        ".venv/bin/cfn-lint cdk.out.gates/*.template.json",
        f"npx cdk synth -c pipeline=true {forwarded} --quiet --output cdk.out",
    ]


class ArtifactStore(Construct):
    """The pipeline's artifact bucket: KMS (rotating key), SSL only, versioned, access-logged, retained."""

    def __init__(self, scope: Construct, id: str) -> None:
        super().__init__(scope, id)
        self.key = kms.Key(
            self,
            "Key",
            description="trainstack pipeline artifacts",
            enable_key_rotation=True,
            removal_policy=RemovalPolicy.RETAIN,
        )
        self.bucket, self.access_logs = add_logged_kms_bucket(
            self,
            key=self.key,
            log_prefix="artifacts/",
            lifecycle_rules=[
                s3.LifecycleRule(
                    expiration=Duration.days(ARTIFACT_EXPIRY_DAYS),
                    noncurrent_version_expiration=Duration.days(1),
                    abort_incomplete_multipart_upload_after=Duration.days(1),
                )
            ],
            access_logs_acknowledgment="AwsSolutions-S1:pipeline-access-logs",
        )


class TeamStage(Stage):
    """One team's recipe stacks, exactly as `cdk deploy -c team=<team>` builds them."""

    def __init__(
        self, scope: Construct, id: str, *, rollout: TeamRollout, config: DeploymentConfig, **kwargs: Any
    ) -> None:
        env = Environment(account=rollout.account, region=rollout.region) if rollout.account else None
        super().__init__(scope, id, env=env, **kwargs)
        from stacks.app import build

        build(
            self, replace(config, deployments=rollout.deployments, account=None, region=None, pipeline=False)
        )


class PipelineStack(Stack):
    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        config: DeploymentConfig,
        settings: PipelineSettings,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            scope, id, description="trainstack GitOps pipeline: validate, price and deploy recipes", **kwargs
        )
        # Grant log delivery by bucket policy, not the legacy LogDeliveryWrite ACL (cfn-lint W3045).
        self.node.set_context("@aws-cdk/aws-s3:serverAccessLogsUseBucketPolicy", True)
        store = ArtifactStore(self, "Artifacts")
        source = pipelines.CodePipelineSource.connection(
            settings.repository,
            settings.branch,
            connection_arn=settings.connection_arn,
        )
        synth = pipelines.CodeBuildStep(
            "Synth",
            input=source,
            install_commands=["make setup"],
            commands=synth_commands(config),
            primary_output_directory="cdk.out",
            timeout=SYNTH_TIMEOUT,
            env={"JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION": "1"},
        )
        self.pipeline = pipelines.CodePipeline(
            self,
            "Pipeline",
            synth=synth,
            artifact_bucket=store.bucket,
            pipeline_type=codepipeline.PipelineType.V2,
            publish_assets_in_parallel=False,
            cli_version=CDK_CLI_VERSION,
            code_build_defaults=pipelines.CodeBuildOptions(
                build_environment=codebuild.BuildEnvironment(
                    build_image=codebuild.LinuxBuildImage.STANDARD_7_0,
                    compute_type=codebuild.ComputeType.LARGE,
                ),
                partial_build_spec=codebuild.BuildSpec.from_object(
                    {"phases": {"install": {"runtime-versions": {"python": "3.11", "nodejs": "22"}}}}
                ),
            ),
        )
        for rollout in rollouts(config):
            stage = TeamStage(scope, f"{id}-{rollout.stage_id}", rollout=rollout, config=config)
            pre = []
            if rollout.approvals:
                runs = ", ".join(
                    f"{name} {budget.usd(cost)} (threshold {budget.usd(limit)})"
                    for name, cost, limit in rollout.approvals
                )
                pre.append(
                    pipelines.ManualApprovalStep(
                        "ApproveCost",
                        comment=f"Team {rollout.team}: planned runs above the approval threshold: {runs}",
                    )
                )
            self.pipeline.add_stage(stage, pre=pre)
        self.pipeline.build_pipeline()  # materialize the generated roles and projects for cdk-nag below
        self._acknowledge_generated(store)
        self._bind_trust_to_account()
        # The pipeline reaches its role through GetAtt already; CodePipeline adds a DependsOn on it too
        # (cfn-lint W3005). Keep only the DependsOn on the role's policy, which GetAtt does not imply.
        policy = self.pipeline.pipeline.role.node.find_child("DefaultPolicy").node.default_child
        cfn_pipeline = self.pipeline.pipeline.node.default_child
        cfn_pipeline.add_override("DependsOn", [policy.logical_id])  # type: ignore[union-attr]
        self._role_arns_as_sub(cfn_pipeline)

    def _bind_trust_to_account(self) -> None:
        """Bind the roles CDK Pipelines generates for CodePipeline and CodeBuild to this account.

        Their trust policies name the service alone. IAM's guidance against the cross-service confused
        deputy (IAM User Guide, "The confused deputy problem") is `aws:SourceAccount` or `aws:SourceArn`
        on every service principal that is given access to the account. The account rather than the
        project or pipeline ARN: those resources reference the roles, so naming them here would make a
        dependency cycle. (Checked against templates only; no pipeline has run on a real account.)"""
        for node in self.node.find_all():
            if not isinstance(node, iam.CfnRole):
                continue
            document = self.resolve(node.assume_role_policy_document)
            for index, statement in enumerate(document.get("Statement", [])):
                principal = statement.get("Principal")
                if isinstance(principal, dict) and "Service" in principal and not statement.get("Condition"):
                    node.add_property_override(
                        f"AssumeRolePolicyDocument.Statement.{index}.Condition",
                        {"StringEquals": {"aws:SourceAccount": self.account}},
                    )

    def _role_arns_as_sub(self, cfn_pipeline: Any) -> None:
        """Write the deploy actions' role ARNs as Fn::Sub: cfn-lint (E3703) rejects the Fn::Join with an
        empty delimiter CDK Pipelines renders for them. Same ARN, different spelling."""
        stages = self.resolve(cfn_pipeline.stages)
        for i, stage in enumerate(stages):
            for j, action in enumerate(stage.get("actions") or stage.get("Actions") or []):
                config = action.get("configuration") or action.get("Configuration") or {}
                arn = config.get("RoleArn")
                joined = arn.get("Fn::Join") if isinstance(arn, dict) else None
                parts = joined[1] if joined and joined[0] == "" else None
                if parts and all(isinstance(part, str) or set(part) == {"Ref"} for part in parts):
                    text = "".join(p if isinstance(p, str) else "${" + p["Ref"] + "}" for p in parts)
                    cfn_pipeline.add_property_override(
                        f"Stages.{i}.Actions.{j}.Configuration.RoleArn", {"Fn::Sub": text}
                    )

    def _acknowledge_generated(self, store: ArtifactStore) -> None:
        """Acknowledge, finding by finding, the wildcards CDK Pipelines writes into its own roles."""

        def ref(construct: Construct) -> str:
            return str(self.resolve(construct.node.default_child.logical_id))  # type: ignore[union-attr]

        nag.acknowledge(
            self.pipeline,
            "AwsSolutions-IAM5:pipeline-artifacts",
            [
                *(
                    f"Action::{a}"
                    for a in (
                        "s3:GetObject*",
                        "s3:GetBucket*",
                        "s3:List*",
                        "s3:DeleteObject*",
                        "s3:Abort*",
                        "kms:ReEncrypt*",
                        "kms:GenerateDataKey*",
                    )
                ),
                f"Resource::<{ref(store.bucket)}.Arn>/*",
            ],
        )
        for project in (self.pipeline.synth_project, self.pipeline.self_mutation_project):
            nag.acknowledge(
                project,
                "AwsSolutions-IAM5:pipeline-build-logs",
                [
                    nag.arn_finding(self, "logs", f"log-group:/aws/codebuild/<{ref(project)}>:*"),
                    nag.arn_finding(self, "codebuild", f"report-group/<{ref(project)}>-*"),
                ],
            )
        account = "<AWS::AccountId>" if Token.is_unresolved(self.account) else self.account
        nag.acknowledge(
            self.pipeline.self_mutation_project,
            "AwsSolutions-IAM5:pipeline-self-mutation",
            [f"Resource::arn:*:iam::{account}:role/*", "Resource::*"],
        )


def build_pipeline(app: App, config: DeploymentConfig) -> PipelineStack:
    """The `-c pipeline=true` app: the pipeline stack, whose stages hold every team's recipe stacks."""
    settings = PipelineSettings.from_context(config.context)
    env = (
        Environment(account=config.account, region=config.region) if config.account or config.region else None
    )
    stack = PipelineStack(app, PIPELINE_STACK, config=config, settings=settings, env=env)
    nag.enable(app)
    return stack


# --- GitHub Actions: the role the deploy workflow assumes ------------------------------------------
# Its own small app, so it needs no recipe context:
#   npx cdk deploy -a ".venv/bin/python -m stacks.pipeline" -c repository=OWNER/NAME \
#       [-c oidc_provider_arn=ARN]    # when the account already has the GitHub OIDC provider

GITHUB_OIDC_HOST = "token.actions.githubusercontent.com"
GITHUB_DEPLOY_STACK = "Trainstack-GitHubDeploy"
GITHUB_ENVIRONMENTS = "training*"  # `training` and `training-approval` (.github/workflows/deploy.yml)
BOOTSTRAP_ROLES = ("deploy", "file-publishing", "image-publishing", "lookup")
OIDC_PROVIDER_ARN = re.compile(
    r"^arn:aws[a-z\-]*:iam::[0-9]{12}:oidc-provider/token\.actions\.githubusercontent\.com\Z"
)


class GitHubDeployRole(Construct):
    """A role only this repository's deploy environments can assume (GitHub OIDC, no stored keys), whose
    only permission is to assume the CDK bootstrap roles: the CDK CLI does everything else through them."""

    def __init__(self, scope: Construct, id: str, *, repository: str, provider_arn: str | None) -> None:
        super().__init__(scope, id)
        if provider_arn is None:
            # The L1 resource: CDK's OpenIdConnectProvider is a Lambda-backed custom resource.
            provider = iam.CfnOIDCProvider(
                self, "GitHubOidc", url=f"https://{GITHUB_OIDC_HOST}", client_id_list=["sts.amazonaws.com"]
            )
            provider_arn = provider.attr_arn
        self.role = iam.Role(
            self,
            "Role",
            description=f"GitHub Actions deploys of {repository} (environments {GITHUB_ENVIRONMENTS})",
            max_session_duration=Duration.hours(1),
            assumed_by=iam.WebIdentityPrincipal(
                provider_arn,
                conditions={
                    "StringEquals": {f"{GITHUB_OIDC_HOST}:aud": "sts.amazonaws.com"},
                    "StringLike": {
                        f"{GITHUB_OIDC_HOST}:sub": f"repo:{repository}:environment:{GITHUB_ENVIRONMENTS}"
                    },
                },
            ),
        )
        self.role.add_to_policy(
            iam.PolicyStatement(
                actions=["sts:AssumeRole"],
                resources=[f"arn:{Stack.of(self).partition}:iam::*:role/cdk-*"],
                conditions={
                    "StringEquals": {"iam:ResourceTag/aws-cdk:bootstrap-role": list(BOOTSTRAP_ROLES)}
                },
            )
        )
        nag.acknowledge(
            self.role,
            "AwsSolutions-IAM5:github-bootstrap-roles",
            ["Resource::arn:<AWS::Partition>:iam::*:role/cdk-*"],
        )


class GitHubDeployStack(Stack):
    def __init__(
        self, scope: Construct, id: str, *, repository: str, provider_arn: str | None, **kwargs: Any
    ) -> None:
        super().__init__(
            scope, id, description="trainstack: the role GitHub Actions deploys recipes with", **kwargs
        )
        self.role = GitHubDeployRole(self, "Deploy", repository=repository, provider_arn=provider_arn).role
        CfnOutput(
            self,
            "RoleArn",
            value=self.role.role_arn,
            description="secret AWS_DEPLOY_ROLE_ARN of the training and training-approval environments",
        )


def build_github_deploy(app: App, context: Mapping[str, Any]) -> GitHubDeployStack:
    repository = str(context.get("repository") or "").strip()
    provider_arn = str(context.get("oidc_provider_arn") or "").strip() or None
    if not REPOSITORY.match(repository):
        raise TrainstackError(
            f"{CONTEXT}: repository: expected OWNER/NAME of the GitHub repository, got {repository!r}"
        )
    if provider_arn is not None and not OIDC_PROVIDER_ARN.match(provider_arn):
        raise TrainstackError(
            f"{CONTEXT}: oidc_provider_arn: {provider_arn!r} is not the GitHub OIDC provider's ARN"
        )
    stack = GitHubDeployStack(app, GITHUB_DEPLOY_STACK, repository=repository, provider_arn=provider_arn)
    nag.enable(app)
    return stack


def main() -> int:
    import sys

    app = App()
    try:
        build_github_deploy(
            app, {k: app.node.try_get_context(k) for k in ("repository", "oidc_provider_arn")}
        )
    except TrainstackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    try:
        app.synth()
    except RuntimeError as exc:  # cdk-nag findings: the report is above
        print(f"error: synthesis failed: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
