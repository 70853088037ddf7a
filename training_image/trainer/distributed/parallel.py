"""FSDP2 sharding in torchtitan's units, over a 1-D (FSDP) or 2-D (HSDP) mesh.

Units (each one `fully_shard` call, so one all-gather in forward and one reduce-scatter in backward):

    tok_embeddings        resharded after forward: it is needed again only at the very end of backward
    layers.0 .. layers.N-2  resharded after forward (the next one is prefetched while one computes)
    layers.N-1            kept gathered after forward: backward starts with it
    [norm, output]        kept gathered after forward: the loss's backward starts with it
    root                  no parameters of its own (the rotary tables are buffers)

With tied embeddings the embedding and the head share one matrix, so [tok_embeddings, norm, output]
is one unit, kept gathered from the first lookup to the last gradient (as torchtitan groups it).
`trainstack.planner.trainer_memory.fsdp_units_in_flight_bytes` is the planner's count of what these units
hold unsharded at the step's peak; change both together.

Parameters are kept sharded in FP32 (the optimizer's master copy), gathered in BF16 for compute, and
gradients are reduced in FP32 (`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`).
`cast_forward_inputs=False` (as torchtitan): FSDP2 would otherwise cast every floating-point argument
of every unit to BF16, the FP32 rotary tables included; the activations are BF16 already, because the
embedding's weight is gathered in BF16. When the shard group is smaller than the world, the mesh is
(replicate, shard): parameters are sharded inside each group (one node's NVLink for shard_group 8)
and replicated across groups, so only gradient all-reduces cross EFA.

The process group itself (`init_distributed`): NCCL on CUDA, gloo on CPU, and a world of one for a
plain `python -m trainer` without torchrun.
"""

from __future__ import annotations

import gc
import os
import socket
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from trainer.models.model import Transformer

# torchrun's elastic agents meet at an exit barrier in a store that node 0's agent hosts; the last to
# arrive sets a key and then waits on it, and if node 0's agent was already waiting it exits at once,
# closing the store under that last wait: "Error waiting on exit barrier ... DistNetworkError" with a
# traceback in a finished job's log (pytorch/pytorch#69520, open). Harmless (exit 0) but alarming, so
# node 0's ranks leave this much after the others, making node 0's agent the last to arrive.
STORE_HOST_EXIT_DELAY_S = 5.0

MIXED_PRECISION = MixedPrecisionPolicy(
    param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
)


def build_mesh(device_type: str, world: int, shard: int) -> DeviceMesh:
    if shard == world:
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (world // shard, shard), mesh_dim_names=("replicate", "shard"))


def mesh_description(mesh: DeviceMesh) -> str:
    """(The FSDP mesh; under context parallelism its shard dimension is the flattened shard x cp.)"""
    if mesh.ndim == 1:
        return f"FSDP over {mesh.size()} ranks"
    return f"HSDP: {mesh.size(0)} replicas x {mesh.size(1)}-way shard"


def fsdp_units(model: Transformer) -> list[tuple[str, list[torch.nn.Module], bool]]:
    """(name, modules, reshard_after_forward) for every unit below the root, in forward order."""
    last = len(model.layers) - 1
    blocks = [(f"layers.{i}", [block], i < last) for i, block in enumerate(model.layers)]
    head = [model.norm, model.output]
    if model.shape.tied_embeddings:
        return [("tok_embeddings+norm+output", [model.tok_embeddings, *head], False), *blocks]
    return [("tok_embeddings", [model.tok_embeddings], True), *blocks, ("norm+output", head, False)]


def shard_model(
    model: Transformer, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy | None = None
) -> Transformer:
    """`mp_policy`: the trainer's BF16 policy (MIXED_PRECISION, read at call time, not bound at
    definition, so a test that swaps the module's policy is honoured); tests that compare layouts in FP32
    pass an FP32 one."""
    if mp_policy is None:
        mp_policy = MIXED_PRECISION
    for _, modules, reshard in fsdp_units(model):
        target = modules[0] if len(modules) == 1 else modules
        with _custom_attributes_kept(modules):
            fully_shard(target, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model


class _custom_attributes_kept:
    """Transformer Engine marks its parameters with Python attributes (e.g. for FP8 metadata) that
    FSDP2 drops when it replaces each parameter with a DTensor shard; TE's own FSDP2 tests save and
    restore them around `fully_shard`. A no-op for plain PyTorch parameters."""

    def __init__(self, modules: list[torch.nn.Module]):
        self.modules = modules
        self.saved: dict[tuple[int, str], dict] = {}

    def __enter__(self):
        for i, module in enumerate(self.modules):
            for name, param in module.named_parameters():
                attributes = {k: v for k, v in vars(param).items() if not k.startswith("_")}
                if attributes:
                    self.saved[(i, name)] = attributes

    def __exit__(self, *exc):
        if exc[0] is None:
            for (i, name), attributes in self.saved.items():
                param = self.modules[i].get_parameter(name)
                for key, value in attributes.items():
                    setattr(param, key, value)


def set_gradient_sync(model: Transformer, mesh: DeviceMesh, last_micro_step: bool) -> None:
    """Gradient communication for one accumulation micro-step.

    Gradients are reduce-scattered on every micro-step, so what accumulates between micro-steps is
    each rank's FP32 gradient *shard*. FSDP2's `set_requires_gradient_sync(False)` (FSDP1's
    `no_sync`) would instead keep every block's full unsharded gradient, upcast to the FP32 reduce
    dtype, until the last micro-step: 4 bytes x all parameters per GPU (120 GB for 30B, 256 GB for
    64B), which no GPU holds. On an HSDP mesh the all-reduce across replicas is what can wait: it
    runs on the last micro-step only (FSDP2's documented `set_requires_all_reduce`)."""
    if mesh.ndim == 2:
        model.set_requires_all_reduce(last_micro_step)  # FSDPModule method, recursive over the units


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device_type: str) -> tuple[int, int, torch.device]:
    """(rank, world, device); a single process without torchrun becomes a world of one."""
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def end_distributed() -> None:
    """Tear the process group down; on node 0 of several, leave after the other nodes' ranks."""
    # The sharded model and optimizer are cyclic garbage holding the mesh's process groups: free
    # them while the groups are up. Left to interpreter exit, a group's worker thread can abort the
    # process after a finished run (seen with gloo under load), which SageMaker reports as a crash.
    gc.collect()
    dist.destroy_process_group()
    if os.environ.get("GROUP_RANK") == "0" and int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:
        time.sleep(STORE_HOST_EXIT_DELAY_S)
