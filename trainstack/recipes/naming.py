"""Names derived from a resolved recipe: stacks, runs, training jobs, S3 prefixes. Defined once here.

SageMaker training job names are at most 63 characters of [a-zA-Z0-9-]; CloudFormation stack names
at most 128.

A **run** is one recipe's token budget trained to the end by as many training jobs as it takes. It is
named `<job-name prefix><run id>` (`ts-<team>-<recipe>--<run id>`): the run id is the `--name` a user
gives, or `<recipe hash>-<suffix>`. Its jobs are `<run>-1`, `<run>-2`, ... (every job of a run gets the
next index, a capacity retry included) and all of them checkpoint under one prefix,
`checkpoints/<team>/<recipe>/<run id>/`, so each resumes from the newest checkpoint of the run.

Names join the team and the recipe with hyphens, and both rules in trainstack.recipes.schema keep that
unambiguous: a team name has no hyphen (so `Trainstack-<team>-<recipe>` splits at the first hyphen
after the project), and a recipe name has no double or trailing hyphen (so the `--` that follows it in
a job name marks where it ends).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from trainstack.recipes.schema import (
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
# A default run id is `<hash>-<suffix>`: the suffix is `deploy` (launch-on-deploy) or `r`/`t` and the
# launch time in base 36 (trainstack.cli.commands.launch).
RUN_SUFFIX_MAX = 7
RUN_ID_MAX = HASH_LEN + len("-") + RUN_SUFFIX_MAX  # 16: a default id, or a --name of up to 16 characters
RUN_ID = re.compile(rf"^(?=.{{1,{RUN_ID_MAX}}}$)[a-z0-9]+(-[a-z0-9]+)*$")
RUN_ID_RULE = f"1-{RUN_ID_MAX} characters: words of lowercase letters and digits joined by single hyphens"
JOB_INDEX_MAX = 99  # `-<index>`: at most two digits, so a run has at most 99 jobs, resumes included
JOB_SUFFIX_MAX = len(f"-{JOB_INDEX_MAX}")
# What followed a run's id in a job name before runs (a capacity retry's `-c<n>`) is now the job index:
# the same 3 characters, kept under the old name for code that builds the longest job name from it.
ATTEMPT_SUFFIX_MAX = JOB_SUFFIX_MAX
JOB_PREFIX_MAX = len("ts-") + TEAM_NAME_MAX + len("-") + RECIPE_NAME_MAX + len("--")  # 44
RUN_NAME_MAX = JOB_PREFIX_MAX + RUN_ID_MAX  # 60
# The longest team, recipe and run id still leave room for the job index: no truncation, which would
# let two recipes (or two runs) share a prefix.
assert RUN_NAME_MAX + JOB_SUFFIX_MAX <= JOB_NAME_MAX


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
    truncated: with a run id of up to RUN_ID_MAX (16) characters and `-<index>` (at most `-99`), a job
    name fits SageMaker's 63.
    """
    return f"ts-{_slug(team, recipe)}--"


def checkpoint_prefix(recipe: Recipe, team: str | None) -> str:
    """Key prefix inside the checkpoint bucket: one folder per team and recipe, runs below it."""
    return f"checkpoints/{team or recipe.tags.team}/{recipe.name}"


# --- Runs and their jobs --------------------------------------------------------------------------


def run_id_problem(run_id: str) -> str | None:
    """Why `run_id` cannot name a run (None when it can): the rule, in one line."""
    if RUN_ID.match(run_id):
        return None
    return f"invalid run name {run_id!r}: a run name is {RUN_ID_RULE}"


def default_run_id(recipe: Recipe, suffix: str) -> str:
    """`<recipe hash>-<suffix>`: the run id when the user gives no --name."""
    if not suffix or len(suffix) > RUN_SUFFIX_MAX or not suffix.replace("-", "").isalnum():
        raise ValueError(
            f"run name suffix must be 1-{RUN_SUFFIX_MAX} characters of [a-zA-Z0-9-], got {suffix!r}"
        )
    return f"{recipe_hash(recipe)}-{suffix}"


def run_name(recipe: Recipe, team: str | None, run_id: str) -> str:
    """`ts-<team>-<recipe>--<run id>`: unique in the account, and the prefix of each of its jobs' names."""
    if (problem := run_id_problem(run_id)) is not None:
        raise ValueError(problem)
    return f"{job_name_prefix(recipe, team)}{run_id}"


def job_of_run(run: str, index: int) -> str:
    """The name of the run's `index`th job (1-based): `<run>-<index>`."""
    if not 1 <= index <= JOB_INDEX_MAX:
        raise ValueError(f"job index must be 1-{JOB_INDEX_MAX}, got {index}")
    name = f"{run}-{index}"
    assert len(name) <= JOB_NAME_MAX, name
    return name


def run_checkpoint_prefix(recipe: Recipe, team: str | None, run_id: str) -> str:
    """`checkpoints/<team>/<recipe>/<run id>/`: shared by every job of the run."""
    return f"{checkpoint_prefix(recipe, team)}/{run_id}/"


@dataclass(frozen=True)
class RunName:
    """A run's name taken apart: `ts-<team>-<recipe>--<run id>`."""

    team: str
    recipe: str
    run_id: str

    @property
    def stack_prefix(self) -> str:
        return f"Trainstack-{self.team}-{self.recipe}"

    @property
    def job_name_prefix(self) -> str:
        return f"ts-{self.team}-{self.recipe}--"

    def __str__(self) -> str:
        return f"{self.job_name_prefix}{self.run_id}"


def parse_run_name(name: str) -> RunName | None:
    """The team, recipe and run id of a run name, or None when `name` is not one.

    Unambiguous because a team name has no hyphen and a recipe name no double hyphen: the team ends at
    the first hyphen after `ts-`, the recipe at the first `--`.
    """
    if not name.startswith("ts-"):
        return None
    team, sep, rest = name[3:].partition("-")
    recipe, sep2, run_id = rest.partition("--")
    if not (sep and sep2) or team_name_problem(team) or recipe_name_problem(recipe) or run_id_problem(run_id):
        return None
    return RunName(team, recipe, run_id)
