#!/usr/bin/env python3
"""The CDK app: `npx cdk deploy -c recipe=30b-fp8 [-c team=nlp] [-c set=k=v,...]`.

Context is read and validated once, here (trainstack.config); a bad or non-fitting recipe prints one
line and exits 2 before any stack exists. Options: see trainstack/config.py and docs/cdk.md.
"""

from __future__ import annotations

import os
import sys

# jsii warns loudly about this machine's Node version on every run; the CDK CLI itself is pinned.
os.environ.setdefault("JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION", "1")
os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")


def main() -> int:
    from aws_cdk import App

    from trainstack import config
    from trainstack.errors import TrainstackError

    app = App()
    try:
        deployment_config = config.load(config.user_context(app.node.get_all_context()), os.environ)
    except TrainstackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code

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
