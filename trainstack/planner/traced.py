"""A traced step's memory plus what a trace cannot see: the figure `trainstack plan --trace` judges.

The trace (training_image/trainer/trace, run by trainstack.tuning.trace) measures the trainer's own
step on fake tensors: parameters, gradients, optimizer state, activations, temporaries and FSDP's
communication buffers, as torch's FSDPMemTracker counts them. What no fake tensor passes through is
added here, each term with its source (docs/planner.md, "The traced step"):

    allocator fragmentation   FRAGMENTATION x the traced peak (the planner's figure; the caching
                              allocator with expandable_segments, which the trainer sets)
    CUDA context              CUDA_CONTEXT_GIB: the context with cuBLAS/cuDNN workspaces
    NCCL buffers              NCCL_GIB: the communicators' own buffers
    TE FP8 weight copies      FP8 recipes only: Transformer Engine's linear modules quantize their
                              weight in forward and keep the FP8 copy (and, for backward, its
                              column-wise / transposed copy) for every block that is not
                              recomputed: 2 bytes per block parameter of those blocks. The trace
                              runs the BF16 path, which keeps none of them
    TE amax histories         FP8 recipes only: FP32 scaling state, a few KiB per module (delayed
                              scaling keeps a 1024-long history per quantized tensor)

No I/O: the trace's JSON report comes in as a dict.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from trainstack.planner.memory import CUDA_CONTEXT_GIB, FRAGMENTATION, GIB, NCCL_GIB
from trainstack.planner.trainer_memory import context_parallel_mask_bytes
from trainstack.recipes.schema import Recipe

# The planner's components a trace cannot see (memory_breakdown's names): left out of its same-scope figure.
OUTSIDE_TRACE = ("allocator fragmentation", "CUDA context", "NCCL buffers")
CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporary", "communication")
FP8_WEIGHT_COPY_BYTES = 2  # the row-wise FP8 copy and its column-wise (transposed) copy, 1 byte each
AMAX_HISTORY_LEN = 1024  # TE DelayedScaling's default amax_history_len
AMAX_TENSORS_PER_BLOCK = 12  # 4 GEMMs x (input, weight, output gradient)
COUNTED_FLOPS_TOLERANCE = 0.02  # the issue's: use the counted FLOPs where they differ by more


def trace_only_gib(recipe: Recipe) -> dict[str, float]:
    """What the traced step holds and the GPU run does not: under context parallelism the trace runs
    the pure-PyTorch CP attention, whose additive causal mask ((seq / cp) x seq in BF16, 16 GiB at 128K
    and cp 2) Transformer Engine's CP attention does not need; the GPU runs TE's unless the op-level
    policy asks for the pure-PyTorch block (the planner counts the mask then)."""
    ac, cp = recipe.activation_checkpointing, recipe.parallelism.cp
    if cp == 1 or (ac.mode == "selective" and ac.policy == "op"):
        return {}
    return {"context-parallel mask": context_parallel_mask_bytes(recipe.training.seq_len, cp) / GIB}


def same_scope_gib(breakdown: dict[str, float], recipe: Recipe | None = None) -> float:
    """The planner's peak over exactly what a trace can see (with `recipe`: and what the trace holds
    that the GPU run does not, `trace_only_gib`, so the two compare like with like)."""
    extra = sum(trace_only_gib(recipe).values()) if recipe is not None else 0.0
    return sum(v for k, v in breakdown.items() if k not in OUTSIDE_TRACE) + extra


def modelled_terms(recipe: Recipe, traced_gib: float) -> dict[str, float]:
    """GiB per GPU the trace cannot see (module doc), by term."""
    terms = {
        "allocator fragmentation": FRAGMENTATION * traced_gib,
        "CUDA context": CUDA_CONTEXT_GIB,
        "NCCL buffers": NCCL_GIB,
    }
    for name, gib in trace_only_gib(recipe).items():  # traced, but not on the GPU: taken back out
        terms[f"{name} (traced path only)"] = -gib
    if recipe.precision.dtype == "fp8":
        m, ac = recipe.model, recipe.activation_checkpointing
        if ac.mode == "full":
            kept = 0
        elif ac.mode == "selective" and ac.policy != "op":
            kept = m.layers - math.ceil(m.layers / ac.every)
        else:
            kept = m.layers
        terms["TE FP8 weight copies"] = FP8_WEIGHT_COPY_BYTES * m.params_per_layer * kept / GIB
        terms["TE amax histories"] = 4 * AMAX_HISTORY_LEN * AMAX_TENSORS_PER_BLOCK * m.layers / GIB
    return terms


@dataclass(frozen=True)
class TracedMemory:
    traced_gib: float
    by_category_gib: dict[str, float]
    modelled_gib: float
    modelled: dict[str, float]
    total_gib: float
    usable_gib: float
    fits: bool
    planned_same_scope_gib: float
    seconds: float
    peak_at: dict
    flops: dict
    notes: tuple[str, ...] = field(default=())
    cached: bool = False

    @property
    def verdict(self) -> str:
        word = "fits" if self.fits else "does NOT fit"
        return (
            f"traced {self.traced_gib:.1f} GiB + modelled {self.modelled_gib:.1f} GiB = "
            f"{self.total_gib:.1f} GiB of {self.usable_gib:.0f}: {word}"
        )

    def to_json(self) -> dict:
        """`memory.traced` of `plan --trace --json`."""
        d = asdict(self)
        d["peak_gib"] = d.pop("traced_gib")
        d["notes"] = list(self.notes)
        return d


def traced_memory(
    recipe: Recipe, breakdown: dict[str, float], usable_gib: float, report: dict, cached: bool = False
) -> TracedMemory:
    """The trace's report (trainer.trace's JSON) plus the modelled terms, judged against `usable_gib`."""
    traced = report["peak_bytes"] / GIB
    terms = modelled_terms(recipe, traced)
    modelled = sum(terms.values())
    total = traced + modelled
    return TracedMemory(
        traced_gib=round(traced, 6),  # 6 places: a CPU test's tiny model is a few MiB
        by_category_gib={k: round(report["by_category_bytes"].get(k, 0) / GIB, 6) for k in CATEGORIES},
        modelled_gib=round(modelled, 6),
        modelled={k: round(v, 6) for k, v in terms.items()},
        total_gib=round(total, 6),
        usable_gib=usable_gib,
        fits=total <= usable_gib,
        planned_same_scope_gib=round(same_scope_gib(breakdown, recipe), 6),
        seconds=report["seconds"],
        peak_at=report.get("peak_at", {}),
        flops=report.get("flops", {}),
        notes=tuple(report.get("notes", ())),
        cached=cached,
    )


# The kinds of the time model (trainstack.planner.throughput: seconds_by_kind) whose seconds are FLOPs at a
# rate, and the counted figure each is checked against: the block and head GEMMs, attention, recompute.
TIMED_KINDS = {"GEMMs": ("block GEMMs",), "attention": ("attention",), "recompute": ("activation recompute",)}


def time_model_flops(throughput) -> dict[str, float]:
    """The hardware FLOPs per token the planner's time model runs, by kind, in the counter's terms
    (torch.utils.flop_counter: 2 m n k per matmul; SDPA without causal halving, its backward 2.5x its
    forward as flash attention's recomputes the scores, which is also what the time model charges,
    `Calibration.attention_backward_ratio`; the causal half is a rate, not FLOPs). From the plan's
    own `flops_by_kind` (PaLM counting: attention 12 L H Q T = forward 4 x 3)."""
    from trainstack.planner.calibration import CALIBRATION

    kinds = throughput.flops_by_kind or {}
    attention_forward = kinds.get("attention", 0.0) / 3
    return {
        "GEMMs": kinds.get("block GEMMs", 0.0) + kinds.get("output head", 0.0),
        "attention": attention_forward * (1 + CALIBRATION.attention_backward_ratio),
        "recompute": kinds.get("activation recompute", 0.0) + kinds.get("loss-chunk recompute", 0.0),
    }


def counted_flops(report: dict, throughput) -> dict:
    """The traced step's counted FLOPs per token (one GPU's micro-step under FlopCounterMode: the ops
    that ran, model and checkpoint recompute apart) beside the planner's two uses of FLOPs, and what
    the plan uses where they differ by more than COUNTED_FLOPS_TOLERANCE (the issue's 2%):

    - MFU counts model FLOPs: PaLM's formula (6N + 12 L H Q T) against the counted model FLOPs. They
      differ by flash attention's backward, which recomputes the score matrix (2 L H Q T per token
      more than PaLM's 12): +5% at 8K for 1B, more at long sequences. Over 2%: MFU of the counted.
    - Time is hardware work by kind at fitted rates; the GEMMs', attention's and recompute's FLOPs are
      checked against the counted ones (`time_model_flops`). A kind over 2% off has its seconds scaled
      to the counted FLOPs. Recompute is compared only where the GPU runs the traced block (the
      pure-PyTorch one: the op policy); Transformer Engine's checkpoint replays more of a block than
      the pure-PyTorch one does, and the trace cannot run it. Where the plan is held at the sanity
      bound (FLOP/s), its floor is set by the counted FLOPs.

    Returns {} without counts. `step_time_s`, `tokens_per_sec_per_gpu`, `mfu` and `time_scale` are what
    the plan uses (`throughput_with_counted_flops`)."""
    flops = report.get("flops") or {}
    if not flops.get("model") or not flops.get("tokens"):
        return {}
    tokens = flops["tokens"]
    model = flops["model"] / tokens
    recompute = (flops.get("recompute") or 0) / tokens
    attention = (flops.get("attention") or 0) / tokens
    counted = {"GEMMs": model - attention, "attention": attention, "recompute": recompute}
    planned = time_model_flops(throughput)
    split = flops.get("attention") is not None  # a report without it cannot tell GEMMs from attention
    comparable = {"GEMMs": split, "attention": split}
    comparable["recompute"] = throughput.backend == "pytorch"
    why = {"GEMMs": "no attention count", "attention": "no attention count"}
    why["recompute"] = "Transformer Engine's checkpoint is not traced"
    by_kind, seconds = {}, dict(throughput.seconds_by_kind or {})
    for kind, kinds in TIMED_KINDS.items():
        ratio = counted[kind] / planned[kind] if planned[kind] else 1.0
        use = comparable[kind] and planned[kind] > 0 and abs(ratio - 1) > COUNTED_FLOPS_TOLERANCE
        by_kind[kind] = {
            "counted_per_token": round(counted[kind]),
            "time_model_per_token": round(planned[kind]),
            "difference": round(ratio - 1, 4),
            "used": "counted" if use else ("time model" if comparable[kind] else f"time model ({why[kind]})"),
        }
        if use:
            for name in kinds:
                if name in seconds:
                    seconds[name] *= ratio
    hardware_formula = throughput.flops_per_token + throughput.recompute_flops_per_token
    recompute_used = recompute if comparable["recompute"] else throughput.recompute_flops_per_token
    hardware_counted = model + recompute_used
    if "sanity bound" in seconds:  # the floor is FLOPs at the bound: the counted FLOPs set it
        unbounded = sum(v for k, v in seconds.items() if k != "sanity bound")
        floor = throughput.step_time_s * hardware_counted / hardware_formula
        seconds["sanity bound"] = max(0.0, floor - unbounded)
    step_time = sum(seconds.values()) if seconds else throughput.step_time_s
    time_scale = step_time / throughput.step_time_s
    planned_model = throughput.flops_per_token
    difference = model / planned_model - 1
    mfu_counted = abs(difference) > COUNTED_FLOPS_TOLERANCE
    tokens_per_s = throughput.tokens_per_sec_per_gpu / time_scale
    mfu = tokens_per_s * (model if mfu_counted else planned_model) / (throughput.peak_tflops * 1e12)
    return {
        "model_per_token": round(model),
        "recompute_per_token": round(recompute),
        "attention_per_token": round(attention),
        "planned_model_per_token": round(planned_model),
        "planned_recompute_per_token": round(throughput.recompute_flops_per_token),
        "difference": round(difference, 4),
        "used": "counted" if mfu_counted else "formula",  # for MFU
        "by_kind": by_kind,
        "time": "counted" if abs(time_scale - 1) > 1e-9 else "time model",
        "time_scale": round(time_scale, 6),
        "step_time_s": step_time,
        "tokens_per_sec_per_gpu": round(tokens_per_s, 1),
        "mfu": mfu,
        "formula_mfu": throughput.mfu,
        "seconds_by_kind": seconds,
    }


def throughput_with_counted_flops(throughput, counted: dict):
    """The plan's ThroughputPlan with the counted FLOPs where `counted_flops` uses them: MFU of the
    counted model FLOPs, and step time, tokens/s (and its range), micro-step time and TFLOP/s from the
    re-timed kinds. The same object when nothing differs by more than 2%."""
    from dataclasses import replace

    if not counted or (counted["used"] == "formula" and counted["time"] == "time model"):
        return throughput
    scale = counted["time_scale"]
    tps = throughput.tokens_per_sec_per_gpu / scale
    model = counted["model_per_token"] if counted["used"] == "counted" else throughput.flops_per_token
    low, high = throughput.tokens_per_sec_per_gpu_range
    return replace(
        throughput,
        flops_per_token=model,
        flops_formula=(
            "counted on the traced step (torch.utils.flop_counter.FlopCounterMode)"
            if counted["used"] == "counted"
            else throughput.flops_formula
        ),
        achieved_tflops_per_gpu=throughput.achieved_tflops_per_gpu / scale,
        model_tflops_per_gpu=tps * model / 1e12,
        tokens_per_sec_per_gpu=tps,
        tokens_per_sec=throughput.tokens_per_sec / scale,
        mfu=counted["mfu"],
        step_time_s=counted["step_time_s"],
        compute_time_per_micro_step_s=throughput.compute_time_per_micro_step_s * scale,
        tokens_per_sec_per_gpu_range=(low / scale, high / scale),
        seconds_by_kind=counted["seconds_by_kind"],
        micro_step_time_s=throughput.micro_step_time_s * scale,
    )


def counted_plan(recipe: Recipe, plan, counted: dict):
    """The plan re-timed by the counted FLOPs (`counted_flops`): its throughput, and the run's time and
    cost that follow from it (trainstack.planner.core.plan_with_throughput). The plan itself where
    the counted figures agree with the planner's within 2%."""
    throughput = throughput_with_counted_flops(plan.throughput, counted)
    if throughput is plan.throughput:
        return plan
    from trainstack.planner.core import plan_with_throughput

    return plan_with_throughput(recipe, throughput)


def counted_flops_lines(counted: dict) -> list[str]:
    """What `plan --trace` prints of the counted FLOPs: the counted figures beside the formula's and
    the time model's, the difference, and which one the plan above uses."""
    if not counted:
        return []
    g = 1e9
    lines = [
        f"FLOPs per token counted on the traced step: {counted['model_per_token'] / g:.2f} G model + "
        f"{counted['recompute_per_token'] / g:.2f} G recompute; PaLM's formula "
        f"{counted['planned_model_per_token'] / g:.2f} ({counted['difference']:+.1%}): MFU "
        + (
            f"{counted['mfu']:.1%} of the counted FLOPs (the formula's {counted['formula_mfu']:.1%})"
            if counted["used"] == "counted"
            else f"{counted['mfu']:.1%} (the formula's; within 2%)"
        )
    ]
    kinds = "; ".join(
        f"{kind} {row['counted_per_token'] / g:.2f} G counted, {row['time_model_per_token'] / g:.2f} G "
        f"timed ({row['difference']:+.1%}, {row['used']})"
        for kind, row in counted["by_kind"].items()
    )
    if counted["time"] == "counted":
        timing = (
            f"the plan's step time, tokens/s, hours and cost above use the counted FLOPs: step "
            f"{counted['step_time_s']:.2f} s ({counted['time_scale'] - 1:+.1%}), "
            f"{counted['tokens_per_sec_per_gpu']:,.0f} tokens/s per GPU"
        )
    else:
        timing = "the traced kinds agree within 2%: the plan's time stands"
    lines.append(f"time model's FLOPs per token: {kinds}; {timing}")
    return lines
