"""Helpers for the monitoring tests: a small stack of our own that hosts `Monitoring` the way the
launcher stack does, and readers for what it synthesizes.

The state machine here is a stand-in (logging ALL, tracing on, like the real launcher). cdk-nag runs on
the whole test app; the tests assert that no finding points into the Monitoring construct. The stand-in's
own findings (its X-Ray policy needs `Resource: *`) are the launcher's business, acknowledged in
stacks/nag.py for the real one, so none are acknowledged here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

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
    from aws_cdk import aws_logs as logs
    from aws_cdk import aws_s3 as s3
    from aws_cdk import aws_stepfunctions as sfn
    from cdk_nag import AwsSolutionsChecks

    from stacks.monitoring import Monitoring
    from stacks.storage import EncryptionKey
    from trainstack.planner import plan
    from trainstack.recipes.loader import resolve

    resolved = resolve(recipe_name, team=team, overrides=overrides)
    recipe, the_plan = resolved.recipe, plan(resolved.recipe)
    app = App(outdir=tempfile.mkdtemp(prefix="monitoring-cdk-"))
    stack = Stack(app, "MonitoringTest")
    # The data stack's own key construct, with its key policy for log groups.
    key = EncryptionKey(stack, "Key", description="monitoring test key").key
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
        key=key,
        checkpoint_bucket=bucket,
        state_machines={"start": machine},
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


def topic_ref(s) -> dict:
    """The deployment's notification topic (not the supervision topic, which has a key of its own)."""
    (topic_id,) = [k for k in s.resources("AWS::SNS::Topic") if "SupervisionTopic" not in k]
    return {"Ref": topic_id}


def supervision_topic_ref(s) -> dict:
    (topic_id,) = [k for k in s.resources("AWS::SNS::Topic") if "SupervisionTopic" in k]
    return {"Ref": topic_id}


def manager(s) -> tuple[str, dict]:
    ((logical_id, machine),) = [
        (k, v) for k, v in s.resources("AWS::StepFunctions::StateMachine").items() if "AlarmManager" in k
    ]
    return logical_id, machine["Properties"]


def definition(s, substitutions: dict[str, str] | None = None) -> dict:
    """The alarm manager's ASL with CloudFormation references replaced by stand-in values."""
    subs = {"AWS::Partition": "aws", **(substitutions or {})}
    raw = manager(s)[1]["DefinitionString"]
    parts = raw["Fn::Join"][1] if isinstance(raw, dict) else [raw]
    text = "".join(p if isinstance(p, str) else subs.get(p["Ref"], f"<{p['Ref']}>") for p in parts)
    return json.loads(text)


def tasks_of(asl: dict) -> dict[str, dict]:
    """Every Task state, at any depth (Parallel branches, Map processors)."""
    found: dict[str, dict] = {}
    for name, state in asl["States"].items():
        if state["Type"] == "Task":
            found[name] = state
        for branch in state.get("Branches", []):
            found.update(tasks_of(branch))
        if "ItemProcessor" in state:
            found.update(tasks_of(state["ItemProcessor"]))
    return found
