"""Throughput from the work itself: FLOPs and bytes by kind, each at its own rate (docs/planner.md).

One optimizer step of one GPU is the sum of:

- block GEMMs (wq wk wv wo w1 w3 w2; forward, input-gradient and weight-gradient GEMMs): FLOP time at
  the GEMM efficiency of the GPU's architecture, plus the memory traffic over operands and output that
  makes small GEMMs slow; in FP8 (`precision.dtype: fp8`; the trainer runs exactly these in FP8 inside
  Transformer Engine's autocast) at the FP8 peak, plus the quantisation traffic of the scaling recipe;
- attention (flash attention, always BF16), causal, at its own rate;
- elementwise ops (norms, RoPE, SiLU, residuals, copies): memory-bound, fused by torch.compile;
- activation recompute: the forward of checkpointed blocks again, as far as the trainer's checkpoint
  replays it (Transformer Engine's checkpoint replays all four matmuls, torch's non-reentrant one
  stops before fc2: trainer_memory.full_recompute_share for the backend the block runs on), plus its
  attention and elementwise ops; the op policy: its share of the GEMMs plus the elementwise ops;
- output head and loss: the BF16 head GEMM per loss chunk, forward, backward and the chunk's recompute,
  plus the FP32 logit traffic;
- host overhead: a block whose GPU work is shorter than its CPU launch time waits for the CPU;
- FSDP all-gather and reduce-scatter per block per micro-step, overlapped only as far as the trainer
  overlaps it (it prefetches one block: block i+1's all-gather runs under block i's compute), on
  NVLink inside a node and on each GPU's own EFA NIC across nodes; the embedding's unit is gathered
  before and reduced after each micro-step's compute, not overlapped (the trainer's FSDP units: the
  embedding, each block, [norm, head]; one [embedding, norm, head] unit when tied, all of it exposed);
- the HSDP gradient all-reduce across replicas, overlapped with the last micro-step's backward except
  the embedding's, which comes last;
- the optimizer (memory-bound over the GPU's parameter shard) and a fixed per-step cost.

Then two limits: FP8's end-to-end gain may not exceed what was published at that model size, and no
GPU may be busier than the best published B200 run of its precision (trainstack.planner.calibration).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainstack.planner.calibration import (
    B200_BF16_PEAK_TFLOPS,
    BEST_PUBLISHED_B200_TFLOPS,
    CALIBRATION,
    FP8_GAIN_PUBLISHED,
    HBM_BYTES_PER_S,
    Calibration,
    loo_range,
)
from trainstack.planner.memory import ActivationPolicy, op_selective_recompute_share
from trainstack.planner.trainer_memory import block_activation_bytes, full_recompute_share
from trainstack.recipes.hardware import Instance
from trainstack.recipes.schema import ModelShape

GRAD_REDUCE_BYTES = 4  # reduce_dtype FP32 (trainer/distributed/parallel.py)
BF16 = 2

KINDS = (
    "block GEMMs",
    "attention",
    "elementwise",
    "activation recompute",
    "output head and loss",
    "host overhead",
    "exposed FSDP communication",
    "exposed replica all-reduce",
    "optimizer",
    "fixed per step",
)


# --- FLOPs ----------------------------------------------------------------------------------------


def flops_per_token(model: ModelShape, seq_len: int) -> float:
    """Training FLOPs per token, PaLM appendix B: 6*N + 12*L*H*Q*T.

    N counts every matmul weight a token passes through: the blocks and the output head, but not the
    input embedding (a lookup, no FLOPs). The attention term uses the full sequence length T (no causal
    halving), as PaLM and torchtitan do, so MFU figures compare with theirs.
    """
    matmul_params = model.non_embedding_params + model.vocab * model.hidden  # output head
    attention = 12 * model.layers * model.heads * model.head_dim * seq_len
    return 6.0 * matmul_params + attention


def _block_linear_shapes(m: ModelShape) -> tuple[tuple[int, int], ...]:
    """(in, out) of each block linear: wq, wk, wv, wo, w1, w3, w2 (q = heads x head_dim)."""
    h, q, kv, f = m.hidden, m.q_dim, m.kv_dim, m.ffn
    return ((h, q), (h, kv), (h, kv), (q, h), (h, f), (h, f), (f, h))


def _block_matmul_params(m: ModelShape) -> int:
    return sum(k * n for k, n in _block_linear_shapes(m))


def trainer_backend(policy: ActivationPolicy) -> str:
    """The block the trainer runs for this policy on a catalogued instance (all NVIDIA GPUs, and the
    training image always has Transformer Engine: its build imports it). trainer.models.model.select_backend:
    Transformer Engine on CUDA, in BF16 and FP8 alike, unless the op-level policy needs every op
    visible to PyTorch's dispatcher, which only the pure-PyTorch block allows."""
    return "pytorch" if policy.op_level else "transformer_engine"


