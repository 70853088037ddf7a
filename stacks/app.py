"""Compose the app from a DeploymentConfig: per deployment a Data stack and a Launcher stack."""

from __future__ import annotations

from aws_cdk import App, DefaultStackSynthesizer, Environment, Tags

from stacks import nag
from stacks.data_stack import DataStack
from stacks.launcher_stack import LauncherStack
from stacks.tracking import TrackingStack
from trainstack.aws.deployment import Deployment, DeploymentConfig
from trainstack.aws.request import tags
from trainstack.aws.tracking import team_of, tracking_stack_name

DATA = "Data"
LAUNCHER = "Launcher"


def stack_names(deployment: Deployment) -> tuple[str, str]:
    return f"{deployment.stack_prefix}-{DATA}", f"{deployment.stack_prefix}-{LAUNCHER}"


def build(app: App, config: DeploymentConfig) -> list:
    # Cross-stack references stay "strong" (an export cannot be deleted while imported): the data stack
    # must never lose an export the launcher still reads.
    app.node.set_context("@aws-cdk/core:defaultCrossStackReferences", "strong")
    env = (
        Environment(account=config.account, region=config.region) if config.account or config.region else None
    )
    stacks = []
    tracking: dict[str, TrackingStack] = {}  # team -> its MLflow App's stack, shared by its recipes
    for deployment in config.deployments:
        data_name, launcher_name = stack_names(deployment)
        common: dict = {"env": env}
        repository_name = None
        if config.emulator:
            # EMULATOR: moto fails to update a stack that has CDK's BootstrapVersion rule, and rejects
            # the ECR repository name CloudFormation would generate. Real AWS keeps both defaults.
            common["synthesizer"] = DefaultStackSynthesizer(generate_bootstrap_version_rule=False)
            repository_name = f"{deployment.stack_prefix.lower()}-images"
        # stack_name: the same CloudFormation stack whether `cdk deploy` or a pipeline stage deploys it.
        data = DataStack(
            app,
            data_name,
            stack_name=data_name,
            deployment=deployment,
            repository_name=repository_name,
            **common,
        )
        team_tracking = None
        if deployment.recipe.tracking.managed:
            team = team_of(deployment.recipe, deployment.team)
            if team not in tracking:
                name = tracking_stack_name(team)
                tracking[team] = TrackingStack(app, name, stack_name=name, team=team, **common)
                stacks.append(tracking[team])
            team_tracking = tracking[team]
        launcher = LauncherStack(
            app,
            launcher_name,
            stack_name=launcher_name,
            deployment=deployment,
            network=config.network,
            data=data,
            tracking=team_tracking,
            **common,
        )
        # EMULATOR: moto reads KMS key tags as TagKey/TagValue and fails on CloudFormation's Key/Value,
        # so the key goes untagged there. Real AWS tags everything.
        untagged = ["AWS::KMS::Key"] if config.emulator else []
        for stack in (data, launcher, *([team_tracking] if team_tracking is not None else [])):
            for key, value in tags(deployment.recipe, deployment.team).items():
                if stack is team_tracking and key == "recipe":
                    continue  # the team's stack serves all of its recipes
                Tags.of(stack).add(key, value, exclude_resource_types=untagged)
        stacks += [data, launcher]
    nag.enable(app)
    return stacks
