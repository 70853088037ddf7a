"""Run under `torchrun --nproc-per-node 4` (gloo, CPU) by test_trainer_context_parallel.py.

Trains the tiny model for a few steps in FP32 (FSDP's FP32 policy, so layouts can be compared at
float32 tolerance; the trainer itself gathers in BF16) in several layouts of the same 4 ranks, with the
trainer's own pieces: build_model, apply_context_parallel, activation checkpointing (selective, one
block in 2, so a recompute re-runs the K/V all-gather in backward), build_meshes / shard_model,
the data plan (micro_batch_indices over the data-parallel ranks, ContextParallel.split), AdamW and
its schedule. Records each step's mean loss over every rank, the gradient norm, and the full
gradients at the first and last step. Then counts what one BF16 block keeps for backward under
context parallelism (bench/saved_tensors.py), for trainstack.planner.trainer_memory.

argv: OUT.pt STEPS
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from trainer.data.loader import SyntheticTokens, micro_batch_indices
from trainer.distributed.context_parallel import (
    ContextParallelSDPAttention,
    apply_context_parallel,
    build_meshes,
)
from trainer.distributed.parallel import set_gradient_sync, shard_model
from trainer.models.activation_checkpointing import apply_activation_checkpointing, recompute_function
from trainer.models.model import Block, build_model, pytorch_backend, rotary_tables
from trainer.optim import build_optimizer, build_scheduler

from trainstack.recipes.schema import ActivationCheckpointing, ModelShape, RopeScaling, Training

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from saved_tensors import count_saved_bytes  # noqa: E402

FP32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
SHAPE = ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, ffn=176, vocab=256, rope_theta=10000.0)
# Llama 3.1's scaling at toy scale: an original context of 16 positions, run at 128 (8x, as 8K -> 64K).
LONG_SHAPE = SHAPE.model_copy(
    update={
        "rope_scaling": RopeScaling(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        )
    }
)
GLOBAL_BATCH, MICRO_BATCH = 4, 1


def train(shape: ModelShape, seq_len: int, cp: int, shard: int, steps: int, run: int | None = None) -> dict:
    """`run` of the schedule's `steps` steps (all by default)."""
    world = dist.get_world_size()
    training = Training(
        seq_len=seq_len,
        micro_batch=MICRO_BATCH,
        global_batch=GLOBAL_BATCH,
        steps=steps,
        lr=3e-3,
        warmup_steps=2,
        loss_chunk_tokens=24,
    )
    meshes = build_meshes("cpu", world, shard, cp, seq_len)
    grad_accum = GLOBAL_BATCH // (MICRO_BATCH * meshes.data_ranks)
    torch.manual_seed(0)
    model = build_model(shape, seq_len, pytorch_backend(), training.loss_chunk_tokens)
    apply_context_parallel(model, meshes.cp, torch.device("cpu"))
    apply_activation_checkpointing(model, ActivationCheckpointing(mode="selective", every=2))
    shard_model(model, meshes.fsdp, FP32)
    model.to_empty(device="cpu")
    model.init_weights()
    optimizer = build_optimizer(model, training, "cpu")
    scheduler = build_scheduler(optimizer, training)
    source = SyntheticTokens(shape.vocab, seq_len, seed=7)
    losses, norms, grads = [], [], {}
    run = steps if run is None else run
    for step in range(run):
        loss_sum = torch.zeros(())
        for micro in range(grad_accum):
            indices = micro_batch_indices(
                step * GLOBAL_BATCH, micro, meshes.data_rank, meshes.data_ranks, MICRO_BATCH
            )
            windows = torch.from_numpy(np.stack([source.sample(i) for i in indices]))
            inputs, targets = meshes.cp.split(windows[:, :-1]), meshes.cp.split(windows[:, 1:])
            set_gradient_sync(model, meshes.fsdp, last_micro_step=micro == grad_accum - 1)
            loss = model(inputs, targets)
            (loss / grad_accum).backward()
            loss_sum += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        if step in (0, run - 1):
            grads[step + 1] = {name: p.grad.full_tensor().clone() for name, p in model.named_parameters()}
        mean = loss_sum / grad_accum
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    del model, optimizer, scheduler
    gc.collect()
    return {"losses": losses, "grad_norms": norms, "grads": grads}


def saved_bytes(cp: int, shard: int, seq_len: int, batch: int) -> dict:
    """What one BF16 block keeps for backward on this rank, per checkpointing mode, at `cp`."""
    meshes = build_meshes("cpu", dist.get_world_size(), shard, cp, seq_len)
    context = meshes.cp
    positions = context.positions
    cos, sin = rotary_tables(SHAPE.head_dim, seq_len, SHAPE.rope_theta, torch.device("cpu"))
    rope = (cos.index_select(0, positions), sin.index_select(0, positions))
    mask = context.causal_mask(torch.bfloat16, torch.device("cpu"))  # made once, shared by every block
    out = {"local_tokens": batch * context.local_len, "mask_bytes": mask.numel() * mask.element_size()}
    for mode in ("none", "full", "op"):
        torch.manual_seed(0)
        block = Block(SHAPE, pytorch_backend())
        for param in block.parameters():
            torch.nn.init.normal_(param, 0.0, 0.02) if param.ndim > 1 else torch.nn.init.ones_(param)
        block.to(torch.bfloat16)
        block.attention.core = ContextParallelSDPAttention(block.attention.core, context)
        if mode != "none":
            block.recompute = recompute_function("pytorch", op_level=mode == "op")

        def make_input():
            torch.manual_seed(1 + dist.get_rank())
            return torch.randn(
                batch, context.local_len, SHAPE.hidden, dtype=torch.bfloat16, requires_grad=True
            )

        counted, result = count_saved_bytes(block, make_input, extra_args=(rope,), excluded=(mask,))
        result.float().sum().backward()  # the backward's collectives (and recomputed gathers) pair up
        out[mode] = counted.live
    return out


def main() -> None:
    out_path, steps = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo")
    results = {
        # (cp, data-parallel shard): FSDP over 4 ranks in each, the CP ranks inside it
        "cp1": train(SHAPE, 32, cp=1, shard=4, steps=steps),
        "cp2": train(SHAPE, 32, cp=2, shard=2, steps=steps),
        "cp4": train(SHAPE, 32, cp=4, shard=1, steps=steps),
        # HSDP: 2 replicas x (1 data-parallel shard x cp 2)
        "cp2-hsdp": train(SHAPE, 32, cp=2, shard=1, steps=steps, run=5),
        # Llama 3.1 rope_scaling, 8x past the original context
        "long-cp1": train(LONG_SHAPE, 128, cp=1, shard=4, steps=5),
        "long-cp4": train(LONG_SHAPE, 128, cp=4, shard=1, steps=5),
        "saved-cp2": saved_bytes(cp=2, shard=2, seq_len=32, batch=2),
        "saved-cp4": saved_bytes(cp=4, shard=1, seq_len=32, batch=2),
    }
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