def recompute_share(m: ModelShape, policy: ActivationPolicy, backend: str | None = None) -> float:
    """Share of a checkpointed block's matmul FLOPs its recompute replays: the op policy's share, or a
    whole block's as the backend's checkpoint replays it (trainer_memory.full_recompute_share)."""
    if policy.op_level:
        return op_selective_recompute_share(m, policy.torchtitan)
    return full_recompute_share(m, backend or trainer_backend(policy))


def recompute_flops_per_token(
    m: ModelShape, seq_len: int, policy: ActivationPolicy, backend: str | None = None
) -> float:
    """Extra forward FLOPs per token spent recomputing checkpointed activations in backward (PaLM
    counting: attention without causal halving), not counting the loss chunk's recompute. `backend`:
    the block whose checkpoint replays the forward (default: the one our trainer runs)."""
    block_matmul = 2.0 * m.layers * _block_matmul_params(m)
    attention_fwd = 4.0 * m.layers * m.heads * m.head_dim * seq_len
    share = recompute_share(m, policy, backend)
    if policy.op_level:
        return share * block_matmul
    return policy.checkpointed_fraction * (share * block_matmul + attention_fwd)


def flops_by_kind(
    m: ModelShape, seq_len: int, policy: ActivationPolicy, backend: str | None = None
) -> dict[str, float]:
    """Model and recompute FLOPs per token, by kind (PaLM counting). The first three sum to
    flops_per_token; the last two are recompute (hardware work, not model FLOPs)."""
    return {
        "block GEMMs": 6.0 * m.non_embedding_params,  # PaLM's N counts the norm weights too
        "attention": 12.0 * m.layers * m.heads * m.head_dim * seq_len,
        "output head": 6.0 * m.vocab * m.hidden,
        "loss-chunk recompute": 2.0 * m.vocab * m.hidden,
        "activation recompute": recompute_flops_per_token(m, seq_len, policy, backend),
    }


# --- Limits ---------------------------------------------------------------------------------------


def fp8_gain_cap(arch: str, params: float) -> float:
    """The largest end-to-end FP8 gain published for this size (interpolated in log parameters)."""
    points = FP8_GAIN_PUBLISHED.get(arch, FP8_GAIN_PUBLISHED["hopper"])
    x = math.log(params)
    if x <= math.log(points[0][0]):
        return points[0][1]
    for (p0, g0), (p1, g1) in zip(points, points[1:], strict=False):
        if x <= math.log(p1):
            return g0 + (g1 - g0) * (x - math.log(p0)) / (math.log(p1) - math.log(p0))
    return points[-1][1]


def bound_tflops(instance: Instance, dtype: str) -> float:
    """Hardware TFLOP/s per GPU no plan may exceed: the best published B200 run of the precision,
    scaled by dense BF16 peak for other GPUs."""
    return BEST_PUBLISHED_B200_TFLOPS[dtype] * instance.gpu.bf16_tflops / B200_BF16_PEAK_TFLOPS


# --- The model ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ThroughputPlan:
    flops_per_token: float
    flops_formula: str
    recompute_flops_per_token: float  # activation recompute plus the loss chunks' recompute
    achieved_tflops_per_gpu: float  # hardware FLOP/s including recompute
    model_tflops_per_gpu: float  # model FLOPs only (what MFU counts)
    tokens_per_sec_per_gpu: float
    tokens_per_sec: float  # whole job
    mfu: float  # model FLOPs / dense peak of the recipe's precision
    peak_tflops: float
    step_time_s: float
    compute_time_per_micro_step_s: float
    exposed_comm_per_step_s: float
    grad_accum_steps: int
    # [low, high] from the calibration's leave-one-out errors (high never above the sanity bound)
    tokens_per_sec_per_gpu_range: tuple[float, float] = (0.0, 0.0)
    flops_by_kind: dict[str, float] | None = None  # per token, PaLM counting
    seconds_by_kind: dict[str, float] | None = None  # per optimizer step; sums to step_time_s
    fp8_gain: float | None = None  # end-to-end over the same layout in BF16, as planned (after the cap)
    fp8_gain_cap: float | None = None  # the published gain at this size
    bound_tflops: float = 0.0  # the sanity bound on achieved_tflops_per_gpu
    limited_by: tuple[str, ...] = ()  # "FP8 gain cap", "sanity bound"
    compile: bool = False
    backend: str = ""  # the block the trainer runs (trainer_backend): its checkpoint sets the recompute
    # One accumulation micro-step: its compute and exposed FSDP traffic (stretched with the step by the
    # FP8 cap or the sanity bound); what the trainer may still run after SIGTERM (planner.run_plan).
    micro_step_time_s: float = 0.0


