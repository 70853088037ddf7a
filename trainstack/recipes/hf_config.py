"""A Hugging Face config.json and the recipe's `model:` shape, both ways (pure; no torch, no transformers).

    shape_from_hf_config(config)      -> the ModelShape fields a Llama / Qwen2 / Mistral config describes,
                                         or HfConfigError naming the first thing the trainer cannot hold
    hf_config_from_shape(shape, ...)  -> the config.json a Hugging Face folder of this shape needs
    shape_mismatch(shape, config)     -> the first field where a base model's config and a recipe differ

What maps (transformers' LlamaConfig / Qwen2Config / MistralConfig attribute -> ModelShape field):
num_hidden_layers -> layers, hidden_size -> hidden, num_attention_heads -> heads, num_key_value_heads ->
kv_heads (default: heads), intermediate_size -> ffn, vocab_size -> vocab, tie_word_embeddings ->
tied_embeddings, rope_theta -> rope_theta, head_dim -> head_dim (default hidden / heads),
rms_norm_eps -> norm_eps, Qwen2's Q/K/V biases -> attention_bias, rope_scaling {rope_type: llama3} ->
rope_scaling. transformers 5 writes the RoPE settings as one `rope_parameters` object (rope_theta and
rope_type in it); older configs as `rope_theta` and `rope_scaling`: both are read.

What is refused, in one line: other architectures (MoE, Qwen3's Q/K norm, ...), a sliding window
that is in use, RoPE types other than the default and llama3, an activation other than SiLU, MLP
biases, and Llama's `attention_bias: true` (it also puts a bias on o_proj, which the trainer has not).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from trainstack.errors import TrainstackError
from trainstack.recipes.schema import ModelShape

# model_type -> the architecture transformers builds for it (config.json's `architectures`).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
# Keys that mean a mixture of experts in the configs of the families transformers ships.
MOE_KEYS = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_intermediate_size",
    "num_experts_per_tok",
)
# Shape fields compared between a base model and the recipe, in the order a mismatch is reported.
COMPARED = (
    "layers",
    "hidden",
    "heads",
    "kv_heads",
    "head_dim",
    "ffn",
    "vocab",
    "tied_embeddings",
    "attention_bias",
    "norm_eps",
    "rope_theta",
    "rope_scaling",
)
# The Hugging Face key each compared field comes from (for the one-line mismatch message).
HF_NAME = {
    "layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "ffn": "intermediate_size",
    "vocab": "vocab_size",
    "tied_embeddings": "tie_word_embeddings",
    "attention_bias": "attention bias (Qwen2)",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "rope_scaling": "rope_scaling",
}


# A Llama/Qwen2 config.json is 1-5 KB; the bound keeps a wrong file (a safetensors, a dataset) from being
# read whole into memory before it is refused.
MAX_CONFIG_BYTES = 1 << 20


class HfConfigError(TrainstackError):
    """A config.json the trainer cannot represent, or unreadable (exit 2, one line)."""


def _shown(value: Any) -> str:
    """A value from the file as a message shows it: repr, cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _number(value: Any, where: str, key: str) -> float:
    """A JSON number (not a bool, not a string), finite, as a float; else one line naming the key."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or value != value
        or value
        in (
            float("inf"),
            float("-inf"),
        )
    ):
        raise HfConfigError(f"{where}: {key}: expected a number, got {_shown(value)}")
    return float(value)


def read_hf_config(path: Path | str) -> tuple[dict[str, Any], str]:
    """(config, where) from a config.json, or a folder holding one."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise HfConfigError(
                f"{path}: {path.stat().st_size:,} bytes; a config.json is a few KB (at most "
                f"{MAX_CONFIG_BYTES:,} read): is this the model's config.json?"
            )
        config = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise HfConfigError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise HfConfigError(f"{path}: is a directory, expected a config.json file") from None
    except OSError as exc:  # a symlink loop (ELOOP), no permission, ...
        raise HfConfigError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HfConfigError(f"{path}: not valid JSON ({' '.join(str(exc).split())[:160]})") from None
    except RecursionError:  # json's C parser recurses once per level of nesting
        raise HfConfigError(
            f"{path}: not a config.json: nested deeper than Python's JSON parser allows"
        ) from None
    if not isinstance(config, dict):
        raise HfConfigError(f"{path}: expected a JSON object")
    return config, str(path)


