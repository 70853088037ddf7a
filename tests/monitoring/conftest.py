"""A small stack of our own that hosts `Monitoring` the way the launcher stack does.

The state machine here is a stand-in (logging ALL, tracing on, like the real launcher). cdk-nag runs on
the whole test app; the tests assert that no finding points into the Monitoring construct. The stand-in's
own findings (its X-Ray policy needs `Resource: *`) are the launcher's business, acknowledged in
stacks/nag.py for the real one, so none are acknowledged here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION", "1")


@dataclass(frozen=True)
class Synth:
    recipe: Any
    team: str | None
    plan: Any
    template: dict[str, Any]
    template_path: str
    monitoring: Any
    nag_violations: tuple[tuple[str, str], ...]  # (rule, construct path) for every cdk-nag finding

    def resources(self, type_: str) -> dict[str, dict[str, Any]]:
        return {k: v for k, v in self.template["Resources"].items() if v["Type"] == type_}


@lru_cache(maxsize=8)
def synth(
    recipe_name: str = "30b-fp8",
    team: str | None = None,
    with_nag: bool = True,
    overrides: tuple[str, ...] = (),
) -> Synth:
    """Synthesize Monitoring for one resolved recipe into a fresh app (cached: synthesis is slow)."""
    import json
    import tempfile

    from aws_cdk import App, Duration, RemovalPolicy, Stack, Validations
    from aws_cdk import aws_kms as kms
    from aws_cdk import aws_logs as logs
    from aws_cdk import aws_s3 as s3
    from aws_cdk import aws_stepfunctions as sfn
    from cdk_nag import AwsSolutionsChecks

    from stacks.monitoring import Monitoring
    from trainstack.loader import resolve
    from trainstack.planner import plan

    resolved = resolve(recipe_name, team=team, overrides=overrides)
    recipe, the_plan = resolved.recipe, plan(resolved.recipe)
    app = App(outdir=tempfile.mkdtemp(prefix="monitoring-cdk-"))
    stack = Stack(app, "MonitoringTest")
    key = kms.Key(stack, "Key", enable_key_rotation=True, removal_policy=RemovalPolicy.RETAIN)
    bucket = s3.Bucket.from_bucket_name(stack, "Checkpoints", "trainstack-checkpoints-example")
    log_group = logs.LogGroup(
        stack, "Executions", retention=logs.RetentionDays.ONE_MONTH, removal_policy=RemovalPolicy.DESTROY
    )
    machine = sfn.StateMachine(
        stack,
        "Launcher",
        definition_body=sfn.DefinitionBody.from_chainable(
            sfn.Wait(stack, "Wait", time=sfn.WaitTime.duration(Duration.seconds(1)))
        ),
        logs=sfn.LogOptions(destination=log_group, level=sfn.LogLevel.ALL),
        tracing_enabled=True,
    )
    monitoring = Monitoring(
        stack,
        "Monitoring",
        recipe=recipe,
        team=team,
        plan=the_plan,
        state_machine=machine,
        key=key,
        checkpoint_bucket=bucket,
    )
    if with_nag:
        Validations.of(app).add_plugins(AwsSolutionsChecks(app))
    try:
        app.synth()
    except RuntimeError as error:  # cdk-nag findings fail synthesis; the report says which
        if "ValidationFailed" not in str(error):
            raise
    outdir = Path(app.outdir)
    violations: list[tuple[str, str]] = []
    report = outdir / "validation-report.json"
    if report.exists():
        for plugin in json.loads(report.read_text())["pluginReports"]:
            for violation in plugin["violations"]:
                for construct in violation["violatingConstructs"]:
                    violations.append((violation["ruleName"], construct["constructPath"]))
    template_path = outdir / "MonitoringTest.template.json"
    template = json.loads(template_path.read_text())
    return Synth(recipe, team, the_plan, template, str(template_path), monitoring, tuple(violations))


@pytest.fixture(scope="session")
def synthesized() -> Synth:
    return synth("30b-fp8")
