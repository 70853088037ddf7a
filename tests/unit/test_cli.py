"""The recipe commands end to end through the typer app: exit codes, JSON, the plot, the gate."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from trainstack.cli.main import COMMAND_MODULES, app

pytestmark = pytest.mark.fast

runner = CliRunner()
ONE_NODE_64B_NO_CKPT = [
    "--set",
    "compute.instance_count=1",
    "--set",
    "parallelism.shard_group=8",
    "--set",
    "activation_checkpointing.mode=none",
]


def test_every_command_module_registers():
    names = {c.name for c in app.registered_commands}
    for expected in ("recipes", "plan", "show", "validate", "schema"):
        assert expected in names
    assert len(COMMAND_MODULES) == len(set(COMMAND_MODULES))


def test_plan_prints_a_table_and_exits_0_when_it_fits():
    result = runner.invoke(app, ["plan", "30b-fp8"], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    for text in (
        "optimizer states (AdamW FP32)",
        "activations (saved)",
        "logits and loss",
        "tokens/s per GPU",
        "MFU",
        "USD/h",
        "FITS",
    ):
        assert text in result.stdout


def test_plan_json_has_the_documented_keys():
    result = runner.invoke(app, ["plan", "8b-fp8", "--json"])
    assert result.exit_code == 0
    d = json.loads(result.stdout)
    assert d["fits"] is True
    assert d["memory"]["peak_gib"] == pytest.approx(sum(d["memory"]["breakdown"].values()), abs=0.01)
    assert d["memory"]["usable_gib"] == 179.0
    assert d["throughput"]["tokens_per_sec_per_gpu"] > 0 and 0 < d["throughput"]["mfu"] < 1
    assert d["cost"]["usd_per_hour"] == pytest.approx(114.0)
    assert d["cost"]["total_usd"] > 0


def test_64b_on_one_node_without_checkpointing_exits_1_naming_the_component_and_the_fix():
    result = runner.invoke(app, ["plan", "64b-fp8", *ONE_NODE_64B_NO_CKPT], env={"COLUMNS": "300"})
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    verdict = next(line for line in lines if line.startswith("DOES NOT FIT"))
    assert "activations (saved)" in verdict and "breaks it" in verdict
    assert lines[-1] == "fix: --set activation_checkpointing.mode=full"
    as_json = runner.invoke(app, ["plan", "64b-fp8", "--json", *ONE_NODE_64B_NO_CKPT])
    assert as_json.exit_code == 1 and json.loads(as_json.stdout)["fits"] is False


def test_plot_writes_a_png_of_memory_across_micro_batches(tmp_path):
    out = tmp_path / "mem.png"
    result = runner.invoke(app, ["plan", "8b-fp8", "--json", "--plot", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["mem.png"]  # no temporary left behind


def test_plot_to_a_missing_directory_is_one_line_exit_2(tmp_path):
    result = runner.invoke(app, ["plan", "8b-fp8", "--plot", str(tmp_path / "nope" / "m.png")])
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "--plot" in result.stderr


def test_recipes_lists_every_base_recipe_and_team_variant_with_a_verdict():
    result = runner.invoke(app, ["recipes"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for name in ("1b-bf16", "3b-bf16", "7b-bf16", "8b-fp8", "14b-fp8", "30b-fp8", "64b-fp8", "8b-fp8-128k"):
        assert name in result.stdout
    assert "nlp" in result.stdout and "DOES NOT FIT" not in result.stdout


def test_validate_accepts_the_repository_recipes():
    result = runner.invoke(app, ["validate"])
    assert result.exit_code == 0, result.output
    assert "recipes/teams/nlp" not in result.stderr
    assert "8b-fp8 --team nlp" in result.stdout


def test_validate_paths_checks_team_files_against_their_base(recipes_dir):
    (recipes_dir / "teams" / "nlp" / "small.yaml").write_text("training: {steps: 5}\n")
    result = runner.invoke(
        app, ["validate", str(recipes_dir / "teams" / "nlp" / "small.yaml"), str(recipes_dir / "small.yaml")]
    )
    assert result.exit_code == 0, result.output
    assert "small --team nlp" in result.stdout


def test_validate_rejects_a_base_recipe_whose_name_differs_from_its_file(recipes_dir, small_text):
    (recipes_dir / "other.yaml").write_text("name: something-else\n" + small_text)
    result = runner.invoke(app, ["validate", str(recipes_dir / "other.yaml")])
    assert result.exit_code == 2
    assert "other.yaml: name: 'something-else' does not match the file name 'other'" in result.stderr


def test_validate_refuses_a_team_override_that_does_not_fit(recipes_dir):
    (recipes_dir / "teams" / "nlp" / "small.yaml").write_text(
        "model: {layers: 200, hidden: 16384, heads: 128, kv_heads: 8, ffn: 65536}\n"  # ~750B parameters
    )
    result = runner.invoke(app, ["validate", str(recipes_dir / "teams" / "nlp" / "small.yaml")])
    assert result.exit_code == 2
    assert "teams/nlp/small.yaml: does not fit: peak" in result.stderr
    assert "fix:" in result.stderr


def test_help_lists_commands_and_exit_codes():
    result = runner.invoke(app, ["plan", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "0 fits, 1 does not fit, 2 invalid input" in result.stdout
