"""Layering (base with extends, team defaults, team per-recipe file, --set) and where each value came from."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainstack.cli import app
from trainstack.errors import RecipeError
from trainstack.loader import parse_set, resolve


@pytest.fixture
def layered(recipes_dir: Path) -> Path:
    (recipes_dir / "small-long.yaml").write_text(
        "name: small-long\nextends: small\n"
        "training: {seq_len: 64, micro_batch: 1, global_batch: 8, steps: 20}\n"
    )
    team = recipes_dir / "teams" / "nlp"
    (team / "defaults.yaml").write_text(
        "tags: {cost_center: nlp-42}\nmonitoring: {notification_email: a@b.co}\ntraining: {steps: 30}\n"
    )
    (team / "small-long.yaml").write_text("training: {steps: 40, lr: 0.0001}\n")
    (team / "small-wide.yaml").write_text("extends: small\nname: small-wide\nmodel: {ffn: 256}\n")
    return recipes_dir


def test_layers_apply_in_order_base_extends_team_defaults_team_recipe_set(layered):
    r = resolve("small-long", team="nlp", overrides=["training.steps=50"], recipes_dir=layered)
    assert r.recipe.training.seq_len == 64  # the extending recipe beats its base
    assert r.recipe.model.layers == 2  # inherited from the base
    assert r.recipe.tags.cost_center == "nlp-42"  # team defaults
    assert r.recipe.training.lr == 0.0001  # team per-recipe file
    assert r.recipe.training.steps == 50  # --set last
    assert r.recipe.tags.team == "nlp"


def test_every_value_remembers_the_file_that_set_it(layered):
    r = resolve("small-long", team="nlp", overrides=["training.seed=7"], recipes_dir=layered)
    src = {k: Path(v).name if "/" in v or v.endswith(".yaml") else v for k, v in r.sources.items()}
    assert src["model.layers"] == "small.yaml"
    assert src["training.seq_len"] == "small-long.yaml"
    assert src["tags.cost_center"] == "defaults.yaml"
    assert r.sources["training.lr"].endswith("teams/nlp/small-long.yaml")
    assert src["training.seed"] == "--set"
    assert r.recipe.training.seed == 7
    assert r.source_of("training.weight_decay") == "default"
    assert [Path(f).name for f in r.files] == [
        "small.yaml",
        "small-long.yaml",
        "defaults.yaml",
        "small-long.yaml",
    ]


def test_team_only_variant_resolves_only_with_its_team(layered):
    assert resolve("small-wide", team="nlp", recipes_dir=layered).recipe.model.ffn == 256
    with pytest.raises(RecipeError, match="unknown recipe 'small-wide'"):
        resolve("small-wide", recipes_dir=layered)


def test_set_values_are_parsed_as_yaml_scalars():
    assert parse_set(["a.b=4", "a.c=true", "d=fp8", "e.f=1.5e-4"]) == {
        "a": {"b": 4, "c": True},
        "d": "fp8",
        "e": {"f": 1.5e-4},
    }
    with pytest.raises(RecipeError, match="not key.path=value"):
        parse_set(["novalue"])


def test_show_prints_resolved_values_with_their_sources(layered):
    result = CliRunner().invoke(
        app, ["show", "small-long", "--team", "nlp", "--json", "--recipes-dir", str(layered)]
    )
    assert result.exit_code == 0, result.output
    import json

    shown = json.loads(result.stdout)
    assert shown["recipe"]["training"]["steps"] == 40
    assert shown["sources"]["training.steps"].endswith("teams/nlp/small-long.yaml")
    assert shown["sources"]["tags.team"] == "--team nlp"
    assert shown["sources"]["training.seed"] == "default"


def test_show_table_names_the_team_file_for_the_repository_team():
    result = CliRunner().invoke(app, ["show", "8b-fp8", "--team", "nlp"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    line = next(row for row in result.stdout.splitlines() if "monitoring.notification_email" in row)
    assert "teams/nlp/defaults.yaml" in line
