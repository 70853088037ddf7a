"""Hugging Face folders in and out, against the outside reference: transformers' own models.

transformers (dev extra only) builds tiny random Llama (untied with eps 1e-6 and Llama 3.1 RoPE
scaling; tied with a head width other than hidden / heads) and Qwen2 (nonzero Q/K/V biases) models and
saves them with `save_pretrained` (sharded). Then, in float32:

- import: our model loaded from the folder (sharded through FSDP2, a world of one) gives the logits
  transformers gives, within 1e-4;
- export: a trainer checkpoint of that model, changed so it is no longer the base, exported with
  `python -m trainer.export`'s function, loads with `from_pretrained` and gives our model's logits;
- round trip with 2 gloo ranks: the real trainer starts from the Qwen2 base (`model.init_from`), takes
  one step at lr 1e-12, saves, and the export reproduces the original tensors; a worker shows the
  import lands sharded (each rank wrote and read only its own rows).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from trainer.checkpoint.manager import CheckpointManager, TrainerState
from trainer.distributed import parallel
from trainer.distributed.parallel import build_mesh, shard_model
from trainer.export.hf_folder import export
from trainer.hf.conversion import load_base, pieces
from trainer.models.model import build_model, pytorch_backend
from trainer.optim import build_optimizer, build_scheduler
from trainer_helpers import REPO, TINY, trainer_env, trainer_ranks

from trainstack.errors import TrainstackError
from trainstack.recipes.hf_config import read_hf_config, recipe_model_block, shape_from_hf_config
from trainstack.recipes.loader import resolve
from trainstack.recipes.schema import ModelShape, Recipe

pytestmark = pytest.mark.slow
TOLERANCE = 1e-4  # float32 logits, ours against transformers'
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
SMALL = dict(
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=64,
)
VARIANTS = {
    "llama-untied-eps1e-6-llama3-rope": (
        "llama",
        dict(rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=LLAMA3_SCALING),
    ),
    "llama-tied-head-dim-32": (
        "llama",
        dict(tie_word_embeddings=True, head_dim=32, rope_scaling=LLAMA3_SCALING),
    ),
    "qwen2-biases": ("qwen2", dict(rms_norm_eps=1e-6, rope_theta=10000.0)),
}


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bases(transformers, tmp_path_factory):
    """name -> (folder, the transformers model in float32), each saved in several safetensors files."""
    made = {}
    for name, (family, extra) in VARIANTS.items():
        torch.manual_seed(len(made))
        if family == "qwen2":
            model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL, **extra))
        else:
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, **extra))
        model = model.float().eval()
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if param_name.endswith("bias"):  # transformers initialises biases to zero
                    param.normal_(0.0, 0.5)
                elif param_name.endswith("norm.weight"):  # and norm gains to one
                    param.uniform_(0.5, 1.5)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder, max_shard_size="100KB")
        assert len(list(folder.glob("*.safetensors"))) > 1  # sharded, with an index
        made[name] = (folder, model)
    return made


@pytest.fixture
def fp32_compute(monkeypatch):
    """FSDP2 computing in float32 (the trainer's BF16 policy otherwise): the comparison is exact math."""
    policy = MixedPrecisionPolicy(
        param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    monkeypatch.setattr(parallel, "MIXED_PRECISION", policy)


def recipe_for(folder: Path, init_from: bool = True) -> Recipe:
    """tiny.yaml with the base model's shape (read with `recipe from-hf`'s function)."""
    config, where = read_hf_config(folder)
    shape = shape_from_hf_config(config, where)
    tiny = resolve(str(TINY)).recipe
    model = ModelShape(**shape, init_from=str(folder) if init_from else None)
    return tiny.model_copy(update={"model": model})


def sharded_model(recipe: Recipe):
    model = build_model(
        recipe.model, recipe.training.seq_len, pytorch_backend(), recipe.training.loss_chunk_tokens
    )
    shard_model(model, build_mesh("cpu", 1, 1))
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(tokens)
    return (out.full_tensor() if hasattr(out, "full_tensor") else out).float()


TOKENS = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("name", VARIANTS)
def test_import_gives_transformers_logits(name, bases, world_of_one, fp32_compute):
    folder, reference = bases[name]
    recipe = recipe_for(folder)
    model = sharded_model(recipe)
    loaded = load_base(model, folder, recipe.model)
    assert loaded.tensors == len(pieces(recipe.model))
    with torch.no_grad():
        expected = reference(TOKENS).logits
    difference = (logits(model, TOKENS) - expected).abs().max().item()
    assert difference < TOLERANCE, difference
    assert (logits(model, TOKENS).argmax(-1) == expected.argmax(-1)).all()


@pytest.mark.parametrize("name", VARIANTS)
def test_checkpoint_exported_loads_in_transformers_with_our_logits(
    name, bases, world_of_one, fp32_compute, tmp_path, transformers
):
    folder, _ = bases[name]
    # The tied, wide-head variant is exported without its base: config.json comes from the shape alone.
    recipe = recipe_for(folder, init_from=name != "llama-tied-head-dim-32")
    model = sharded_model(recipe)
    load_base(model, folder, recipe.model)
    with torch.no_grad():  # no longer the base: the export must carry the trained weights
        for param in model.parameters():
            param.to_local().add_(torch.randn_like(param.to_local()) * 0.05)
    optimizer = build_optimizer(model, recipe.training, "cpu")
    scheduler = build_scheduler(optimizer, recipe.training)
    checkpoints = CheckpointManager(tmp_path / "ck", keep=1, rank=0, world=1, asynchronous=False)
    checkpoints.save(model, optimizer, scheduler, TrainerState(3, 48, "synthetic", 1), blocking=True)
    checkpoints.close()
    result = export(recipe, str(tmp_path / "ck"), str(tmp_path / "hf"), dtype="fp32", max_shard_gb=0.0002)
    assert result.step == 3 and result.files > 1 and result.tokenizer is None
    written = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert {"config.json", "generation_config.json", "model.safetensors.index.json", "export.json"} <= set(
        written
    )
    assert not any("sharded" in n or n.endswith(".tmp") for n in written)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    family = VARIANTS[name][0]
    assert type(exported).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family]
    with torch.no_grad():
        difference = (exported(TOKENS).logits - logits(model, TOKENS)).abs().max().item()
    assert difference < TOLERANCE, difference


def test_bf16_export_is_bf16_without_extra_state(bases, world_of_one, tmp_path):
    from safetensors import safe_open

    folder, _ = bases["qwen2-biases"]
    recipe = recipe_for(folder)
    model = sharded_model(recipe)
    optimizer = build_optimizer(model, recipe.training, "cpu")
    checkpoints = CheckpointManager(tmp_path / "ck", keep=1, rank=0, world=1, asynchronous=False)
    checkpoints.save(
        model,
        optimizer,
        build_scheduler(optimizer, recipe.training),
        TrainerState(1, 16, "s", 1),
        blocking=True,
    )
    checkpoints.close()
    export(recipe, str(tmp_path / "ck"), str(tmp_path / "hf"))
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {p.hf for p in pieces(recipe.model)}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(tmp_path / "hf" / file, framework="pt") as f:
            assert all(f.get_slice(k).get_dtype() == "BF16" for k in f.keys())
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["model_type"], config["torch_dtype"]) == ("qwen2", "bfloat16")


