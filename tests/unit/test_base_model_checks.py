"""A stranger's own model (issue 40 item 4): `recipe from-hf` writes every field the base's config.json
decides, so the recipe it is pasted into inherits none from the recipe it extends; `plan`, `validate` and
`from-hf` refuse, in one line, a base that differs from the recipe or cannot be where it says.

The configs are transformers' own (LlamaConfig / Qwen2Config / MistralConfig(...).to_dict(), no hub)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainstack.aws.base_model import base_problem, config_key
from trainstack.cli.main import app
from trainstack.recipes.hf_config import shape_from_hf_config
from trainstack.recipes.loader import resolve
from trainstack.recipes.schema import ModelShape

pytestmark = pytest.mark.fast
transformers = pytest.importorskip("transformers")

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
SMALL = dict(
    num_hidden_layers=2, hidden_size=64, intermediate_size=176, vocab_size=256, max_position_embeddings=128
)


def configs() -> dict[str, dict]:
    """Base models of each family, in the shapes transformers saves them (untied unless said)."""
    return {
        # Llama-3-8B's published settings: untied, 8 KV heads, rope_theta 500000, eps 1e-5
        "llama3-8b": transformers.LlamaConfig(
            num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
            intermediate_size=14336, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
        ).to_dict(),
        "llama-tied-small": transformers.LlamaConfig(
            **SMALL, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True
        ).to_dict(),
        "qwen2-small": transformers.Qwen2Config(
            **SMALL, num_attention_heads=4, num_key_value_heads=2
        ).to_dict(),
        # Mistral-7B-v0.3's shape (no sliding window): untied, head_dim written out
        "mistral-7b": transformers.MistralConfig(
            num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
            intermediate_size=14336, vocab_size=32768, rope_theta=1000000.0, rms_norm_eps=1e-5,
            sliding_window=None,
        ).to_dict(),
        "llama31-rope-scaling-small": transformers.LlamaConfig(
            **SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64},
        ).to_dict(),
    }  # fmt: skip


def from_hf(tmp_path, config: dict, *args: str):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return CliRunner().invoke(app, ["recipe", "from-hf", str(tmp_path / "config.json"), *args])


@pytest.mark.parametrize("base", sorted(configs()))
# tied 1b-bf16; 30b-fp8 with Q/K/V biases, eps, theta and its own init_from; its 128K variant; 7b-bf16
@pytest.mark.parametrize("extends", ["1b-bf16", "30b-fp8", "30b-fp8-128k", "7b-bf16"])
def test_from_hf_block_pasted_over_any_recipe_is_the_base_models_shape(tmp_path, base, extends):
    config = configs()[base]
    result = from_hf(tmp_path, config)
    assert result.exit_code == 0, result.output
    block = [line for line in result.stdout.splitlines() if not line.startswith("#")]
    recipe = tmp_path / "cpt.yaml"
    recipe.write_text(f"name: cpt\nextends: {extends}\n" + "\n".join(block) + "\n")
    model = resolve(str(recipe)).recipe.model
    assert model == ModelShape(**shape_from_hf_config(config))  # init_from None: not the extended one's
    assert base_problem(model, config, "config.json") is None


def test_untied_llama3_over_tied_1b_bf16_trains_untied(tmp_path):
    """The issue's case: the tutorial's recipe extends 1b-bf16 (tied); Llama-3-8B is not."""
    assert resolve("1b-bf16").recipe.model.tied_embeddings is True
    result = from_hf(tmp_path, configs()["llama3-8b"])
    assert "tied_embeddings: false" in result.stdout and "rope_scaling: null" in result.stdout


def test_a_base_that_differs_from_the_recipe_is_one_line_naming_the_field_and_both_values():
    config = configs()["llama3-8b"]
    recipe = ModelShape(**{**shape_from_hf_config(config), "tied_embeddings": True})
    assert base_problem(recipe, config, "s3://b/llama/config.json") == (
        "model.init_from: s3://b/llama/config.json: tie_word_embeddings is false, the recipe's "
        "model.tied_embeddings is true"
    )
    moe = {**config, "num_local_experts": 8}
    assert "a mixture of experts" in base_problem(recipe, moe, "config.json")


def test_config_json_sits_at_the_top_of_the_prefix_with_or_without_its_slash():
    assert config_key("s3://b/models/llama/") == ("b", "models/llama/config.json")
    assert config_key("s3://b/models/llama") == ("b", "models/llama/config.json")
    assert config_key("s3://b") == ("b", "config.json")


@pytest.mark.parametrize(
    "init_from, message",
    [
        ("ftp://example.com/llama/", "--init-from 'ftp://example.com/llama/': expected an s3://"),
        ("s3://Bad_Bucket/x/", "--init-from 's3://Bad_Bucket/x/': expected an s3://"),
        ("no/such/folder", "--init-from no/such/folder: no such directory"),
    ],
)
def test_from_hf_refuses_an_init_from_that_validate_would_refuse(tmp_path, init_from, message):
    result = from_hf(tmp_path, configs()["llama-tied-small"], "--init-from", init_from)
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"error: {message}" + result.output.split(message, 1)[1].strip()
    ]
    assert "model:" not in result.stdout


def _recipe_with_base(tmp_path, folder: str, **changes) -> str:
    config = configs()["llama-tied-small"]
    shape = {**shape_from_hf_config(config), **changes}
    block = ", ".join(f"{k}: {json.dumps(v)}" for k, v in shape.items())
    # `validate FILE` resolves `extends` beside the file: the recipes folder it would live in
    shutil.copy(RECIPES / "1b-bf16.yaml", tmp_path)
    path = tmp_path / "cpt.yaml"
    path.write_text(
        f"name: cpt\nextends: 1b-bf16\nmodel: {{{block}, init_from: {folder}}}\n"
        "training: {seq_len: 64, micro_batch: 1, global_batch: 8, steps: 10}\n"
    )
    return str(path)


def test_validate_refuses_a_local_init_from_that_does_not_exist(tmp_path):
    recipe = _recipe_with_base(tmp_path, str(tmp_path / "missing"))
    result = CliRunner().invoke(app, ["validate", recipe, "-q"])
    assert result.exit_code == 2
    assert f"model.init_from: {tmp_path / 'missing'}: no such directory" in result.output


def test_validate_and_plan_refuse_a_local_base_whose_config_differs(tmp_path):
    folder = tmp_path / "base"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(configs()["llama-tied-small"]))
    good = _recipe_with_base(tmp_path, str(folder))
    assert CliRunner().invoke(app, ["validate", good, "-q"]).exit_code == 0
    bad = _recipe_with_base(tmp_path, str(folder), tied_embeddings=False)
    line = (
        f"model.init_from: {folder / 'config.json'}: tie_word_embeddings is true, the recipe's "
        "model.tied_embeddings is false"
    )
    validated = CliRunner().invoke(app, ["validate", bad, "-q"])
    assert validated.exit_code == 2 and line in validated.output
    planned = CliRunner().invoke(app, ["plan", bad, "-q"])
    assert planned.exit_code == 2 and line in planned.output.splitlines()[-1]
