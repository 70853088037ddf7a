"""Run under `torchrun --nproc-per-node 2` (gloo, CPU) by test_sft_trainer_ranks.py: one fine-tuning
optimizer step's forward and backward as the training loop runs it (each rank's micro-batches of packed
rows from the real plan, `target_scale`, `micro_step` with FSDP2 in float32), then rank 0 saves the
step's loss as the metric line computes it (ranks' step losses all-reduced / world), the full gradients
and the rows every rank read, to argv[3]."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from trainer.config import recipe_from_json, resolve_layout
from trainer.data.loader import Prefetcher, micro_batch_indices, micro_batch_plan
from trainer.data.packing import open_chat
from trainer.distributed import parallel
from trainer.distributed.parallel import build_mesh, shard_model
from trainer.hf.conversion import load_base
from trainer.models.model import build_model, pytorch_backend
from trainer.train import micro_step, target_scale


def main(recipe_path: str, data: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    recipe = recipe_from_json(Path(recipe_path))
    layout = resolve_layout(recipe, world, recipe_path)
    parallel.MIXED_PRECISION = MixedPrecisionPolicy(  # exact float32 math, to compare with one process
        param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    tr = recipe.training
    model = build_model(recipe.model, tr.seq_len, pytorch_backend(), tr.loss_chunk_tokens)
    mesh = build_mesh("cpu", world, world)
    shard_model(model, mesh)
    model.to_empty(device="cpu")
    model.init_weights()
    load_base(model, Path(recipe.model.init_from), recipe.model)
    source = open_chat(Path(data), tr.seq_len, recipe.model.vocab, tr.seed)
    plan = [
        micro_batch_indices(0, m, rank, layout.data_ranks, layout.micro_batch)
        for m in range(layout.grad_accum)
    ]
    batches = Prefetcher(
        source,
        micro_batch_plan(
            0, layout.grad_accum, layout.global_batch, rank, layout.data_ranks, layout.micro_batch
        ),
        torch.device("cpu"),
    )
    try:
        read = [batches.next(indices) for indices in plan]
    finally:
        batches.close()
    scale = target_scale(read, layout.data_ranks)
    step_loss = torch.zeros(())
    for m, batch in enumerate(read):
        last = m == layout.grad_accum - 1
        no_autocast = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731
        step_loss += micro_step(
            model,
            mesh,
            batch.inputs,
            batch.targets,
            no_autocast,
            layout.grad_accum,
            last,
            batch.packed,
            scale,
        ).detach()
    dist.all_reduce(step_loss)
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    rows = [None] * world
    dist.all_gather_object(rows, [i for batch in read for i in batch.sample_indices])
    if rank == 0:
        torch.save(
            {"loss": float(step_loss) / world, "grads": grads, "rows": rows, "grad_accum": layout.grad_accum},
            out,
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