def _rope(config: dict[str, Any], where: str) -> tuple[float | None, dict[str, Any] | None]:
    """(rope_theta, rope_scaling fields or None) from either spelling of the RoPE settings."""
    params = config.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise HfConfigError(f"{where}: rope_parameters: expected an object, got {_shown(params)}")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type settings (Gemma-style)
        raise HfConfigError(f"{where}: rope_parameters: per-layer-type RoPE is not supported")
    scaling = params if isinstance(params, dict) else config.get("rope_scaling")
    key = "rope_parameters" if isinstance(params, dict) else "rope_scaling"
    if scaling is not None and not isinstance(scaling, dict):
        raise HfConfigError(
            f'{where}: {key}: expected an object such as {{"rope_type": "llama3", "factor": 8.0, ...}} '
            f"or null, got {_shown(scaling)}"
        )
    theta = config.get("rope_theta")
    theta_key = "rope_theta"
    if isinstance(params, dict) and "rope_theta" in params:
        theta, theta_key = params["rope_theta"], "rope_parameters.rope_theta"
    if theta is not None:
        theta = _number(theta, where, theta_key)
    if not scaling:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise HfConfigError(
            f"{where}: {key}.rope_type: {_shown(kind)} is not supported (the trainer implements the default "
            "RoPE and llama3's scaling)"
        )
    fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [f for f in fields if f not in scaling]
    if missing:
        raise HfConfigError(f"{where}: {key}: llama3 scaling without {missing[0]}")
    for f in fields:
        _number(scaling[f], where, f"{key}.{f}")  # checked; kept as written (an int stays an int)
    return theta, {"rope_type": "llama3", **{f: scaling[f] for f in fields}}


