"""The planner: the P6-B200 tuning guide as arithmetic. Recipe in, Plan out; no I/O, no randomness.

    plan(recipe) -> Plan       memory breakdown and verdict, throughput, cost, recommendations

Memory is modelled per GPU, component by component, from the model shape and the layout (see
docs/planner.md for every formula, constant and its source). Throughput is FLOPs per token (PaLM)
divided into an achieved FLOP rate from an efficiency model calibrated to published measurements
(../shared/calibration/published.yaml; bench/planner_accuracy.py prints the fit).

The core functions (`memory_breakdown`, `throughput`) take explicit knobs rather than a Recipe, so
the recommendation search and the calibration bench can ask "what if" without building recipes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from trainstack.hardware import GPU, Instance
from trainstack.recipe import ActivationCheckpointing, ModelShape, Recipe
from trainstack.run_plan import RunPlan, plan_run
from trainstack.trainer_memory import (
    BLOCK_IN_FLIGHT_BYTES,
    BLOCKS_IN_FLIGHT,
    LOSS_BYTES,
    ROOT_IN_FLIGHT_BYTES,
    block_activation_bytes,
    op_selective_bytes,
    op_selective_recompute_share,
)

GIB = float(2**30)

# Headroom the recommendations (and the base recipes) keep below usable memory: the planner aims to be
# within 10% of measured peaks, so a plan at 90% of usable memory still fits if it is 10% optimistic.
HEADROOM = 0.10

# --- Memory constants (bytes) ---------------------------------------------------------------------
# Mixed-precision AdamW under FSDP2 (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)): the
# sharded master copy is FP32, its gradient FP32, AdamW m and v FP32 (ZeRO paper, arXiv:1910.02054).
BYTES_PARAM, BYTES_GRAD, BYTES_ADAM = 4, 4, 8
BF16 = 2
# Outside the model: CUDA context with cuBLAS/cuDNN workspaces, NCCL communicator buffers (estimates;
# the guide says "several GiB, measure it"), and caching-allocator fragmentation as a fraction of what
# the allocator hands out (with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, which the trainer sets).
CUDA_CONTEXT_GIB = 1.0
NCCL_GIB = 1.0
FRAGMENTATION = 0.05

# --- Throughput constants -------------------------------------------------------------------------
# BF16 model-FLOPs utilisation (PaLM accounting) at the reference shape (Llama 3 8B, 8K tokens, micro-batch 2,
# no recompute, one node), per GPU type. B200: 21,618 tokens/s/GPU (Megatron-Bridge recipe, third-party
# run) x 57.9 GFLOP/token / 2250 TFLOP/s = 0.556. H100/H200: torchtitan FSDP2 + compile, 6,667 tokens/s/GPU,
# with its op-level selective recompute (+8.8% FLOPs for this shape) taken out: 0.390 x 1.088 = 0.425.
BF16_MFU_AT_REFERENCE = {"B200": 0.556, "H100": 0.425, "H200": 0.425}
REFERENCE_HIDDEN = 4096
# FP8 throughput gain over BF16 at the reference shape. B200: 30,624 / 21,618 (current scaling) and
# 29,521 / 21,618 (MXFP8), Megatron-Bridge; delayed assumed like current, block like MXFP8.
# Hopper: torchtitan float8 tensorwise + compile vs BF16 + compile, 8,532 / 6,667.
FP8_GAIN_AT_REFERENCE = {
    "B200": {"current": 0.417, "delayed": 0.417, "mxfp8": 0.366, "block": 0.366},
    "H100": {"current": 0.280, "delayed": 0.280, "block": 0.280},
    "H200": {"current": 0.280, "delayed": 0.280, "block": 0.280},
}
# How the FP8 gain scales with hidden size, relative to the reference (piecewise linear in log2 hidden).
# Hopper: torchtitan's FP8 gains 1.8B +18%, 8B +28%, 70B +50% -> 0.64, 1.0, 1.79. Blackwell: the AWS guide
# says the gain is small or negative below ~7B, so 0 at hidden 2048; larger shapes follow Hopper's trend.
FP8_GAIN_SCALE = {
    "blackwell": ((2048, 0.0), (4096, 1.0), (8192, 1.79)),
    "hopper": ((2048, 0.64), (4096, 1.0), (8192, 1.79)),
}
# Smaller GEMMs run further from peak: efficiency x (hidden / 4096) ** 0.15 below the reference hidden
# (assumption, not calibrated: only one published shape; 1B comes out at 0.90 of the 8B efficiency).
SMALL_GEMM_EXPONENT = 0.15
# CPU-side cost per block per micro-step (kernel launches, FSDP hooks); matters only for tiny micro-batches
# (assumption: ~30 kernels forward+backward at ~10 us).
LAYER_OVERHEAD_S = 0.0003
# Fraction of link bandwidth collectives achieve (NCCL bus bandwidth; assumption).
LINK_EFFICIENCY = 0.7

FP8_MIN_PARAMS = 6.0e9  # the guide: below ~7B FP8 gains little; from ~7B it pays (Llama 2 7B has 6.7B)


# --- Activation policies --------------------------------------------------------------------------


@dataclass(frozen=True)
class ActivationPolicy:
    """What one transformer block keeps for backward.

    `checkpointed_fraction` of the blocks keep only their input (and recompute the rest in backward);
    `op_level` is torchtitan's op-level selective checkpointing (keep every other matmul output and the
    attention output, recompute the rest), used only to plan the published calibration runs.
    """

    name: str
    checkpointed_fraction: float = 0.0
    op_level: bool = False

    @classmethod
    def from_recipe(cls, ac: ActivationCheckpointing, layers: int | None = None) -> ActivationPolicy:
        """The trainer checkpoints blocks 0, every, 2*every, ... (ceil(layers / every) of them)."""
        if ac.mode == "selective" and ac.policy == "op":
            return cls.op_selective()
        if ac.mode != "selective" or layers is None:
            return cls(
                f"selective (1 in {ac.every})" if ac.mode == "selective" else ac.mode,
                ac.checkpointed_fraction(),
            )
        return cls(f"selective (1 in {ac.every})", math.ceil(layers / ac.every) / layers)

    @classmethod
    def op_selective(cls) -> ActivationPolicy:
        return cls("selective-op", 0.0, op_level=True)


# --- Memory ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryPlan:
    breakdown: dict[str, float]  # component -> GiB per GPU, in the order they are listed
    peak_gib: float
    usable_gib: float
    budget_gib: float  # usable less the planner's headroom
    fits: bool
    breaking_component: str | None = (
        None  # the largest component that grows with the knobs, if it does not fit
    )
    fix: str | None = None  # the cheapest change that makes it fit

    @property
    def utilisation(self) -> float:
        return self.peak_gib / self.usable_gib

    @property
    def allocator_peak_gib(self) -> float:
        """What torch.cuda.max_memory_reserved() would report: the peak less context and NCCL buffers."""
        return self.peak_gib - self.breakdown["CUDA context"] - self.breakdown["NCCL buffers"]


def memory_breakdown(
    m: ModelShape,
    gpu: GPU,
    *,
    seq_len: int,
    micro_batch: int,
    shard_group: int,
    tp: int = 1,
    cp: int = 1,
    policy: ActivationPolicy,
    loss_chunk_tokens: int,
) -> dict[str, float]:
    """Per-GPU memory components in GiB at the step's peak (start of backward)."""
    n = m.total_params
    shard = shard_group * tp
    tokens = micro_batch * seq_len / cp  # tokens whose activations this GPU holds (CP splits the sequence)
    act_tokens = tokens / tp  # sequence parallel splits what tensor parallel would otherwise replicate

    full_block = block_activation_bytes(m)
    if policy.op_level:
        saved_block = op_selective_bytes(m)
    else:
        f = policy.checkpointed_fraction
        saved_block = (1 - f) * full_block + f * m.hidden * BF16
    # Recompute (or plain backward) rebuilds one block's activations and their gradients at a time.
    working_block = full_block

    root_params = m.embedding_params
    in_flight = (
        BLOCKS_IN_FLIGHT * m.params_per_layer * BLOCK_IN_FLIGHT_BYTES + root_params * ROOT_IN_FLIGHT_BYTES
    ) / tp
    if shard_group == 1:  # unsharded: the BF16 copies are still made for compute, but nothing is gathered
        in_flight = (m.params_per_layer * m.layers + root_params) * BF16 / tp

    chunk = min(loss_chunk_tokens, tokens)
    # Logits: one chunk at a time (vocabulary split across TP ranks) plus the final hidden states.
    logits = LOSS_BYTES * chunk * m.vocab / tp + tokens * m.hidden * BF16

    # The loss chunk's backward and the last block's backward run one after the other, so the step's
    # peak holds the larger of the two; the working set is listed only for what it adds beyond the loss.
    working = max(0.0, working_block * act_tokens - logits)
    parts = {
        "parameters (sharded FP32)": n * BYTES_PARAM / shard,
        "gradients (sharded FP32)": n * BYTES_GRAD / shard,
        "optimizer states (AdamW FP32)": n * BYTES_ADAM / shard,
        "unsharded layers in flight": in_flight,
        "activations (saved)": m.layers * saved_block * act_tokens,
        "activations (backward working set)": working,
        "logits and loss": logits,
    }
    gib = {k: v / GIB for k, v in parts.items()}
    gib["allocator fragmentation"] = FRAGMENTATION * sum(gib.values())
    gib["CUDA context"] = CUDA_CONTEXT_GIB
    gib["NCCL buffers"] = NCCL_GIB
    return gib


