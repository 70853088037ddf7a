"""Run under `torchrun --nproc-per-node 2` (gloo, CPU) by test_trainer_hf.py: shard the model as the
trainer does, load the base model of the recipe (argv[1], JSON) with trainer.hf.conversion.start_from_base,
and write, per rank, to argv[2]/rank<r>.json: the elements this rank holds against the whole model, the
bytes it read from the safetensors files, and the largest difference between its local rows and the
same rows of the base's tensors (read here whole, after the load, for the comparison only)."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from trainer.distributed.parallel import build_mesh, shard_model
from trainer.hf.conversion import pieces, start_from_base
from trainer.models.model import build_model, pytorch_backend

from trainstack.recipes.schema import Recipe


def main() -> None:
    recipe = Recipe.model_validate_json(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(
        recipe.model, recipe.training.seq_len, pytorch_backend(), recipe.training.loss_chunk_tokens
    )
    shard_model(model, build_mesh("cpu", world, world))
    model.to_empty(device="cpu")
    model.init_weights()
    loaded = start_from_base(model, recipe.model, local_rank=rank, group=None)
    base = {}
    for file in Path(recipe.model.init_from).glob("*.safetensors"):
        base.update(load_file(file))
    params = dict(model.named_parameters())
    worst, local_elements, full_elements = 0.0, 0, 0
    for name, param in params.items():
        local = param.to_local()
        _, offsets = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        full = torch.cat([base[p.hf] for p in pieces(recipe.model) if p.ours == name])
        rows = full[offsets[0] : offsets[0] + local.shape[0]]
        worst = max(worst, (local.detach() - rows).abs().max().item() if local.numel() else 0.0)
        local_elements += local.numel()
        full_elements += param.numel()
    record = {
        "max_difference": worst,
        "local_elements": local_elements,
        "full_elements": full_elements,
        "bytes_read": loaded.bytes_read,
    }
    (Path(sys.argv[2]) / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    del model, params
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
