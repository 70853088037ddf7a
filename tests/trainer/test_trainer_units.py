"""The trainer's pieces, one behaviour each (fast; no torchrun)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import typing

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from trainer.config import recipe_from_json, resolve_layout
from trainer.data.loader import SyntheticTokens, micro_batch_indices, open_source
from trainer.models.activation_checkpointing import apply_activation_checkpointing, checkpointed_blocks
from trainer.models.loss import chunked_cross_entropy
from trainer.models.model import apply_rotary, build_model, pytorch_backend, rotary_tables
from trainer.models.precision import TE_RECIPE_CLASS, check_precision
from trainer.optim import lr_factor
from trainer.prepare.make_shards import write_shards
from trainer_helpers import REPO, TINY, trainer_env

from trainstack.errors import RecipeError, TrainstackError
from trainstack.recipes.loader import base_recipe_names, resolve
from trainstack.recipes.schema import ActivationCheckpointing, Precision, to_hyperparameters

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def tiny():
    return resolve(str(TINY)).recipe


def materialised(recipe, ac: str = "none"):
    torch.manual_seed(0)
    tr = recipe.training
    model = build_model(recipe.model, tr.seq_len, pytorch_backend(), tr.loss_chunk_tokens)
    apply_activation_checkpointing(model, ActivationCheckpointing(mode=ac))
    model.to_empty(device="cpu")
    model.init_weights()
    return model


# --- model and loss ---------------------------------------------------------------------------------
def test_model_has_the_recipe_parameter_count(tiny):
    model = materialised(tiny)
    assert sum(p.numel() for p in model.parameters()) == tiny.model.total_params
    tied = tiny.model.model_copy(update={"tied_embeddings": True})
    model = build_model(tied, 32, pytorch_backend(), 64)
    assert sum(p.numel() for p in model.parameters()) == tied.total_params


def test_block_parameters_have_transformer_engine_fused_module_names_and_shapes(tiny):
    """Q/K/V is one RMSNorm+linear (te.LayerNormLinear's names), the MLP one RMSNorm+SwiGLU
    (te.LayerNormMLP's): so a checkpoint's keys do not depend on the backend."""
    m = tiny.model
    shapes = {name: tuple(p.shape) for name, p in materialised(tiny).layers[0].named_parameters()}
    assert shapes == {
        "attention.qkv.layer_norm_weight": (m.hidden,),
        "attention.qkv.weight": ((m.heads + 2 * m.kv_heads) * m.head_dim, m.hidden),
        "attention.proj.weight": (m.hidden, m.heads * m.head_dim),
        "feed_forward.layer_norm_weight": (m.hidden,),
        "feed_forward.fc1_weight": (2 * m.ffn, m.hidden),
        "feed_forward.fc2_weight": (m.hidden, m.ffn),
    }


def test_rotary_scores_depend_only_on_relative_position():
    """RoPE's point: q.k after rotation at positions (m, n) equals that at (m + s, n + s)."""
    torch.manual_seed(0)
    head_dim, theta = 16, 500000.0
    cos, sin = rotary_tables(head_dim, 64, theta, torch.device("cpu"))
    q, k = torch.randn(head_dim, dtype=torch.float64), torch.randn(head_dim, dtype=torch.float64)

    def rotated(vector: torch.Tensor, position: int) -> torch.Tensor:
        sequence = torch.zeros(1, 64, 1, head_dim, dtype=torch.float64)  # (batch, seq, heads, dim)
        sequence[0, position, 0] = vector
        return apply_rotary(sequence, cos, sin)[0, position, 0]

    def score(m: int, n: int) -> float:
        return float(rotated(q, m) @ rotated(k, n))

    assert score(9, 3) == pytest.approx(score(50, 44), rel=1e-5)
    assert score(9, 3) != pytest.approx(score(9, 4), rel=1e-3)  # and it does depend on the distance
    assert score(0, 0) == pytest.approx(float(q @ k), rel=1e-6)  # position 0 is not rotated


def test_chunked_cross_entropy_equals_the_full_loss_and_gradient():
    torch.manual_seed(0)
    hidden = torch.randn(3, 10, 16, requires_grad=True)
    head = torch.nn.Linear(16, 50, bias=False)
    targets = torch.randint(0, 50, (3, 10))
    chunked = chunked_cross_entropy(hidden, targets, head, chunk_tokens=7)  # 30 tokens: 7,7,7,7,2
    (grad_chunked,) = torch.autograd.grad(chunked, hidden)
    full = F.cross_entropy(head(hidden).reshape(-1, 50).float(), targets.reshape(-1))
    (grad_full,) = torch.autograd.grad(full, hidden)
    assert torch.allclose(chunked, full, atol=1e-6)
    assert torch.allclose(grad_chunked, grad_full, atol=1e-6)


def test_chunked_cross_entropy_keeps_no_logits_for_backward():
    """Backward recomputes each chunk's logits: autograd holds none of them between forward and
    backward, only the hidden states (a plain loss keeps its logits, as the control shows)."""
    torch.manual_seed(0)
    vocab, dim = 50, 16
    hidden = torch.randn(3, 10, dim, requires_grad=True)
    head = torch.nn.Linear(dim, vocab, bias=False)
    targets = torch.randint(0, vocab, (3, 10))

    def saved_shapes(loss_fn) -> list[tuple[int, ...]]:
        shapes: list[tuple[int, ...]] = []

        def pack(tensor):
            shapes.append(tuple(tensor.shape))
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = loss_fn()
        loss.backward()
        return shapes

    plain = saved_shapes(
        lambda: F.cross_entropy(head(hidden).reshape(-1, vocab).float(), targets.reshape(-1))
    )
    assert any(shape[-1] == vocab and len(shape) >= 2 for shape in plain)  # the control keeps logits
    chunked = saved_shapes(lambda: chunked_cross_entropy(hidden, targets, head, chunk_tokens=7))
    assert not [shape for shape in chunked if shape and shape[-1] == vocab], chunked


def test_activation_checkpointing_changes_memory_not_math(tiny):
    tokens = torch.from_numpy(np.stack([SyntheticTokens(256, 32, 1).sample(i) for i in range(2)]))
    grads = []
    for mode in ("none", "full"):
        model = materialised(tiny, mode)
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        grads.append(model.layers[0].attention.qkv.weight.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


@pytest.mark.parametrize(
    "mode, every, expected",
    [
        ("none", 2, []),
        ("full", 2, [0, 1, 2, 3, 4]),
        ("selective", 2, [0, 2, 4]),
        ("selective", 3, [0, 3]),
    ],
)
def test_checkpointed_blocks_follow_the_recipe(mode, every, expected):
    assert checkpointed_blocks(ActivationCheckpointing(mode=mode, every=every), 5) == expected


# --- optimizer schedule -----------------------------------------------------------------------------
def test_warmup_then_cosine_to_min_ratio(tiny):
    tr = tiny.training  # steps 60, warmup 5, min_lr_ratio 0.1
    assert [lr_factor(s, tr) for s in (1, 5)] == [0.2, 1.0]
    decay = [lr_factor(s, tr) for s in range(5, 61)]
    assert all(a >= b for a, b in zip(decay, decay[1:], strict=False))
    assert lr_factor(60, tr) == pytest.approx(0.1) and lr_factor(1000, tr) == pytest.approx(0.1)


# --- layout -------------------------------------------------------------------------------------------
def test_layout_on_the_ranks_running(tiny):
    layout = resolve_layout(tiny, 2, "r.yaml")  # shard_group 8 > 2 ranks: FSDP over all 2
    assert (layout.shard, layout.replicas, layout.grad_accum) == (2, 1, 4)
    hsdp = tiny.model_copy(update={"parallelism": tiny.parallelism.model_copy(update={"shard_group": 2})})
    assert (resolve_layout(hsdp, 4, "r.yaml").shard, resolve_layout(hsdp, 4, "r.yaml").replicas) == (2, 2)


@pytest.mark.parametrize("name", base_recipe_names())
def test_every_base_recipe_lays_out_on_its_planned_world(name):
    recipe = resolve(name).recipe
    layout = resolve_layout(recipe, recipe.world_size, name)
    assert layout.grad_accum == recipe.grad_accum_steps
    assert layout.shard == recipe.parallelism.shard_group


@pytest.mark.parametrize(
    "update, world, field",
    [
        ({"parallelism": {"shard_group": 4}}, 6, "parallelism.shard_group"),
        ({}, 3, "training.global_batch"),
    ],
)
def test_layout_refusals_name_the_field(tiny, update, world, field):
    data = tiny.model_dump()
    for section, values in update.items():
        data[section].update(values)
    recipe = type(tiny).model_validate(data)
    with pytest.raises(RecipeError, match=rf"^r\.yaml: {re.escape(field)}: "):
        resolve_layout(recipe, world, "r.yaml")


# --- precision ------------------------------------------------------------------------------------
def test_every_fp8_recipe_maps_to_a_transformer_engine_recipe():
    options = typing.get_args(Precision.model_fields["fp8_recipe"].annotation)[0]
    assert set(typing.get_args(options)) == set(TE_RECIPE_CLASS)
    assert TE_RECIPE_CLASS["mxfp8"] == "MXFP8BlockScaling" and TE_RECIPE_CLASS["delayed"] == "DelayedScaling"


def test_fp8_without_a_gpu_is_refused_not_downgraded():
    with pytest.raises(TrainstackError, match="^precision.dtype: fp8 needs an NVIDIA GPU"):
        check_precision(Precision(dtype="fp8", fp8_recipe="mxfp8"), "cpu", "pytorch")
    check_precision(Precision(dtype="bf16"), "cpu", "pytorch")


def test_mxfp8_on_a_hopper_gpu_fails_at_start_with_a_clear_message(monkeypatch):
    # A Blackwell recipe started on an H100: no silent fallback to another scaling recipe.
    import trainer.models.precision as precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(precision, "_te_support", lambda name: None)  # decide by compute capability
    with pytest.raises(
        TrainstackError,
        match=r"^precision.fp8_recipe: mxfp8 cannot run on NVIDIA H100 .*"
        r"needs compute capability 10.0\+.*MXFP8 needs Blackwell; use current or delayed",
    ):
        check_precision(Precision(dtype="fp8", fp8_recipe="mxfp8"), "cuda", "transformer_engine")
    check_precision(Precision(dtype="fp8", fp8_recipe="current"), "cuda", "transformer_engine")


# --- data -----------------------------------------------------------------------------------------
def test_each_step_takes_exactly_the_next_global_batch_of_samples():
    world, accum, micro, position = 4, 3, 2, 48
    taken = [
        i
        for m in range(accum)
        for r in range(world)
        for i in micro_batch_indices(position, m, r, world, micro)
    ]
    assert sorted(taken) == list(range(position, position + world * accum * micro))


def test_synthetic_set_is_fixed_and_learnable():
    a, b = SyntheticTokens(256, 32, seed=7), SyntheticTokens(256, 32, seed=7)
    assert np.array_equal(a.sample(5), b.sample(5)) and not np.array_equal(a.sample(5), a.sample(6))
    window = a.sample(3)
    successor = {int(x): int(y) for x, y in zip(a.cycle, np.roll(a.cycle, -1), strict=True)}
    assert all(successor[int(x)] == int(y) for x, y in zip(window[:-1], window[1:], strict=True))


def test_shards_round_trip_through_make_shards(tmp_path):
    docs = []
    for i, text in enumerate(["hello world", "ünïcode text", "x" * 50]):
        (tmp_path / f"{i}.txt").write_text(text)
        docs.append(tmp_path / f"{i}.txt")
    index = write_shards(docs, tmp_path / "out", "bytes", shard_tokens=20, seed=0)
    assert index["vocab_size"] == 257 and index["dtype"] == "uint16"
    stream = np.concatenate(
        [np.fromfile(tmp_path / "out" / s["file"], dtype=np.uint16) for s in index["shards"]]
    )
    assert (stream == 256).sum() == 3  # one end-of-document per file
    assert sorted(bytes(stream[stream != 256].astype(np.uint8)).decode().replace("x" * 50, "X")) == sorted(
        "hello world" + "ünïcode text" + "X"
    )
    source = open_source(tmp_path / "out", seq_len=8, vocab=257, seed=0)
    assert source.total_windows == (stream.size - 1) // 8  # windows span shard ends: none is lost
    visited = [source.order(i) for i in range(source.total_windows)]
    assert sorted(visited) == list(range(source.total_windows)) and visited != sorted(visited)
    for i, w in enumerate(visited):  # sample i is window order(i) of the token stream, read in place
        assert np.array_equal(source.sample(i), stream[8 * w : 8 * w + 9])
    next_epoch = source.sample(source.total_windows)
    assert np.array_equal(next_epoch, stream[8 * source.order(0, 1) :][:9])


def test_shard_problems_are_one_line_naming_the_file(tmp_path):
    (tmp_path / "a.txt").write_text("some text " * 20)
    write_shards([tmp_path / "a.txt"], tmp_path / "out", "bytes")
    with pytest.raises(TrainstackError, match="vocab_size: the shards use 257"):
        open_source(tmp_path / "out", 8, vocab=256, seed=0)
    (shard,) = (tmp_path / "out" / "shards").glob("*.bin")
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(TrainstackError, match=r"\.bin: holds .* tokens, index.json says"):
        open_source(tmp_path / "out", 8, vocab=257, seed=0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TrainstackError, match="no token-shard index"):
        open_source(tmp_path / "empty", 8, vocab=257, seed=0)


# --- recipe input ------------------------------------------------------------------------------------
def test_hyperparameters_json_rebuilds_the_planned_recipe(tiny, tmp_path):
    path = tmp_path / "hyperparameters.json"
    path.write_text(json.dumps({**to_hyperparameters(tiny), "sagemaker_region": '"us-west-2"'}))
    assert recipe_from_json(path) == tiny
    full = tmp_path / "recipe.json"
    full.write_text(tiny.model_dump_json())
    assert recipe_from_json(full) == tiny


def test_bad_hyperparameters_name_file_and_field(tiny, tmp_path):
    path = tmp_path / "hyperparameters.json"
    path.write_text(json.dumps({**to_hyperparameters(tiny), "training.micro_batch": "0"}))
    with pytest.raises(RecipeError, match=r"hyperparameters.json: training.micro_batch: "):
        recipe_from_json(path)


@pytest.mark.parametrize(
    "args, expected",
    [
        ([], "--recipe: not given, and /opt/ml/input/config/hyperparameters.json does not exist"),
        (["--recipe", "does/not/exist.yaml"], "does/not/exist.yaml: file not found"),
        (
            ["--recipe", str(TINY), "--set", "parallelism.tp=2", "--set", "parallelism.shard_group=4"],
            "parallelism.tp: 2: the trainer does not implement tensor parallelism",
        ),
        (
            ["--recipe", str(TINY), "--set", "precision.dtype=fp8", "--set", "precision.fp8_recipe=current"],
            "precision.dtype: fp8 needs an NVIDIA GPU",
        ),
        (
            ["--recipe", str(TINY), "--set", "precision.dtype=fp8", "--set", "precision.fp8_recipe=current"]
            + ["--set", "activation_checkpointing.policy=op"],
            "activation_checkpointing.policy: op cannot run with precision.dtype fp8",
        ),
    ],
)
def test_cli_mistakes_exit_2_with_one_line(args, expected, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "trainer", "--device", "cpu", "--checkpoint-dir", str(tmp_path), *args],
        cwd=REPO,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
