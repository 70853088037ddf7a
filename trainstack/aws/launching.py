"""Starting a run through its deployed run supervisor, below the command line (moved from
trainstack/cli/commands/launch.py so trainstack.api.launch can compose it).

`start_run` reads the recipe's deployed stacks, refuses a recipe changed since its deploy and a run name
that exists, opens the run's MLflow run, starts the StartJob state machine for job 1 and learns whether
its registration won. `wait_for_job` follows that execution until SageMaker has the job (`launch
--wait`); `wait_for_end` follows the run in its registry until it has ended (`trainstack.api.launch(...,
wait=True)`). `first_job_request` is `launch --dry-run`'s request, with placeholders for what only the
deployed stacks know. Lines for a person go through callbacks; nothing here prints.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainstack.errors import TrainstackError

PLACEHOLDER = "<placeholder: {}>"
FIRST_JOB_WAIT_S = (
    120.0  # `launch --wait`: the supervisor creates job 1 within seconds unless capacity is short
)
ENDED = ("completed", "stopped", "failed")  # a run's states after which no job of it starts by itself
RUN_POLL_S = 5.0  # the registry is read every 5 s while waiting for a run's end (one GetItem each)

Say = Callable[[str], None]


def _silent(line: str) -> None:
    pass


def deployed_image(aws: Any, state_machine_arn: str) -> str:
    """The training image the deployed StartJob state machine puts in every CreateTrainingJob request."""
    definition = json.loads(
        aws.client("stepfunctions").describe_state_machine(stateMachineArn=state_machine_arn)["definition"]
    )
    return definition["States"]["BuildRequest"]["Parameters"]["AlgorithmSpecification"]["TrainingImage"]


def deployed_values(aws: Any, stacks: Any) -> dict[str, str]:
    """What a job's request takes from the recipe's deployed stacks."""
    return {
        "role_arn": stacks.launcher["ExecutionRoleArn"],
        "bucket_name": stacks.data["BucketName"],
        "kms_key_arn": stacks.data["KeyArn"],
        "image_uri": deployed_image(aws, stacks.start_job),
    }


def open_mlflow_run(aws: Any, recipe: Any, team: str | None, run: str, hint: str, warn: Say) -> Any:
    """The new run's MLflow run when the recipe tracks in MLflow (trainstack.aws.mlflow_access); None,
    with one warning line, when the tracker cannot be reached: tracking never stops a launch."""
    from trainstack.aws import mlflow_access

    try:
        uri = mlflow_access.tracking_uri(aws, recipe, team, hint)
    except TrainstackError as error:
        warn(f"warning: {error}; the run's first job creates its MLflow run")
        return None
    return mlflow_access.create_for_launch(uri, recipe, team, run, warn) if uri else None


@dataclass(frozen=True)
class Started:
    """A run whose job 1 the supervisor is creating."""

    run: str
    job: str
    execution: str
    table: str  # its registry
    checkpoint_uri: str
    mlflow_run_id: str | None = None
    mlflow_url: str | None = None
    mlflow_tracking_uri: str | None = None
    where: str = ""


def start_run(
    aws: Any,
    deployed_recipe: Any,
    run_recipe: Any,
    team: str | None,
    *,
    run: str,
    run_id: str,
    keep_alive: int,
    hint: str,
    emulator: bool,
    warn: Say = _silent,
) -> Started:
    """Start job 1 of a new run `run` (trainstack.aws.request.execution_input) through the deployed
    StartJob state machine; one-line TrainstackErrors for what refuses it before or while it starts."""
    from botocore.exceptions import BotoCoreError, ClientError

    from trainstack.aws import request
    from trainstack.aws.base_model import check_for_launch
    from trainstack.aws.dataset_check import check_datasets
    from trainstack.aws.registry import read_run
    from trainstack.aws.run_access import caller, deployed, execution_name, registration_won, winner_line
    from trainstack.aws.session import explain
    from trainstack.recipes import naming

    # The base model is read where the job would read it (this S3, never the instance) before any job
    # exists: a recipe whose shape differs from it would fail every job of the run at step 0.
    check_for_launch(run_recipe, aws.client("s3"), emulator)
    # So are the prepared datasets' manifests: an empty held-out split, another tokenizer's shards or a
    # text set under sft would end job 1 at step 0 (trainstack.aws.dataset_check).
    check_datasets(run_recipe, aws.client("s3"))
    stacks = deployed(aws, naming.stack_prefix(deployed_recipe, team), hint)
    deployed_hash, local_hash = stacks.launcher.get("RecipeHash"), naming.recipe_hash(deployed_recipe)
    if deployed_hash != local_hash:
        raise TrainstackError(
            f"recipe {deployed_recipe.name} changed since it was deployed (deployed {deployed_hash}, "
            f"local {local_hash}): run {hint} first"
        )
    job = naming.job_of_run(run, 1)
    overrides = request.hyperparameter_overrides(deployed_recipe, run_recipe)
    try:
        existing = read_run(aws.client("dynamodb"), stacks.table, run)
        if existing is not None:
            launched = existing.history[0] if existing.history else None
            by = f"; {launched.what} by {launched.who} at {launched.at}" if launched else ""
            raise TrainstackError(
                f"a run named {run} exists ({existing.state}{by}): `trainstack resume {run}` continues it, "
                "or pick another --name"
            )
        what = f"launch of recipe {local_hash}" + (
            f" with {', '.join(f'{k}={v}' for k, v in sorted(overrides.items()))}" if overrides else ""
        )
        mlflow_run = open_mlflow_run(aws, deployed_recipe, team, run, hint, warn)
        execution_input = request.execution_input(
            run,
            run_id,
            1,
            run_recipe.training.steps,
            overrides,
            keep_alive,
            "launch",
            change={"Who": caller(aws), "What": what},
            mlflow_run_id=mlflow_run.run_id if mlflow_run is not None else "",
        )
        # A name per attempt: the registry's conditional write decides whether the run starts.
        started = aws.client("stepfunctions").start_execution(
            stateMachineArn=stacks.start_job, name=execution_name(job), input=json.dumps(execution_input)
        )
        # Two launches of one name both passed the check above: the one whose registration won says so,
        # the other exits 2 naming the winner and its settings (never both exit 0).
        if not registration_won(aws, started["executionArn"], "launch"):
            winner = read_run(aws.client("dynamodb"), stacks.table, run)
            raise TrainstackError(winner_line(winner, "launch", what) if winner else f"run {run} exists")
    except (ClientError, BotoCoreError) as exc:
        raise TrainstackError(f"could not start run {run} in {aws.where}: {explain(exc)}") from None
    return Started(
        run=run,
        job=job,
        execution=started["executionArn"],
        table=stacks.table,
        checkpoint_uri=request.checkpoint_uri(stacks.data["BucketName"], deployed_recipe, team, run_id),
        mlflow_run_id=mlflow_run.run_id if mlflow_run is not None else None,
        mlflow_url=mlflow_run.url if mlflow_run is not None else None,
        mlflow_tracking_uri=getattr(mlflow_run, "tracking_uri", None) if mlflow_run is not None else None,
        where=aws.where,
    )


@dataclass(frozen=True)
class DryRun:
    """`launch --dry-run`: the first job's request, which of its values are placeholders, the input mode."""

    request: dict[str, Any]
    placeholders: tuple[str, ...]
    input_mode: dict[str, str]
    notes: tuple[str, ...] = field(default=())  # lines for stderr, in the order the command prints them