def shape_from_hf_config(config: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """The `model:` fields of a recipe for a Hugging Face config (validated as a ModelShape), or
    HfConfigError naming the first thing this trainer cannot represent."""
    for key in MOE_KEYS:
        if config.get(key):
            raise HfConfigError(f"{where}: {key}: a mixture of experts cannot be represented (dense only)")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        raise HfConfigError(
            f"{where}: model_type: {_shown(model_type)} is not supported (supported: "
            f"{', '.join(ARCHITECTURES)}: Llama-style decoders with RMSNorm, RoPE, grouped-query attention "
            "and SwiGLU)"
        )
    if config.get("hidden_act", "silu") != "silu":
        raise HfConfigError(
            f"{where}: hidden_act: {_shown(config['hidden_act'])} (the trainer's MLP is SwiGLU: silu)"
        )
    if config.get("mlp_bias"):
        raise HfConfigError(f"{where}: mlp_bias: true (the trainer's MLP has no biases)")
    if model_type == "llama" and config.get("attention_bias"):
        raise HfConfigError(
            f"{where}: attention_bias: true puts a bias on o_proj as well as q/k/v in a Llama model; the "
            "trainer holds Q/K/V biases only (as Qwen2 has them)"
        )
    sliding = config.get("sliding_window")
    in_use = config.get("use_sliding_window", model_type == "mistral")
    if sliding and in_use:
        raise HfConfigError(
            f"{where}: sliding_window: {sliding} (sliding-window attention is not implemented; the trainer "
            "attends to the whole sequence)"
        )
    if config.get("partial_rotary_factor", 1.0) != 1.0:
        raise HfConfigError(f"{where}: partial_rotary_factor: RoPE on part of each head is not supported")
    theta, scaling = _rope(config, where)
    required = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
    for key in required:
        if isinstance(config.get(key), bool) or not isinstance(config.get(key), int):
            raise HfConfigError(f"{where}: {key}: missing or not an integer")
    for key in ("tie_word_embeddings",):
        if key in config and not isinstance(config[key], bool):
            raise HfConfigError(f"{where}: {key}: expected true or false, got {_shown(config[key])}")
    norm_eps = _number(config["rms_norm_eps"], where, "rms_norm_eps") if "rms_norm_eps" in config else 1e-6
    heads = config["num_attention_heads"]
    shape: dict[str, Any] = {
        "layers": config["num_hidden_layers"],
        "hidden": config["hidden_size"],
        "heads": heads,
        "kv_heads": config.get("num_key_value_heads") or heads,
        "ffn": config["intermediate_size"],
        "vocab": config["vocab_size"],
        "tied_embeddings": bool(config.get("tie_word_embeddings", False)),
        "rope_theta": float(theta if theta is not None else 10000.0),  # transformers' default
        "norm_eps": norm_eps,  # transformers' default (1e-6) for all three
        "attention_bias": model_type == "qwen2",  # Qwen2 always has Q/K/V biases
    }
    if config.get("head_dim") is not None:
        shape["head_dim"] = config["head_dim"]
    if scaling is not None:
        shape["rope_scaling"] = scaling
    try:
        return ModelShape.model_validate(shape).model_dump(exclude={"init_from"})
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        raise HfConfigError(f"{where}: {loc + ': ' if loc else ''}{message}") from None


def recipe_model_block(shape: dict[str, Any], init_from: str | None = None) -> str:
    """The recipe's `model:` line in the recipes' flow style, every field written out.

    The block is pasted into a recipe that `extends` another, and the loader merges `model:` key by key:
    a field left out at its default would be inherited from the extended recipe instead (an untied
    Llama-3-8B extending the tied 1b-bf16 would train tied, and fail on the instance when its weights
    load). So every field the base model's config decides is written, `tied_embeddings: false`,
    `attention_bias: false`, `head_dim`, `rope_scaling: null` and `init_from` included."""
    parts = [f"{key}: {_flow(shape.get(key))}" for key in COMPARED]
    # Without a base, `init_from: null`: the run starts from random weights, not from the weights of
    # the extended recipe's base model (30b-fp8 names Qwen2.5-32B's).
    parts.append(f"init_from: {init_from or 'null'}")
    return "model: {" + ", ".join(parts) + "}"


def _flow(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        text = repr(value)
        return text if ("e" in text or "." in text) else text + ".0"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    return str(value)


def shape_mismatch(shape: ModelShape, config: dict[str, Any], where: str) -> str | None:
    """The first field where the base model's config and the recipe's shape differ, as one line (or None).
    A config the trainer cannot represent at all raises HfConfigError."""
    base = shape_from_hf_config(config, where)
    ours = shape.model_dump(exclude={"init_from"})
    for field in COMPARED:
        theirs = base.get(field)
        if theirs != ours.get(field):
            return (
                f"{where}: {HF_NAME[field]} is {_flow(theirs)}, the recipe's model.{field} is "
                f"{_flow(ours.get(field))}"
            )
    return None


def hf_config_from_shape(
    shape: ModelShape,
    *,
    base: dict[str, Any] | None = None,
    max_position_embeddings: int,
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    dtype: str = "bfloat16",
) -> dict[str, Any]:
    """config.json for a Hugging Face folder holding this shape's weights.

    With `base` (the config of the model the run started from) its model_type and architecture are
    kept, and so are its other settings (token ids, max_position_embeddings, ...), with the shape's
    fields written over them; otherwise a Qwen2 config when the shape has Q/K/V biases, else Llama.
    RoPE settings are written as rope_theta and rope_scaling, which transformers 4 and 5 and vLLM read.
    """
    config: dict[str, Any] = dict(base or {})
    for key in ("rope_parameters", "transformers_version", "_name_or_path", "quantization_config"):
        config.pop(key, None)
    model_type = config.get("model_type")
    if model_type not in ARCHITECTURES or (model_type == "qwen2") != shape.attention_bias:
        model_type = "qwen2" if shape.attention_bias else "llama"
    config.update(
        {
            "architectures": [ARCHITECTURES[model_type]],
            "model_type": model_type,
            "hidden_act": "silu",
            "num_hidden_layers": shape.layers,
            "hidden_size": shape.hidden,
            "num_attention_heads": shape.heads,
            "num_key_value_heads": shape.kv_heads,
            "head_dim": shape.head_dim,
            "intermediate_size": shape.ffn,
            "vocab_size": shape.vocab,
            "tie_word_embeddings": shape.tied_embeddings,
            "rms_norm_eps": shape.norm_eps,
            "rope_theta": shape.rope_theta,
            "rope_scaling": shape.rope_scaling.model_dump() if shape.rope_scaling else None,
            "torch_dtype": dtype,  # transformers 4 and vLLM
            "dtype": dtype,  # transformers 5
            "use_cache": True,
        }
    )
    if len(config.get("layer_types") or [None] * shape.layers) != shape.layers:
        config.pop("layer_types")
    config.setdefault("max_position_embeddings", max_position_embeddings)
    config.setdefault("initializer_range", 0.02)
    config.setdefault("attention_dropout", 0.0)
    if model_type == "llama":
        config.update({"attention_bias": False, "mlp_bias": False})
    if model_type == "qwen2":
        config.setdefault("use_sliding_window", False)
    if model_type == "mistral":
        config["sliding_window"] = None
    for key, value in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
        if value is not None:
            config[key] = value
    return config


def generation_config(config: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json: the token ids generation needs, from the model's config."""
    out: dict[str, Any] = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if config.get(key) is not None:
            out[key] = config[key]
    return out
