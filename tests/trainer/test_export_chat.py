"""A chat model out: a fine-tuned (training.objective sft) export is a folder transformers chats with.

The outside reference is transformers itself (dev extra): `AutoTokenizer.apply_chat_template` on the
exported folder renders what the base folder renders, and `generate` with the exported
generation_config stops at the end-of-turn token. The model is a tiny Llama whose weights are set by
hand so its next token depends only on the current one ("\\n" -> "4" -> "<|im_end|>" -> ...): greedy
decoding after the generation prompt answers "4" and then ends its turn, so whether `generate` stops
there is decided by generation_config.json alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from sft_helpers import base_folder
from trainer.checkpoint.manager import CheckpointManager, TrainerState
from trainer.distributed.parallel import build_mesh, shard_model
from trainer.export.chat_model import end_of_turn, export_generation_config
from trainer.export.hf_folder import export
from trainer.hf.conversion import load_base
from trainer.models.model import build_model, pytorch_backend
from trainer.optim import build_optimizer, build_scheduler
from trainer_helpers import TINY

from trainstack.errors import TrainstackError
from trainstack.recipes.loader import resolve
from trainstack.recipes.schema import ModelShape, Recipe

pytestmark = pytest.mark.fast

# A byte-level tokenizer with Qwen2's specials (as docs/sft.md's walkthrough makes it) and Qwen2's
# published ChatML template; the base's own eos is <|endoftext|>, as Qwen2.5's base models name it.
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
PROMPT = [{"role": "user", "content": "What is 2 plus 2?"}]


@pytest.mark.parametrize(
    ("family", "expected"),
    [
        ("qwen2", "<|im_end|>"),
        ("qwen2-marked", "<|im_end|>"),
        ("llama3", "<|eot_id|>"),
        ("llama3-marked", "<|eot_id|>"),
        ("mistral", "</s>"),
        ("alternating", "</s>"),
    ],
)
def test_end_of_turn_is_the_special_token_a_reply_was_trained_to_end_with(family, expected, tmp_path):
    folder = base_folder(tmp_path / family, family)
    found = end_of_turn(folder)
    assert found is not None and found[1] == expected


def test_end_of_turn_is_none_for_a_template_that_ends_replies_with_text(tmp_path):
    folder = base_folder(tmp_path / "qwen2", "qwen2")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert end_of_turn(folder) is None


def test_generation_config_keeps_the_bases_settings_and_adds_the_end_of_turn_first():
    base = {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "temperature": 0.6}
    base["transformers_version"] = "5.23.0"
    config = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    out = export_generation_config(config, base, 9)
    assert out == {
        "bos_token_id": 1,
        "eos_token_id": [9, 2, 3],
        "pad_token_id": 0,
        "do_sample": True,
        "temperature": 0.6,
    }
    # no end of turn (a pretraining export): the ids as they were, one id as an int
    assert export_generation_config({"eos_token_id": 2}, None, None) == {"eos_token_id": 2}
    assert export_generation_config({"eos_token_id": 2}, {"eos_token_id": 2}, 2) == {"eos_token_id": 2}


def _chat_base(folder: Path, transformers) -> Path:
    """The tiny base: tokenizer files with the template, and a hand-set Llama (module doc)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte = pre_tokenizers.ByteLevel(add_prefix_space=False)
    vocab = {c: i for i, c in enumerate(sorted(byte.alphabet()))}
    vocab |= {s: 256 + i for i, s in enumerate(SPECIALS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = byte, decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHATML,
            }
        )
    )
    newline, four, im_end = tok.token_to_id("Ċ"), tok.token_to_id("4"), tok.token_to_id("<|im_end|>")
    config = transformers.LlamaConfig(
        vocab_size=264,  # the tokenizer's 259, padded as published vocabularies are
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        bos_token_id=None,
        eos_token_id=256,
        pad_token_id=256,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()  # the blocks add nothing: the last hidden state is the token's embedding
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed.zero_()
        head.zero_()
        embed[newline, 0] = embed[four, 1] = 1.0
        head[four, 0] = head[im_end, 1] = 10.0  # "\n" -> "4", "4" -> <|im_end|>
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


def _sft_recipe(base: Path) -> Recipe:
    tiny = resolve(str(TINY)).recipe
    shape = tiny.model.model_dump(exclude={"head_dim"}) | {"vocab": 264, "init_from": str(base)}
    return tiny.model_copy(
        update={
            "model": ModelShape(**shape),
            "training": tiny.training.model_copy(update={"objective": "sft"}),
        }
    )


def _checkpoint_of_base(recipe: Recipe, base: Path, out: Path) -> Path:
    """The trainer's checkpoint of a model loaded from `base` (what an SFT run's final save holds)."""
    model = build_model(
        recipe.model, recipe.training.seq_len, pytorch_backend(), recipe.training.loss_chunk_tokens
    )
    shard_model(model, build_mesh("cpu", 1, 1))
    model.to_empty(device="cpu")
    model.init_weights()
    load_base(model, base, recipe.model)
    optimizer = build_optimizer(model, recipe.training, "cpu")
    checkpoints = CheckpointManager(out, keep=1, rank=0, world=1, asynchronous=False)
    checkpoints.save(
        model,
        optimizer,
        build_scheduler(optimizer, recipe.training),
        TrainerState(5, 80, "chat", 1),
        blocking=True,
    )
    checkpoints.close()
    return out


def test_sft_export_chats_in_transformers_and_stops_at_the_end_of_its_turn(
    transformers, world_of_one, tmp_path
):
    base = _chat_base(tmp_path / "base", transformers)
    recipe = _sft_recipe(base)
    checkpoint = _checkpoint_of_base(recipe, base, tmp_path / "ck")
    result = export(recipe, str(checkpoint), str(tmp_path / "hf"), dtype="fp32")
    out = tmp_path / "hf"
    assert result.tokenizer == str(base)
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    reference = transformers.AutoTokenizer.from_pretrained(base)
    prompt = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert prompt == reference.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")

    generation = json.loads((out / "generation_config.json").read_text())
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert generation["eos_token_id"] == [im_end, 256]  # the turn's end first, the base's eos kept

    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        answered = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :]
    assert tokenizer.decode(answered, skip_special_tokens=True) == "4"
    assert answered.tolist()[-1] == im_end and len(answered) == 2  # stopped at the end of its turn
    # The base's generation settings would not have stopped it: it runs on to max_new_tokens.
    with torch.no_grad():
        runaway = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=256)[0, ids.shape[1] :]
    assert len(runaway) == 8


def test_sft_export_without_a_chat_template_is_refused_in_one_line(transformers, world_of_one, tmp_path):
    base = _chat_base(tmp_path / "base", transformers)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    recipe = _sft_recipe(base)
    checkpoint = _checkpoint_of_base(recipe, base, tmp_path / "ck")
    with pytest.raises(TrainstackError, match="ends an assistant reply with no special token") as caught:
        export(recipe, str(checkpoint), str(tmp_path / "hf"))
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "hf" / "export.json").exists()  # not complete: no record written


def test_sft_export_of_a_base_without_a_chat_template_names_the_base_not_a_copy(
    transformers, world_of_one, tmp_path
):
    base = _chat_base(tmp_path / "base", transformers)
    config = json.loads((base / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    recipe = _sft_recipe(base)
    checkpoint = _checkpoint_of_base(recipe, base, tmp_path / "ck")
    with pytest.raises(TrainstackError) as caught:
        export(recipe, str(checkpoint), str(tmp_path / "hf"))
    message = str(caught.value)
    assert f"{base}/tokenizer_config.json: chat_template: missing" in message, message
    assert "trainstack-tokenizer-" not in message and "\n" not in message
    assert not (tmp_path / "hf" / "export.json").exists()
