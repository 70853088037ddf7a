"""Bad input through the real entry points (app.py as the CDK CLI runs it, and `npx cdk synth`):
one clear line, a non-zero exit, and no stack written."""

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
}


def run_app(context: dict[str, str], outdir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, **ENV, **QUIET, "CDK_CONTEXT_JSON": json.dumps(context), "CDK_OUTDIR": str(outdir)}
    return subprocess.run(
        [sys.executable, "app.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    ("context", "expected"),
    [
        ({"recipe": "nope"}, "recipes: recipe: unknown recipe 'nope'"),
        ({"recipe": "nope", "team": "nlp"}, "unknown recipe 'nope' for team 'nlp'"),
        # errors name the overrides as they were typed for the CDK app: -c set, not the CLI's --set
        (
            {"recipe": "30b-fp8", "set": "training.steps"},
            "error: -c set: 'training.steps' is not key.path=value",
        ),
        (
            {"recipe": "30b-fp8", "set": "training.micro_batch=0"},
            "error: -c set=training.micro_batch=0: training.micro_batch: Input",
        ),
        (
            {
                "recipe": "30b-fp8",
                # policy block: mode none takes no other policy, whatever the recipe sets
                "set": "activation_checkpointing.mode=none,activation_checkpointing.policy=block,"
                "training.micro_batch=4",
            },
            "does not fit",
        ),
        ({"recipe": "30b-fp8", "set": "compute.instance_type=ml.g5.xlarge"}, "'ml.g5.xlarge' is not offered"),
        # a misspelt key would otherwise be ignored: this one would deploy the platform team's stacks
        ({"recipe": "30b-fp8", "tem": "nlp"}, "cdk context: tem: unknown key (did you mean team?)"),
    ],
)
def test_app_refuses_bad_input_in_one_line_and_writes_nothing(
    tmp_path: Path, context: dict, expected: str
) -> None:
    result = run_app(context, tmp_path)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_cdk_cli_exits_non_zero_on_a_bad_recipe(tmp_path: Path) -> None:
    npx = shutil.which("npx")
    assert npx, "npx (Node.js) is needed for the CDK CLI"
    env = {**os.environ, **ENV, **QUIET}
    result = subprocess.run(
        [npx, "cdk", "synth", "-c", "recipe=nope", "-o", str(tmp_path / "out")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "error: recipes: recipe: unknown recipe 'nope'" in result.stderr
    assert not list(tmp_path.glob("out/*.template.json"))
