"""Warnings for legal values that are almost surely wrong (trainstack.planner.sanity): each fires past its
threshold and not before, names the threshold and why, is printed by validate, show and the CDK app,
is silenced by --quiet / -c quiet=true, and never changes an exit status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainstack.cli.main import app
from trainstack.planner import plan, sanity
from trainstack.recipes.loader import base_recipe_names, resolve, team_names, team_recipe_names

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]


def concerns(recipe_name: str = "8b-fp8", *sets: str, **kw) -> dict[str, str]:
    r = resolve(recipe_name, overrides=list(sets)).recipe
    return {c.field: c.message for c in sanity.check(r, plan(r), **kw)}


def test_the_repository_recipes_raise_no_concern():
    pairs = [(n, None) for n in base_recipe_names()]
    pairs += [(n, t) for t in team_names() for n in team_recipe_names(t)]
    for name, team in pairs:
        r = resolve(name, team).recipe
        assert sanity.check(r, plan(r), local_storage_gb=0) == [], (name, team)


def test_learning_rate_warns_only_beyond_ten_times_the_compute_optimal_rate():
    recipe = resolve("8b-fp8").recipe
    eta = sanity.optimal_lr(recipe)
    # the DeepSeek LLM fit, by hand: 0.3118 x (6 N D)^-0.125
    budget = 6 * recipe.model.non_embedding_params * recipe.training.global_batch * recipe.training.seq_len
    assert eta == pytest.approx(0.3118 * (budget * recipe.training.steps) ** -0.125)
    assert "training.lr" not in concerns("8b-fp8", f"training.lr={9.9 * eta}")
    message = concerns("8b-fp8", "training.lr=0.5")["training.lr"]
    assert message.startswith(f"0.5 is {0.5 / eta:,.0f} x the compute-optimal rate for this run ({eta:.2g}")
    assert "above 10 x that, training almost surely diverges" in message
    low = concerns("8b-fp8", f"training.lr={eta / 200}")["training.lr"]
    assert "1/200 of the compute-optimal rate" in low and "below 0.01 x that" in low


def test_warmup_warns_past_half_the_run_and_says_when_it_is_longer_than_the_run():
    steps = resolve("8b-fp8").recipe.training.steps
    assert "training.warmup_steps" not in concerns("8b-fp8", f"training.warmup_steps={steps // 2}")
    half = concerns("8b-fp8", f"training.warmup_steps={steps // 2 + 1}")["training.warmup_steps"]
    assert f"more than 50% of the {steps:,} steps" in half
    longer = concerns("8b-fp8", f"training.warmup_steps={2 * steps}")["training.warmup_steps"]
    assert f"longer than the run ({steps:,} steps): the learning rate never reaches its peak" in longer


def test_global_batch_warns_ten_times_away_from_the_compute_optimal_batch_for_the_budget():
    # 8b-fp8 at 64x its global batch for the same steps: far above the compute-optimal batch.
    base = resolve("8b-fp8").recipe.training
    batch = 64 * base.global_batch
    recipe = resolve("8b-fp8", overrides=[f"training.global_batch={batch}"]).recipe
    best = sanity.optimal_batch_tokens(recipe)
    assert recipe.tokens_per_step > 10 * best
    message = concerns("8b-fp8", f"training.global_batch={batch}")["training.global_batch"]
    assert message.startswith(
        f"{batch:,} sequences ({recipe.tokens_per_step / 1e6:,.3g}M tokens) per step is"
    )
    assert f"above 10 x that, the token budget buys only {base.steps:,} optimizer steps" in message
    assert "training.global_batch" not in concerns("8b-fp8")


def test_the_volume_check_applies_only_where_a_volume_exists():
    recipe = resolve("64b-fp8", overrides=["compute.volume_size_gb=50"]).recipe
    planned = plan(recipe)
    gib = planned.run.checkpoint.gib_per_node
    assert gib * 2**30 / 1e9 > 50
    # NVMe instance storage (every catalogued type): SageMaker provisions no volume; unknown: no claim
    assert sanity.check(recipe, planned, local_storage_gb=30720) == []
    assert sanity.check(recipe, planned) == []  # ml.p6-b200.48xlarge has 8 x 3.84 TB NVMe
    (concern,) = sanity.check(recipe, planned, local_storage_gb=0)
    assert concern.field == "compute.volume_size_gb"
    assert concern.message.startswith(f"50 GB is smaller than one checkpoint per node ({gib:,.0f} GiB")
    assert "checkpoints stream to S3" in concern.message


def test_validate_and_show_print_warnings_with_the_source_and_keep_the_exit_status(recipes_dir):
    (recipes_dir / "teams" / "nlp" / "small.yaml").write_text("training: {lr: 0.5}\n")
    result = CliRunner().invoke(app, ["validate", "--recipes-dir", str(recipes_dir)])
    assert result.exit_code == 0, result.output
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("warning:") and "training.lr" in x]
    assert line.startswith("warning: ") and "teams/nlp/small.yaml: training.lr: 0.5 is " in line
    assert line.endswith("[small --team nlp]")
    quiet = CliRunner().invoke(app, ["validate", "-q", "--recipes-dir", str(recipes_dir)])
    assert quiet.exit_code == 0 and "warning" not in quiet.stderr

    shown = CliRunner().invoke(
        app,
        ["show", "small", "--set", "training.warmup_steps=99", "--json", "--recipes-dir", str(recipes_dir)],
    )
    assert shown.exit_code == 0 and json.loads(shown.stdout)["recipe"]["training"]["warmup_steps"] == 99
    assert "warning: --set: training.warmup_steps: 99 warmup steps is longer than the run" in shown.stderr
    silent = CliRunner().invoke(
        app,
        ["show", "small", "--set", "training.warmup_steps=99", "--quiet", "--recipes-dir", str(recipes_dir)],
    )
    assert silent.exit_code == 0 and "warning" not in silent.stderr


@pytest.mark.parametrize("quiet", [False, True])
def test_the_cdk_app_prints_warnings_unless_quiet(tmp_path, quiet):
    context = {"recipe": "1b-bf16", "set": "training.lr=0.5", "aws:cdk:bundling-stacks": ["**"]}
    if quiet:
        context["quiet"] = "true"
    env = {
        **os.environ,
        "CDK_DEFAULT_ACCOUNT": "123456789012",
        "CDK_DEFAULT_REGION": "us-west-2",
        "JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION": "1",
        "JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION": "20",
        "CDK_CONTEXT_JSON": json.dumps(context),
        "CDK_OUTDIR": str(tmp_path),
    }
    env.pop("AWS_ENDPOINT_URL", None)
    done = subprocess.run(
        [sys.executable, "app.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    warned = [x for x in done.stderr.splitlines() if x.startswith("warning:")]
    if quiet:
        assert warned == []
    else:
        (line,) = warned
        assert line.startswith("warning: -c set: training.lr: 0.5 is ") and line.endswith("[1b-bf16]")


def test_plan_prints_warnings_keeps_its_exit_status_and_quiet_silences_them(recipes_dir):
    (recipes_dir / "teams" / "nlp" / "small.yaml").write_text("training: {lr: 0.5}\n")
    loud = CliRunner().invoke(app, ["plan", "small", "--team", "nlp", "--recipes-dir", str(recipes_dir)])
    quiet = CliRunner().invoke(
        app, ["plan", "small", "--team", "nlp", "-q", "--recipes-dir", str(recipes_dir)]
    )
    assert loud.exit_code == quiet.exit_code
    assert any(x.startswith("warning: ") and "training.lr: 0.5 is " in x for x in loud.stderr.splitlines())
    assert "warning" not in quiet.stderr
