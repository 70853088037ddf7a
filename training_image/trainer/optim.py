"""AdamW (fused on CUDA) with linear warmup then cosine decay to lr * min_lr_ratio, as in the recipe.

Weight decay applies to matrices only (not norm gains). The schedule is a pure function of the step
and of `training.steps` (the recipe's full run), so stopping early with --max-steps and resuming later
follows exactly the schedule of one uninterrupted run.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from trainstack.recipes.schema import Training


def lr_factor(step: int, training: Training) -> float:
    """Multiplier of training.lr for optimizer step `step` (1-based)."""
    if training.warmup_steps and step <= training.warmup_steps:
        return step / training.warmup_steps
    decay_steps = max(1, training.steps - training.warmup_steps)
    progress = min(1.0, (step - training.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return training.min_lr_ratio + (1.0 - training.min_lr_ratio) * cosine


def build_optimizer(model: nn.Module, training: Training, device_type: str) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": training.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = device_type == "cuda"  # one kernel per step over all DTensor shards; foreach on CPU
    return torch.optim.AdamW(
        groups, lr=training.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused, foreach=None if fused else True
    )


def build_scheduler(optimizer: torch.optim.Optimizer, training: Training) -> LambdaLR:
    # LambdaLR counts from 0 before the first step; the first optimizer step is step 1.
    return LambdaLR(optimizer, lambda epoch: lr_factor(epoch + 1, training))


def follow_schedule(
    optimizer: torch.optim.Optimizer, scheduler: LambdaLR, training: Training, step: int
) -> None:
    """Drive the steps after `step` by `training`'s schedule. A resumed optimizer and scheduler carry
    the lr, weight decay and base lr of the recipe the checkpoint was written with (the scheduler's
    lambda is this job's): `trainstack resume --set training.lr=...` must change them, from the next
    step on. With an unchanged recipe this sets exactly the values the load restored."""
    decay = (training.weight_decay, 0.0)  # build_optimizer's two groups, in order
    for group, weight_decay in zip(optimizer.param_groups, decay, strict=True):
        group["initial_lr"] = training.lr
        group["weight_decay"] = weight_decay
    scheduler.base_lrs = [training.lr] * len(optimizer.param_groups)
    # LambdaLR's lr after `step` scheduler steps: base_lr * lambda(step) = lr * lr_factor(step + 1).
    factor = lr_factor(step + 1, training)
    for group in optimizer.param_groups:
        group["lr"] = training.lr * factor
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
