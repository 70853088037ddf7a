"""FSDP2 sharding: one `fully_shard` per block plus the root, over a 1-D (FSDP) or 2-D (HSDP) mesh.

Parameters are kept sharded in FP32 (the optimizer's master copy), gathered in BF16 for compute, and
gradients are reduced in FP32 (`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`). When the
shard group is smaller than the world, the mesh is (replicate, shard): parameters are sharded inside
each group (one node's NVLink for shard_group 8) and replicated across groups, so only gradient
all-reduces cross EFA.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from trainer.model import Transformer


def build_mesh(device_type: str, world: int, shard: int) -> DeviceMesh:
    if shard == world:
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (world // shard, shard), mesh_dim_names=("replicate", "shard"))


def mesh_description(mesh: DeviceMesh) -> str:
    if mesh.ndim == 1:
        return f"FSDP over {mesh.size()} ranks"
    return f"HSDP: {mesh.size(0)} replicas x {mesh.size(1)}-way shard"


def shard_model(model: Transformer, mesh: DeviceMesh) -> Transformer:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    last = len(model.layers) - 1
    for index, block in enumerate(model.layers):
        # The last block's parameters are needed again at the start of backward: keep them gathered.
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=index < last)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def set_gradient_sync(model: Transformer, mesh: DeviceMesh, last_micro_step: bool) -> None:
    """Gradient communication for one accumulation micro-step.

    Gradients are reduce-scattered on every micro-step, so what accumulates between micro-steps is
    each rank's FP32 gradient *shard*. FSDP2's `set_requires_gradient_sync(False)` (FSDP1's
    `no_sync`) would instead keep every block's full unsharded gradient, upcast to the FP32 reduce
    dtype, until the last micro-step: 4 bytes x all parameters per GPU (120 GB for 30B, 256 GB for
    64B), which no GPU holds. On an HSDP mesh the all-reduce across replicas is what can wait: it
    runs on the last micro-step only (FSDP2's documented `set_requires_all_reduce`)."""
    if mesh.ndim == 2:
        model.set_requires_all_reduce(last_micro_step)  # FSDPModule method, recursive over the blocks
