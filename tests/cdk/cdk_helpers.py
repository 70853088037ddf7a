"""Synthesize the app in-process and read what it wrote: shared by the CDK gate tests."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
ENV = {"CDK_DEFAULT_ACCOUNT": "123456789012", "CDK_DEFAULT_REGION": "us-west-2"}
os.environ.setdefault("JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION", "1")
os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")


def synth(context: dict[str, str], outdir: Path, env: dict[str, str] | None = None) -> Path:
    """What `npx cdk synth -c k=v ...` does, in this process: config, stacks, nag, templates."""
    from aws_cdk import App

    from stacks.app import build
    from trainstack.aws import deployment as config

    deployment_config = config.load(context, {**ENV, **(env or {})})
    app = App(outdir=str(outdir))
    build(app, deployment_config)
    app.synth()
    return outdir


def templates(outdir: Path) -> dict[str, dict[str, Any]]:
    return {
        p.name.removesuffix(".template.json"): json.loads(p.read_text())
        for p in sorted(outdir.glob("*.template.json"))
    }


def resources(template: dict[str, Any], type_: str) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in template.get("Resources", {}).items() if v["Type"] == type_}


def flatten_join(value: Any) -> str:
    """A DefinitionString (`Fn::Join` of strings and tokens) as text, tokens shown as `${...}`."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and "Fn::Join" in value:
        sep, parts = value["Fn::Join"]
        return sep.join(flatten_join(p) for p in parts)
    return "${" + json.dumps(value, sort_keys=True).replace('"', "'") + "}"


def launcher_state_machine(template: dict[str, Any], which: str = "StartJob") -> dict[str, Any]:
    """The run supervisor's StartJob (or JobEnded) state machine resource."""
    (machine,) = [
        r
        for k, r in resources(template, "AWS::StepFunctions::StateMachine").items()
        if k.startswith(f"Supervisor{which}") and not k.startswith(f"Supervisor{which}Role")
    ]
    return machine


def state_machine_definition(template: dict[str, Any], which: str = "StartJob") -> dict[str, Any]:
    machine = launcher_state_machine(template, which)
    return json.loads(flatten_join(machine["Properties"]["DefinitionString"]))
