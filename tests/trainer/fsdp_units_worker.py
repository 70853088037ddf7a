"""Run under `torchrun --nproc-per-node 2` (gloo, CPU) by test_trainer_fsdp_units.py: shard the tiny
model as the trainer does, run forward, record which FSDP units are still gathered and how many
parameter bytes that is, then finish the step. Rank 0 writes the record as JSON to argv[1]."""

from __future__ import annotations

import gc
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from trainer.distributed.parallel import build_mesh, fsdp_units, shard_model
from trainer.models.model import build_model, pytorch_backend

from trainstack.planner.trainer_memory import gathered_parameter_bytes_after_forward
from trainstack.recipes.loader import resolve


def param_groups(model: torch.nn.Module) -> dict[str, object]:
    """Every FSDP parameter group below the root, named by the modules it was made for."""
    names: dict[int, list[str]] = {}
    states = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule) and module is not model:
            state = module._get_fsdp_state()
            names.setdefault(id(state), []).append(name)
            states[id(state)] = state
    return {
        ", ".join(names[key]): group for key, state in states.items() for group in state._fsdp_param_groups
    }


def record(recipe_path: str, tied: bool) -> dict:
    recipe = resolve(recipe_path).recipe
    shape = recipe.model.model_copy(update={"layers": 3, "tied_embeddings": tied})
    torch.manual_seed(0)
    model = build_model(shape, recipe.training.seq_len, pytorch_backend(), recipe.training.loss_chunk_tokens)
    planned = {name: reshard for name, _, reshard in fsdp_units(model)}
    mesh = build_mesh("cpu", dist.get_world_size(), dist.get_world_size())
    shard_model(model, mesh)
    model.to_empty(device="cpu")
    model.init_weights()
    groups = param_groups(model)
    tokens = torch.randint(0, shape.vocab, (2, recipe.training.seq_len + 1))
    loss = model(tokens[:, :-1], tokens[:, 1:])
    gathered = {name: g for name, g in groups.items() if g.is_unsharded}
    gathered_bytes = sum(
        p.unsharded_param.numel() * p.unsharded_param.element_size()
        for g in gathered.values()
        for p in g.fsdp_params
    )
    loss.backward()
    return {
        "planned_reshard_after_forward": planned,
        "groups": {name: g.post_forward_mesh_info is not None for name, g in groups.items()},
        "gathered_after_forward": sorted(gathered),
        "gathered_bytes": gathered_bytes,
        "expected_bytes": gathered_parameter_bytes_after_forward(shape),
        "loss": loss.item(),
        "sharded_param_ranks": sorted({p.device_mesh.size() for p in model.parameters()}),
    }


def main() -> None:
    dist.init_process_group("gloo")
    out = {str(tied): record(sys.argv[2], tied) for tied in (False, True)}
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)
    # The sharded models are cyclic garbage that still holds the mesh's process groups: collect them
    # now, while gloo is up, not at interpreter exit after it is torn down, where a group's worker
    # thread can abort the process ("terminate called without an active exception", about 1 run in
    # 12 on a loaded 2-core machine). Then both ranks finish every collective before either tears
    # gloo down.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
