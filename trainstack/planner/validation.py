"""Validation's share of the run: how long each evaluation takes and what all of them add.

Every `validation.every_steps` steps the trainer runs `validation.batches` global batches of each
validation split (one per blend source) forward only (training_image/trainer/validation.py). Forward
FLOPs per token are a third of PaLM's training count: 2*N + 4*L*H*Q*T (the backward is twice the
forward, and no activation is recomputed without a backward). The planner runs them at the training
step's achieved hardware FLOP rate (model plus recompute FLOPs over the planned step time), an
estimate: a forward-only pass does no gradient reduce-scatter (less exposed communication, so faster),
but has no accumulation overlap either; its range follows the throughput range, as training's does.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainstack.planner.throughput import ThroughputPlan, flops_per_token
from trainstack.recipes.schema import ModelShape, Recipe


def forward_flops_per_token(model: ModelShape, seq_len: int) -> float:
    """Forward-only FLOPs per token: a third of PaLM's 6*N + 12*L*H*Q*T."""
    return flops_per_token(model, seq_len) / 3.0


@dataclass(frozen=True)
class ValidationPlan:
    every_steps: int
    batches: int
    splits: int  # validation splits evaluated each time (a blend: one per source)
    evaluations: int  # over the run: one after every every_steps-th step, and one before the first
    tokens_per_evaluation: int  # all splits, all ranks
    seconds_per_evaluation: float
    hours: float  # all evaluations of the run
    interval_s: float  # planned wall time between two evaluations (every_steps steps and one evaluation)

    def summary(self) -> str:
        """'every 1,000 steps: 10 batches x 1 split, 42 s each; 12.3 h over 500 evaluations (1.2%)'"""
        splits = f"{self.splits} split" + ("s" if self.splits != 1 else "")
        return (
            f"every {self.every_steps:,} steps: {self.batches} batches x {splits}, "
            f"{self.seconds_per_evaluation:,.0f} s each; {self.hours:,.1f} h over {self.evaluations:,} "
            "evaluations"
        )


def plan_validation(recipe: Recipe, thr: ThroughputPlan) -> ValidationPlan | None:
    """The recipe's validation cost at the planned throughput, or None without a validation section."""
    settings = recipe.validation
    if settings is None:
        return None
    splits = max(1, len(recipe.data.sources))
    tokens = settings.batches * recipe.training.global_batch * recipe.training.seq_len * splits
    achieved_flops = thr.achieved_tflops_per_gpu * 1e12 * recipe.world_size  # the whole job's FLOP/s
    seconds = tokens * forward_flops_per_token(recipe.model, recipe.training.seq_len) / achieved_flops
    evaluations = recipe.training.steps // settings.every_steps + int(recipe.validates_at_start)
    return ValidationPlan(
        every_steps=settings.every_steps,
        batches=settings.batches,
        splits=splits,
        evaluations=evaluations,
        tokens_per_evaluation=tokens,
        seconds_per_evaluation=seconds,
        hours=evaluations * seconds / 3600.0,
        interval_s=settings.every_steps * thr.step_time_s + seconds,
    )
