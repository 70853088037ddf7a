"""`npx cdk bootstrap` as the README writes it, with no recipe: the app then synthesizes only an empty
placeholder stack (the CDK CLI reads the environment to bootstrap from the app's stacks) and says in one
line how to pick a recipe; `cdk deploy` and `cdk synth` without a recipe still fail with one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cdk_helpers import ENV, ROOT

pytestmark = [pytest.mark.fast, pytest.mark.xdist_group("cdk-synth")]
QUIET = {
    "JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION": "1",
    "JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION": "20",
    "CDK_DISABLE_CLI_TELEMETRY": "true",
}


def run_app(context: dict, outdir: Path) -> subprocess.CompletedProcess:
    """app.py as the CDK CLI runs it (the CLI passes its bundling selection in the context)."""
    env = {**os.environ, **ENV, **QUIET, "CDK_CONTEXT_JSON": json.dumps(context), "CDK_OUTDIR": str(outdir)}
    return subprocess.run(
        [sys.executable, "app.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_bootstrap_without_a_recipe_gets_one_empty_stack_and_one_line(tmp_path: Path) -> None:
    # `cdk bootstrap`, `cdk ls` and `cdk destroy` bundle no stack: the CLI passes an empty list.
    result = run_app({"aws:cdk:bundling-stacks": []}, tmp_path)
    assert result.returncode == 0, result.stderr
    (line,) = [x for x in result.stderr.splitlines() if x.strip()]
    assert "no recipe in context" in line and "-c recipe=30b-fp8" in line and "trainstack recipes" in line
    templates = sorted(p.name for p in tmp_path.glob("*.template.json"))
    assert templates == ["Trainstack-NoRecipe.template.json"]
    template = json.loads((tmp_path / templates[0]).read_text())
    assert template.get("Resources", {}) == {}  # nothing that a deploy could create


@pytest.mark.parametrize("bundling", [["**"], ["Trainstack-NoRecipe"], None], ids=["all", "named", "by-hand"])
def test_deploy_or_synth_without_a_recipe_fails_in_one_line(tmp_path: Path, bundling) -> None:
    context = {} if bundling is None else {"aws:cdk:bundling-stacks": bundling}
    result = run_app(context, tmp_path)
    assert result.returncode == 2
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: cdk context: recipe: required"), result.stderr
    assert "-c recipe=30b-fp8" in lines[0]
    assert list(tmp_path.glob("*.template.json")) == []


@pytest.mark.slow
@pytest.mark.xdist_group("emulator")
def test_the_real_cli_bootstraps_without_a_recipe_and_refuses_to_deploy(tmp_path: Path) -> None:
    from trainstack.emulator.endpoint import Emulator

    npx = shutil.which("npx")
    assert npx, "npx (Node.js) is needed for the CDK CLI"
    with Emulator(log_path=tmp_path / "moto.log") as emulator:
        env = {**os.environ, **emulator.env(), **QUIET}
        cdk = [npx, "cdk", "--output", str(tmp_path / "out")]
        boot = subprocess.run(
            [*cdk, "bootstrap"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
        )
        assert boot.returncode == 0, boot.stdout[-2000:] + boot.stderr[-2000:]
        assert "no recipe in context" in boot.stderr
        cfn = emulator.client("cloudformation")
        assert [s["StackName"] for s in cfn.describe_stacks()["Stacks"]] == ["CDKToolkit"]

        deploy = subprocess.run(
            [*cdk, "deploy", "--all", "--require-approval=never"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert deploy.returncode != 0
        assert "error: cdk context: recipe: required" in deploy.stderr
        assert [s["StackName"] for s in cfn.describe_stacks()["Stacks"]] == ["CDKToolkit"]
