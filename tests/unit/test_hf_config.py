"""trainstack.recipes.hf_config and `trainstack recipe from-hf`: published config.json files in, the
recipe's model block out; what the trainer cannot hold refused in one line (exit 2)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from trainstack.cli.main import app
from trainstack.recipes.hf_config import (
    HfConfigError,
    hf_config_from_shape,
    recipe_model_block,
    shape_from_hf_config,
    shape_mismatch,
)
from trainstack.recipes.loader import resolve
from trainstack.recipes.schema import ModelShape

pytestmark = pytest.mark.fast

# Qwen/Qwen2.5-32B's published config.json (the base model, not the instruct one: eps 1e-5, eos = bos).
QWEN25_32B = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "initializer_range": 0.02,
    "intermediate_size": 27648,
    "max_position_embeddings": 131072,
    "max_window_layers": 64,
    "model_type": "qwen2",
    "num_attention_heads": 40,
    "num_hidden_layers": 64,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 152064,
}
# meta-llama/Llama-3.1-8B's published config.json (the fields that matter here).
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "vocab_size": 128256,
}


def test_qwen25_32b_is_the_30b_recipes_shape_with_its_published_parameter_count():
    shape = ModelShape(**shape_from_hf_config(QWEN25_32B))
    recipe = resolve("30b-fp8").recipe.model
    assert shape_mismatch(recipe, QWEN25_32B, "config.json") is None
    # 31.2B in the blocks (Q/K/V biases included) + 2 x 152064 x 5120 embedding and head + the final norm.
    assert shape.total_params == 32_763_876_352
    assert shape.attention_bias and shape.norm_eps == 1e-5 and shape.head_dim == 128


def test_llama31_rope_scaling_in_both_spellings():
    legacy = shape_from_hf_config(LLAMA31_8B)
    assert legacy["rope_scaling"]["rope_type"] == "llama3" and legacy["rope_theta"] == 500000.0
    # transformers 5 writes the RoPE settings as one object, rope_theta inside it.
    v5 = {k: v for k, v in LLAMA31_8B.items() if k not in ("rope_scaling", "rope_theta")}
    v5["rope_parameters"] = {**LLAMA31_8B["rope_scaling"], "rope_theta": 500000.0}
    assert shape_from_hf_config(v5) == legacy
    block = recipe_model_block(legacy)
    assert block.startswith(
        "model: {layers: 32, hidden: 4096, heads: 32, kv_heads: 8, head_dim: 128, ffn: 14336, vocab: 128"
    )
    # every field written out: a recipe that `extends` another inherits none of the base model's fields
    assert "attention_bias: false" in block and "head_dim: 128" in block and "init_from: null" in block


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "mixtral", "num_local_experts": 8}, "num_local_experts: a mixture of experts"),
        ({"model_type": "qwen3"}, "model_type: 'qwen3' is not supported"),
        ({"model_type": "mistral", "sliding_window": 4096}, "sliding_window: 4096 (sliding-window attention"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type: 'yarn' is not"),
        ({"attention_bias": True}, "attention_bias: true puts a bias on o_proj"),
        ({"hidden_act": "gelu"}, "hidden_act: 'gelu'"),
        ({"mlp_bias": True}, "mlp_bias: true"),
    ],
)
def test_what_the_trainer_cannot_hold_is_refused_in_one_line(change, message):
    pattern = "^config.json: " + message.replace("(", r"\(").replace(".", r"\.")
    with pytest.raises(HfConfigError, match=pattern):
        shape_from_hf_config({**LLAMA31_8B, **change})


def test_mistral_without_a_sliding_window_and_qwen2_with_one_unused_are_accepted():
    mistral = {**LLAMA31_8B, "model_type": "mistral", "sliding_window": None, "rope_scaling": None}
    assert shape_from_hf_config(mistral)["attention_bias"] is False
    assert shape_from_hf_config(QWEN25_32B)["attention_bias"] is True  # sliding_window set, not used


def test_a_mismatch_names_the_first_field_both_ways():
    recipe = resolve("8b-fp8").recipe.model
    assert shape_mismatch(recipe, {**LLAMA31_8B, "rope_scaling": None}, "base/config.json") is None
    changed = {**LLAMA31_8B, "rms_norm_eps": 1e-6}
    assert shape_mismatch(recipe, changed, "base/config.json") == (
        "base/config.json: rms_norm_eps is 1e-06, the recipe's model.norm_eps is 1e-05"
    )


def test_exported_config_keeps_the_base_and_writes_the_shape():
    shape = ModelShape(**shape_from_hf_config(QWEN25_32B))
    config = hf_config_from_shape(shape, base=QWEN25_32B, max_position_embeddings=8192)
    assert (config["architectures"], config["model_type"]) == (["Qwen2ForCausalLM"], "qwen2")
    assert config["eos_token_id"] == 151643 and config["max_position_embeddings"] == 131072
    assert "transformers_version" not in config
    assert shape_from_hf_config(config) == shape_from_hf_config(QWEN25_32B)
    llama = resolve("8b-fp8").recipe.model
    scratch = hf_config_from_shape(llama, max_position_embeddings=8192, eos_token_id=2)
    assert (scratch["model_type"], scratch["attention_bias"], scratch["eos_token_id"]) == ("llama", False, 2)


def test_from_hf_command_prints_the_block_and_refuses_in_one_line(tmp_path):
    runner = CliRunner()
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_32B))
    done = runner.invoke(app, ["recipe", "from-hf", str(tmp_path), "--init-from", "s3://my-models/qwen/"])
    assert done.exit_code == 0, done.output
    assert "32.76B parameters" in done.output
    assert done.output.strip().endswith("rope_scaling: null, init_from: s3://my-models/qwen/}")
    (tmp_path / "config.json").write_text(json.dumps({**QWEN25_32B, "use_sliding_window": True}))
    refused = runner.invoke(app, ["recipe", "from-hf", str(tmp_path / "config.json")])
    assert refused.exit_code == 2
    assert refused.output.count("\n") == 1 and "sliding_window: 131072" in refused.output
    missing = runner.invoke(app, ["recipe", "from-hf", str(tmp_path / "nope.json")])
    assert missing.exit_code == 2 and "nope.json: file not found" in missing.output


# Issue 29 item 11: config.json files `recipe from-hf` read with a traceback, each now one line naming the
# file and key, exit 2. The text is written as bytes: deep nesting cannot go through json.dumps.
HOSTILE_CONFIGS = [
    ("nested 200,000 deep", b"[" * 200_000 + b"]" * 200_000, "nested deeper than Python's JSON parser"),
    ("object nested deep", b'{"a":' * 150_000 + b"1" + b"}" * 150_000, "nested deeper than"),
    ("rope_theta text", {"rope_theta": "ten thousand"}, "rope_theta: expected a number, got 'ten thousand'"),
    ("rope_scaling text", {"rope_scaling": "llama3"}, "rope_scaling: expected an object such as"),
    ("rope_scaling list", {"rope_scaling": [8.0]}, "rope_scaling: expected an object"),
    ("rope_parameters text", {"rope_parameters": "default"}, "rope_parameters: expected an object"),
    ("rms_norm_eps text", {"rms_norm_eps": "1e-5"}, "rms_norm_eps: expected a number, got '1e-5'"),
    ("rope_theta true", {"rope_theta": True}, "rope_theta: expected a number, got True"),
    (
        "llama3 factor text",
        {"rope_scaling": {**LLAMA31_8B["rope_scaling"], "factor": "8"}},
        "factor: expected",
    ),
    ("model_type a list", {"model_type": ["llama"]}, "model_type: ['llama'] is not supported"),
    (
        "tie_word_embeddings text",
        {"tie_word_embeddings": "no"},
        "tie_word_embeddings: expected true or false",
    ),
    ("layers a bool", {"num_hidden_layers": True}, "num_hidden_layers: missing or not an integer"),
    ("architectures a number", {"architectures": 7, "model_type": "mistral"}, None),
    ("not UTF-8", b'{"model_type": "\xff"}', "not valid JSON"),
    ("empty file", b"", "not valid JSON"),
    ("a symlink loop", "loop", "cannot be read (Too many levels of symbolic links)"),
    ("huge file", b" " * (2 << 20), "is this the model's config.json?"),
]


@pytest.mark.parametrize(
    "content, message", [c[1:] for c in HOSTILE_CONFIGS], ids=[c[0] for c in HOSTILE_CONFIGS]
)
def test_a_hostile_config_json_is_one_line_naming_the_file_and_key(tmp_path, content, message):
    path = tmp_path / "config.json"
    if content == "loop":
        (tmp_path / "other.json").symlink_to(path)
        path.symlink_to(tmp_path / "other.json")
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(json.dumps({**LLAMA31_8B, **content}))
    done = CliRunner().invoke(app, ["recipe", "from-hf", str(path)])
    if message is None:  # a value the command only shows: accepted
        assert done.exit_code == 0 and "MistralForCausalLM" in done.output, done.output
        return
    assert done.exit_code == 2 and done.exception is None or isinstance(done.exception, SystemExit)
    assert done.output.count("\n") == 1 and done.output.startswith(f"error: {path}: "), done.output
    assert message in done.output, done.output