# Components that depend on the knobs a user would turn, used to name what breaks a plan.
_GROWING = (
    "activations (saved)",
    "logits and loss",
    "optimizer states (AdamW FP32)",
    "activations (backward working set)",
    "unsharded layers in flight",
)


def _memory_plan(parts: dict[str, float], gpu: GPU) -> MemoryPlan:
    peak = sum(parts.values())
    return MemoryPlan(
        breakdown={k: round(v, 3) for k, v in parts.items()},
        peak_gib=round(peak, 3),
        usable_gib=gpu.usable_gib,
        budget_gib=round(gpu.usable_gib * (1 - HEADROOM), 3),
        fits=peak <= gpu.usable_gib,
    )


# --- FLOPs and throughput -------------------------------------------------------------------------


def flops_per_token(model: ModelShape, seq_len: int) -> float:
    """Training FLOPs per token, PaLM appendix B: 6*N + 12*L*H*Q*T.

    N counts every matmul weight a token passes through: the blocks and the output head, but not the
    input embedding (a lookup, no FLOPs). The attention term uses the full sequence length T (no causal
    halving), as PaLM and torchtitan do, so MFU figures compare with theirs.
    """
    matmul_params = model.non_embedding_params + model.vocab * model.hidden  # output head
    attention = 12 * model.layers * model.heads * model.head_dim * seq_len
    return 6.0 * matmul_params + attention


