"""Trainer pieces that need a process group, in this process as a world of one (gloo, CPU)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from trainer.data.loader import SyntheticTokens, load_batch, micro_batch_indices
from trainer.distributed.parallel import set_gradient_sync, shard_model
from trainer.models.model import build_model, pytorch_backend
from trainer_helpers import TINY

from trainstack.recipes.loader import resolve

pytestmark = pytest.mark.fast


def unsharded_gradients_held(model: torch.nn.Module) -> list[str]:
    """Parameters whose full (unsharded) accumulated gradient FSDP2 keeps for a later reduction."""
    held = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                held += [p._param_fqn for p in group.fsdp_params if p.unsharded_accumulated_grad is not None]
    return held


@pytest.mark.parametrize("mesh_shape", [(1,), (1, 1)], ids=["fsdp", "hsdp"])
def test_accumulated_gradients_stay_sharded_between_micro_steps(world_of_one, mesh_shape):
    """Between accumulation micro-steps each rank must hold only its FP32 gradient shard: FSDP2's
    no-sync mode keeps full unsharded FP32 gradients instead (4 bytes x every parameter per GPU)."""
    recipe = resolve(str(TINY)).recipe
    tr = recipe.training
    torch.manual_seed(0)
    model = build_model(recipe.model, tr.seq_len, pytorch_backend(), tr.loss_chunk_tokens)
    names = ("replicate", "shard")[-len(mesh_shape) :]
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    shard_model(model, mesh)
    model.to_empty(device="cpu")
    model.init_weights()
    source = SyntheticTokens(recipe.model.vocab, tr.seq_len, tr.seed)
    accum = 2
    for micro_step in range(accum):
        batch = load_batch(
            source, micro_batch_indices(0, micro_step, 0, 1, tr.micro_batch), torch.device("cpu")
        )
        set_gradient_sync(model, mesh, last_micro_step=micro_step == accum - 1)
        (model(batch.inputs, batch.targets) / accum).backward()
        held = unsharded_gradients_held(model)
        assert not held, f"after micro-step {micro_step}: full FP32 gradients held for {held[:3]}"
    # The last micro-step reduced across every rank: each parameter has its FP32 gradient shard.
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
