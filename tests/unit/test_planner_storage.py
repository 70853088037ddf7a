"""The run's checkpoint storage in the plan (trainstack.planner.storage): what one checkpoint holds,
how many the run writes, what the kept and pruned ones cost until the bucket's lifecycle removes them."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from trainstack.cli.main import app
from trainstack.planner import plan
from trainstack.planner import storage as priced
from trainstack.recipes.loader import resolve

pytestmark = pytest.mark.fast


def test_a_30b_run_writes_about_90_tib_of_checkpoints_and_keeps_one():
    recipe = resolve("30b-fp8").recipe
    p = plan(recipe)
    s = p.storage
    # one checkpoint: FP32 master weights and AdamW m, v for every parameter, by hand
    assert s.checkpoint_tib == pytest.approx(recipe.model.total_params * 12 / 2**40)
    assert s.written == p.run.saves + 1 and p.run.jobs == 1  # interval saves and the final one
    assert 85 < s.written_tib < 100  # the issue: "a 30b-fp8 run leaves about 90 TiB behind" (old rule)
    assert (s.kept, s.pruned) == (3, s.written - 3)
    assert s.left_tib == pytest.approx(3 * s.checkpoint_tib) and s.left_tib < 0.02 * s.written_tib


def test_storage_hours_by_hand():
    # 5 saves, 2 h apart over 10 h, 3 kept: 1, 2, 3, 3 checkpoints between them (18 checkpoint-hours),
    # then 2 pruned ones billed 1.5 days each (72 checkpoint-hours)
    assert priced._tib_hours(5, 3, 10.0, 1.5, checkpoint_tib=2.0) == pytest.approx(2.0 * (18 + 72))
    assert priced._tib_hours(2, 3, 10.0, 1.5, checkpoint_tib=1.0) == pytest.approx(5.0)  # none pruned


def test_the_run_cost_includes_the_storage_with_its_range():
    p = plan(resolve("64b-fp8").recipe)
    s, cost = p.storage, p.cost
    assert cost.storage_usd == pytest.approx(s.tib_months * 1024 * priced.S3_USD_PER_GIB_MONTH)
    assert s.usd_range[0] < s.usd < s.usd_range[1] and s.tib_months_range[0] < s.tib_months
    assert cost.total_usd == pytest.approx(cost.usd_per_hour * cost.hours + s.usd)
    assert any(a.startswith("storage: ") and "included in the cost" in a for a in p.assumptions)


def test_keeping_more_checkpoints_costs_more_while_the_run_trains_and_after():
    few = plan(resolve("30b-fp8").recipe).storage
    many = plan(resolve("30b-fp8", overrides=["checkpointing.keep=50"]).recipe).storage
    assert many.tib_months > few.tib_months and many.left_usd_per_month == pytest.approx(
        few.left_usd_per_month * 50 / 3
    )


def test_plan_shows_the_storage_and_its_json_carries_it():
    runner = CliRunner()
    text = runner.invoke(app, ["plan", "30b-fp8"], env={"COLUMNS": "200"})
    assert "checkpoint storage" in text.stdout and "TiB-months" in text.stdout
    assert "checkpoint storage included" in text.stdout
    as_json = runner.invoke(app, ["plan", "30b-fp8", "--json"])
    data = json.loads(as_json.stdout)
    assert data["storage"]["written"] > 200 and data["cost"]["storage_usd"] == pytest.approx(
        data["storage"]["usd"]
    )
    assert data["storage"]["price_source"].startswith("S3 Standard")