def recompute_flops_per_token(m: ModelShape, seq_len: int, policy: ActivationPolicy) -> float:
    """Extra forward FLOPs per token spent recomputing checkpointed activations in backward."""
    block_matmul = 2.0 * (m.non_embedding_params - m.hidden)  # forward FLOPs of the blocks' weights
    attention_fwd = 4.0 * m.layers * m.heads * m.head_dim * seq_len
    if policy.op_level:
        return op_selective_recompute_share(m) * block_matmul
    return policy.checkpointed_fraction * (block_matmul + attention_fwd)


def _interp_log2(points: tuple[tuple[int, float], ...], x: float) -> float:
    lx = math.log2(x)
    pts = [(math.log2(a), b) for a, b in points]
    if lx <= pts[0][0]:
        (x0, y0), (x1, y1) = pts[0], pts[1]
    elif lx >= pts[-1][0]:
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
    else:
        (x0, y0), (x1, y1) = next((p, q) for p, q in zip(pts, pts[1:], strict=False) if p[0] <= lx <= q[0])
    return y0 + (y1 - y0) * (lx - x0) / (x1 - x0)


def fp8_gain(gpu: GPU, fp8_recipe: str, hidden: int) -> float:
    """Throughput gain of FP8 over BF16 for this GPU, scaling recipe and hidden size (can be 0)."""
    table = FP8_GAIN_AT_REFERENCE.get(gpu.name, FP8_GAIN_AT_REFERENCE["H100"])
    at_ref = table.get(fp8_recipe, max(table.values()))
    scale = _interp_log2(FP8_GAIN_SCALE[gpu.arch], hidden)
    return max(at_ref * scale, -0.1)  # extrapolating below 2048 may go negative; the guide saw small losses


