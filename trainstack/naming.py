"""Names derived from a resolved recipe: stacks, training jobs, S3 prefixes. Defined once here.

SageMaker training job names are at most 63 characters of [a-zA-Z0-9-]; CloudFormation stack names
at most 128. A run is named by a hash of its resolved recipe, so the same recipe never starts twice.
"""

from __future__ import annotations

import hashlib
import json

from trainstack.recipe import Recipe, to_hyperparameters

PROJECT = "trainstack"
JOB_NAME_MAX = 63


def _slug(team: str | None, recipe: Recipe) -> str:
    return f"{team or recipe.tags.team}-{recipe.name}"


def stack_prefix(recipe: Recipe, team: str | None) -> str:
    """`Trainstack-<team>-<recipe>`; the stateful and launcher stacks append their role."""
    return f"Trainstack-{_slug(team, recipe)}"


# Where a run may go and what it may cost (recipe `budget`, `deploy`) is policy, not what it trains: a team
# raising its cost cap must not rename, and so relaunch, its runs.
POLICY_SECTIONS = ("budget.", "deploy.")


def recipe_hash(recipe: Recipe) -> str:
    """Eight hex digits over the resolved recipe exactly as the trainer will receive it (policy aside)."""
    trained = {k: v for k, v in to_hyperparameters(recipe).items() if not k.startswith(POLICY_SECTIONS)}
    canonical = json.dumps(trained, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:8]


def job_name_prefix(recipe: Recipe, team: str | None) -> str:
    """Every training job of this recipe and team starts with this (alarms and rules filter on it).

    Shortened so `<prefix>-<8 hex>-<suffix up to 10>` fits SageMaker's 63 characters.
    """
    prefix = f"ts-{_slug(team, recipe)}"
    return prefix[: JOB_NAME_MAX - 1 - 8 - 1 - 10].rstrip("-")


def checkpoint_prefix(recipe: Recipe, team: str | None) -> str:
    """Key prefix inside the checkpoint bucket: one folder per team and recipe, runs below it."""
    return f"checkpoints/{team or recipe.tags.team}/{recipe.name}"
