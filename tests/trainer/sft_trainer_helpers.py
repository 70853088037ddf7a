"""What the fine-tuning trainer tests share: a small Llama base folder (transformers' weights saved with
`save_pretrained`, beside a tokenizer and a chat template marked with `{% generation %}`), a chat dataset
prepared from conversations with `prepare_chat`, and an sft recipe for them validated by the schema."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from sft_helpers import CONVERSATIONS, base_folder, write_jsonl
from trainer.prepare.chat import ChatTokenizer
from trainer.prepare.chat_prepare import prepare_chat
from trainer_helpers import TINY

from trainstack.recipes.hf_config import read_hf_config, shape_from_hf_config
from trainstack.recipes.loader import resolve
from trainstack.recipes.schema import Recipe

TRAIN_URI = "s3://chat-data/tests/"  # the schema wants one with sft; the job reads --data-dir


def conversations(count: int) -> list[list[dict]]:
    """`count` distinct conversations of varied length, from sft_helpers.CONVERSATIONS."""
    made = []
    for i in range(count):
        turns = CONVERSATIONS[i % len(CONVERSATIONS)]
        repeat = i // len(CONVERSATIONS)
        made.append([{**m, "content": m["content"] + f" ({i})" * (1 + repeat % 3)} for m in turns])
    return made


def llama_base(transformers, folder: Path, seq_len: int, seed: int = 0):
    """A Llama base folder (tokenizer, marked chat template, config.json, safetensors) and the
    transformers model in float32. A sharp init (std 0.2) and norm gains off one, so what one example
    would take from another, or a gain applied in the wrong place, shows in the loss."""
    base_folder(folder, "llama3-marked")
    chat = ChatTokenizer(folder)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=chat.vocab_size,
        max_position_embeddings=seq_len,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        initializer_range=0.2,
    )
    reference = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    reference.save_pretrained(folder)
    return reference, chat


def prepare(folder: Path, base: Path, count: int, seq_len: int, validation_fraction: float = 0.25) -> Path:
    """`count` conversations prepared as a chat dataset in folder/data (a validation split beside)."""
    source = write_jsonl(folder / "chats.jsonl", conversations(count))
    out = folder / "data"
    prepare_chat([str(source)], str(base), str(out), seq_len=seq_len, validation_fraction=validation_fraction)
    return out


def sft_recipe(base: Path, **training) -> Recipe:
    """tests/trainer/fixtures/tiny.yaml as an sft recipe for the base folder's shape (validated)."""
    config, where = read_hf_config(base)
    shape = shape_from_hf_config(config, where)
    data = resolve(str(TINY)).recipe.model_dump(mode="json", exclude={"extends"})
    data["model"] = {**shape, "init_from": str(base)}
    data["training"].update({"objective": "sft", **training})
    data["data"]["train_s3_uri"] = TRAIN_URI
    return Recipe.model_validate(data)


def write_recipe(recipe: Recipe, path: Path) -> Path:
    path.write_text(json.dumps(recipe.model_dump(mode="json")))
    return path
