#!/usr/bin/env python3
"""The CDK app: `npx cdk deploy -c recipe=30b-fp8 [-c team=nlp] [-c set=k=v,...]`.

Context is read and validated once, here (trainstack.aws.deployment); a bad or non-fitting recipe prints one
line and exits 2 before any stack exists. Options: see trainstack/aws/deployment.py and docs/cdk.md.

`npx cdk bootstrap` needs no recipe: without one, commands that deploy nothing (bootstrap, ls, destroy)
get a single stack without resources, so the CDK CLI can read the account and region from it.
"""

from __future__ import annotations

import os
import sys

# jsii warns loudly about this machine's Node version on every run; the CDK CLI itself is pinned.
os.environ.setdefault("JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION", "1")
os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")
NO_RECIPE_STACK = "Trainstack-NoRecipe"


def main() -> int:
    from aws_cdk import App

    from trainstack.aws import deployment as config
    from trainstack.errors import TrainstackError

    app = App()
    if config.bootstrap_only(app.node.get_all_context()):
        # The CLI needs one stack to learn the environment from; without resources it deploys nothing.
        from aws_cdk import Acknowledgment, Stack, Validations

        placeholder = Stack(app, NO_RECIPE_STACK, analytics_reporting=False)
        Validations.of(placeholder).acknowledge(
            Acknowledgment(
                id="CloudFormation-Validate::F0001",
                reason="no resources on purpose: this stack only tells `cdk bootstrap` the environment",
            )
        )
        print(
            f"trainstack: no recipe in context, so no recipe stacks (only the empty {NO_RECIPE_STACK}, "
            f"which `cdk bootstrap` reads the account and region from); to deploy, {config.NO_RECIPE_HINT}",
            file=sys.stderr,
        )
        app.synth()
        return 0
    try:
        deployment_config = config.load(config.user_context(app.node.get_all_context()), os.environ)
    except TrainstackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    if not config.flag(config.user_context(app.node.get_all_context()), "quiet"):
        for (
            deployment
        ) in deployment_config.deployments:  # legal but almost surely wrong (trainstack.planner.sanity)
            for line in deployment.warnings:
                print(line, file=sys.stderr)

    if deployment_config.pipeline:
        from stacks.pipeline import build_pipeline

        try:  # the pipeline stack; every team's recipe stacks go inside its per-team stages
            build_pipeline(app, deployment_config)
        except TrainstackError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return exc.exit_code
    else:
        from stacks.app import build

        build(app, deployment_config)
    try:
        app.synth()
    except RuntimeError as exc:  # cdk-nag findings or other validation failures: the report is above
        print(f"error: synthesis failed: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