def first_job_request(
    deployed_recipe: Any,
    run_recipe: Any,
    team: str | None,
    *,
    run: str,
    run_id: str,
    job: str,
    keep_alive: int,
    local: bool,
    hint: str,
    aws_factory: Callable[[], Any],
) -> DryRun:
    """The first job's request, from the deployed stacks where they can be read, else with placeholders
    (marked as such); works without any AWS configuration. `aws_factory` makes the boto3 access (it may
    raise the one-line error of a missing region or emulator: then every deployed value is a placeholder)."""
    from botocore.exceptions import BotoCoreError, ClientError

    from trainstack.aws import request
    from trainstack.aws.run_access import deployed
    from trainstack.aws.session import explain
    from trainstack.planner.input_mode import input_plan
    from trainstack.recipes import naming

    notes: list[str] = []
    prefix = naming.stack_prefix(deployed_recipe, team)
    values: dict[str, str] = {}
    region: str | None = None
    why = ""
    try:
        aws = aws_factory()
        region = aws.region
        stacks = deployed(aws, prefix, hint)
        values = deployed_values(aws, stacks)
        if deployed_recipe.tracking.managed:  # the team's MLflow App (stack Trainstack-<team>-Tracking)
            from trainstack.aws.mlflow_access import tracking_uri

            try:
                values["mlflow_arn"] = tracking_uri(aws, deployed_recipe, team, hint, resource=True) or ""
            except TrainstackError as error:  # the team's tracking stack is not deployed (yet)
                values["mlflow_arn"] = PLACEHOLDER.format(f"the team's MLflow App ARN: {error}")
        if stacks.launcher.get("RecipeHash") != naming.recipe_hash(deployed_recipe):
            notes.append(
                f"note: recipe {deployed_recipe.name} changed since it was deployed; `launch` would refuse "
                f"it until {hint}"
            )
    except TrainstackError as error:
        why = str(error)
    except (ClientError, BotoCoreError) as error:
        why = f"could not read the deployed stacks: {explain(error)}"
    placeholders: dict[str, str] = {}
    if not values:
        placeholders = {
            "role_arn": f"the execution role ARN of {prefix}-Launcher",
            "bucket_name": f"the checkpoint bucket of {prefix}-Data",
            "kms_key_arn": f"the key ARN of {prefix}-Data",
            "image_uri": f"the training image {prefix}-Launcher deploys",
        }
        if deployed_recipe.tracking.managed:
            placeholders["mlflow_arn"] = "the team's MLflow App ARN (stack Trainstack-<team>-Tracking)"
        values = {k: PLACEHOLDER.format(v) for k, v in placeholders.items()}
        if deployed_recipe.image.uri:
            values["image_uri"] = deployed_recipe.image.uri
            placeholders.pop("image_uri")
    if region is None:  # no AWS configuration at all
        placeholders["region"] = "the deployment's region"
        region = PLACEHOLDER.format(placeholders["region"])
    body = request.create_training_job_request(
        run_recipe,
        team,
        job_name=job,
        run=run,
        checkpoint_uri=request.checkpoint_uri(values["bucket_name"], deployed_recipe, team, run_id),
        keep_alive_seconds=keep_alive,
        region=region,
        previous_job_end="",
        **values,
    )
    # The job limit is fixed when the stack is deployed, by the deployed recipe's plan.
    body["StoppingCondition"] = request.stopping_condition(deployed_recipe)
    if placeholders:
        note = f"note: {', '.join(sorted(placeholders))} are placeholders (marked <placeholder: ...>): {why}"
        notes.append(" ".join(note.split()))
    inputs = input_plan(run_recipe)
    notes.append(f"data input: {inputs.summary()}")  # which input mode, and why
    return DryRun(
        body, tuple(sorted(placeholders)), {"mode": inputs.mode, "reason": inputs.reason}, tuple(notes)
    )


