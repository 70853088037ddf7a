"""training.objective sft in the recipe schema: what it needs of the other sections, each refusal one
line naming the field, and pretraining recipes unchanged (objective pretrain by default)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from trainstack.cli.main import app
from trainstack.errors import RecipeError
from trainstack.recipes.changes import changes
from trainstack.recipes.loader import resolve
from trainstack.recipes.schema import from_hyperparameters, to_hyperparameters

pytestmark = pytest.mark.fast

SFT = (
    "training.objective=sft",
    "model.init_from=s3://base-models/llama-3.2-1b/",
    "data.train_s3_uri=s3://chat-data/support-v1/",
)


def _refusal(*overrides: str) -> str:
    with pytest.raises(RecipeError) as caught:
        resolve("1b-bf16", overrides=overrides)
    return str(caught.value)


def test_a_recipe_without_objective_pretrains():
    assert resolve("1b-bf16").recipe.training.objective == "pretrain"


def test_an_sft_recipe_with_base_model_and_chat_data_validates_and_round_trips():
    recipe = resolve("1b-bf16", overrides=SFT).recipe
    assert recipe.training.objective == "sft"
    assert from_hyperparameters(to_hyperparameters(recipe)) == recipe


def test_sft_without_init_from_is_refused_naming_model_init_from():
    message = _refusal("training.objective=sft", "data.train_s3_uri=s3://chat-data/support-v1/")
    assert "model.init_from: required with training.objective sft" in message
    assert "\n" not in message


def test_sft_with_context_parallelism_is_refused_until_the_split_respects_examples():
    message = _refusal(*SFT, "parallelism.cp=2", "parallelism.shard_group=4")
    assert "parallelism.cp: 2: context parallelism is not supported with training.objective sft" in message
    assert "\n" not in message


def test_sft_without_a_dataset_is_refused_naming_train_s3_uri():
    message = _refusal(*SFT[:2])
    assert "data.train_s3_uri: required with training.objective sft" in message


def test_sft_on_a_blend_is_refused_naming_sources():
    with pytest.raises(RecipeError) as caught:
        resolve(
            "1b-bf16",
            overrides=(*SFT[:2], "data.sources=[{uri: 's3://chat-data/a/', weight: 1}]"),
        )
    assert "data.sources: a blend is not supported with training.objective sft" in str(caught.value)


def test_an_unknown_objective_names_the_choices():
    message = _refusal("training.objective=finetune")
    assert "training.objective: Input should be 'pretrain' or 'sft'" in message


def test_changing_the_objective_mid_run_is_unsafe():
    before = resolve("1b-bf16", overrides=SFT).recipe
    after = resolve("1b-bf16", overrides=(*SFT[1:],)).recipe
    assert [c.key for c in changes(before, after) if not c.safe] == ["training.objective"]


def test_plan_refuses_sft_without_a_base_in_one_line_exit_2():
    result = CliRunner().invoke(app, ["plan", "1b-bf16", "--set", "training.objective=sft"])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "model.init_from: required" in lines[0]
