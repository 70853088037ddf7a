"""Prices: every catalogued type names its price's source and date; a team's own price per instance-hour
is what plan, diff and the budget guard use."""

from __future__ import annotations

import re
import subprocess

import pytest

from trainstack.gitops import gitdiff
from trainstack.planner import budget, plan
from trainstack.recipes.hardware import INSTANCES
from trainstack.recipes.loader import resolve

pytestmark = pytest.mark.fast

SMALL = """\
name: small
model: {layers: 16, hidden: 2048, heads: 32, kv_heads: 8, ffn: 8192, vocab: 128256, tied_embeddings: true}
training: {seq_len: 8192, micro_batch: 2, global_batch: 128, steps: 2000}
precision: {dtype: bf16}
activation_checkpointing: {mode: none}
parallelism: {shard_group: 8}
compute: {instance_type: ml.p6-b200.48xlarge}
"""


@pytest.mark.parametrize("instance_type", sorted(INSTANCES))
def test_every_catalogued_price_names_its_source_and_date(instance_type):
    instance = INSTANCES[instance_type]
    assert instance.usd_per_hour > 0
    assert len(instance.price_source) > 20
    assert re.fullmatch(r"20\d\d-\d\d", instance.price_date)


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "recipes"
    (root / "teams" / "nlp").mkdir(parents=True)
    (root / "small.yaml").write_text(SMALL)
    return root


def test_a_teams_own_price_is_what_plan_and_the_budget_guard_use(tree):
    catalogue = plan(resolve("small", team="nlp", recipes_dir=tree).recipe)
    (tree / "teams" / "nlp" / "defaults.yaml").write_text(
        "compute: {usd_per_instance_hour: 60.0}\nbudget: {max_run_usd: 1.0}\n"
    )
    resolved = resolve("small", team="nlp", recipes_dir=tree)
    negotiated = plan(resolved.recipe)
    assert negotiated.cost.usd_per_instance_hour == 60.0
    assert negotiated.cost.price_source == "compute.usd_per_instance_hour"
    # the instance hours at the team's rate; the checkpoint storage (S3's price) is the same
    storage, high_storage = catalogue.cost.storage_usd, catalogue.cost.storage_usd_range[1]
    assert negotiated.cost.storage_usd == pytest.approx(storage)
    instances = catalogue.cost.total_usd - storage
    assert negotiated.cost.total_usd - storage == pytest.approx(instances * 60.0 / 114.0)
    assert negotiated.cost.total_usd_range[1] - high_storage == pytest.approx(
        (catalogue.cost.total_usd_range[1] - high_storage) * 60.0 / 114.0
    )
    check = budget.check(resolved.recipe, negotiated)
    assert check.run_usd == pytest.approx(negotiated.cost.total_usd)
    assert "at $60/h" in check.overruns[0].message


def test_diff_shows_the_cost_at_the_teams_price(tree):
    root = tree.parent
    (tree / "teams" / "nlp" / "defaults.yaml").write_text("tags: {cost_center: nlp}\n")

    def git(*args):
        subprocess.run(
            [
                "git",
                "-c",
                "user.name=t",
                "-c",
                "user.email=t@example.com",
                "-c",
                "commit.gpgsign=false",
                *args,
            ],
            cwd=root,
            check=True,
            capture_output=True,
        )

    git("init", "--quiet")
    git("add", ".")
    git("commit", "--quiet", "-m", "recipes")
    (tree / "teams" / "nlp" / "defaults.yaml").write_text(
        "tags: {cost_center: nlp}\ncompute: {usd_per_instance_hour: 57.0}\n"
    )
    diff = gitdiff.compute("HEAD", root)
    (target,) = [t for t in diff.targets if t.team == "nlp"]
    storage = plan(resolve("small", team="nlp", recipes_dir=tree).recipe).cost.storage_usd  # S3's price
    before, after = target.before.figures.total_usd, target.after.figures.total_usd
    assert after - storage == pytest.approx((before - storage) / 2)


def test_the_price_of_another_instance_type_is_the_catalogues():
    # a team's negotiated rate is for its own instance type; --compare prices the others from the catalogue
    from trainstack.planner.compare import compare

    recipe = resolve("8b-fp8", overrides=["compute.usd_per_instance_hour=50"]).recipe
    rows = {row.instance_type: row for row in compare(recipe)}
    assert rows["ml.p6-b200.48xlarge"].usd_per_instance_hour == 50
    assert rows["ml.p5.48xlarge"].usd_per_instance_hour == INSTANCES["ml.p5.48xlarge"].usd_per_hour
