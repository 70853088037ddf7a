"""The planner against hand-computed cases: every expected number below is worked out here from the
formulas in docs/planner.md, not read back from the planner."""

from __future__ import annotations

import pytest

from trainstack.hardware import INSTANCES
from trainstack.loader import resolve
from trainstack.planner import (
    GIB,
    ActivationPolicy,
    flops_per_token,
    memory_breakdown,
    plan,
    recommend,
    throughput,
)
from trainstack.recipe import ModelShape

B200 = INSTANCES["ml.p6-b200.48xlarge"]
TINY = ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=1000)
LLAMA3_8B = ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256)
BASE = ["1b-bf16", "3b-bf16", "7b-bf16", "8b-fp8", "14b-fp8", "30b-fp8", "64b-fp8", "8b-fp8-128k"]


def tiny_memory(**knobs):
    args = dict(
        seq_len=32, micro_batch=1, shard_group=8, policy=ActivationPolicy("none"), loss_chunk_tokens=8192
    )
    args.update(knobs)
    return {k: v * GIB for k, v in memory_breakdown(TINY, B200.gpu, **args).items()}  # back to bytes


# Tiny shape by hand: head_dim 16, kv dim 2*16 = 32.
# block params: wq 64*64 + wk 64*32 + wv 64*32 + wo 64*64 + MLP 3*64*128 + norms 2*64 = 36,992
# embeddings (untied) 2*1000*64 = 128,000; total 2*36,992 + 128,000 + final norm 64 = 202,048
TINY_PARAMS = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64) + 2 * 1000 * 64 + 64
# bytes one block saves per token without checkpointing (trainstack.trainer_memory, counted on the
# trainer's block): 12h + 4kv + 8ffn + 4 heads + 8 = 768 + 128 + 1024 + 16 + 8
TINY_BLOCK_BYTES = 12 * 64 + 4 * 32 + 8 * 128 + 4 * 4 + 8


def test_tiny_shape_parameter_count():
    assert TINY.total_params == TINY_PARAMS == 202_048


def test_sharded_states_are_16_bytes_per_parameter_over_the_shard_group():
    m = tiny_memory(shard_group=8)
    assert m["parameters (sharded FP32)"] == pytest.approx(TINY_PARAMS * 4 / 8)
    assert m["gradients (sharded FP32)"] == pytest.approx(TINY_PARAMS * 4 / 8)
    assert m["optimizer states (AdamW FP32)"] == pytest.approx(TINY_PARAMS * 8 / 8)
    wider = tiny_memory(shard_group=16)
    assert wider["optimizer states (AdamW FP32)"] == pytest.approx(TINY_PARAMS * 8 / 16)


def test_unsharded_layers_in_flight_two_blocks_and_the_root():
    # two blocks x 36,992 params x (2 BF16 param + 2 BF16 grad + 4 FP32 reduce) + root 128,000 x (2 + 2)
    expected = 2 * 36_992 * 8 + 128_000 * 4
    assert tiny_memory()["unsharded layers in flight"] == pytest.approx(expected)


@pytest.mark.parametrize(
    "policy, saved_per_token_per_layer",
    [
        (ActivationPolicy("none"), TINY_BLOCK_BYTES),
        (ActivationPolicy("selective (1 in 2)", 0.5), 0.5 * TINY_BLOCK_BYTES + 0.5 * 2 * 64),
        (ActivationPolicy("full", 1.0), 2 * 64),  # only the block input, BF16
    ],
)
def test_saved_activations_by_checkpointing_mode(policy, saved_per_token_per_layer):
    tokens = 4 * 32  # micro-batch 4 of 32 tokens
    m = tiny_memory(micro_batch=4, policy=policy)
    assert m["activations (saved)"] == pytest.approx(2 * saved_per_token_per_layer * tokens)
    # the loss chunk's backward (12 x 128 x 1000 + 128 x 64 x 2 bytes) is larger than one block's
    # recompute here, and the two run one after the other: nothing extra for the working set
    assert m["activations (backward working set)"] == 0


def test_backward_working_set_counts_what_one_block_adds_beyond_the_loss_peak():
    tokens = 4 * 32
    m = tiny_memory(micro_batch=4, loss_chunk_tokens=1)
    loss = 12 * 1 * 1000 + tokens * 64 * 2
    assert m["logits and loss"] == pytest.approx(loss)
    assert m["activations (backward working set)"] == pytest.approx(TINY_BLOCK_BYTES * tokens - loss)


def test_tensor_and_context_parallel_divide_activations():
    base = tiny_memory(micro_batch=4)["activations (saved)"]
    assert tiny_memory(micro_batch=4, shard_group=4, tp=2)["activations (saved)"] == pytest.approx(base / 2)
    assert tiny_memory(micro_batch=4, shard_group=4, cp=2)["activations (saved)"] == pytest.approx(base / 2)