class StillCreating(TrainstackError):
    """--wait ran out before the job existed; the launch itself started (exit 1, not 2)."""

    exit_code = 1


def wait_for_job(
    aws: Any, execution_arn: str, job_name: str, timeout_s: float = FIRST_JOB_WAIT_S, echo: Say = print
) -> str:
    """Follow the StartJob execution `execution_arn` until SageMaker has `job_name`; its status. Progress
    lines go to `echo` (on a change, and every 15 s); one-line errors when the start failed, when the
    execution ended without the job (the run changed meanwhile), or (exit 1) when time ran out."""
    from botocore.exceptions import ClientError

    from trainstack.aws.session import explain

    sfn, sagemaker = aws.client("stepfunctions"), aws.client("sagemaker")
    started = time.monotonic()
    deadline = started + timeout_s
    said, said_at = None, 0.0
    while time.monotonic() < deadline:
        execution = sfn.describe_execution(executionArn=execution_arn)
        if execution["status"] in ("FAILED", "TIMED_OUT", "ABORTED"):
            raise TrainstackError(
                f"the start of {job_name} {execution['status'].lower()}: "
                f"{execution.get('error', '')} {execution.get('cause', '')}".strip()
            )
        try:
            job = sagemaker.describe_training_job(TrainingJobName=job_name)
            echo(f"training job {job_name}: {job['TrainingJobStatus']}")
            return job["TrainingJobStatus"]
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in ("ValidationException", "ResourceNotFound"):
                raise TrainstackError(f"could not read training job {job_name}: {explain(exc)}") from None
        if execution["status"] == "SUCCEEDED":
            raise TrainstackError(
                f"the supervisor started no job {job_name}: the run changed meanwhile (another launch or "
                "resume of it, or a stop); see `trainstack runs`"
            )
        waited = time.monotonic() - started
        note = f"supervisor execution {execution['status']}, no training job yet"
        if note != said or waited - said_at >= 15:  # on a change, and every 15 s
            echo(f"  ... {note} ({waited:.0f} s)")
            said, said_at = note, waited
        time.sleep(1)
    raise StillCreating(
        f"the launch started but no training job {job_name} exists after {timeout_s:.0f} s (the supervisor "
        f"retries while capacity or quota is short); follow it with `trainstack runs` or execution "
        f"{execution_arn}"
    )