def test_a_base_that_does_not_match_the_recipe_is_named_in_one_line(bases, world_of_one, tmp_path):
    folder, _ = bases["qwen2-biases"]
    recipe = recipe_for(folder)
    wrong = ModelShape(**{**recipe.model.model_dump(), "kv_heads": 4})
    with pytest.raises(
        TrainstackError, match=r"config.json: num_key_value_heads is 2, the recipe's model.kv_heads is 4"
    ):
        load_base(sharded_model(recipe.model_copy(update={"model": wrong})), folder, wrong)
    # A folder whose tensors do not match its own config: the first missing tensor is named.
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((folder / "config.json").read_text())
    from safetensors.torch import load_file, save_file

    tensors = {}
    for file in folder.glob("*.safetensors"):
        tensors.update(load_file(file))
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TrainstackError, match=r"tensor model.layers.1.self_attn.k_proj.bias is missing"):
        load_base(sharded_model(recipe), broken, recipe.model)


def test_from_hf_block_is_the_shape_transformers_saved(bases):
    folder, _ = bases["llama-untied-eps1e-6-llama3-rope"]
    config, where = read_hf_config(folder / "config.json")
    block = recipe_model_block(shape_from_hf_config(config, where))
    assert block == (
        "model: {layers: 2, hidden: 64, heads: 4, kv_heads: 2, head_dim: 16, ffn: 176, vocab: 256, "
        "tied_embeddings: false, attention_bias: false, norm_eps: 1e-06, rope_theta: 10000.0, "
        "rope_scaling: {rope_type: llama3, factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, "
        "original_max_position_embeddings: 16}, init_from: null}"
    )