def test_logits_use_one_chunk_of_the_chunked_loss():
    # 12 bytes per token per vocabulary entry for one chunk, plus the final hidden states in BF16
    whole = tiny_memory(micro_batch=4)["logits and loss"]  # chunk 8192 > 128 tokens: one chunk of 128
    assert whole == pytest.approx(12 * 128 * 1000 + 128 * 64 * 2)
    chunked = tiny_memory(micro_batch=4, loss_chunk_tokens=16)["logits and loss"]
    assert chunked == pytest.approx(12 * 16 * 1000 + 128 * 64 * 2)


def test_overheads_fragmentation_context_and_nccl():
    m = tiny_memory()
    model_side = sum(
        v for k, v in m.items() if k not in ("allocator fragmentation", "CUDA context", "NCCL buffers")
    )
    assert m["allocator fragmentation"] == pytest.approx(0.05 * model_side)
    assert m["CUDA context"] == pytest.approx(1.0 * GIB)
    assert m["NCCL buffers"] == pytest.approx(1.0 * GIB)


def test_llama3_8b_states_on_one_node():
    # 8,030,261,248 params x 16 bytes / 8 GPUs = 14.96 GiB of sharded states per GPU
    m = memory_breakdown(
        LLAMA3_8B,
        B200.gpu,
        seq_len=8192,
        micro_batch=2,
        shard_group=8,
        policy=ActivationPolicy("none"),
        loss_chunk_tokens=8192,
    )
    states = (
        m["parameters (sharded FP32)"] + m["gradients (sharded FP32)"] + m["optimizer states (AdamW FP32)"]
    )
    assert states == pytest.approx(8_030_261_248 * 16 / 8 / 2**30)


def test_flops_per_token_is_palm_6n_plus_attention():
    # Llama 3 8B: N = 32 blocks x 218,112,000 + final norm 4,096 + output head 128,256 x 4,096
    n = 32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096) + 4096 + 128256 * 4096
    attention = 12 * 32 * 32 * 128 * 8192
    assert flops_per_token(LLAMA3_8B, 8192) == 6 * n + attention == pytest.approx(57.914e9, rel=1e-4)


