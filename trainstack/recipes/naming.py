"""Names derived from a resolved recipe: stacks, runs, training jobs, S3 prefixes. Defined once here.

SageMaker training job names are at most 63 characters of [a-zA-Z0-9-]; CloudFormation stack names
at most 128.

A **run** is one recipe's token budget trained to the end by as many training jobs as it takes. It is
named `<job-name prefix><run id>` (`ts-<team>-<recipe>--<run id>`): the run id is the `--name` a user
gives, or `<recipe hash>-<suffix>`. Its jobs are `<run>-1`, `<run>-2`, ... (every job of a run gets the
next index, a capacity retry included) and all of them checkpoint under one prefix,
`checkpoints/<team>/<recipe>/<run id>/`, so each resumes from the newest checkpoint of the run. Past
job 99 the suffix is two base-36 characters (`job_suffix`), so even the longest run name has 1035 jobs.

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
# `\Z`, and fullmatch below: a Python `$` also matches before a trailing newline ("odd\n" would pass).
RUN_ID = re.compile(rf"(?=.{{1,{RUN_ID_MAX}}}\Z)[a-z0-9]+(-[a-z0-9]+)*\Z")
RUN_ID_RULE = f"1-{RUN_ID_MAX} characters: words of lowercase letters and digits joined by single hyphens"
# A job's name is `<run>-<suffix>`, and the longest run name leaves room for 2 characters after the
# hyphen (RUN_NAME_MAX + 3 = SageMaker's 63). Jobs 1-99 are numbered in decimal; from job 100 the suffix is
# a letter and a base-36 digit (`a0` is job 100, `zz` job 1035), so no suffix of one scheme is one of the
# other and every name still fits. A capacity retry takes an index too (each try is a job SageMaker
# names), but not a slot of `compute.max_jobs` (trainstack.aws.supervisor).
DECIMAL_JOBS = 99
_BASE36 = "0123456789abcdefghijklmnopqrstuvwxyz"
JOB_INDEX_MAX = DECIMAL_JOBS + 26 * 36  # 1035
JOB_SUFFIX_MAX = len("-") + 2
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


STACK_PROJECT = "Trainstack"  # every stack name begins with it


def stack_prefix(recipe: Recipe, team: str | None) -> str:
    """`Trainstack-<team>-<recipe>`; the stateful and launcher stacks append their role."""
    return f"{STACK_PROJECT}-{_slug(team, recipe)}"


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
    truncated: with a run id of up to RUN_ID_MAX (16) characters and `-<suffix>` (at most 3 characters,
    `job_suffix`), a job name fits SageMaker's 63.
    """
    return f"ts-{_slug(team, recipe)}--"


def checkpoint_prefix(recipe: Recipe, team: str | None) -> str:
    """Key prefix inside the checkpoint bucket: one folder per team and recipe, runs below it."""
    return f"checkpoints/{team or recipe.tags.team}/{recipe.name}"


# --- Runs and their jobs --------------------------------------------------------------------------


def run_id_problem(run_id: str) -> str | None:
    """Why `run_id` cannot name a run (None when it can): the rule, in one line."""
    if RUN_ID.fullmatch(run_id):
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


def job_suffix(index: int) -> str:
    """What follows `<run>-` in the name of the run's `index`th job (1-based): `7`, `99`, then `a0`..`zz`."""
    if not 1 <= index <= JOB_INDEX_MAX:
        raise ValueError(f"job index must be 1-{JOB_INDEX_MAX}, got {index}")
    if index <= DECIMAL_JOBS:
        return str(index)
    letter, digit = divmod(index - DECIMAL_JOBS - 1, 36)
    return _BASE36[10 + letter] + _BASE36[digit]


def job_index(suffix: str) -> int | None:
    """The index a job suffix names (the inverse of `job_suffix`), or None when it names none."""
    if suffix.isdigit() and not suffix.startswith("0"):
        return int(suffix) if int(suffix) <= DECIMAL_JOBS else None
    if len(suffix) == 2 and suffix[0] in _BASE36[10:] and suffix[1] in _BASE36:
        return DECIMAL_JOBS + 1 + (_BASE36.index(suffix[0]) - 10) * 36 + _BASE36.index(suffix[1])
    return None


# Every suffix in index order, comma-separated: the supervisor's state machines look a job's name up in
# this list (States.ArrayGetItem over States.StringSplit), as they have no base-36 arithmetic.
JOB_SUFFIXES = ",".join(job_suffix(i) for i in range(1, JOB_INDEX_MAX + 1))


def job_of_run(run: str, index: int) -> str:
    """The name of the run's `index`th job (1-based): `<run>-<job_suffix(index)>`."""
    name = f"{run}-{job_suffix(index)}"
    assert len(name) <= JOB_NAME_MAX, name
    return name


EXECUTION_NAME_MAX = 80  # Step Functions execution names
ATTEMPT_TOKEN_LEN = 12


def execution_name(job: str, token: str) -> str:
    """The name of one attempt to start `job`: `<job>-<token>`, unique per attempt. Step Functions keeps
    a closed execution's name for 90 days, so a name per job would let one failed attempt block every
    later `launch --name` or `resume` of it; whether the job may start is the run registry's
    conditional write, not the name."""
    if not token.isalnum() or len(token) != ATTEMPT_TOKEN_LEN:
        raise ValueError(f"attempt token must be {ATTEMPT_TOKEN_LEN} letters or digits, got {token!r}")
    name = f"{job}-{token}"
    assert len(name) <= EXECUTION_NAME_MAX, name
    return name


def job_of_execution(name: str) -> str:
    """The job an execution named by `execution_name` starts (`<job>-<token>` -> `<job>`); any other
    name as it is (an execution named after its job, as before attempt tokens)."""
    job, sep, token = name.rpartition("-")
    if sep and len(token) == ATTEMPT_TOKEN_LEN and token.isalnum() and index_of_job(job) is not None:
        return job
    return name


def index_of_job(name: str) -> int | None:
    """The index of a job from its name `<run>-<suffix>` (None when the name has no job suffix)."""
    return job_index(name.rpartition("-")[2])


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
        return f"{STACK_PROJECT}-{self.team}-{self.recipe}"

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