@dataclass(frozen=True)
class ThroughputPlan:
    flops_per_token: float
    flops_formula: str
    recompute_flops_per_token: float
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
) -> ThroughputPlan:
    gpu = instance.gpu
    fpt = flops_per_token(m, seq_len)
    rfpt = recompute_flops_per_token(m, seq_len, policy)
    base = (
        BF16_MFU_AT_REFERENCE.get(gpu.name, 0.4)
        * min(1.0, m.hidden / REFERENCE_HIDDEN) ** SMALL_GEMM_EXPONENT
    )
    speedup = 1.0 + (fp8_gain(gpu, fp8_recipe or "current", m.hidden) if dtype == "fp8" else 0.0)
    hw_flops = gpu.bf16_tflops * 1e12 * base * speedup  # achieved FLOP/s, recompute included

    data_parallel = world_size // (tp * cp)
    accum = max(1, global_batch // (micro_batch * data_parallel))
    tokens_per_micro_gpu = micro_batch * seq_len / (tp * cp)  # tokens each GPU processes per micro-step
    compute = tokens_per_micro_gpu * (fpt + rfpt) / hw_flops + m.layers * LAYER_OVERHEAD_S

    # FSDP collectives per micro-step (all-gather forward and backward in BF16, reduce-scatter in FP32),
    # overlapped with compute; only what exceeds compute is exposed.
    # Ring collectives move bytes * (g-1)/g through their slowest hop. Inside a node that is NVLink; a
    # group spanning nodes runs one ring per NIC, so its bus bandwidth is the node's whole EFA bandwidth.
    # Replica all-reduces (HSDP) run one per local rank, each on its own NIC.
    per_node = instance.gpus
    nvlink = gpu.nvlink_gbps / 2 * 1e9 * LINK_EFFICIENCY  # one direction, bytes/s
    efa_node = instance.efa_gbps / 8 * 1e9 * LINK_EFFICIENCY  # bytes/s, all NICs of a node
    efa = efa_node / per_node  # bytes/s, one GPU's NIC
    params_local = m.total_params / tp
    fsdp_bytes = (BF16 + BF16 + 4) * params_local * (shard_group - 1) / shard_group
    fsdp_bw = nvlink if shard_group * tp * cp <= per_node else min(nvlink, efa_node)
    exposed_micro = max(0.0, fsdp_bytes / fsdp_bw - compute) if shard_group > 1 else 0.0
    # Gradient all-reduce across replicas (HSDP) once per step, overlapped with the last backward.
    replicas = data_parallel // shard_group
    dp_bytes = 2 * 4 * params_local / shard_group * (replicas - 1) / max(replicas, 1)
    dp_bw = nvlink if world_size <= per_node else efa
    exposed_dp = max(0.0, dp_bytes / dp_bw - compute) if replicas > 1 else 0.0

    step = accum * (compute + exposed_micro) + exposed_dp
    tokens_per_gpu_step = global_batch * seq_len / world_size
    tps_gpu = tokens_per_gpu_step / step
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
        step_time_s=step,
        compute_time_per_micro_step_s=compute,
        exposed_comm_per_step_s=accum * exposed_micro + exposed_dp,
        grad_accum_steps=accum,
    )


