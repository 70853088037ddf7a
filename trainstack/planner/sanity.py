"""Warnings for recipe values that are legal but almost surely wrong (a pure function of recipe and plan).

`plan`, `validate`, `show` and the CDK app print them to stderr (`--quiet`, or `-c quiet=true`, silences
them); they never change an exit status. Each says the threshold and why, so a deliberate choice can be
recognised as one. Not named `warnings.py`: that would shadow the standard library module.

Reference points (estimates: fits to other people's runs, so the thresholds are generous factors):
- Compute-optimal learning rate and batch size as functions of the compute budget C (FLOPs):
  eta_opt = 0.3118 C^-0.125 and B_opt = 0.2920 C^0.3271 tokens (DeepSeek LLM, arXiv:2401.02954, sec. 3.1),
  with C taken as 6 x non-embedding parameters x training tokens. The repository's recipes sit at
  0.1-0.5 x eta_opt (published Llama-style runs use a lower rate than the fit) and 1-5.5 x B_opt.
- Warmup: Llama 3 405B warmed up for 8,000 of 1.2M steps (0.7%, arXiv:2407.21783, sec. 3.4.1); runs
  typically warm up for well under 10% of their steps.
- The ML storage volume: on instance types with NVMe instance storage (every type in
  trainstack.recipes.hardware today) SageMaker provisions no volume and uses the instance storage instead
  (SageMaker API reference, ResourceConfig.VolumeSizeInGB), so the check applies only where a volume
  exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainstack.recipes.loader import ResolvedRecipe
    from trainstack.recipes.schema import Recipe

LR_HIGH_FACTOR = 10.0  # above 10 x eta_opt: almost surely diverges
LR_LOW_FACTOR = 0.01  # below eta_opt / 100: the model barely moves
BATCH_FACTOR = 10.0  # a global batch 10 x above or below B_opt for the run's token budget
WARMUP_SHARE = 0.5  # warmup longer than half the run
# Full-parameter supervised fine-tuning's learning rates: Tulu 3's 2e-6 (70B) and 5e-6 (8B)
# (arXiv:2411.15124, SFT hyperparameters) to Alpaca's 2e-5 (7B, tatsu-lab/stanford_alpaca README).
FT_LR_PUBLISHED = (2e-6, 2e-5)
GB_PER_GIB = 2**30 / 1e9


@dataclass(frozen=True)
class Concern:
    """One value that is legal but almost surely wrong: the field, then what and why (with the threshold)."""

    field: str
    message: str


def compute_budget_flops(recipe: Recipe) -> float:
    """C = 6 x non-embedding parameters x tokens of the whole run (the FLOPs the fits are indexed by)."""
    tokens = recipe.tokens_per_step * recipe.training.steps
    return 6.0 * recipe.model.non_embedding_params * tokens


def optimal_lr(recipe: Recipe) -> float:
    return 0.3118 * compute_budget_flops(recipe) ** -0.125


def optimal_batch_tokens(recipe: Recipe) -> float:
    return 0.2920 * compute_budget_flops(recipe) ** 0.3271


def _times(ratio: float) -> str:
    """`28,200 x` or `1/44,600 of`: a factor a reader takes in at a glance."""
    if ratio >= 1:
        return f"{ratio:,.0f} x" if ratio >= 10 else f"{ratio:.2g} x"
    return f"1/{1 / ratio:,.0f} of" if ratio <= 0.1 else f"{ratio:.2g} x"


def _local_storage_gb(recipe: Recipe) -> float:
    """The instance's NVMe instance storage in GB as recipes.hardware records it (0: an EBS volume)."""
    return float(recipe.instance.instance_store_gb)


def _fine_tuning_lr(lr: float) -> list[Concern]:
    """Full-parameter fine-tuning (training.objective sft) moves a trained model: published runs use
    2e-6 to 2e-5 (FT_LR_PUBLISHED); 10 x above the top of that range undoes the base's training, 10 x below
    the bottom barely moves it."""
    low, high = FT_LR_PUBLISHED
    if lr > LR_HIGH_FACTOR * high:
        outcome = f"above {LR_HIGH_FACTOR:g} x the highest, the fine-tune overwrites what the base learned"
    elif lr < low / LR_HIGH_FACTOR:
        outcome = f"below 1/{LR_HIGH_FACTOR:g} of the lowest, the model barely moves from the base"
    else:
        return []
    return [
        Concern(
            "training.lr",
            f"{lr:g} for a full fine-tune (training.objective sft): published runs use {low:g} to {high:g} "
            f"(Tulu 3, Alpaca); {outcome}",
        )
    ]


