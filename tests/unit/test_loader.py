"""Layering (base with extends, team defaults, team per-recipe file, --set) and where each value came from."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainstack.cli.main import app
from trainstack.errors import RecipeError
from trainstack.recipes.loader import parse_set, resolve

pytestmark = pytest.mark.fast


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


# --- Errors that an override caused name the override, as typed ------------------------------------


def test_a_cross_field_error_caused_by_set_names_the_override_not_the_file(recipes_dir):
    # small: global_batch 8 on 8 GPUs; micro_batch 3 makes global_batch the field that fails
    with pytest.raises(RecipeError) as caught:
        resolve("small", overrides=["training.steps=5", "training.micro_batch=3"], recipes_dir=recipes_dir)
    assert str(caught.value).startswith(
        "--set training.micro_batch=3: training.global_batch: 8 is not a multiple of micro_batch"
    )


def test_the_cdk_app_names_its_overrides_as_typed_with_c_set(recipes_dir):
    with pytest.raises(RecipeError, match=r"^-c set=training\.micro_batch=0: training\.micro_batch: "):
        resolve(
            "small", overrides=["training.micro_batch=0"], recipes_dir=recipes_dir, overrides_source="-c set"
        )


def test_an_error_only_a_combination_of_overrides_causes_names_them_all(recipes_dir, small_text):
    (recipes_dir / "pair.yaml").write_text(
        "name: pair\n" + small_text.replace("global_batch: 8", "global_batch: 16")
    )
    overrides = ["training.micro_batch=2", "compute.instance_count=2"]
    for alone in overrides:  # each is valid on its own: 16 = 2 x 8 ranks, and 16 = 1 x 16 ranks
        resolve("pair", overrides=[alone], recipes_dir=recipes_dir)
    with pytest.raises(RecipeError) as caught:
        resolve("pair", overrides=overrides, recipes_dir=recipes_dir)
    assert str(caught.value).startswith(
        "--set training.micro_batch=2, --set compute.instance_count=2: training.global_batch: 16 is not"
    )


def test_an_invalid_file_is_still_blamed_when_overrides_are_given(recipes_dir, small_text):
    (recipes_dir / "broken.yaml").write_text(
        "name: broken\n" + small_text.replace("kv_heads: 2", "kv_heads: 3")
    )
    with pytest.raises(RecipeError, match=r"broken\.yaml: model\.kv_heads: "):
        resolve("broken", overrides=["training.steps=5"], recipes_dir=recipes_dir)


@pytest.mark.parametrize("key", ["name", "extends", "name.x"])
def test_name_and_extends_cannot_be_set(recipes_dir, key):
    with pytest.raises(RecipeError, match=rf"^--set {key}=other: {key.split('.')[0]}: cannot be overridden"):
        resolve("small", overrides=[f"{key}=other"], recipes_dir=recipes_dir)


@pytest.mark.parametrize(
    ("key", "meant"),
    [
        ("training.microbatch", "training.micro_batch"),
        ("trainig.steps", "training.steps"),
        ("model.micro_batch", "training.micro_batch"),  # a right leaf in the wrong section
        ("compute.instance", "compute.instance_type"),
    ],
)
def test_a_misspelt_set_key_gets_did_you_mean(recipes_dir, key, meant):
    with pytest.raises(RecipeError) as caught:
        resolve("small", overrides=[f"{key}=3"], recipes_dir=recipes_dir)
    assert str(caught.value) == f"--set {key}=3: {key}: unknown key (did you mean {meant}?)"


def test_an_unknown_key_with_nothing_close_says_only_unknown_key(recipes_dir):
    with pytest.raises(RecipeError) as caught:
        resolve("small", overrides=["zzzz=3"], recipes_dir=recipes_dir)
    assert str(caught.value) == "--set zzzz=3: zzzz: unknown key"


def test_an_account_id_given_as_a_bare_number_is_accepted_by_set(recipes_dir):
    r = resolve(
        "small", overrides=["deploy.account=012345678901", "tags.extra.code=42"], recipes_dir=recipes_dir
    )
    assert r.recipe.deploy.account == "012345678901"  # as typed: YAML would read a leading-zero octal
    assert r.recipe.tags.extra == {"code": "42"}
    assert parse_set(["deploy.account=123456789012"]) == {"deploy": {"account": "123456789012"}}


def test_an_unquoted_account_in_a_file_says_to_quote_it(recipes_dir):
    (recipes_dir / "teams" / "nlp" / "defaults.yaml").write_text("deploy: {account: 123456789012}\n")
    with pytest.raises(RecipeError) as caught:
        resolve("small", team="nlp", recipes_dir=recipes_dir)
    assert str(caught.value).endswith(
        "defaults.yaml: deploy.account: expected text, got the number 123456789012: "
        "quote it ('123456789012') so YAML keeps it text"
    )


def test_every_pattern_rule_in_the_schema_is_said_in_words(recipes_dir):
    """Each text field given a value no pattern accepts: the error states the rule, never a regex."""
    from trainstack.recipes import keys as recipe_keys

    checked = []
    for key in recipe_keys.leaf_fields():
        if not recipe_keys.is_text(key) or key in recipe_keys.NOT_SETTABLE:
            continue
        try:
            resolve("small", overrides=[f"{key}=@ not valid @"], recipes_dir=recipes_dir)
        except RecipeError as error:
            message = error.message
            assert "pattern" not in message and "^" not in message and "$" not in message, (key, message)
            checked.append(key)
    assert set(recipe_keys.PATTERN_WORDS) <= set(checked)


def test_a_team_file_named_after_no_base_recipe_says_did_you_mean(recipes_dir):
    (recipes_dir / "teams" / "nlp" / "smal.yaml").write_text("training: {steps: 5}\n")
    with pytest.raises(RecipeError) as caught:
        resolve("smal", team="nlp", recipes_dir=recipes_dir)
    assert str(caught.value).endswith(
        "teams/nlp/smal.yaml: matches no base recipe (did you mean small.yaml?); a team file overrides the "
        "base recipe of the same name, or is a team-only variant with `extends: <base recipe>`"
    )
