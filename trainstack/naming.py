"""Names derived from a resolved recipe: stacks, training jobs, S3 prefixes. Defined once here.

SageMaker training job names are at most 63 characters of [a-zA-Z0-9-]; CloudFormation stack names
at most 128. A run is named by a hash of its resolved recipe, so the same recipe never starts twice.

Names join the team and the recipe with hyphens, and both rules in trainstack.recipe keep that
unambiguous: a team name has no hyphen (so `Trainstack-<team>-<recipe>` splits at the first hyphen
after the project), and a recipe name has no double or trailing hyphen (so the `--` that follows it in
a job name marks where it ends).
"""

from __future__ import annotations

import hashlib
import json

from trainstack.recipe import (
    RECIPE_NAME_MAX,
    TEAM_NAME_MAX,
    Recipe,
    recipe_name_problem,
    team_name_problem,
    to_hyperparameters,
)

PROJECT = "trainstack"
JOB_NAME_MAX = 63
HASH_LEN = 8  # recipe_hash
# After the hash: the run's suffix (`deploy`, `r<base36 time>`; trainstack.request.job_name), then, for
# a capacity retry, the launcher's `-c<n>` (n <= 9, stacks.state_machine).
RUN_SUFFIX_MAX = 7
ATTEMPT_SUFFIX_MAX = len("-c9")
JOB_SUFFIX_MAX = RUN_SUFFIX_MAX + ATTEMPT_SUFFIX_MAX  # 10
JOB_PREFIX_MAX = len("ts-") + TEAM_NAME_MAX + len("-") + RECIPE_NAME_MAX + len("--")  # 44
# The longest team and recipe still leave room for the hash and the longest suffix: no truncation, which
# would let two recipes share a prefix.
assert JOB_PREFIX_MAX + HASH_LEN + len("-") + JOB_SUFFIX_MAX <= JOB_NAME_MAX


def _slug(team: str | None, recipe: Recipe) -> str:
    team = team or recipe.tags.team
    # Recipe validation and the loader refuse bad names with a user-facing error first; this is the
    # guarantee every name below relies on, so it is checked where they are made.
    if (problem := team_name_problem(team) or recipe_name_problem(recipe.name)) is not None:
        raise ValueError(problem)
    return f"{team}-{recipe.name}"


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
    return hashlib.sha256(canonical.encode()).hexdigest()[:HASH_LEN]


def job_name_prefix(recipe: Recipe, team: str | None) -> str:
    """`ts-<team>-<recipe>--`: every training job of this recipe and team starts with it, and no other's.

    Job names are `<prefix><8 hex recipe hash>-<suffix>`. The prefix ends in `--`, which no team or
    recipe name contains, so it is exact: `8b-fp8`'s prefix `ts-nlp-8b-fp8--` is not a prefix of
    `8b-fp8-128k`'s jobs (`ts-nlp-8b-fp8-128k--...`), and team `nlp` with recipe `8b-fp8` cannot meet a
    team `nlp8b` with recipe `fp8`. IAM resources, EventBridge rules and alarm names filter on
    `<prefix>*` and so on exactly this recipe's jobs. At most JOB_PREFIX_MAX (44) characters, never
    truncated: with the hash and a suffix of up to JOB_SUFFIX_MAX (10) characters, a capacity retry's
    `-c<n>` included, a job name fits SageMaker's 63.
    """
    return f"ts-{_slug(team, recipe)}--"


def checkpoint_prefix(recipe: Recipe, team: str | None) -> str:
    """Key prefix inside the checkpoint bucket: one folder per team and recipe, runs below it."""
    return f"checkpoints/{team or recipe.tags.team}/{recipe.name}"