class StillRunning(TrainstackError):
    """A wait for a run's end ran out; the run goes on (exit 1: nothing failed)."""

    exit_code = 1


def wait_for_end(
    aws: Any,
    table: str,
    run: str,
    timeout_s: float | None = None,
    echo: Say = _silent,
    poll_s: float = RUN_POLL_S,
) -> Any:
    """Follow run `run` in its registry until the supervisor has recorded its end (completed, stopped or
    failed: no job of it starts by itself after these); the registry's record of it (trainstack.aws
    .registry.Run). Each change of state, job, job status or step is one line to `echo` (the step and
    loss SageMaker reports for the current job where it has any, else the registry's). StillRunning
    (exit 1) when `timeout_s` passes first; the run is not touched."""
    from botocore.exceptions import BotoCoreError, ClientError

    from trainstack.aws.registry import read_run
    from trainstack.aws.session import explain

    dynamodb, sagemaker = aws.client("dynamodb"), aws.client("sagemaker")
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    said = None
    while True:
        try:
            record = read_run(dynamodb, table, run)
            if record is None:
                raise TrainstackError(f"run {run} is not in its registry ({table}) any more")
            status, metrics = _job_now(sagemaker, record.current_job)
        except (ClientError, BotoCoreError) as error:
            raise TrainstackError(
                f"lost contact with {aws.where} while waiting for run {run}: {explain(error)}"
            ) from None
        step = max(record.step, int(metrics.get("train:step", 0)))
        loss = metrics.get("train:loss")
        line = (
            f"run {run}: {record.state}, job {record.current_job} {status}, step {step:,} of {record.steps:,}"
            + (f", loss {loss:.4g}" if loss is not None else "")
        )
        if line != said:
            echo(line)
            said = line
        if record.state in ENDED:
            echo(f"run {run} {record.state}: {record.why}")
            return record
        if deadline is not None and time.monotonic() >= deadline:
            raise StillRunning(
                f"run {run} is still {record.state} after {timeout_s:.0f} s (job {record.current_job}, step "
                f"{step:,} of {record.steps:,}); it goes on: follow it with `trainstack runs`"
            )
        time.sleep(poll_s if deadline is None else max(0.0, min(poll_s, deadline - time.monotonic())))


def _job_now(sagemaker: Any, job: str) -> tuple[str, dict[str, float]]:
    """(the job's status as SageMaker reports it, or `not created yet`; its newest metrics by name:
    FinalMetricDataList, the values of the recipe's metric definitions SageMaker holds for the job)."""
    from botocore.exceptions import ClientError

    try:
        described = sagemaker.describe_training_job(TrainingJobName=job)
    except ClientError as error:
        if error.response.get("Error", {}).get("Code") in ("ValidationException", "ResourceNotFound"):
            return "not created yet", {}
        raise
    metrics = {m["MetricName"]: m["Value"] for m in described.get("FinalMetricDataList", [])}
    return described["TrainingJobStatus"], metrics
