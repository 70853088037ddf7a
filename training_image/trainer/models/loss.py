"""Chunked cross-entropy: logits exist one chunk of tokens at a time, never whole in FP32.

At 128K tokens and a 128K vocabulary, FP32 logits for one sequence are 4 * 131072 * 128256 bytes =
67 GB. Here each chunk's logits are computed, reduced to a summed loss and dropped; the chunk runs
under non-reentrant activation checkpointing, so backward recomputes that chunk's logits instead of
keeping them. Peak extra memory is one chunk: 4 * chunk_tokens * vocab bytes (plus its gradient).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def _chunk_loss_sum(hidden: torch.Tensor, targets: torch.Tensor, head: nn.Module) -> torch.Tensor:
    logits = head(hidden).float()
    return F.cross_entropy(logits, targets, reduction="sum")


def chunked_cross_entropy_sum(
    hidden: torch.Tensor, targets: torch.Tensor, head: nn.Module, chunk_tokens: int
) -> torch.Tensor:
    """Summed cross-entropy of head(hidden) against targets; hidden is (..., dim), targets (...).
    Targets of -100 (transformers' ignore index, F.cross_entropy's default) add nothing: the sum over
    a fine-tuning batch's target tokens, which the trainer divides by the whole global batch's count."""
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    total = flat_hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, flat_targets.numel(), chunk_tokens):
        end = start + chunk_tokens
        total = total + checkpoint(
            _chunk_loss_sum, flat_hidden[start:end], flat_targets[start:end], head, use_reentrant=False
        )
    return total


def chunked_cross_entropy(
    hidden: torch.Tensor, targets: torch.Tensor, head: nn.Module, chunk_tokens: int
) -> torch.Tensor:
    """Mean cross-entropy of head(hidden) against targets (pretraining: every position is a target)."""
    return chunked_cross_entropy_sum(hidden, targets, head, chunk_tokens) / targets.numel()
