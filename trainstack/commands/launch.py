"""`trainstack launch RECIPE [--team T] [--max-steps N] [--local]`: start a training run.

Starts an execution of the recipe's deployed launcher state machine (stack `<prefix>-Launcher`),
which creates the training job with the request from `trainstack.request`. A short tuning run is the
same recipe with `training.steps` overridden (--max-steps), on a warm pool so the next try skips
provisioning. The job is named `ts-<team>-<recipe>--<hash of the run's recipe>-<suffix>`.
"""

from __future__ import annotations

import json
import time
from typing import Annotated

import typer

from trainstack.commands.plan_options import RecipeArg, RecipesDirOpt, TeamOpt
from trainstack.commands.status import LocalOpt
from trainstack.errors import TrainstackError


def register(app: typer.Typer) -> None:
    app.command("launch")(launch)


def launch(
    recipe: RecipeArg,
    team: TeamOpt = None,
    max_steps: Annotated[
        int | None,
        typer.Option(
            "--max-steps", min=1, help="A short tuning run: the same recipe with training.steps set to this."
        ),
    ] = None,
    keep_alive: Annotated[
        int | None,
        typer.Option(
            "--keep-alive",
            min=0,
            max=3600,
            help="Warm-pool seconds after the job (default: 1800 with --max-steps, else the recipe's).",
        ),
    ] = None,
    local: LocalOpt = False,
    wait: Annotated[
        bool,
        typer.Option(
            "--wait",
            help="Wait until the launcher has created the training job (up to 2 minutes, printing "
            "progress); then follow it with `trainstack status RECIPE --watch`.",
        ),
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run", help="Print the CreateTrainingJob request this launch would make; start nothing."
        ),
    ] = False,
    recipes_dir: RecipesDirOpt = None,
) -> None:
    """Start a training run of RECIPE through its deployed launcher (see `npx cdk deploy -c recipe=...`).

    Needs the recipe's stacks deployed, unchanged since (the local recipe's hash must match the
    deployed one). Exit status 0 when the run started, 1 when --wait saw no training job in time
    (the run did start), 2 when the recipe is invalid, not deployed or changed since, or AWS refuses
    (one line saying which).

    Examples:

      trainstack launch 30b-fp8 --max-steps 50 --wait

      trainstack launch 8b-fp8 --team nlp --dry-run
    """
    from trainstack import naming, request
    from trainstack.aws import Aws, explain
    from trainstack.loader import resolve
    from trainstack.recipe import Recipe

    resolved = resolve(recipe, team=team, recipes_dir=recipes_dir)
    deployed = resolved.recipe
    run = deployed
    if max_steps is not None:
        data = deployed.model_dump(mode="json", exclude={"extends"})
        data["training"]["steps"] = max_steps
        run = Recipe.model_validate(data)
    keep = (
        keep_alive
        if keep_alive is not None
        else (
            max(request.WARM_POOL_SECONDS, deployed.compute.keep_alive_seconds)
            if max_steps is not None
            else deployed.compute.keep_alive_seconds
        )
    )
    prefix = naming.stack_prefix(deployed, team)
    deploy_hint = f"`npx cdk deploy --all -c recipe={deployed.name}" + (f" -c team={team}" if team else "")
    # EMULATOR: the emulator loses exports on the change-set path (docs/cdk.md)
    deploy_hint += " --method=direct` with the emulator's AWS_* variables exported" if local else "`"

    aws = Aws(local=local)
    outputs = aws.stack_outputs(f"{prefix}-Launcher", deploy_hint)
    deployed_hash, local_hash = outputs.get("RecipeHash"), naming.recipe_hash(deployed)
    if deployed_hash != local_hash:
        raise TrainstackError(
            f"recipe {deployed.name} changed since it was deployed (deployed {deployed_hash}, "
            f"local {local_hash}): "
            f"run {deploy_hint} first"
        )
    job_name = request.job_name(run, team, _suffix(max_steps))
    overrides = request.hyperparameter_overrides(deployed, run)
    execution_input = request.execution_input(job_name, overrides, keep)

    from botocore.exceptions import BotoCoreError, ClientError

    if dry_run:
        data_outputs = aws.stack_outputs(f"{prefix}-Data", deploy_hint)
        try:
            image_uri = _deployed_image(aws, outputs["StateMachineArn"])
        except (ClientError, BotoCoreError) as exc:
            raise TrainstackError(
                f"could not read the deployed state machine in {aws.where}: {explain(exc)}"
            ) from None
        body = request.create_training_job_request(
            run,
            team,
            job_name=job_name,
            role_arn=outputs["ExecutionRoleArn"],
            image_uri=image_uri,
            bucket_name=data_outputs["BucketName"],
            kms_key_arn=data_outputs["KeyArn"],
            keep_alive_seconds=keep,
        )
        typer.echo(json.dumps(body, indent=2))
        return

    sfn = aws.client("stepfunctions")
    try:
        started = sfn.start_execution(
            stateMachineArn=outputs["StateMachineArn"], name=job_name, input=json.dumps(execution_input)
        )
    except (ClientError, BotoCoreError) as exc:
        raise TrainstackError(f"could not start {job_name} in {aws.where}: {explain(exc)}") from None
    typer.echo(f"launched {job_name} ({run.training.steps} steps, warm pool {keep}s) in {aws.where}")
    typer.echo(f"execution: {started['executionArn']}")
    if wait:
        try:
            _wait_for_job(aws, started["executionArn"], job_name)
        except BotoCoreError as exc:  # ClientErrors are handled inside
            raise TrainstackError(
                f"lost contact with {aws.where} while waiting for {job_name}: {explain(exc)}"
            ) from None


