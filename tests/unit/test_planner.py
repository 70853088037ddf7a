"""The planner against hand-computed cases and the behaviour docs/planner.md promises: expected numbers
are worked out here from the formulas (or compared between layouts), not read back from the planner."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainstack.planner import (
    CALIBRATION,
    GIB,
    ActivationPolicy,
    flops_by_kind,
    flops_per_token,
    fp8_gain_cap,
    memory_breakdown,
    plan,
    recompute_flops_per_token,
    throughput,
)
from trainstack.planner.trainer_memory import (
    bottom_block_backward_in_flight_bytes,
    full_recompute_share,
    loss_backward_in_flight_bytes,
    top_block_backward_in_flight_bytes,
)
from trainstack.recipes.hardware import INSTANCES
from trainstack.recipes.loader import resolve
from trainstack.recipes.schema import ModelShape

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]
B200 = INSTANCES["ml.p6-b200.48xlarge"]
TINY = ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=1000)
LLAMA3_8B = ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256)
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
# bytes one block saves per token without checkpointing (trainstack.planner.trainer_memory, counted on the
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


TINY_PPL = 36_992  # the tiny block's parameters (above)


def test_unsharded_layers_in_flight_at_the_loss_backward():
    # The peak of the tiny step is the loss's backward (the traced step's moments, trainer_memory): the
    # 1000 x 64 head matrix in BF16 with its BF16 gradient, and the last block's BF16 parameters.
    expected = 1000 * 64 * (2 + 2) + TINY_PPL * 2
    assert tiny_memory()["unsharded layers in flight"] == pytest.approx(expected)


def test_a_block_backward_peak_holds_its_units_and_its_working_set():
    # Full recompute and a one-token loss chunk on the 2-block shape: the last block's backward is the
    # peak. It holds this block and the next in BF16, the FP32 reduce-scatter input of the unit above
    # (the untied [norm, output] head unit, 1000 x 64 + 64, larger than a block here; FSDP2 keeps it
    # until this block's reduce-scatter), every block's checkpointed input, and the block rebuilt with
    # fc1's output gradient (4 x ffn bytes per token).
    tokens = 4 * 32
    m = tiny_memory(micro_batch=4, loss_chunk_tokens=1, policy=ActivationPolicy("full", 1.0))
    assert m["unsharded layers in flight"] == pytest.approx(TINY_PPL * (2 + 2) + (1000 * 64 + 64) * 4)
    assert m["activations (saved)"] == pytest.approx(2 * 2 * 64 * tokens)
    # ... and fc2's BF16 weight gradient (128 x 64): an upper block's backward peaks before fc1's is made
    assert m["activations (backward working set)"] == pytest.approx(
        (TINY_BLOCK_BYTES + 4 * 128) * tokens + 2 * 128 * 64
    )
    assert m["logits and loss"] == 0


@pytest.mark.parametrize("name", BASE)
def test_unsharded_layers_in_flight_are_the_trainers_fsdp_units(name):
    # The trainer's own figures (trainstack.planner.trainer_memory, the traced step's moments), not a
    # second copy of the formula: the peak holds the units of one of the three moments.
    recipe = resolve(name).recipe
    planned = plan(recipe).memory.breakdown["unsharded layers in flight"]
    moments = [
        f(recipe.model) / GIB
        for f in (
            loss_backward_in_flight_bytes,
            top_block_backward_in_flight_bytes,
            bottom_block_backward_in_flight_bytes,
        )
    ]
    assert min(abs(planned - m) for m in moments) < 1e-3


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


def test_the_peak_is_one_moment_not_the_sum_of_the_loss_and_a_block_backward():
    # A one-token loss chunk makes the loss's backward small: the block's backward is the peak, and
    # the logits are not added to it (the traced step frees them before any block's backward).
    tokens = 64 * 32
    m = tiny_memory(micro_batch=64, loss_chunk_tokens=1)
    assert m["logits and loss"] == 0
    assert m["activations (backward working set)"] == pytest.approx(4 * 128 * tokens + 2 * 128 * 64)
    # this block and the next in BF16, the FP32 reduce-scatter input of the head unit above
    assert m["unsharded layers in flight"] == pytest.approx(TINY_PPL * (2 + 2) + (1000 * 64 + 64) * 4)


def test_tensor_and_context_parallel_divide_activations():
    base = tiny_memory(micro_batch=4)["activations (saved)"]
    assert tiny_memory(micro_batch=4, shard_group=4, tp=2)["activations (saved)"] == pytest.approx(base / 2)
    # CP halves the tokens a GPU holds; an uncheckpointed block also keeps the all-gathered K/V, the
    # other rank's 2 x 32 kv values in BF16 per local token (trainer_memory, counted on the CP block).
    layers, local_tokens = 2, 4 * 32 / 2
    gathered = layers * 2 * 2 * 32 * (2 - 1) * local_tokens
    cp2 = tiny_memory(micro_batch=4, shard_group=4, cp=2)
    assert cp2["activations (saved)"] == pytest.approx(base / 2 + gathered)
    # FSDP shards over shard_group x cp: cp 2 at shard group 4 shards like shard group 8
    assert cp2["optimizer states (AdamW FP32)"] == pytest.approx(
        tiny_memory(shard_group=8)["optimizer states (AdamW FP32)"]
    )
    full = ActivationPolicy("full", 1.0)
    assert tiny_memory(micro_batch=4, cp=2, shard_group=4, policy=full)[
        "activations (saved)"
    ] == pytest.approx(tiny_memory(micro_batch=4, policy=full)["activations (saved)"] / 2)


def test_logits_use_one_chunk_of_the_chunked_loss():
    # 12 bytes per token per vocabulary entry for one chunk, plus per token the final norm's saved
    # input and output and the final hidden states' gradient, 3 x 2h (BF16)
    whole = tiny_memory(micro_batch=4)["logits and loss"]  # chunk 8192 > 128 tokens: one chunk of 128
    assert whole == pytest.approx(12 * 128 * 1000 + 128 * 64 * 6)
    chunked = tiny_memory(micro_batch=4, loss_chunk_tokens=16)["logits and loss"]
    assert chunked == pytest.approx(12 * 16 * 1000 + 128 * 64 * 6)


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


def _llama8b(dtype="bf16", fp8_recipe=None, **knobs):
    args = dict(
        seq_len=8192,
        micro_batch=2,
        global_batch=128,
        world_size=8,
        shard_group=8,
        dtype=dtype,
        fp8_recipe=fp8_recipe,
        policy=ActivationPolicy.none(),
        compile=True,
        loss_chunk_tokens=2048,
    )
    args.update(knobs)
    return throughput(LLAMA3_8B, B200, **args)


def test_block_gemm_time_by_hand_for_llama3_8b_bf16_on_b200():
    # Each block linear (in K, out N) at M = 2 x 8192 tokens: three GEMMs of 2MKN FLOPs at the planning
    # efficiency of dense BF16 peak, plus one pass over the operands and the output (MK + KN + MN BF16
    # elements) per GEMM at HBM bandwidth; seven linears per block, 32 blocks, 8 micro-steps per step.
    cal = CALIBRATION
    rate = 2250e12 * cal.planning_efficiency("B200")
    m_tokens, h, kv, f = 2 * 8192, 4096, 1024, 14336
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, f), (h, f), (f, h)]
    one_block = sum(
        3 * 2 * m_tokens * k * n / rate
        + 3 * cal.gemm_memory_passes * 2 * (m_tokens * k + k * n + m_tokens * n) / 7.7e12
        for k, n in shapes
    )
    t = _llama8b()
    assert t.grad_accum_steps == 8
    assert t.seconds_by_kind["block GEMMs"] == pytest.approx(8 * 32 * one_block)


def test_step_time_is_the_sum_of_its_kinds_and_tokens_per_second_follow_from_it():
    for t in (_llama8b(), _llama8b("fp8", "mxfp8"), _llama8b(policy=ActivationPolicy.full())):
        assert t.step_time_s == pytest.approx(sum(t.seconds_by_kind.values()))
        assert t.tokens_per_sec_per_gpu == pytest.approx(128 * 8192 / 8 / t.step_time_s)
        assert t.mfu == pytest.approx(t.tokens_per_sec_per_gpu * t.flops_per_token / t.peak_tflops / 1e12)


def test_fp8_speeds_up_only_the_block_gemms():
    bf16, fp8 = _llama8b(), _llama8b("fp8", "current")
    assert fp8.seconds_by_kind["block GEMMs"] < 0.8 * bf16.seconds_by_kind["block GEMMs"]
    for kind in ("attention", "output head and loss", "elementwise"):  # BF16 in the trainer either way
        assert fp8.seconds_by_kind[kind] == pytest.approx(bf16.seconds_by_kind[kind])


def test_fp8_gains_little_at_128k_where_attention_dominates():
    kw = dict(
        seq_len=131072, micro_batch=1, global_batch=8, policy=ActivationPolicy.full(), loss_chunk_tokens=8192
    )
    long_bf16, long_fp8 = _llama8b(**kw), _llama8b("fp8", "mxfp8", **kw)
    share = long_bf16.seconds_by_kind["attention"] / long_bf16.step_time_s
    assert share > 0.5
    assert long_fp8.fp8_gain < 1.10  # a few percent, not 8K's gain
    assert _llama8b("fp8", "mxfp8").fp8_gain > long_fp8.fp8_gain + 0.1


def test_fp8_gain_is_capped_at_the_published_gain_for_the_size():
    big = ModelShape(layers=80, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256)  # ~260B
    t = throughput(
        big,
        B200,
        seq_len=8192,
        micro_batch=4,
        global_batch=2048,
        world_size=512,
        shard_group=8,  # memory aside: GEMM-bound, so the modelled gain exceeds the published one
        dtype="fp8",
        fp8_recipe="current",
        policy=ActivationPolicy.full(),
    )
    assert t.fp8_gain_cap == pytest.approx(1.28)  # beyond the largest published size: its figure, flat
    assert t.fp8_gain <= t.fp8_gain_cap + 1e-9
    assert "FP8 gain cap" in t.limited_by
    assert fp8_gain_cap("blackwell", 8.0e9) == pytest.approx(1.254)
    assert fp8_gain_cap("blackwell", 1.0e9) == pytest.approx(1.254)  # flat below the smallest published
    assert 1.254 < fp8_gain_cap("blackwell", 30e9) < 1.28  # interpolated in log parameters


def test_small_micro_batches_and_small_models_run_further_from_peak():
    one, two, eight = (_llama8b(micro_batch=mb).seconds_by_kind["block GEMMs"] / mb for mb in (1, 2, 8))
    assert one > two > eight  # per sequence: the GEMMs' M dimension is the micro-step's tokens
    small = ModelShape(layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256)
    flops_rate = {}
    for name, shape in (("small", small), ("8b", LLAMA3_8B)):
        t = throughput(
            shape, B200, seq_len=8192, micro_batch=2, global_batch=16, world_size=8, shard_group=8,
            dtype="bf16", fp8_recipe=None, policy=ActivationPolicy.none(),
        )  # fmt: skip
        gemm_flops = 6 * shape.layers * sum(k * n for k, n in _shapes(shape)) * 2 * 8192
        flops_rate[name] = gemm_flops / t.seconds_by_kind["block GEMMs"]
    assert flops_rate["small"] < flops_rate["8b"]


def _shapes(m):
    kv = m.kv_heads * m.head_dim
    h, f = m.hidden, m.ffn
    return ((h, h), (h, kv), (h, kv), (h, h), (h, f), (h, f), (f, h))


def test_a_shard_group_across_nodes_pays_for_its_traffic_and_a_larger_micro_batch_hides_it():
    model = resolve("64b-fp8").recipe.model
    kw = dict(
        seq_len=8192, global_batch=1024, world_size=64, dtype="fp8", fp8_recipe="mxfp8",
        policy=ActivationPolicy.full(),
    )  # fmt: skip
    inside = throughput(model, B200, micro_batch=1, shard_group=8, **kw)
    across = throughput(model, B200, micro_batch=1, shard_group=16, **kw)
    across_mb4 = throughput(model, B200, micro_batch=4, shard_group=16, **kw)
    exposed = lambda t: t.seconds_by_kind["exposed FSDP communication"] / t.step_time_s  # noqa: E731
    assert exposed(inside) < 0.05 < 0.3 < exposed(across)
    assert across.tokens_per_sec_per_gpu < 0.5 * inside.tokens_per_sec_per_gpu
    assert exposed(across_mb4) < exposed(across) / 4


def test_compile_shortens_only_the_elementwise_work():
    eager, compiled = _llama8b(compile=False), _llama8b(compile=True)
    ratio = compiled.seconds_by_kind["elementwise"] / eager.seconds_by_kind["elementwise"]
    assert ratio == pytest.approx(CALIBRATION.compile_elementwise_factor)
    assert compiled.seconds_by_kind["block GEMMs"] == eager.seconds_by_kind["block GEMMs"]


def test_recompute_costs_one_more_forward_of_the_checkpointed_blocks():
    none, full = _llama8b(), _llama8b(policy=ActivationPolicy.full())
    # full recompute on the trainer's Transformer Engine block = one more forward (TE's checkpoint
    # replays all four matmuls): 2 x block weights + 4 L H Q T attention FLOPs per token
    assert full.backend == "transformer_engine"
    block_matmul = 32 * sum(k * n for k, n in _shapes(LLAMA3_8B))
    assert full.flops_by_kind["activation recompute"] == pytest.approx(
        2 * block_matmul + 4 * 32 * 32 * 128 * 8192
    )
    assert full.recompute_flops_per_token == pytest.approx(
        full.flops_by_kind["activation recompute"] + 2 * 128256 * 4096  # plus the loss chunks' head recompute
    )
    gemm_forward = none.seconds_by_kind["block GEMMs"] / 3
    assert full.seconds_by_kind["activation recompute"] > gemm_forward
    op = _llama8b(policy=ActivationPolicy.op_selective())
    assert 0 < op.seconds_by_kind["activation recompute"] < full.seconds_by_kind["activation recompute"]


def test_full_recompute_replays_what_the_backends_checkpoint_replays():
    # torch's non-reentrant checkpoint (pure-PyTorch block, torchtitan) stops once fc2's input is
    # rebuilt: Q/K/V + proj + fc1 of 4096 x (6144 + 4096 + 28672 + 14336) multiply-adds per token
    h, f = 4096, 14336
    replayed = h * (h + 2 * 1024) + h * h + h * 2 * f
    share = replayed / (replayed + f * h)
    assert share == pytest.approx(full_recompute_share(LLAMA3_8B, "pytorch"))
    assert full_recompute_share(LLAMA3_8B, "transformer_engine") == 1.0
    block_matmul = 32 * sum(k * n for k, n in _shapes(LLAMA3_8B))
    attention = 4 * 32 * 32 * 128 * 8192
    te = _llama8b(policy=ActivationPolicy.full())
    torch_block = _llama8b(policy=ActivationPolicy.full(), backend="pytorch")
    assert te.flops_by_kind["activation recompute"] == pytest.approx(2 * block_matmul + attention)
    assert torch_block.flops_by_kind["activation recompute"] == pytest.approx(
        share * 2 * block_matmul + attention
    )
    gemm_forward = te.seconds_by_kind["block GEMMs"] / 3
    saved = te.seconds_by_kind["activation recompute"] - torch_block.seconds_by_kind["activation recompute"]
    assert saved == pytest.approx((1 - share) * gemm_forward)


@pytest.mark.parametrize("name", BASE)
def test_each_base_recipe_recomputes_as_the_block_it_runs_on(name):
    # trainer.models.model.select_backend on a GPU with TE (the image always has it): TE in BF16 and FP8
    # alike, the pure-PyTorch block only for the op-level policy.
    recipe = resolve(name).recipe
    t = plan(recipe).throughput
    op = recipe.activation_checkpointing.policy == "op"
    assert t.backend == ("pytorch" if op else "transformer_engine")
    policy = ActivationPolicy.from_recipe(recipe.activation_checkpointing, recipe.model.layers)
    expected = recompute_flops_per_token(recipe.model, recipe.training.seq_len, policy, t.backend)
    assert t.flops_by_kind["activation recompute"] == pytest.approx(expected)


def test_untied_models_expose_only_the_embeddings_fsdp_traffic():
    # The trainer wraps the embedding and [norm, head] as units of their own: the head's gather is
    # prefetched like a block's, so a shard group across nodes exposes only the embedding's traffic.
    model = resolve("64b-fp8").recipe.model
    kw = dict(
        seq_len=8192, micro_batch=1, global_batch=1024, world_size=64, shard_group=16, dtype="fp8",
        fp8_recipe="mxfp8", policy=ActivationPolicy.full(),
    )  # fmt: skip
    ours, one_root = throughput(model, B200, **kw), throughput(model, B200, root_unit=True, **kw)
    assert ours.tokens_per_sec_per_gpu == pytest.approx(
        throughput(model, B200, root_unit=False, **kw).tokens_per_sec_per_gpu
    )
    exposed = lambda t: t.seconds_by_kind["exposed FSDP communication"]  # noqa: E731
    # per micro-step: (2-byte gather + 4-byte reduce) x one more vocab x hidden matrix x 15/16 over a NIC
    nic = 3200e9 / 8 / 8 * CALIBRATION.efa_efficiency
    head = (2 + 4) * 128256 * 8192 * 15 / 16 / nic
    micro_steps = 1024 // 64
    assert exposed(one_root) - exposed(ours) == pytest.approx(micro_steps * head, rel=1e-6)
    tied = resolve("1b-bf16").recipe.model  # one [embedding, norm, head] unit: the same either way
    kw_tied = {**kw, "dtype": "bf16", "fp8_recipe": None}
    assert throughput(tied, B200, **kw_tied).step_time_s == pytest.approx(
        throughput(tied, B200, root_unit=True, **kw_tied).step_time_s
    )


def test_flops_by_kind_add_up_to_the_palm_formula():
    kinds = flops_by_kind(LLAMA3_8B, 8192, ActivationPolicy.none())
    model = kinds["block GEMMs"] + kinds["attention"] + kinds["output head"]
    assert model == pytest.approx(flops_per_token(LLAMA3_8B, 8192))


def test_cost_is_price_times_nodes_times_instance_hours():
    recipe = resolve("30b-fp8").recipe
    p = plan(recipe)
    # Instance hours: training plus each job's start-up and restore, staging waits and expected failures.
    hours = recipe.training.steps * p.throughput.step_time_s / 3600 + p.run.overhead_hours
    assert p.run.overhead_hours > 0
    assert p.cost.hours == pytest.approx(hours)
    assert p.cost.usd_per_hour == pytest.approx(B200.usd_per_hour * 4)
    # plus the run's checkpoints in S3 (trainstack.planner.storage), included in the total
    assert 0 < p.cost.storage_usd == p.storage.usd < 0.01 * p.cost.total_usd
    assert p.cost.total_usd == pytest.approx(B200.usd_per_hour * 4 * hours + p.cost.storage_usd)
    assert p.cost.tokens == recipe.training.steps * recipe.training.global_batch * recipe.training.seq_len


def test_peak_is_the_sum_of_the_breakdown_and_fits_compares_with_usable():
    p = plan(resolve("8b-fp8").recipe)
    assert p.memory.peak_gib == pytest.approx(sum(p.memory.breakdown.values()), abs=0.01)
    assert p.memory.usable_gib == 179.0
    assert p.fits == (p.memory.peak_gib <= p.memory.usable_gib)


@pytest.mark.parametrize("name", BASE)
def test_every_base_recipe_fits_within_headroom_and_is_its_own_recommendation(name):
    recipe = resolve(name).recipe
    p = plan(recipe)
    assert p.fits, p.verdict
    assert p.memory.peak_gib <= p.memory.budget_gib  # within the 10% headroom the recipes promise
    rec = p.recommendations
    assert rec.matches, (rec.set_flags, rec.notes)
    assert all(change.matches for change in rec.changes)


@pytest.mark.parametrize("name", BASE)
def test_precision_follows_the_guide_by_size(name):
    recipe = resolve(name).recipe
    advice = plan(recipe).recommendations
    assert advice.precision == ("fp8" if recipe.model.total_params >= 6e9 else "bf16")
    if name == "7b-bf16":  # the deliberate BF16 baseline at the threshold: the plan says so in a note
        assert any("suggests fp8" in note for note in advice.notes)
    else:
        assert advice.precision == recipe.precision.dtype


@pytest.mark.parametrize("name", BASE)
def test_base_recipes_keep_the_guides_rules(name):
    recipe = resolve(name).recipe
    params = recipe.model.total_params
    if params >= 30e9:
        assert recipe.compute.instance_count > 1  # multi-node from ~30B
    if recipe.training.seq_len / recipe.parallelism.cp >= 131072:
        # 128K on one GPU per sequence without CPU offload; context parallelism splits the sequence
        assert recipe.activation_checkpointing.mode == "full"
    tokens_per_param = recipe.training.steps * recipe.tokens_per_step / params
    text = (ROOT / "recipes" / f"{name}.yaml").read_text()
    # every recipe states its tokens per parameter, and says why when far from ~20
    stated = (
        f"{tokens_per_param:.0f} per parameter" in text or f"{tokens_per_param:.1f} per parameter" in text
    )
    assert stated, f"{name}: {tokens_per_param:.1f} tokens per parameter not stated"
    if not 15 <= tokens_per_param <= 25:
        assert "continued" in text or "context-extension" in text


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
    # the fix is the recommendation on the recipe's own node, as pasteable flags
    assert "--set activation_checkpointing.mode=full" in p.memory.fix
    assert "compute.instance_count" not in p.memory.fix


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


def test_a_recipe_is_planned_once_however_often_it_is_asked_and_a_changed_one_anew():
    """A request check and a synthesis plan the same recipe many times (trainstack.planner.core._PLANS)."""
    from trainstack.planner.core import plan as planned
    from trainstack.recipes.loader import resolve

    first = planned(resolve("8b-fp8", None).recipe)
    assert planned(resolve("8b-fp8", None).recipe) is first  # an equal recipe, resolved again
    changed = planned(resolve("8b-fp8", None, ("training.steps=1000",)).recipe)
    assert changed is not first and changed.run.hours < first.run.hours  # 1,000 steps, not the recipe's
