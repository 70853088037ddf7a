"""trainstack.planner.trainer_memory says what the real block keeps and recomputes.

Counted on the real pure-PyTorch block (training_image/trainer/models/model.py) in BF16 on CPU, for several
shapes and every checkpointing mode, by bench/saved_tensors.py: storages alive between forward and
backward, deduplicated, at their dtype sizes (and, outside checkpoints, the tensors autograd packs
through saved-tensor hooks). A change to the block that the planner's formulas do not follow fails
here; so does a formula edited without the block.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from trainer.models.activation_checkpointing import (
    ATTENTION_OPS,
    apply_activation_checkpointing,
    recompute_function,
)
from trainer.models.model import Block, build_model, pytorch_backend, rotary_tables
from trainer_helpers import REPO

from trainstack.planner import trainer_memory
from trainstack.recipes.loader import base_recipe_names, resolve
from trainstack.recipes.schema import ActivationCheckpointing, ModelShape

sys.path.insert(0, str(REPO / "bench"))
from saved_tensors import count_saved_bytes  # noqa: E402

pytestmark = pytest.mark.fast

SHAPES = {
    "gqa": ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, ffn=176, vocab=256),
    "mha": ModelShape(layers=2, hidden=48, heads=3, kv_heads=3, ffn=128, vocab=256),
    "gqa-8-to-1": ModelShape(layers=2, hidden=128, heads=8, kv_heads=1, ffn=96, vocab=256),
    # Qwen2-style Q/K/V bias with a head width other than hidden / heads (q = 128 != hidden = 64).
    "bias-wide-heads": ModelShape(
        layers=2, hidden=64, heads=4, kv_heads=2, ffn=176, vocab=256, head_dim=32, attention_bias=True
    ),
}
BATCH_SEQ = {"gqa": (2, 32), "mha": (1, 40), "gqa-8-to-1": (3, 16), "bias-wide-heads": (2, 24)}
MODES = ("none", "full", "op")


def bf16_block(shape: ModelShape, mode: str) -> Block:
    torch.manual_seed(0)
    block = Block(shape, pytorch_backend())
    for param in block.parameters():
        torch.nn.init.normal_(param, 0.0, 0.02) if param.ndim > 1 else torch.nn.init.ones_(param)
    block.to(torch.bfloat16)  # as FSDP2 gathers it (param_dtype bf16)
    if mode != "none":
        block.recompute = recompute_function("pytorch", op_level=mode == "op")
    return block


def block_input(shape: ModelShape, batch: int, seq: int) -> torch.Tensor:
    return torch.randn(batch, seq, shape.hidden, dtype=torch.bfloat16, requires_grad=True)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape_name", SHAPES)
def test_block_keeps_exactly_what_trainer_memory_says(shape_name, mode):
    shape, (batch, seq) = SHAPES[shape_name], BATCH_SEQ[shape_name]
    rope = rotary_tables(shape.head_dim, seq, shape.rope_theta, torch.device("cpu"))
    saved, out = count_saved_bytes(
        bf16_block(shape, mode), lambda: block_input(shape, batch, seq), extra_args=(rope,)
    )
    tokens = batch * seq
    assert saved.live == trainer_memory.block_saved_bytes(shape, mode) * tokens, saved
    if mode == "none":  # outside checkpoints the saved-tensor hooks see the same tensors
        assert saved.hooked == saved.live
    else:  # inside, the checkpoint's own hooks take over: outside ones see the block input at most
        assert saved.hooked <= shape.hidden * 2 * tokens
    out.float().sum().backward()


def test_selective_block_policy_keeps_full_blocks_and_input_only_blocks_in_turn():
    """mode selective, policy block, every 2: blocks 0 and 2 keep only their input, 1 and 3 all."""
    shape = SHAPES["gqa"].model_copy(update={"layers": 4})
    batch, seq = 2, 24
    torch.manual_seed(0)
    model = build_model(shape, seq, pytorch_backend(), loss_chunk_tokens=16)
    apply_activation_checkpointing(model, ActivationCheckpointing(mode="selective", every=2))
    model.to_empty(device="cpu")
    model.init_weights()
    model.to(torch.bfloat16)
    rope = rotary_tables(shape.head_dim, seq, shape.rope_theta, torch.device("cpu"))
    stack = _Chain(torch.nn.Sequential(*model.layers))
    saved, out = count_saved_bytes(stack, lambda: block_input(shape, batch, seq), extra_args=(rope,))
    full, none = trainer_memory.full_checkpoint_bytes(shape), trainer_memory.block_activation_bytes(shape)
    per_token = 2 * full + 2 * none
    assert saved.live == per_token * batch * seq
    out.float().sum().backward()


class _Chain(torch.nn.Module):
    def __init__(self, layers: torch.nn.Sequential):
        super().__init__()
        self.layers = layers

    def forward(self, x, rope):
        for block in self.layers:
            x = block(x, rope)
        return x


class _BackwardWork(TorchDispatchMode):
    """Matmul FLOPs and attention forwards run while the mode is active."""

    def __init__(self) -> None:
        super().__init__()
        self.matmul_flops = 0
        self.attention_forwards = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            self.matmul_flops += 2 * args[0].shape[0] * args[0].shape[1] * args[1].shape[1]
        elif func is torch.ops.aten.addmm.default:  # a linear with a bias: addmm(bias, input, weight.T)
            self.matmul_flops += 2 * args[1].shape[0] * args[1].shape[1] * args[2].shape[1]
        elif func is torch.ops.aten.bmm.default:
            raise AssertionError(f"{func}: the block's matmuls are expected to be mm or addmm")
        if func in ATTENTION_OPS:
            self.attention_forwards += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape_name", SHAPES)
def test_recompute_costs_the_matmul_share_trainer_memory_says(shape_name, mode):
    """Backward runs two matmuls per forward matmul (input and weight gradients); whatever it runs
    beyond that is recompute. Full checkpointing replays Q/K/V, the projection and fc1 (non-reentrant
    checkpointing stops before fc2) and attention; the op policy replays the projection only."""
    shape = SHAPES[shape_name]
    seq = 32
    rope = rotary_tables(shape.head_dim, seq, shape.rope_theta, torch.device("cpu"))
    block = bf16_block(shape, mode)
    x = block_input(shape, 2, seq)
    with _BackwardWork() as forward:
        out = block(x, rope)
    with _BackwardWork() as backward:
        out.float().sum().backward()
    recomputed = (backward.matmul_flops - 2 * forward.matmul_flops) / forward.matmul_flops
    expected = {
        "none": 0.0,
        "full": trainer_memory.full_recompute_share(shape),
        "op": trainer_memory.op_selective_recompute_share(shape),
    }[mode]
    assert recomputed == pytest.approx(expected, abs=1e-12)
    assert backward.attention_forwards == (1 if mode == "full" else 0)


@pytest.mark.parametrize("name", base_recipe_names())
def test_planner_constants_spell_the_fsdp_units_in_flight(name):
    """planner.py multiplies trainer_memory's constants; they must add up to the units in flight."""
    m = resolve(name).recipe.model
    from_constants = (
        trainer_memory.BLOCKS_IN_FLIGHT * m.params_per_layer * trainer_memory.BLOCK_IN_FLIGHT_BYTES
        + m.embedding_params * trainer_memory.ROOT_IN_FLIGHT_BYTES
    )
    assert from_constants == trainer_memory.fsdp_units_in_flight_bytes(m)
