"""The budget guard: a team's caps on instance count and planned run cost, with the numbers."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainstack.errors import RecipeError
from trainstack.planner import budget, plan
from trainstack.recipes.loader import resolve

pytestmark = pytest.mark.fast


@pytest.fixture
def recipes(tmp_path, monkeypatch, h):
    monkeypatch.chdir(tmp_path)
    return h.write_tree(
        tmp_path,
        {
            "recipes/small.yaml": h.base_recipe("small", nodes=2),
            "recipes/teams/nlp/defaults.yaml": "budget: {max_instance_count: 1}\n",
        },
    )


def test_over_the_instance_cap_is_refused_with_both_numbers(recipes):
    resolved = resolve("small", team="nlp", recipes_dir=recipes)
    with pytest.raises(RecipeError) as info:
        budget.enforce(resolved, plan(resolved.recipe))
    assert str(info.value) == (
        "recipes/small.yaml: compute.instance_count: 2 instances is over the team cap "
        "budget.max_instance_count = 1 (set in recipes/teams/nlp/defaults.yaml)"
    )


def test_over_the_cost_cap_is_refused_with_the_planned_cost(recipes):
    (recipes / "teams" / "nlp" / "defaults.yaml").write_text("budget: {max_run_usd: 10}\n")
    (recipes / "teams" / "nlp" / "small.yaml").write_text("training: {steps: 5000}\n")
    resolved = resolve("small", team="nlp", recipes_dir=recipes)
    p = plan(resolved.recipe)
    assert p.cost.total_usd > 10  # the premise: this run costs more than the cap
    with pytest.raises(RecipeError) as info:
        budget.enforce(resolved, p)
    message = str(info.value)
    assert message.startswith("recipes/teams/nlp/small.yaml: budget.max_run_usd: planned run cost ")
    assert budget.usd(p.cost.total_usd) in message
    assert f"{p.cost.hours:,.1f} h at {budget.usd(p.cost.usd_per_hour)}/h" in message
    assert message.endswith("budget.max_run_usd = $10 (set in recipes/teams/nlp/defaults.yaml)")


def test_within_the_caps_passes_and_approval_follows_the_threshold(recipes):
    resolved = resolve("small", recipes_dir=recipes)
    p = plan(resolved.recipe)
    cap = p.cost.total_usd * 1.01
    for threshold, needs in ((p.cost.total_usd * 0.99, True), (p.cost.total_usd * 1.01, False)):
        recipe = resolved.recipe.model_copy(
            update={
                "budget": resolved.recipe.budget.model_copy(
                    update={"max_instance_count": 2, "max_run_usd": cap, "approval_usd": threshold}
                )
            }
        )
        result = budget.check(recipe, p)
        assert result.ok and result.run_usd == pytest.approx(p.cost.total_usd)
        assert result.needs_approval is needs


def test_without_a_plan_only_the_instance_cap_is_checked(recipes):
    resolved = resolve("small", team="nlp", recipes_dir=recipes)
    result = budget.check(resolved.recipe, None)
    assert [o.field for o in result.overruns] == ["compute.instance_count"]
    assert result.run_usd is None and not result.needs_approval


def test_validate_and_plan_refuse_an_over_cap_team_recipe_with_exit_2(recipes):
    cli = shutil.which("trainstack", path=str(Path(sys.executable).parent))
    done = subprocess.run(
        [cli, "validate", "--recipes-dir", str(recipes)], capture_output=True, text=True, cwd=recipes.parent
    )
    assert done.returncode == 2
    assert (
        "invalid recipes/small.yaml: compute.instance_count: 2 instances is over the team cap "
        "budget.max_instance_count = 1 (set in recipes/teams/nlp/defaults.yaml) [small --team nlp]"
    ) in done.stderr
    assert "ok      " in done.stdout  # the base recipe alone has no cap

    done = subprocess.run(
        [cli, "plan", "small", "--team", "nlp", "--recipes-dir", str(recipes)],
        capture_output=True,
        text=True,
        cwd=recipes.parent,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "2 instances is over the team cap budget.max_instance_count = 1" in done.stderr
