"""What the trainer (training_image/trainer) holds in GPU memory, as the planner counts it.

The planner's memory model (trainstack.planner) is arithmetic over the model shape; the terms here are
the ones that depend on how *our* trainer is written: which tensors one block saves for backward, what
the activation-checkpointing policies keep and recompute, and which FSDP units are gathered at once.
They live next to each other so that a change to the trainer's model, checkpointing or FSDP wrapping
has exactly one place to change in the planner, and the tests that count the trainer's real saved
tensors compare against this module.

No third-party imports: the training image imports trainstack modules too.
"""

from __future__ import annotations

from trainstack.recipe import ModelShape

BF16 = 2

# FSDP2 prefetches the next block while computing the current one: two blocks are unsharded at once.
# In backward each holds BF16 parameters, a BF16 gradient and the FP32 copy for the reduce-scatter.
BLOCKS_IN_FLIGHT = 2
BLOCK_IN_FLIGHT_BYTES = BF16 + BF16 + 4
# The root FSDP unit (embedding, final norm, output head) stays unsharded for the whole step
# (reshard_after_forward=False for the root): BF16 parameters plus their BF16 gradient in backward.
ROOT_IN_FLIGHT_BYTES = BF16 + BF16
# Cross-entropy over one chunk of logits, per token per vocabulary entry, at its backward peak: the
# saved FP32 log-softmax (4), the FP32 gradient of the log-probabilities (4) and of the logits (4).
LOSS_BYTES = 12


def block_activation_bytes(m: ModelShape) -> int:
    """Bytes per token one block of our trainer (training_image/trainer/model.py) saves for backward
    without checkpointing. Tensor by tensor, BF16 unless noted:

    attention: norm input (2h) and output (2h, shared by wq/wk/wv); RoPE saves the FP32 copies of q
    and k (4h + 4kv) and flash attention the rotated q, k and v (2h + 4kv); attention output (2h) and
    its contiguous copy that feeds wo (2h);
    MLP: norm input and output (4h); w1 and w3 outputs, SiLU output, their product (8 ffn).
    = 18h + 8kv + 8ffn (the README's Korthikanti-style 34*h comes out at 41*h for Llama 3 8B).
    """
    kv = m.kv_heads * m.head_dim
    return 18 * m.hidden + 8 * kv + 8 * m.ffn


def op_selective_bytes(m: ModelShape) -> int:
    """torchtitan's op-level policy keeps, in BF16, the block input, every other matmul output (wq, wv,
    w1, w2 of wq wk wv wo w1 w3 w2) and the attention output: 2 * (4h + kv + ffn) bytes per token."""
    kv = m.kv_heads * m.head_dim
    return BF16 * (m.hidden + (m.hidden + kv + m.ffn + m.hidden) + m.hidden)


def op_selective_recompute_share(m: ModelShape) -> float:
    """Share of a block's matmul FLOPs the op-level policy recomputes (wk, wo, w3)."""
    kv = m.kv_heads * m.head_dim
    recomputed = m.hidden * kv + m.hidden * m.hidden + m.hidden * m.ffn
    total = m.hidden * (2 * m.hidden + 2 * kv) + 3 * m.hidden * m.ffn
    return recomputed / total