# --- 2 gloo ranks ------------------------------------------------------------------------------------
def test_import_lands_sharded_on_two_ranks(bases, tmp_path):
    """Each rank reads only the rows of its own shards and they equal the base's rows."""
    folder, _ = bases["qwen2-biases"]
    recipe_path = tmp_path / "recipe.json"
    recipe_path.write_text(recipe_for(folder).model_dump_json())
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        str(REPO / "tests" / "trainer" / "hf_import_worker.py"), str(recipe_path), str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    total = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    for rank in ranks:
        assert rank["max_difference"] == 0.0  # every local row is the base's row, bit for bit
        assert rank["local_elements"] < 0.6 * rank["full_elements"]  # about half the model each
        assert rank["bytes_read"] < 0.6 * total
    assert ranks[0]["local_elements"] + ranks[1]["local_elements"] == ranks[0]["full_elements"]


def test_round_trip_through_the_trainer_reproduces_the_base(bases, tmp_path):
    """The trainer starts from the base (2 ranks), one step at lr 1e-12, saves; the export is the base.
    Then the base is removed and the run's next job resumes its own checkpoint, never reading it."""
    import shutil

    from safetensors.torch import load_file

    folder = tmp_path / "base"
    shutil.copytree(bases["qwen2-biases"][0], folder)
    recipe = recipe_for(folder)
    training = recipe.training.model_copy(update={"lr": 1e-12, "warmup_steps": 0, "weight_decay": 0.0})
    recipe = recipe.model_copy(update={"training": training})
    recipe_path = tmp_path / "recipe.json"
    recipe_path.write_text(recipe.model_dump_json())
    args = ("--recipe", str(recipe_path), "--checkpoint-dir", str(tmp_path / "ck"), "--synthetic")
    done = trainer_ranks(2, *args, "--max-steps", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"loaded base model {folder}" in done.stderr
    export(recipe, str(tmp_path / "ck"), str(tmp_path / "hf"), dtype="fp32")
    original, exported = {}, {}
    for file in folder.glob("*.safetensors"):
        original.update(load_file(file))
    for file in (tmp_path / "hf").glob("*.safetensors"):
        exported.update(load_file(file))
    assert set(exported) == set(original)
    worst = max((exported[k] - original[k]).abs().max().item() for k in original)
    assert worst < 1e-6, worst
    shutil.rmtree(folder)  # a next job (one process here) that read init_from would now fail
    command = [sys.executable, "-m", "trainer", "--device", "cpu", *args, "--max-steps", "2"]
    again = subprocess.run(command, cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stderr and "loaded base model" not in again.stderr


def test_a_base_config_nested_too_deep_is_one_line(tmp_path):
    """model.init_from's config.json read by the trainer (issue 29 item 11's nesting, on this side too)."""
    from trainer.hf.conversion import check_base

    (tmp_path / "config.json").write_bytes(b"[" * 200_000 + b"]" * 200_000)
    with pytest.raises(
        TrainstackError, match=r"model.init_from: .*config.json: not valid JSON \(nested deeper"
    ):
        check_base(
            tmp_path,
            ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, ffn=176, vocab=256),
            "model.init_from",
        )
