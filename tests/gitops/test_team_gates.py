"""A team's files cannot weaken the security gates: encryption, retention, nag findings."""

from __future__ import annotations

import pytest

from trainstack.errors import RecipeError, TrainstackError
from trainstack.recipes.loader import GATES_MESSAGE, resolve

pytestmark = pytest.mark.fast


@pytest.fixture
def recipes(tmp_path, monkeypatch, h):
    monkeypatch.chdir(tmp_path)  # loader errors name files relative to the working directory
    return h.write_tree(
        tmp_path,
        {
            "recipes/small.yaml": h.base_recipe("small"),
            "recipes/teams/nlp/defaults.yaml": "tags: {cost_center: nlp-research}\n",
        },
    )


@pytest.mark.parametrize(
    ("file", "text", "key"),
    [
        ("defaults.yaml", "security: {encryption: false}\n", "security"),
        ("defaults.yaml", "storage: {removal_policy: destroy}\n", "storage"),
        ("small.yaml", "checkpointing: {retain: false}\n", "checkpointing.retain"),
        ("small.yaml", "compute: {Encryption: none}\n", "compute.Encryption"),
        ("defaults.yaml", "monitoring: {retention_days: 1}\n", "monitoring.retention_days"),
        ("small.yaml", "nag_suppressions: [{id: AwsSolutions-S1, reason: x}]\n", "nag_suppressions"),
        ("defaults.yaml", "data: {kms-key: alias/mine}\n", "data.kms-key"),
        ("small.yaml", "compute: {termination_protection: false}\n", "compute.termination_protection"),
    ],
)
def test_team_file_touching_a_gate_is_refused_naming_file_and_key(recipes, file, text, key):
    (recipes / "teams" / "nlp" / file).write_text(text)
    with pytest.raises(RecipeError) as info:
        resolve("small", team="nlp", recipes_dir=recipes)
    err = info.value
    assert err.source == f"recipes/teams/nlp/{file}"
    assert err.field == key
    assert str(err) == f"recipes/teams/nlp/{file}: {key}: {GATES_MESSAGE}"
    assert "\n" not in str(err)
    assert isinstance(err, TrainstackError) and err.exit_code == 2


def test_team_only_variant_touching_a_gate_is_refused(recipes):
    (recipes / "teams" / "nlp" / "small-long.yaml").write_text(
        "extends: small\nname: small-long\nsecurity: {enforce_ssl: false}\n"
    )
    with pytest.raises(RecipeError, match=r"^recipes/teams/nlp/small-long.yaml: security: a team file"):
        resolve("small-long", team="nlp", recipes_dir=recipes)


def test_ordinary_team_overrides_and_free_form_tags_still_resolve(recipes):
    (recipes / "teams" / "nlp" / "small.yaml").write_text(
        "training: {micro_batch: 2}\ntags: {extra: {retention: long, encryption: default}}\n"
    )
    resolved = resolve("small", team="nlp", recipes_dir=recipes)
    assert resolved.recipe.training.micro_batch == 2
    assert resolved.recipe.tags.extra == {"retention": "long", "encryption": "default"}
    assert resolved.source_of("training.micro_batch") == "recipes/teams/nlp/small.yaml"


def test_base_recipes_are_not_team_files(recipes, h):
    # The gate applies to team-owned files; a base recipe with an unknown section still fails the schema.
    (recipes / "small.yaml").write_text(h.base_recipe("small") + "security: {encryption: false}\n")
    with pytest.raises(RecipeError, match=r"^recipes/small.yaml: security: unknown key$"):
        resolve("small", recipes_dir=recipes)
