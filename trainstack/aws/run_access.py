"""What `launch`, `runs`, `stop`, `resume` and `export` share below the command line: finding a run's
deployment and registry, one-line errors for a run that does not exist, who is asking, and whether a
StartJob execution's registration won the run registry's conditional write.

Moved from trainstack/cli/commands/run_access.py so trainstack.api can use it (the API may not import
the CLI); that module re-exports these names for the commands that still import them from there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from trainstack.errors import TrainstackError


def team_option(team: str, recipes_dir: str | None = None) -> str | None:
    """The `--team` a run of `team` (the team in its name) was deployed and launched with: None for the
    default team (the recipe's `tags.team`, "platform"), which has no directory under recipes/teams and
    deploys without `--team`; resolving its name as a team file would fail."""
    from trainstack.recipes.loader import recipes_dir_or_default

    return team if (recipes_dir_or_default(recipes_dir) / "teams" / team).is_dir() else None


def deploy_hint(recipe: str, team: str | None, local: bool) -> str:
    hint = f"`npx cdk deploy --all -c recipe={recipe}" + (f" -c team={team}" if team else "")
    # The emulator deploys as AWS does (trainstack.emulator.cloudformation): only its endpoint differs.
    return hint + ("` with the emulator's AWS_* variables exported" if local else "`")


@dataclass(frozen=True)
class Deployed:
    """A recipe's deployed stacks, as the commands need them."""

    launcher: dict[str, str]  # outputs of <prefix>-Launcher
    data: dict[str, str]  # outputs of <prefix>-Data

    @property
    def start_job(self) -> str:
        return self.launcher["StateMachineArn"]

    @property
    def table(self) -> str:
        table = self.data.get("RunTableName")
        if not table:
            raise TrainstackError(
                "the data stack has no run registry (RunTableName): redeploy it with this version"
            )
        return table


def deployed(aws: Any, stack_prefix: str, hint: str) -> Deployed:
    return Deployed(
        aws.stack_outputs(f"{stack_prefix}-Launcher", hint), aws.stack_outputs(f"{stack_prefix}-Data", hint)
    )


def find_run(aws: Any, run: str) -> tuple[Any, Deployed]:
    """The registry's record of run `run` and its deployment, or one line saying why there is none."""
    from botocore.exceptions import BotoCoreError, ClientError

    from trainstack.aws.registry import read_run
    from trainstack.aws.session import explain
    from trainstack.recipes.naming import parse_run_name

    name = parse_run_name(run)
    if name is None:
        raise TrainstackError(
            f"unknown run {run!r}: a run is named ts-<team>-<recipe>--<run id> (see `trainstack runs`)"
        )
    hint = deploy_hint(name.recipe, name.team, aws.local)
    try:
        where = deployed(aws, name.stack_prefix, hint)
    except TrainstackError as error:
        raise TrainstackError(f"unknown run {run}: {error}") from None
    try:
        record = read_run(aws.client("dynamodb"), where.table, run)
    except (ClientError, BotoCoreError) as error:
        raise TrainstackError(f"could not read the run registry in {aws.where}: {explain(error)}") from None
    if record is None:
        raise TrainstackError(
            f"unknown run {run}: the run registry of {name.team}/{name.recipe} in {aws.where} has no such "
            "run (see `trainstack runs`)"
        )
    return record, where


def execution_name(job: str) -> str:
    """A new execution name for one attempt at starting `job` (naming.execution_name)."""
    import uuid

    from trainstack.recipes.naming import ATTEMPT_TOKEN_LEN
    from trainstack.recipes.naming import execution_name as name

    return name(job, uuid.uuid4().hex[:ATTEMPT_TOKEN_LEN])


def caller(aws: Any) -> str:
    """Who is asking, for the run's history: the caller's ARN (STS GetCallerIdentity)."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return aws.client("sts").get_caller_identity()["Arn"]
    except (ClientError, BotoCoreError):
        return "unknown caller"


# The StartJob states that tell whether an execution's registration won (stacks/supervisor/start_job.py):
# it goes on to create the job, or the registry's conditional write sent it to one of these.
CREATED_AT = "CreateTrainingJob"
LOST_AT = {"launch": "AlreadyLaunched", "resume": "NotStarted"}
HISTORY_PAGE_MAX = 1000  # GetExecutionHistory maxResults: 0-1000 (Step Functions API reference)


class Undecided(TrainstackError):
    """The registration was not seen within the wait; the command did start an execution (exit 1)."""

    exit_code = 1


def registration_won(aws: Any, execution_arn: str, how: str, timeout_s: float = 90.0) -> bool:
    """Whether this StartJob execution's registration won the run registry's conditional write (True:
    it creates the job) or lost it to a concurrent launch or resume of the same run (False).

    One winner per run name (RegisterRun: `attribute_not_exists(run)`) and per resume (RegisterResume:
    the run stopped or failed at the job index this resume read): DynamoDB evaluates a
    ConditionExpression atomically with its write, so of two concurrent writers exactly one succeeds
    and the other gets ConditionalCheckFailedException (DynamoDB developer guide, "Condition
    expressions"). The execution's own history says which state followed."""
    from botocore.exceptions import BotoCoreError, ClientError

    from trainstack.aws.session import explain

    sfn = aws.client("stepfunctions")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            status = sfn.describe_execution(executionArn=execution_arn)["status"]
            entered = {
                event["stateEnteredEventDetails"]["name"]
                for page in sfn.get_paginator("get_execution_history").paginate(
                    executionArn=execution_arn, PaginationConfig={"PageSize": HISTORY_PAGE_MAX}
                )
                for event in page["events"]
                if "stateEnteredEventDetails" in event
            }
        except (ClientError, BotoCoreError) as error:
            raise TrainstackError(f"could not read execution {execution_arn}: {explain(error)}") from None
        if LOST_AT[how] in entered:
            return False
        if CREATED_AT in entered:
            return True
        if status != "RUNNING":
            raise TrainstackError(f"the {how} execution {execution_arn} ended {status} before registering")
        if time.monotonic() > deadline:
            raise Undecided(
                f"the {how} started execution {execution_arn}, which has not registered the run after "
                f"{timeout_s:.0f} s; see `trainstack runs`"
            )
        time.sleep(0.5)


def winner_line(record: Any, how: str, mine: str) -> str:
    """One line for the losing caller: which launch or resume won, and its settings (the run's history
    records who asked and what, with the changes; trainstack.aws.registry.history_with)."""
    won = record.history[0] if how == "launch" else record.history[-1] if record.history else None
    said = f"{won.what} by {won.who} at {won.at}" if won is not None else f"{record.why} ({record.state})"
    return (
        f"run {record.run}: another {how} won ({said}); this {how} ({mine}) was not applied: see "
        f"`trainstack runs {record.recipe}`"
    )
