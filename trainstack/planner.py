"""The planner: the P6-B200 tuning guide as arithmetic. (Being written; see issue 2.)"""

from __future__ import annotations

from trainstack.recipe import ModelShape


def flops_per_token(model: ModelShape, seq_len: int) -> float:
    """Training FLOPs per token, PaLM appendix B: 6*N + 12*L*H*Q*T.

    N counts every matmul weight a token passes through: the blocks and the output head, but not the
    input embedding (a lookup, no FLOPs). The attention term uses the full sequence length T (no causal
    halving), as PaLM and torchtitan do, so MFU figures compare with theirs.
    """
    matmul_params = model.non_embedding_params + model.vocab * model.hidden  # output head
    attention = 12 * model.layers * model.heads * model.head_dim * seq_len
    return 6.0 * matmul_params + attention