@dataclass(frozen=True)
class _Step:
    seconds: float
    by_kind: dict[str, float]
    compute_micro: float
    exposed_comm: float
    micro: float  # one micro-step: compute plus its exposed FSDP traffic


def _linear_seconds(
    m_tokens: float, k: int, n: int, *, fp8: bool, fp8_recipe: str | None, rates: _Rates
) -> float:
    """One linear's forward, input-gradient and weight-gradient GEMMs in one micro-step."""
    elements = m_tokens * k + k * n + m_tokens * n
    flops = 3 * 2.0 * m_tokens * k * n
    cal = rates.cal
    if fp8:
        compute = flops / rates.fp8_flops + 3 * cal.gemm_memory_passes * 1.0 * elements / rates.hbm
        # Each of the three GEMMs quantises its two operands: 2 x (MK + KN + MN) elements in all.
        return compute + cal.fp8_quant_bytes(fp8_recipe) * 2 * elements / rates.hbm
    return flops / rates.bf16_flops + 3 * cal.gemm_memory_passes * BF16 * elements / rates.hbm


@dataclass(frozen=True)
class _Rates:
    cal: Calibration
    bf16_flops: float  # achieved large-GEMM FLOP/s
    fp8_flops: float
    attention_flops: float
    hbm: float  # bytes/s
    nvlink: float  # bytes/s, one direction, achieved
    nic: float  # bytes/s, one GPU's EFA NIC, achieved


def _rates(instance: Instance, cal: Calibration, efficiency: float) -> _Rates:
    gpu = instance.gpu
    e = efficiency
    return _Rates(
        cal=cal,
        bf16_flops=gpu.bf16_tflops * 1e12 * e,
        fp8_flops=gpu.fp8_tflops * 1e12 * e,
        attention_flops=gpu.bf16_tflops * 1e12 * e * cal.attention_relative_efficiency,
        hbm=HBM_BYTES_PER_S.get(gpu.name, HBM_BYTES_PER_S["H100"]),
        nvlink=gpu.nvlink_gbps / 2 * 1e9 * cal.nvlink_efficiency,
        nic=instance.efa_gbps / 8 / instance.gpus * 1e9 * cal.efa_efficiency,
    )


def _overlap(comm: float, compute: float, cal: Calibration) -> float:
    """Time `comm` adds when it runs under `compute`: what sticks out, plus the interference."""
    return max(0.0, comm - compute) + cal.overlap_interference * min(comm, compute)