# --- Cost -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CostPlan:
    instance_type: str
    instance_count: int
    usd_per_hour: float  # whole job
    tokens: int  # the recipe's token budget: steps x tokens per step
    hours: float
    total_usd: float
    price_source: str


# --- The plan -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recommendations:
    max_micro_batch: (
        int | None
    )  # largest that fits within the headroom (and divides the batch); None: none fits
    lightest_checkpointing: str | None  # at the recipe's micro-batch
    smallest_shard_group: int | None  # at the recipe's micro-batch and checkpointing
    precision: str  # "bf16" or "fp8", by model size as the guide says
    precision_reason: str
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Plan:
    recipe: str
    instance_type: str
    gpus: int
    params: int
    fits: bool
    verdict: str
    memory: MemoryPlan
    throughput: ThroughputPlan
    cost: CostPlan
    recommendations: Recommendations
    run: RunPlan
    assumptions: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["memory"]["utilisation"] = round(self.memory.utilisation, 4)
        d["memory"]["allocator_peak_gib"] = round(self.memory.allocator_peak_gib, 3)
        d["assumptions"] = list(self.assumptions)
        d["recommendations"]["notes"] = list(self.recommendations.notes)
        return d


def _recipe_memory(recipe: Recipe, **changes: Any) -> dict[str, float]:
    knobs = dict(
        seq_len=recipe.training.seq_len,
        micro_batch=recipe.training.micro_batch,
        shard_group=recipe.parallelism.shard_group,
        tp=recipe.parallelism.tp,
        cp=recipe.parallelism.cp,
        policy=ActivationPolicy.from_recipe(recipe.activation_checkpointing, recipe.model.layers),
        loss_chunk_tokens=recipe.training.loss_chunk_tokens,
    )
    knobs.update(changes)
    return memory_breakdown(recipe.model, recipe.instance.gpu, **knobs)


def _peak(parts: dict[str, float]) -> float:
    return sum(parts.values())


