"""Per-GPU memory at the step's peak, component by component (docs/planner.md, Memory).

`memory_breakdown` takes explicit knobs rather than a Recipe, so the recommender and the calibration
bench can ask "what if" without building recipes. The terms that depend on how our trainer is written
(saved bytes per block, the op-level policy, FSDP units in flight, loss bytes) come from
trainstack.planner.trainer_memory, which the trainer-model engineer owns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainstack.planner import trainer_memory
from trainstack.planner.trainer_memory import (
    FINAL_HIDDEN_BYTES,
    LOSS_BYTES,
    block_gradient_working_bytes,
    bottom_block_backward_in_flight_bytes,
    context_parallel_block_saved_bytes,
    context_parallel_mask_bytes,
    fc1_weight_gradient_bytes,
    ffn_weight_gradient_bytes,
    loss_backward_in_flight_bytes,
    top_block_backward_in_flight_bytes,
)
from trainstack.recipes.hardware import GPU
from trainstack.recipes.schema import ActivationCheckpointing, ModelShape

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

# --- Activation policies --------------------------------------------------------------------------


@dataclass(frozen=True)
class ActivationPolicy:
    """What one transformer block keeps for backward.

    `checkpointed_fraction` of the blocks keep only their input (and recompute the rest in backward);
    `op_level` is op-level selective checkpointing in every block (`activation_checkpointing.policy:
    op`: matmul outputs kept, cheap ops recomputed; its bytes and recompute share come from
    trainstack.planner.trainer_memory). `torchtitan` marks torchtitan's own op-level policy, which keeps a
    different set (its block has separate wq wk wv wo w1 w3 w2): the calibration cases use it.
    """

    name: str
    checkpointed_fraction: float = 0.0
    op_level: bool = False
    torchtitan: bool = False
    # Whether the last block recomputes (its backward, the step's first, then holds a rebuilt block);
    # None: as the fraction says (any checkpointed block: yes).
    last_block_checkpointed: bool | None = None

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
        return cls(
            f"selective (1 in {ac.every})",
            math.ceil(layers / ac.every) / layers,
            last_block_checkpointed=(layers - 1) % ac.every == 0,  # blocks 0, every, 2 every, ...
        )

    @classmethod
    def op_selective(cls) -> ActivationPolicy:
        return cls("selective-op", 0.0, op_level=True)

    @classmethod
    def torchtitan_op_selective(cls) -> ActivationPolicy:
        return cls("torchtitan selective-op", 0.0, op_level=True, torchtitan=True)

    @classmethod
    def none(cls) -> ActivationPolicy:
        return cls("none", 0.0)

    @classmethod
    def full(cls) -> ActivationPolicy:
        return cls("full", 1.0)


# --- The op-level policy's terms -------------------------------------------------------------------
# Our trainer's op policy (fused Q/K/V and fc1 saved, the output projection recomputed) keeps a
# different set than torchtitan's (its block has separate wq wk wv wo w1 w3 w2): recipes use the
# trainer's terms, the calibration cases (torchtitan runs) torchtitan's; both from trainer_memory.


def op_selective_bytes(m: ModelShape, torchtitan: bool = False) -> int:
    if torchtitan:
        return trainer_memory.torchtitan_op_selective_bytes(m)
    return trainer_memory.op_selective_bytes(m)


def op_selective_recompute_share(m: ModelShape, torchtitan: bool = False) -> float:
    if torchtitan:
        return trainer_memory.torchtitan_op_selective_recompute_share(m)
    return trainer_memory.op_selective_recompute_share(m)


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
    grad_accum: int = 2,
    loss_bytes_per_logit: float = LOSS_BYTES,
) -> dict[str, float]:
    """Per-GPU memory components in GiB at the step's peak, which falls at one of three moments (the
    traced step's, trainer_memory): the chunked loss's backward, the last block's backward, or block
    0's backward. Each moment's transient terms are its own; the largest moment is the peak.
    `grad_accum` 1: no gradient exists at the peak (the previous step's were freed, this step's are
    not reduced yet); more: the earlier micro-steps' FP32 gradient shards are held.
    `loss_bytes_per_logit`: our trainer's eager chunked loss (LOSS_BYTES); another trainer's loss (the
    calibration bench's published runs) may hold other bytes per logit."""
    n = m.total_params
    # FSDP shards over shard_group x cp ranks: the CP ranks of a sequence hold the same weights
    # (training_image/trainer/distributed/context_parallel.py, as torchtitan's dp_shard_cp).
    fsdp_ranks = shard_group * cp
    shard = fsdp_ranks * tp
    tokens = micro_batch * seq_len / cp  # tokens whose activations this GPU holds (CP splits the sequence)
    act_tokens = tokens / tp  # sequence parallel splits what tensor parallel would otherwise replicate

    # Per local token; under CP an uncheckpointed block also keeps the all-gathered K/V (cp x the local
    # ones; trainer_memory.context_parallel_block_saved_bytes, counted on the trainer's CP block).
    full_block = context_parallel_block_saved_bytes(m, "none", cp)
    if policy.op_level:
        saved_block = op_selective_bytes(m, torchtitan=policy.torchtitan)
        recompute_block = max(0, full_block - saved_block)  # the cheap ops, replayed in backward
        bottom_block = saved_block
    else:
        f = policy.checkpointed_fraction
        saved_block = (1 - f) * full_block + f * m.hidden * BF16
        last = policy.last_block_checkpointed if policy.last_block_checkpointed is not None else f > 0
        recompute_block = full_block if last else 0  # a checkpointed block rebuilds it all
        bottom_block = m.hidden * BF16 if f > 0 else full_block  # block 0 is checkpointed first
    working = (recompute_block + block_gradient_working_bytes(m)) * act_tokens + ffn_weight_gradient_bytes(
        m
    ) / tp
    saved = m.layers * saved_block * act_tokens

    chunk = min(loss_chunk_tokens, tokens)
    # One chunk's logits at a time (vocabulary split across TP ranks) plus the final hidden states.
    logits = loss_bytes_per_logit * chunk * m.vocab / tp + FINAL_HIDDEN_BYTES * tokens * m.hidden
    if fsdp_ranks == 1:  # unsharded: the BF16 copies are still made for compute, but nothing is gathered
        unsharded = (m.params_per_layer * m.layers + m.embedding_params) * BF16 / tp
        flight = {"loss": unsharded, "top": unsharded, "bottom": unsharded}
    else:
        flight = {
            "loss": loss_backward_in_flight_bytes(m) / tp,
            "top": top_block_backward_in_flight_bytes(m) / tp,
            "bottom": bottom_block_backward_in_flight_bytes(m) / tp,
        }
    moments = {
        "loss": {"in flight": flight["loss"], "saved": saved, "working": 0.0, "logits": logits},
        # An upper block's backward peaks before fc1's weight gradient is made (traced: the planner's
        # figure was that gradient above the trace at every full-checkpointing shape once the trace
        # kept FSDP2's grouped head unit whole); block 0's holds all three MLP weight gradients.
        "top": {
            "in flight": flight["top"],
            "saved": saved,
            "working": working - fc1_weight_gradient_bytes(m) / tp,
            "logits": 0.0,
        },
        "bottom": {
            "in flight": flight["bottom"],
            "saved": bottom_block * act_tokens,
            "working": working,
            "logits": 0.0,
        },
    }
    at = moments[max(moments, key=lambda k: sum(moments[k].values()))]
    parts = {
        "parameters (sharded FP32)": n * BYTES_PARAM / shard,
        "gradients (sharded FP32)": n * BYTES_GRAD / shard if grad_accum > 1 else 0.0,
        "optimizer states (AdamW FP32)": n * BYTES_ADAM / shard,
        "unsharded layers in flight": at["in flight"],
        "activations (saved)": at["saved"],
        "activations (backward working set)": at["working"],
        "logits and loss": at["logits"],
    }
    if cp > 1 and policy.op_level:
        # The pure-PyTorch CP attention's causal mask (one, shared by every block). The op policy runs
        # that path; otherwise Transformer Engine's CP attention runs, which needs no mask.
        parts["context-parallel mask"] = context_parallel_mask_bytes(seq_len, cp)
    gib = {k: v / GIB for k, v in parts.items()}
    gib["allocator fragmentation"] = FRAGMENTATION * sum(gib.values())
    gib["CUDA context"] = CUDA_CONTEXT_GIB
    gib["NCCL buffers"] = NCCL_GIB
    return gib


# Components that depend on the knobs a user would turn, used to name what breaks a plan.
GROWING = (
    "activations (saved)",
    "logits and loss",
    "optimizer states (AdamW FP32)",
    "activations (backward working set)",
    "unsharded layers in flight",
)


def memory_plan(parts: dict[str, float], gpu: GPU) -> MemoryPlan:
    total = sum(parts.values())
    return MemoryPlan(
        breakdown={k: round(v, 3) for k, v in parts.items()},
        peak_gib=round(total, 3),
        usable_gib=gpu.usable_gib,
        budget_gib=round(gpu.usable_gib * (1 - HEADROOM), 3),
        fits=total <= gpu.usable_gib,
    )


def peak(parts: dict[str, float]) -> float:
    return sum(parts.values())