def _step(
    m: ModelShape,
    instance: Instance,
    rates: _Rates,
    *,
    seq_len: int,
    micro_batch: int,
    accum: int,
    world_size: int,
    shard_group: int,
    tp: int,
    cp: int,
    fp8: bool,
    fp8_recipe: str | None,
    policy: ActivationPolicy,
    compile: bool,
    loss_chunk_tokens: int,
    param_gather_bytes: int,
    root_unit: bool,
    backend: str,
) -> _Step:
    cal = rates.cal
    tokens = micro_batch * seq_len / (tp * cp)  # per GPU per micro-step
    # Parameters in the unit gathered before the forward and reduced after the backward (exposed).
    root_params = m.embedding_params if root_unit else m.vocab * m.hidden

    # One block, one micro-step.
    gemm = sum(
        _linear_seconds(tokens, k, n, fp8=fp8, fp8_recipe=fp8_recipe, rates=rates)
        for k, n in _block_linear_shapes(m)
    )
    attention_fwd = 4.0 * tokens * seq_len * m.heads * m.head_dim * cal.attention_causal_fraction
    attention_fwd_s = attention_fwd / rates.attention_flops
    attention = attention_fwd_s * (1 + cal.attention_backward_ratio)
    elementwise = cal.elementwise_passes * block_activation_bytes(m) * tokens / rates.hbm
    if compile:
        elementwise *= cal.compile_elementwise_factor
    share = recompute_share(m, policy, backend)
    if policy.op_level:
        recompute = share * gemm / 3 + elementwise / 3
    else:
        recompute = policy.checkpointed_fraction * (share * gemm / 3 + attention_fwd_s + elementwise / 3)
    gpu_block = gemm + attention + elementwise + recompute
    fwd_block = gemm / 3 + attention_fwd_s + elementwise / 3
    host = cal.host_seconds_per_block_compiled if compile else cal.host_seconds_per_block_eager
    host_wait = max(0.0, host - gpu_block)
    block = gpu_block + host_wait
    bwd_block = block - fwd_block

    # Output head per loss chunk (BF16, never FP8): forward, backward, and the chunk's recompute.
    chunk = min(loss_chunk_tokens, tokens)
    head_gemm = _linear_seconds(chunk, m.hidden, m.vocab, fp8=False, fp8_recipe=None, rates=rates)
    head = (tokens / chunk) * head_gemm * 4 / 3
    head += cal.loss_logit_passes * 4 * m.vocab * tokens / rates.hbm

    compute_micro = m.layers * block + head

    # FSDP: per block, block i+1's all-gather under block i's forward; in backward the previous block's
    # all-gather and the next block's reduce-scatter under this block's backward.
    node = instance.gpus
    fsdp_micro = 0.0
    if shard_group > 1:
        bw = rates.nvlink if shard_group * tp * cp <= node else rates.nic
        spread = (shard_group - 1) / shard_group
        block_params = m.params_per_layer / tp
        all_gather = param_gather_bytes * block_params * spread / bw
        reduce_scatter = GRAD_REDUCE_BYTES * block_params * spread / bw
        per_block = _overlap(all_gather, fwd_block, cal)
        per_block += _overlap(all_gather + reduce_scatter, bwd_block, cal)
        # The first block's gather is not overlapped, nor the root unit's (gathered before the forward,
        # reduced after the backward): with the embedding and the head as units of their own (our
        # trainer's untied models, torchtitan) only the embedding's traffic sticks out.
        root = (param_gather_bytes + GRAD_REDUCE_BYTES) * root_params / tp * spread / bw
        fsdp_micro = m.layers * per_block + all_gather + root

    # HSDP: the all-reduce of gradient shards across replicas, on the last micro-step only.
    replicas = world_size // (tp * cp) // shard_group
    all_reduce = 0.0
    if replicas > 1:
        bw = rates.nvlink if world_size <= node else rates.nic
        ring = 2 * (replicas - 1) / replicas
        shard_bytes = GRAD_REDUCE_BYTES * m.total_params / tp / shard_group * ring
        root_share = root_params / m.total_params  # the last unit of the backward is not overlapped
        blocks_part = shard_bytes * (1 - root_share) / bw
        all_reduce = _overlap(blocks_part, m.layers * bwd_block, cal) + shard_bytes * root_share / bw

    optimizer = cal.optimizer_bytes_per_param * m.total_params / tp / shard_group / rates.hbm
    by_kind = {
        "block GEMMs": accum * m.layers * gemm,
        "attention": accum * m.layers * attention,
        "elementwise": accum * m.layers * elementwise,
        "activation recompute": accum * m.layers * recompute,
        "output head and loss": accum * head,
        "host overhead": accum * m.layers * host_wait,
        "exposed FSDP communication": accum * fsdp_micro,
        "exposed replica all-reduce": all_reduce,
        "optimizer": optimizer,
        "fixed per step": cal.step_fixed_seconds,
    }
    return _Step(
        seconds=sum(by_kind.values()),
        by_kind=by_kind,
        compute_micro=compute_micro,
        exposed_comm=accum * fsdp_micro + all_reduce,
        micro=compute_micro + fsdp_micro,
    )