CHECKPOINTING_LADDER = (
    ("none", ActivationCheckpointing(mode="none")),
    ("selective every 4", ActivationCheckpointing(mode="selective", every=4)),
    ("selective every 2", ActivationCheckpointing(mode="selective", every=2)),
    ("full", ActivationCheckpointing(mode="full")),
)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def recommend(recipe: Recipe) -> Recommendations:
    gpu = recipe.instance.gpu
    budget = gpu.usable_gib * (1 - HEADROOM)
    par = recipe.parallelism
    dp = recipe.data_parallel
    per_rank = recipe.training.global_batch // dp  # sequences per data-parallel rank per step

    max_mb = None
    for mb in _divisors(per_rank):
        if _peak(_recipe_memory(recipe, micro_batch=mb)) <= budget:
            max_mb = mb
        else:
            break  # memory grows with micro-batch

    lightest = next(
        (
            label
            for label, ac in CHECKPOINTING_LADDER
            if _peak(_recipe_memory(recipe, policy=ActivationPolicy.from_recipe(ac, recipe.model.layers)))
            <= budget
        ),
        None,
    )

    groups = [g for g in _divisors(recipe.world_size // (par.tp * par.cp))]
    smallest = next((g for g in groups if _peak(_recipe_memory(recipe, shard_group=g)) <= budget), None)

    n = recipe.model.total_params
    if n >= FP8_MIN_PARAMS:
        kind = "MXFP8 on Blackwell" if gpu.supports_mxfp8 else "current scaling on Hopper"
        precision = (
            "fp8",
            f"{n / 1e9:.1f}B parameters: from ~7B FP8 pays in throughput ({kind}); it does not save memory",
        )
    else:
        precision = (
            "bf16",
            f"{n / 1e9:.1f}B parameters: below ~7B FP8 gains little or loses "
            "(small GEMMs); BF16 is the simple default",
        )
    notes = []
    if recipe.precision.dtype != precision[0]:
        notes.append(
            f"precision.dtype is {recipe.precision.dtype}; the guide suggests {precision[0]} at this size"
        )
    if max_mb is not None and max_mb > recipe.training.micro_batch:
        notes.append(
            f"training.micro_batch={max_mb} also fits within {HEADROOM:.0%} headroom "
            "(larger micro-batches buy throughput)"
        )
    if (
        smallest is not None
        and smallest < par.shard_group
        and par.shard_group * par.tp * par.cp > recipe.instance.gpus
    ):
        notes.append(
            f"parallelism.shard_group={smallest} fits: a group inside one node keeps FSDP traffic on NVLink"
        )
    return Recommendations(max_mb, lightest, smallest, precision[0], precision[1], tuple(notes))


def _fix_candidates(recipe: Recipe):
    """(description, memory knobs) for changes in order of what they cost in speed and money."""
    mb = recipe.training.micro_batch
    par = recipe.parallelism
    current = ActivationPolicy.from_recipe(recipe.activation_checkpointing, recipe.model.layers)
    heavier = [
        (
            f"activation_checkpointing.mode={ac.mode}"
            + (f" with every: {ac.every}" if ac.mode == "selective" else ""),
            ActivationPolicy.from_recipe(ac, recipe.model.layers),
        )
        for _, ac in CHECKPOINTING_LADDER
        if ac.checkpointed_fraction() > current.checkpointed_fraction
    ]
    per_rank = recipe.training.global_batch // recipe.data_parallel
    smaller = [m for m in range(mb - 1, 0, -1) if per_rank % m == 0]
    for label, pol in heavier:
        yield f"set {label}", {"policy": pol}
    for m in smaller:
        yield f"set training.micro_batch={m}", {"micro_batch": m}
    for label, pol in heavier:
        for m in smaller:
            yield f"set {label} and training.micro_batch={m}", {"policy": pol, "micro_batch": m}
    full = ActivationPolicy("full", 1.0)
    for g in _divisors(recipe.world_size // (par.tp * par.cp)):
        if g > par.shard_group:
            yield f"set parallelism.shard_group={g}", {"shard_group": g}
            yield (
                f"set parallelism.shard_group={g}, activation_checkpointing.mode=full "
                "and training.micro_batch=1",
                {"shard_group": g, "policy": full, "micro_batch": 1},
            )
    for nodes in (2, 4, 8, 16, 32, 64):
        if nodes > recipe.compute.instance_count:
            g = nodes * recipe.instance.gpus // (par.tp * par.cp)
            yield (
                f"set compute.instance_count={nodes}, parallelism.shard_group={g}, "
                "activation_checkpointing.mode=full and training.micro_batch=1",
                {"shard_group": g, "policy": full, "micro_batch": 1, "nodes": nodes},
            )


def _fix(recipe: Recipe) -> str:
    """The change that fits and trains fastest on the recipe's nodes (more nodes only if nothing else
    fits): within the headroom if any does, else within usable memory."""
    gpu = recipe.instance.gpu
    tr, par = recipe.training, recipe.parallelism
    scored = []
    for label, knobs in _fix_candidates(recipe):
        nodes = knobs.pop("nodes", recipe.compute.instance_count)
        peak = _peak(_recipe_memory(recipe, **knobs))
        world = nodes * recipe.instance.gpus
        speed = throughput(
            recipe.model,
            recipe.instance,
            seq_len=tr.seq_len,
            micro_batch=knobs.get("micro_batch", tr.micro_batch),
            global_batch=tr.global_batch,
            world_size=world,
            shard_group=knobs.get("shard_group", par.shard_group),
            tp=par.tp,
            cp=par.cp,
            dtype=recipe.precision.dtype,
            fp8_recipe=recipe.precision.fp8_recipe,
            policy=knobs.get(
                "policy", ActivationPolicy.from_recipe(recipe.activation_checkpointing, recipe.model.layers)
            ),
        ).tokens_per_sec_per_gpu
        scored.append((nodes, -speed, label, peak))
    scored.sort()
    for limit, note in ((gpu.usable_gib * (1 - HEADROOM), ""), (gpu.usable_gib, ", tight")):
        for _, speed, label, peak in scored:
            if peak <= limit:
                return f"{label} (peak {peak:.1f} GiB, {-speed:,.0f} tokens/s/GPU{note})"
    return "no layout in reach fits: use tensor or context parallelism (parallelism.tp / parallelism.cp)"


def plan(recipe: Recipe) -> Plan:
    """Plan one resolved recipe: memory verdict, throughput, cost and advice."""
    inst = recipe.instance
    parts = _recipe_memory(recipe)
    mem = _memory_plan(parts, inst.gpu)
    if not mem.fits:
        breaking = max(_GROWING, key=lambda k: parts[k])
        mem = MemoryPlan(**{**asdict(mem), "breaking_component": breaking, "fix": _fix(recipe)})

    tr, par = recipe.training, recipe.parallelism
    thr = throughput(
        recipe.model,
        inst,
        seq_len=tr.seq_len,
        micro_batch=tr.micro_batch,
        global_batch=tr.global_batch,
        world_size=recipe.world_size,
        shard_group=par.shard_group,
        tp=par.tp,
        cp=par.cp,
        dtype=recipe.precision.dtype,
        fp8_recipe=recipe.precision.fp8_recipe,
        policy=ActivationPolicy.from_recipe(recipe.activation_checkpointing, recipe.model.layers),
    )
    rate = (recipe.compute.usd_per_instance_hour or inst.usd_per_hour) * recipe.compute.instance_count
    run = plan_run(recipe, thr.step_time_s)
    # Instance hours: training, plus each job's start-up and (after the first) its checkpoint restore.
    hours = run.hours + run.overhead_hours
    cost = CostPlan(
        inst.instance_type,
        recipe.compute.instance_count,
        rate,
        tr.steps * recipe.tokens_per_step,
        hours,
        rate * hours,
        "compute.usd_per_instance_hour" if recipe.compute.usd_per_instance_hour else inst.price_source,
    )

    if mem.fits:
        margin = mem.usable_gib - mem.peak_gib
        tight = " (tight: within the planner's 10% error)" if mem.peak_gib > mem.budget_gib else ""
        verdict = f"fits: peak {mem.peak_gib:.1f} of {mem.usable_gib:.0f} GiB, {margin:.1f} GiB spare{tight}"
    else:
        verdict = (
            f"does not fit: peak {mem.peak_gib:.1f} GiB > {mem.usable_gib:.0f} GiB usable; "
            f"{mem.breaking_component} ({parts[mem.breaking_component]:.1f} GiB) breaks it; fix: {mem.fix}"
        )
    assumptions = (
        "memory: FSDP2 mixed precision (FP32 master, BF16 compute), flash attention, "
        "chunked loss recomputed per chunk",
        "throughput: efficiency calibrated to published Llama 3 8B runs (see docs/planner.md); "
        "other shapes extrapolate",
        f"price: {inst.price_source}",
    )
    return Plan(
        recipe.name,
        inst.instance_type,
        recipe.world_size,
        recipe.model.total_params,
        mem.fits,
        verdict,
        mem,
        thr,
        cost,
        recommend(recipe),
        run,
        assumptions,
    )
