"""`trainstack plan` as people read it: one verdict word, panels within 120 columns, the plot."""

from __future__ import annotations

import os
import stat

import pytest
from typer.testing import CliRunner

from trainstack.cli.commands.plan_plot import plot_data
from trainstack.cli.main import app
from trainstack.recipes.loader import resolve

pytestmark = pytest.mark.fast

BASE = [
    "1b-bf16",
    "3b-bf16",
    "7b-bf16",
    "8b-fp8",
    "14b-fp8",
    "30b-fp8",
    "64b-fp8",
    "8b-fp8-128k",
    "30b-fp8-128k",
    "64b-fp8-128k",
]
runner = CliRunner()
WIDE = {"COLUMNS": "200"}  # a wide terminal: the plan still keeps to 120 columns


@pytest.mark.parametrize("name", BASE)
def test_every_panel_fits_120_columns_and_the_verdict_is_one_word(name):
    result = runner.invoke(app, ["plan", name], env=WIDE)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) == 120  # tables use the width, and no more
    assert lines[-1].startswith(("FITS: peak", "TIGHT: peak"))
    assert "FITS: fits" not in result.stdout and "fits: peak" not in result.stdout


@pytest.mark.parametrize("args", [["recipes"], ["plan", "30b-fp8", "--compare"]])
def test_the_other_plan_tables_fit_120_columns(args):
    result = runner.invoke(app, args, env=WIDE)
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.stdout.splitlines()) <= 120


def test_a_plan_that_does_not_fit_says_so_once_with_a_pasteable_fix():
    result = runner.invoke(app, ["plan", "64b-fp8", "--set", "activation_checkpointing.mode=none"], env=WIDE)
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert sum(line.startswith("DOES NOT FIT") for line in lines) == 1
    assert lines[-2].startswith("DOES NOT FIT: peak") and lines[-1].startswith("fix: --set ")
    assert max(len(line) for line in lines) <= 120


def test_a_matching_recipe_says_so_and_a_changed_one_lists_each_knob_beside_the_recipe():
    same = runner.invoke(app, ["plan", "8b-fp8"], env=WIDE).stdout
    assert "the recipe already matches the recommendation" in same and "matches" in same
    changed = runner.invoke(app, ["plan", "64b-fp8", "--set", "parallelism.shard_group=16"], env=WIDE).stdout
    row = next(
        line for line in changed.splitlines() if "parallelism.shard_group" in line and "change" in line
    )
    assert "16" in row and "8" in row
    assert "--set parallelism.shard_group=8" in changed


def test_plot_is_readable_by_others_and_draws_totals_tokens_and_the_range(tmp_path):
    out = tmp_path / "mem.png"
    old = os.umask(0o022)
    try:
        result = runner.invoke(app, ["plan", "30b-fp8", "--plot", str(out)])
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert stat.S_IMODE(out.stat().st_mode) == 0o644  # as a plain open() would make it, not mkstemp's 0600
    data = plot_data(resolve("30b-fp8").recipe)
    assert data["recipe_micro_batch"] in data["sizes"]
    assert data["totals"] == pytest.approx([sum(parts.values()) for parts in data["memory"]])
    assert any(total > data["usable"] for total in data["totals"])  # an over-limit bar, marked in the plot
    for tps, (low, high) in zip(data["tokens_per_sec"], data["tokens_per_sec_range"], strict=True):
        assert low < tps <= high