def check(recipe: Recipe, plan: Any, local_storage_gb: float | None = None) -> list[Concern]:
    """Every concern about `recipe` given its plan (trainstack.planner.plan). Pure; never raises.

    `local_storage_gb`: the instance storage to assume (default: trainstack.recipes.hardware's figure; the
    volume check runs only when that is known to be 0, i.e. the instance has an EBS volume)."""
    concerns: list[Concern] = []
    training = recipe.training

    eta = optimal_lr(recipe)
    if training.objective == "sft":  # the fits below are pretraining's; a fine-tune has its own range
        concerns += _fine_tuning_lr(training.lr)
    elif training.lr > LR_HIGH_FACTOR * eta or training.lr < LR_LOW_FACTOR * eta:
        side = "above" if training.lr > eta else "below"
        limit = LR_HIGH_FACTOR if side == "above" else LR_LOW_FACTOR
        outcome = "training almost surely diverges" if side == "above" else "the model barely learns"
        concerns.append(
            Concern(
                "training.lr",
                f"{training.lr:g} is {_times(training.lr / eta)} the compute-optimal rate for this run "
                f"({eta:.2g}, DeepSeek LLM fit for {compute_budget_flops(recipe):.2g} FLOPs); {side} "
                f"{limit:g} x that, {outcome}",
            )
        )

    if training.warmup_steps > WARMUP_SHARE * training.steps:
        how = (
            f"longer than the run ({training.steps:,} steps): the learning rate never reaches its peak"
            if training.warmup_steps >= training.steps
            else f"more than {WARMUP_SHARE:.0%} of the {training.steps:,} steps: the decay gets less "
            "than half the run"
        )
        concerns.append(
            Concern(
                "training.warmup_steps",
                f"{training.warmup_steps:,} warmup steps is {how} (published runs warm up for under 10%, "
                "Llama 3 405B for 0.7%)",
            )
        )

    batch, best = recipe.tokens_per_step, optimal_batch_tokens(recipe)
    if training.objective != "sft" and (batch > BATCH_FACTOR * best or batch < best / BATCH_FACTOR):
        side = "above" if batch > best else "below"
        effect = (
            f"the token budget buys only {training.steps:,} optimizer steps"
            if side == "above"
            else "each step's gradient is noisy and the GPUs run small, slow steps"
        )
        concerns.append(
            Concern(
                "training.global_batch",
                f"{training.global_batch:,} sequences ({batch / 1e6:,.3g}M tokens) per step is "
                f"{_times(batch / best)} the compute-optimal batch for this token budget "
                f"({best / 1e6:,.3g}M tokens, DeepSeek LLM fit); {side} {BATCH_FACTOR:g} x that, {effect}",
            )
        )

    storage = _local_storage_gb(recipe) if local_storage_gb is None else local_storage_gb
    volume = recipe.compute.volume_size_gb
    checkpoint_gib = float(plan.run.checkpoint.gib_per_node) if storage == 0 else 0.0
    if storage == 0 and volume < checkpoint_gib * GB_PER_GIB:
        concerns.append(
            Concern(
                "compute.volume_size_gb",
                f"{volume:,} GB is smaller than one checkpoint per node ({checkpoint_gib:,.0f} GiB = "
                f"{checkpoint_gib * GB_PER_GIB:,.0f} GB, the plan's run.checkpoint): checkpoints stream "
                "to S3, but this volume is the node's only disk for scratch space, model artifacts and "
                "anything the job writes locally (a local checkpoint directory included)",
            )
        )
    return concerns


def lines(resolved: ResolvedRecipe, plan: Any, label: str | None = None) -> list[str]:
    """`warning: <file that set it>: <field>: <message>` per concern (label: which recipe, for lists)."""
    suffix = f" [{label}]" if label else ""
    return [
        f"warning: {resolved.source_of(c.field)}: {c.field}: {c.message}{suffix}"
        for c in check(resolved.recipe, plan)
    ]


def print_warnings(
    resolved: ResolvedRecipe, plan: Any, quiet: bool = False, label: str | None = None
) -> None:
    """Print the warnings to stderr unless `quiet`: what `plan`, `validate` and `show` call."""
    if quiet:
        return
    import sys

    for line in lines(resolved, plan, label):
        print(line, file=sys.stderr)