def _suffix(max_steps: int | None) -> str:
    """`t<base36 seconds>` for a tuning run, `r<...>` for a full one: unique per second, 7 characters
    (naming.RUN_SUFFIX_MAX) until December 2038."""
    n, digits = int(time.time()), ""
    while n:
        n, d = divmod(n, 36)
        digits = "0123456789abcdefghijklmnopqrstuvwxyz"[d] + digits
    return ("t" if max_steps is not None else "r") + digits


def _deployed_image(aws, state_machine_arn: str) -> str:
    definition = json.loads(
        aws.client("stepfunctions").describe_state_machine(stateMachineArn=state_machine_arn)["definition"]
    )
    return definition["States"]["CreateTrainingJob"]["Parameters"]["AlgorithmSpecification"]["TrainingImage"]


class _StillCreating(TrainstackError):
    """--wait ran out before the job existed; the launch itself started (exit 1, not 2)."""

    exit_code = 1


def _wait_for_job(aws, execution_arn: str, job_name: str, timeout_s: float = 120.0) -> None:
    from botocore.exceptions import ClientError

    from trainstack.aws import explain

    sfn, sagemaker = aws.client("stepfunctions"), aws.client("sagemaker")
    started = time.monotonic()
    deadline = started + timeout_s
    said, said_at = None, 0.0
    while time.monotonic() < deadline:
        execution = sfn.describe_execution(executionArn=execution_arn)
        if execution["status"] in ("FAILED", "TIMED_OUT", "ABORTED"):
            raise TrainstackError(
                f"launch of {job_name} {execution['status'].lower()}: "
                f"{execution.get('error', '')} {execution.get('cause', '')}".strip()
            )
        try:
            job = sagemaker.describe_training_job(TrainingJobName=job_name)
            typer.echo(f"training job {job_name}: {job['TrainingJobStatus']}")
            return
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in ("ValidationException", "ResourceNotFound"):
                raise TrainstackError(f"could not read training job {job_name}: {explain(exc)}") from None
        waited = time.monotonic() - started
        note = f"launcher execution {execution['status']}, no training job yet"
        if note != said or waited - said_at >= 15:  # on a change, and every 15 s
            typer.echo(f"  ... {note} ({waited:.0f} s)")
            said, said_at = note, waited
        time.sleep(1)
    raise _StillCreating(
        f"the launch started but no training job {job_name} exists after {timeout_s:.0f} s (the launcher "
        f"retries while capacity or quota is short); follow it with `trainstack status` or execution "
        f"{execution_arn}"
    )
