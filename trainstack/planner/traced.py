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


def counted_flops(report: dict, throughput) -> dict:
    """The traced step's counted FLOPs per token (one GPU's micro-step, FlopCounterMode: the ops that
    ran) beside the planner's formula (6N + attention, with its recompute term), and the planner's
    step time, tokens/s and MFU re-scaled to the counted figures where model or recompute FLOPs
    differ by more than 2% (time in proportion to the FLOPs run; MFU of the counted model FLOPs)."""
    flops = report.get("flops") or {}
    if not flops.get("model") or not flops.get("tokens"):
        return {}
    model = flops["model"] / flops["tokens"]
    recompute = (flops.get("recompute") or 0) / flops["tokens"]
    planned_model, planned_recompute = throughput.flops_per_token, throughput.recompute_flops_per_token
    planned_total, counted_total = planned_model + planned_recompute, model + recompute
    difference = model / planned_model - 1
    use_counted = (
        abs(difference) > COUNTED_FLOPS_TOLERANCE
        or abs(counted_total / planned_total - 1) > COUNTED_FLOPS_TOLERANCE
    )
    out = {
        "model_per_token": round(model),
        "recompute_per_token": round(recompute),
        "planned_model_per_token": round(planned_model),
        "planned_recompute_per_token": round(planned_recompute),
        "difference": round(difference, 4),
        "used": "counted" if use_counted else "formula",
    }
    if use_counted:
        scale = counted_total / planned_total
        tokens_per_s = throughput.tokens_per_sec_per_gpu / scale
        out.update(
            step_time_s=round(throughput.step_time_s * scale, 3),
            tokens_per_sec_per_gpu=round(tokens_per_s, 1),
            mfu=round(throughput.mfu * (model / planned_model) / scale, 4),
        )
    return out
