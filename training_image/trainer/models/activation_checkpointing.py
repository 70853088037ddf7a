"""Activation checkpointing as the recipe says.

    mode none                         every block keeps what its ops save for backward
    mode full                         every block keeps only its input; backward recomputes it
    mode selective, policy block      blocks 0, every, 2*every, ... recompute whole (1 in `every`)
    mode selective, policy op         every block runs under torchtitan-style op-level selective
                                      checkpointing: the outputs of the expensive ops (matmuls,
                                      attention) are saved, the cheap ones (norms, RoPE, SwiGLU,
                                      residual adds, copies) are recomputed in backward

The op policy follows torchtitan's default (torchtitan/distributed/activation_checkpoint.py): save
attention's outputs and every other matmul's. A block runs four matmuls (Q/K/V, output projection,
fc1, fc2): Q/K/V and fc1 are saved, the output projection is recomputed. fc2 is "recomputed" too, but
non-reentrant checkpointing stops replaying the forward once the last tensor backward needs (fc2's
input) is rebuilt, so fc2 itself never runs again. `trainstack.planner.trainer_memory` has the bytes kept and
the share of matmul FLOPs recomputed per mode; tests/trainer/test_trainer_memory.py counts both on
the real block.

The op policy needs every op to pass through PyTorch's dispatcher, so it runs on the pure-PyTorch
block (train.py selects it); Transformer Engine's fused modules are opaque to it, which is why an FP8
recipe (TE only) cannot use it: the recipe schema (trainstack.recipes.schema.Recipe) refuses that pair, so
`trainstack validate`, `plan` and `cdk synth` say so before any node is paid for. A TE block
recomputes with TE's own checkpoint, which replays the FP8 scaling state exactly; otherwise torch's
non-reentrant checkpoint.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from trainer.models.model import Transformer
from trainstack.recipes.schema import ActivationCheckpointing

_aten = torch.ops.aten
# addmm: a linear with a bias (Qwen2's Q/K/V) on a contiguous input runs as one addmm.
MATMUL_OPS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.linear.default})
# Every SDPA kernel a block can reach: cuDNN and flash on GPU, the flash kernel for CPU, math as the
# last resort. Saving attention means backward never recomputes an O(seq^2) forward.
ATTENTION_OPS = frozenset(
    getattr(_aten, name).default
    for name in (
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_fused_attention_overrideable",
        "_scaled_dot_product_attention_math",
    )
    if hasattr(_aten, name)
)


def op_level_policy() -> Callable:
    """A fresh per-block policy (a new one per checkpointed call, so the matmul count restarts).
    Forward and recompute count separately, so the same matmul gets the same decision in both."""
    matmuls = {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in ATTENTION_OPS:
            return CheckpointPolicy.MUST_SAVE
        if func in MATMUL_OPS:
            matmuls[ctx.is_recompute] += 1
            odd = matmuls[ctx.is_recompute] % 2
            return CheckpointPolicy.MUST_SAVE if odd else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_level_contexts():
    return create_selective_checkpoint_contexts(op_level_policy())


def recompute_function(backend_name: str, op_level: bool = False) -> Callable:
    if op_level:
        return functools.partial(checkpoint, use_reentrant=False, context_fn=_op_level_contexts)
    if backend_name == "transformer_engine":
        import transformer_engine.pytorch as te

        # Non-reentrant: the reentrant variant does not compose with FSDP2's backward hooks.
        return functools.partial(te.distributed.checkpoint, use_reentrant=False)
    return functools.partial(checkpoint, use_reentrant=False)


def is_op_level(config: ActivationCheckpointing) -> bool:
    return config.mode == "selective" and config.policy == "op"


def checkpointed_blocks(config: ActivationCheckpointing, layers: int) -> list[int]:
    """Indices of the blocks that recompute (whole, or op by op): all, none, or every `every`-th."""
    if config.mode == "none":
        return []
    if config.mode == "full" or is_op_level(config):
        return list(range(layers))
    return [i for i in range(layers) if i % config.every == 0]


def apply_activation_checkpointing(model: Transformer, config: ActivationCheckpointing) -> list[int]:
    if is_op_level(config) and model.backend_name != "pytorch":
        raise ValueError("op-level selective checkpointing needs the pure-PyTorch block")
    chosen = checkpointed_blocks(config, len(model.layers))
    recompute = recompute_function(model.backend_name, is_op_level(config)) if chosen else None
    for index in chosen:
        model.layers[index].recompute = recompute
    return chosen
