"""The recipe schema: base recipes validate, unknown keys and bad values are rejected, the schema
command describes it, and the hyperparameter encoding round-trips."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from trainstack.cli.main import app
from trainstack.recipes.loader import base_recipe_names, resolve
from trainstack.recipes.schema import ModelShape, Recipe, from_hyperparameters, to_hyperparameters

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


def test_every_required_base_recipe_exists():
    assert set(BASE) <= set(base_recipe_names())


@pytest.mark.parametrize("name", BASE)
def test_base_recipe_validates_and_round_trips_through_hyperparameters(name):
    recipe = resolve(name).recipe
    assert recipe.name == name
    encoded = to_hyperparameters(recipe)
    assert all(isinstance(v, str) for v in encoded.values())
    assert from_hyperparameters(encoded) == recipe


@pytest.mark.parametrize(
    "name, params_b",
    [
        ("1b-bf16", 1.24),
        ("3b-bf16", 3.21),
        ("7b-bf16", 6.74),
        ("8b-fp8", 8.03),
        ("14b-fp8", 14.77),
        ("30b-fp8", 32.76),
        ("64b-fp8", 63.71),
        ("8b-fp8-128k", 8.03),
    ],
)
def test_base_recipe_shapes_have_the_published_parameter_counts(name, params_b):
    # Published sizes (shared README section 9): 1.24B, 3.21B, 6.7B, 8.03B, 14.8B, 32.8B; 64B derived.
    assert resolve(name).recipe.model.total_params / 1e9 == pytest.approx(params_b, abs=0.01)


def test_multi_node_recipes_are_the_large_ones():
    for name in BASE:
        recipe = resolve(name).recipe
        assert (recipe.compute.instance_count > 1) == (recipe.model.total_params > 20e9), name


def test_model_shape_counts_parameters_like_llama():
    # Llama 3.1 8B: 8,030,261,248 parameters (its published config).
    shape = ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256)
    assert shape.total_params == 8_030_261_248


def test_unknown_keys_are_rejected_in_every_section():
    data = resolve("8b-fp8").recipe.model_dump()
    data["training"]["micro_batchh"] = 2
    with pytest.raises(ValidationError, match="micro_batchh"):
        Recipe.model_validate(data)


def test_fp8_needs_a_scaling_recipe_and_mxfp8_needs_blackwell():
    data = resolve("8b-fp8").recipe.model_dump()
    data["compute"]["instance_type"] = "ml.p5.48xlarge"
    with pytest.raises(ValidationError, match="mxfp8 needs Blackwell"):
        Recipe.model_validate(data)
    data["precision"] = {"dtype": "fp8"}
    with pytest.raises(ValidationError, match="fp8_recipe"):
        Recipe.model_validate(data)


def test_fp8_with_the_op_level_policy_is_refused_by_the_schema_and_bf16_keeps_it():
    # training_image/trainer/models/activation_checkpointing.py: a per-op policy cannot see inside Transformer
    # Engine's fused FP8 modules, so the trainer could only fail at start; the schema says so first.
    data = resolve("8b-fp8").recipe.model_dump()
    data["activation_checkpointing"] = {"mode": "selective", "policy": "op"}
    with pytest.raises(ValidationError) as refused:
        Recipe.model_validate(data)
    (error,) = refused.value.errors()
    message = error["msg"].removeprefix("Value error, ")
    assert message.startswith("activation_checkpointing.policy: op cannot run with precision.dtype fp8")
    assert "Transformer Engine" in message and "use mode full, or mode selective with policy block" in message
    assert "\n" not in message
    for allowed in ({"mode": "full"}, {"mode": "selective", "every": 2}, {"mode": "none"}):
        data["activation_checkpointing"] = allowed
        Recipe.model_validate(data)
    data["precision"] = {"dtype": "bf16"}
    data["activation_checkpointing"] = {"mode": "selective", "policy": "op"}
    assert Recipe.model_validate(data).activation_checkpointing.policy == "op"


def test_schema_command_prints_the_recipe_json_schema():
    result = CliRunner().invoke(app, ["schema"])
    assert result.exit_code == 0
    schema = json.loads(result.stdout)
    assert schema["title"] == "trainstack recipe"
    assert {"model", "training", "precision", "activation_checkpointing", "parallelism", "compute"} <= set(
        schema["required"]
    )
    model = schema["$defs"]["ModelShape"]
    assert model["additionalProperties"] is False  # unknown keys flagged in the editor too
    assert model["properties"]["layers"]["exclusiveMinimum"] == 0


def test_team_file_schema_has_the_same_keys_and_requires_none():
    result = CliRunner().invoke(app, ["schema", "--team-file"])
    assert result.exit_code == 0
    schema = json.loads(result.stdout)
    assert "required" not in json.dumps(schema).replace('"required field', "")
    assert schema["$defs"]["Training"]["additionalProperties"] is False