def throughput(
    m: ModelShape,
    instance: Instance,
    *,
    seq_len: int,
    micro_batch: int,
    global_batch: int,
    world_size: int,
    shard_group: int,
    tp: int = 1,
    cp: int = 1,
    dtype: str,
    fp8_recipe: str | None,
    policy: ActivationPolicy,
    compile: bool = True,
    loss_chunk_tokens: int = 2048,
    param_gather_bytes: int = BF16,
    root_unit: bool | None = None,
    backend: str | None = None,
    calibration: Calibration = CALIBRATION,
    limits: bool = True,
    efficiency: float | None = None,
    with_range: bool = True,
) -> ThroughputPlan:
    """Tokens/s and its parts for one layout. `limits=False` skips the FP8 gain cap and the sanity
    bound (the calibration fit compares the bare model with measurements). `param_gather_bytes`,
    `root_unit` and `backend` describe other trainers for the calibration; their defaults are ours:
    BF16 all-gathers; the embedding and the head as FSDP units of their own (root_unit False), one
    [embedding, norm, head] unit when tied (True); the block `trainer_backend` says, whose checkpoint
    sets how much of a block recompute replays.
    `efficiency` overrides the planning GEMM efficiency (the bench: what the measured GPUs showed);
    `with_range=False` skips the slow-scenario evaluation (the recommender ranks central figures)."""
    planning = calibration.planning_efficiency(instance.gpu.name)
    rates = _rates(instance, calibration, efficiency if efficiency is not None else planning)
    if root_unit is None:
        root_unit = m.tied_embeddings
    backend = backend or trainer_backend(policy)
    data_parallel = world_size // (tp * cp)
    accum = max(1, global_batch // (micro_batch * data_parallel))
    knobs = dict(
        seq_len=seq_len,
        micro_batch=micro_batch,
        accum=accum,
        world_size=world_size,
        shard_group=shard_group,
        tp=tp,
        cp=cp,
        fp8_recipe=fp8_recipe,
        policy=policy,
        compile=compile,
        loss_chunk_tokens=loss_chunk_tokens,
        param_gather_bytes=param_gather_bytes,
        root_unit=root_unit,
        backend=backend,
    )
    fp8 = dtype == "fp8"
    step = _step(m, instance, rates, fp8=fp8, **knobs)
    seconds, by_kind = step.seconds, dict(step.by_kind)

    fpt = flops_per_token(m, seq_len)
    kinds = flops_by_kind(m, seq_len, policy, backend)
    rfpt = kinds["activation recompute"] + kinds["loss-chunk recompute"]
    tokens_per_gpu_step = global_batch * seq_len / world_size
    limited: list[str] = []
    gain = cap = None
    if fp8:
        bf16_seconds = _step(m, instance, rates, fp8=False, **knobs).seconds
        cap = fp8_gain_cap(instance.gpu.arch, m.total_params)
        if limits and bf16_seconds / seconds > cap:
            by_kind["FP8 gain cap"] = bf16_seconds / cap - seconds
            seconds = bf16_seconds / cap
            limited.append("FP8 gain cap")
        gain = bf16_seconds / seconds
    bound = bound_tflops(instance, dtype)
    if limits and tokens_per_gpu_step * (fpt + rfpt) / seconds / 1e12 > bound:
        floor = tokens_per_gpu_step * (fpt + rfpt) / (bound * 1e12)
        by_kind["sanity bound"] = floor - seconds
        seconds = floor
        limited.append("sanity bound")

    tps_gpu = tokens_per_gpu_step / seconds
    slow = fast = tps_gpu
    if with_range and efficiency is None:  # the two published regimes that bracket this GPU

        def at(eff: float) -> float:
            rated = _rates(instance, calibration, eff)
            return tokens_per_gpu_step / _step(m, instance, rated, fp8=fp8, **knobs).seconds

        name = instance.gpu.name
        slow = min(tps_gpu, at(calibration.measured_efficiency(name)))
        fast = max(tps_gpu, at(calibration.rated_efficiency(name)))
    low, high = loo_range(slow, fast)
    if limits:
        high = min(high, bound * 1e12 / (fpt + rfpt))
    peak = instance.peak_tflops(dtype)
    return ThroughputPlan(
        flops_per_token=fpt,
        flops_formula="PaLM: 6*N + 12*L*H*Q*T (N = block and output-head weights)",
        recompute_flops_per_token=rfpt,
        achieved_tflops_per_gpu=tps_gpu * (fpt + rfpt) / 1e12,
        model_tflops_per_gpu=tps_gpu * fpt / 1e12,
        tokens_per_sec_per_gpu=tps_gpu,
        tokens_per_sec=tps_gpu * world_size,
        mfu=tps_gpu * fpt / (peak * 1e12),
        peak_tflops=peak,
        step_time_s=seconds,
        compute_time_per_micro_step_s=step.compute_micro,
        exposed_comm_per_step_s=step.exposed_comm,
        grad_accum_steps=accum,
        tokens_per_sec_per_gpu_range=(low, max(high, low)),
        flops_by_kind=kinds,
        seconds_by_kind=by_kind,
        fp8_gain=gain,
        fp8_gain_cap=cap,
        bound_tflops=bound,
        limited_by=tuple(limited),
        compile=compile,
        backend=backend,
        micro_step_time_s=step.micro * seconds / step.seconds,
    )