def test_throughput_by_hand_for_llama3_8b_bf16_on_b200():
    # compute per micro-step: 2 x 8192 tokens x 57.914 GFLOP / (2250 TFLOP/s x 0.556) + 32 layers x 0.3 ms
    fpt = flops_per_token(LLAMA3_8B, 8192)
    micro = 2 * 8192 * fpt / (2250e12 * 0.556) + 32 * 0.0003
    step = (128 // (2 * 8)) * micro  # 8 micro-steps; FSDP traffic on NVLink hides under compute
    t = throughput(
        LLAMA3_8B,
        B200,
        seq_len=8192,
        micro_batch=2,
        global_batch=128,
        world_size=8,
        shard_group=8,
        dtype="bf16",
        fp8_recipe=None,
        policy=ActivationPolicy("none"),
    )
    assert t.step_time_s == pytest.approx(step)
    assert t.tokens_per_sec_per_gpu == pytest.approx(128 * 8192 / 8 / step)
    assert t.mfu == pytest.approx(t.tokens_per_sec_per_gpu * fpt / 2250e12)
    # and it lands within 5% of the published 21,618 tokens/s/GPU it was calibrated on
    assert t.tokens_per_sec_per_gpu == pytest.approx(21618, rel=0.05)


def test_fp8_gain_and_recompute_cost():
    kw = dict(seq_len=8192, micro_batch=2, global_batch=128, world_size=8, shard_group=8)
    bf16 = throughput(LLAMA3_8B, B200, dtype="bf16", fp8_recipe=None, policy=ActivationPolicy("none"), **kw)
    fp8 = throughput(
        LLAMA3_8B, B200, dtype="fp8", fp8_recipe="current", policy=ActivationPolicy("none"), **kw
    )
    overhead = 32 * 0.0003
    assert (bf16.compute_time_per_micro_step_s - overhead) / (
        fp8.compute_time_per_micro_step_s - overhead
    ) == pytest.approx(1.417, rel=1e-3)
    full = throughput(
        LLAMA3_8B, B200, dtype="bf16", fp8_recipe=None, policy=ActivationPolicy("full", 1.0), **kw
    )
    # full recompute = one more forward: 2 x block weights + 4 L H Q T attention FLOPs per token
    extra = 2 * (LLAMA3_8B.non_embedding_params - 4096) + 4 * 32 * 32 * 128 * 8192
    assert full.recompute_flops_per_token == pytest.approx(extra)
    assert (full.compute_time_per_micro_step_s - overhead) / (
        bf16.compute_time_per_micro_step_s - overhead
    ) == pytest.approx((bf16.flops_per_token + extra) / bf16.flops_per_token)


def test_cost_is_price_times_nodes_times_hours():
    recipe = resolve("30b-fp8").recipe
    p = plan(recipe)
    # Instance hours: training plus each job's start-up and restore (trainstack.run_plan).
    hours = recipe.training.steps * p.throughput.step_time_s / 3600 + p.run.overhead_hours
    assert p.run.overhead_hours > 0
    assert p.cost.hours == pytest.approx(hours)
    assert p.cost.usd_per_hour == pytest.approx(B200.usd_per_hour * 4)
    assert p.cost.total_usd == pytest.approx(B200.usd_per_hour * 4 * hours)
    assert p.cost.tokens == recipe.training.steps * recipe.training.global_batch * recipe.training.seq_len


def test_peak_is_the_sum_of_the_breakdown_and_fits_compares_with_usable():
    p = plan(resolve("8b-fp8").recipe)
    assert p.memory.peak_gib == pytest.approx(sum(p.memory.breakdown.values()), abs=0.01)
    assert p.memory.usable_gib == 179.0
    assert p.fits == (p.memory.peak_gib <= p.memory.usable_gib)


@pytest.mark.parametrize("name", BASE)
def test_every_base_recipe_fits_and_uses_the_largest_micro_batch_within_headroom(name):
    recipe = resolve(name).recipe
    p = plan(recipe)
    assert p.fits, p.verdict
    assert p.memory.peak_gib <= p.memory.budget_gib  # within the 10% headroom the recipes promise
    advice = recommend(recipe)
    assert advice.max_micro_batch == recipe.training.micro_batch
    # Inside a node any group rides NVLink, so recipes shard over the whole node to free memory for batch;
    # a group wider than a node must be the smallest that fits (memory forced it wider).
    assert advice.smallest_shard_group <= recipe.parallelism.shard_group
    if recipe.parallelism.shard_group > recipe.instance.gpus:
        assert advice.smallest_shard_group == recipe.parallelism.shard_group
    else:
        assert recipe.parallelism.shard_group == recipe.instance.gpus
    assert advice.lightest_checkpointing.split()[0] == recipe.activation_checkpointing.mode


@pytest.mark.parametrize("name", BASE)
def test_precision_follows_the_guide_by_size(name):
    recipe = resolve(name).recipe
    advice = recommend(recipe)
    assert advice.precision == ("fp8" if recipe.model.total_params >= 6e9 else "bf16")
    if name != "7b-bf16":  # the deliberate BF16 baseline at the threshold; the plan notes FP8 instead
        assert advice.precision == recipe.precision.dtype


def test_64b_on_one_node_without_checkpointing_does_not_fit_and_names_the_fix():
    recipe = resolve(
        "64b-fp8",
        overrides=[
            "compute.instance_count=1",
            "parallelism.shard_group=8",
            "activation_checkpointing.mode=none",
        ],
    ).recipe
    p = plan(recipe)
    assert not p.fits
    assert p.memory.breaking_component == "activations (saved)"
    assert "activation_checkpointing.mode=full" in p.memory.fix


def test_128k_context_keeps_logits_to_one_chunk():
    p = plan(resolve("8b-fp8-128k").recipe)
    whole_fp32 = 4 * 131072 * 128256 / GIB  # the README's 67 GB
    assert p.memory.breakdown["logits and loss"] < whole_fp32 / 4
    assert p.fits


def test_plan_to_dict_has_the_documented_shape():
    d = plan(resolve("8b-fp8").recipe).to_dict()
    assert isinstance(d["fits"], bool)
    for key in ("peak_gib", "usable_gib", "breakdown"):
        assert key in d["memory"]
    for key in ("tokens_per_sec_per_gpu", "mfu", "step_time_s"):
        assert key in d["throughput"]
    for key in ("usd_per_hour", "total_usd", "hours"):
        assert key in d["cost"]


def test_selective_checkpointing_counts_the_blocks_the_trainer_checkpoints():
    # every: 3 over 32 blocks checkpoints blocks 0, 3, ..., 30: 11 keep only their input (2h bytes/token),
    # 21 keep everything (12h + 4kv + 8ffn + 4 heads + 8 = 168,072 bytes/token, Llama 3 8B); 2 x 8192 tokens
    recipe = resolve(
        "8b-fp8", overrides=["activation_checkpointing.mode=selective", "activation_checkpointing.every=3"]
    ).recipe
    saved = (21 * (12 * 4096 + 4 * 1024 + 8 * 14336 + 4 * 32 + 8) + 11 * 2 * 4096) * 2 * 8192
    assert plan(recipe).memory.breakdown["activations (saved)"] == pytest.approx(saved / GIB, abs=1e-3)
