"""`trainstack launch RECIPE [--team T] [--name NAME] [--max-steps N] [--local]`: start a run.

A run is one recipe's token budget trained to the end by as many SageMaker jobs as it takes
(docs/runs.md). `launch` starts the deployed run supervisor's StartJob state machine (stack
`<prefix>-Launcher`) for job 1 of a new run; the supervisor starts the next jobs itself. The run is
named `ts-<team>-<recipe>--<run id>` (the id is --name, or the run's recipe hash and the launch time),
its jobs `<run>-1`, `<run>-2`, ..., and all of them checkpoint under `checkpoints/<team>/<recipe>/<run id>/`.
A short tuning run is the same recipe with `training.steps` overridden (--max-steps), on a warm pool
so the next try skips provisioning.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated, Any
from urllib.parse import urlsplit

import typer

from trainstack.cli.commands.plan_options import RecipeArg, RecipesDirOpt, TeamOpt
from trainstack.cli.commands.run_access import (
    JsonOpt,
    answer,
    caller,
    deploy_hint,
    deployed,
    execution_name,
    registration_won,
    winner_line,
)
from trainstack.cli.commands.status import LocalOpt
from trainstack.errors import RecipeError, TrainstackError

PLACEHOLDER = "<placeholder: {}>"


def register(app: typer.Typer) -> None:
    app.command("launch")(launch)


def launch(
    recipe: RecipeArg,
    team: TeamOpt = None,
    name: Annotated[
        str | None,
        typer.Option(
            "--name",
            help="The run id (1-16 lowercase letters, digits, single hyphens); default: the recipe hash "
            "and the launch time.",
        ),
    ] = None,
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
            help="Warm-pool seconds after each job (default: 1800 with --max-steps, else the recipe's).",
        ),
    ] = None,
    local: LocalOpt = False,
    wait: Annotated[
        bool,
        typer.Option(
            "--wait",
            help="Wait until the supervisor has created the run's first job (up to 2 minutes, printing "
            "progress); then follow it with `trainstack runs RECIPE` or `trainstack status RECIPE --watch`.",
        ),
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Print the first job's CreateTrainingJob request and start nothing; works without AWS "
            "(placeholders, marked as such, for what only the deployed stacks know).",
        ),
    ] = False,
    tuned: Annotated[
        bool,
        typer.Option(
            "--tuned",
            help="Train with the layout `trainstack tune` chose for this recipe and team (its --set "
            "overrides, from the tuning store; see `trainstack show`).",
        ),
    ] = False,
    as_json: JsonOpt = False,
    recipes_dir: RecipesDirOpt = None,
) -> None:
    """Start a run of RECIPE through its deployed run supervisor (see `npx cdk deploy -c recipe=...`).

    Needs the recipe's stacks deployed, unchanged since (the local recipe's hash must match the deployed
    one). The supervisor continues the run with its next job when a job reaches its max runtime, loses
    its spot capacity or fails on infrastructure, up to compute.max_jobs, and ends it when the steps are
    done, on `trainstack stop`, or on a failure the next job would repeat. --json prints {run, job,
    execution} (with --dry-run: {"request": ...}).

    Exit status 0 when the run started, 1 when --wait saw no training job in time (the run did start),
    2 when the recipe or --name is invalid, not deployed or changed since, a run of that name exists
    (also when a concurrent launch of the name won: the line names it and its settings), or AWS
    refuses (one line saying which).

    Examples:

      trainstack launch 30b-fp8 --max-steps 50 --wait

      trainstack launch 8b-fp8 --team nlp --name lr-sweep-1 --json

      trainstack launch 8b-fp8 --team nlp --dry-run
    """
    from trainstack.aws import request
    from trainstack.recipes import naming
    from trainstack.recipes.loader import resolve
    from trainstack.recipes.schema import Recipe

    resolved = resolve(recipe, team=team, recipes_dir=recipes_dir)
    deployed_recipe = resolved.recipe
    run_recipe = deployed_recipe
    if tuned:
        run_recipe = _tuned(deployed_recipe, team, local)
    if max_steps is not None:
        from pydantic import ValidationError

        data = run_recipe.model_dump(mode="json", exclude={"extends"})
        data["training"]["steps"] = max_steps
        try:
            run_recipe = Recipe.model_validate(data)
        except ValidationError as exc:  # past the schema's bound on training.steps (one line, exit 2)
            raise RecipeError(
                "--max-steps", "training.steps", exc.errors()[0]["msg"].removeprefix("Value error, ")
            ) from None
    keep = (
        keep_alive
        if keep_alive is not None
        else (
            max(request.WARM_POOL_SECONDS, deployed_recipe.compute.keep_alive_seconds)
            if max_steps is not None
            else deployed_recipe.compute.keep_alive_seconds
        )
    )
    if name is not None and (problem := naming.run_id_problem(name)) is not None:
        raise TrainstackError(f"--name: {problem}")
    run_id = name or naming.default_run_id(run_recipe, _suffix(max_steps))
    run = naming.run_name(deployed_recipe, team, run_id)
    job = naming.job_of_run(run, 1)
    overrides = request.hyperparameter_overrides(deployed_recipe, run_recipe)
    hint = deploy_hint(_context_recipe(recipe, deployed_recipe.name, recipes_dir), team, local)
    from trainstack.tuning.trace import trace_refusal

    refusal = trace_refusal(run_recipe)  # its cached trace (plan --trace, tune) did not fit: as the planner's
    if refusal is not None:
        raise TrainstackError(refusal)

    if dry_run:
        _dry_run(deployed_recipe, run_recipe, team, run, run_id, job, keep, local, hint, as_json)
        return

    from botocore.exceptions import BotoCoreError, ClientError

    from trainstack.aws.registry import read_run
    from trainstack.aws.session import Aws, explain

    aws = Aws(local=local)
    from trainstack.aws.base_model import check_for_launch

    # The base model is read where the job would read it (this S3, never the instance) before any job
    # exists: a recipe whose shape differs from it would fail every job of the run at step 0.
    s3 = aws.client("s3")
    # EMULATOR: the emulator trains its stand-in (no base read) whether it was named by --local or by its
    # exported AWS_* variables (docs/runs.md's commands, run as written against it)
    emulator = local or urlsplit(s3.meta.endpoint_url).hostname in ("localhost", "127.0.0.1")
    check_for_launch(run_recipe, s3, emulator)
    stacks = deployed(aws, naming.stack_prefix(deployed_recipe, team), hint)
    deployed_hash, local_hash = stacks.launcher.get("RecipeHash"), naming.recipe_hash(deployed_recipe)
    if deployed_hash != local_hash:
        raise TrainstackError(
            f"recipe {deployed_recipe.name} changed since it was deployed (deployed {deployed_hash}, "
            f"local {local_hash}): run {hint} first"
        )
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
        mlflow_run = _mlflow_run(aws, deployed_recipe, team, run, hint)
        execution_input = request.execution_input(
            run,
            run_id,
            1,
            run_recipe.training.steps,
            overrides,
            keep,
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
    answer(
        as_json,
        run=run,
        job=job,
        execution=started["executionArn"],
        lines=[
            f"launched run {run}: job {job} ({run_recipe.training.steps:,} steps, warm pool {keep}s) "
            f"in {aws.where}",
            f"execution: {started['executionArn']}",
            "checkpoints: "
            + request.checkpoint_uri(stacks.data["BucketName"], deployed_recipe, team, run_id),
            *([f"mlflow: {mlflow_run.url}"] if mlflow_run is not None else []),
        ],
    )
    if wait:
        try:
            _wait_for_job(aws, started["executionArn"], job, echo=_progress(as_json))
        except BotoCoreError as exc:  # ClientErrors are handled inside
            raise TrainstackError(
                f"lost contact with {aws.where} while waiting for {job}: {explain(exc)}"
            ) from None


def _context_recipe(given: str, name: str, recipes_dir: Any) -> str:
    """What `-c recipe=` must say to deploy this recipe: its name when it is one of the project's recipes
    (the CDK app reads recipes/), else the file's absolute path (`cdk deploy` runs the app from the
    project's root, and a name outside recipes/ is unknown there)."""
    import shlex
    from pathlib import Path

    is_path = given.endswith((".yaml", ".yml")) or "/" in given  # the loader's rule (resolve)
    if is_path:
        return shlex.quote(str(Path(given).resolve()))
    if recipes_dir is not None:  # a name under another recipes folder: the app reads recipes/ only
        file = Path(recipes_dir) / f"{name}.yaml"
        return shlex.quote(str(file.resolve())) if file.is_file() else name
    return name


def _tuned(recipe: Any, team: str | None, local: bool) -> Any:
    """The recipe with the layout its newest tuning run chose (on the emulator's CPU with --local, else
    on the recipe's GPU): a CPU choice never becomes a GPU run's layout."""
    from trainstack.tuning.candidates import apply
    from trainstack.tuning.store import Store

    store = Store()
    result = store.latest_result(recipe.name, team)
    wanted_gpu = "cpu" if local else recipe.instance.gpu.name
    if result is None or result["hardware"]["gpu"] != wanted_gpu or result.get("overrides") is None:
        raise TrainstackError(
            f"--tuned: no tuning result for {recipe.name}"
            + (f" (team {team})" if team else "")
            + f" on {wanted_gpu} in {store.path}: run `trainstack tune {recipe.name}"
            + (f" --team {team}" if team else "")
            + (" --local" if local else "")
            + "` first"
        )
    typer.echo(
        f"tuned: the layout of tuning run {result['run']} ({result['date']}): "
        + (" ".join(f"--set {o}" for o in result["overrides"]) or "the recipe's own"),
        err=True,
    )
    return apply(recipe, tuple(result["overrides"]), "--tuned")


def _mlflow_run(aws: Any, recipe: Any, team: str | None, run: str, hint: str) -> Any:
    """The new run's MLflow run when the recipe tracks in MLflow (trainstack.cli.commands.mlflow_access)."""
    from trainstack.cli.commands import mlflow_access

    try:
        uri = mlflow_access.tracking_uri(aws, recipe, team, hint)
    except TrainstackError as error:  # tracking never stops a launch
        typer.echo(f"warning: {error}; the run's first job creates its MLflow run", err=True)
        return None
    return mlflow_access.create_for_launch(uri, recipe, team, run) if uri else None


def _progress(as_json: bool):
    """Progress lines: on stdout for a person, on stderr when stdout carries JSON."""
    return (lambda line: typer.echo(line, err=True)) if as_json else typer.echo


def _dry_run(
    deployed_recipe: Any,
    run_recipe: Any,
    team: str | None,
    run: str,
    run_id: str,
    job: str,
    keep: int,
    local: bool,
    hint: str,
    as_json: bool,
) -> None:
    """The first job's request, from the deployed stacks where they can be read, else with placeholders."""
    from botocore.exceptions import BotoCoreError, ClientError

    from trainstack.aws import request
    from trainstack.aws.session import Aws, explain
    from trainstack.recipes import naming

    prefix = naming.stack_prefix(deployed_recipe, team)
    values: dict[str, str] = {}
    region: str | None = None
    why = ""
    try:
        aws = Aws(local=local)
        region = aws.region
        stacks = deployed(aws, prefix, hint)
        values = {
            "role_arn": stacks.launcher["ExecutionRoleArn"],
            "bucket_name": stacks.data["BucketName"],
            "kms_key_arn": stacks.data["KeyArn"],
            "image_uri": _deployed_image(aws, stacks.start_job),
        }
        if deployed_recipe.tracking.managed:  # the team's MLflow App (stack Trainstack-<team>-Tracking)
            from trainstack.cli.commands.mlflow_access import tracking_uri

            try:
                values["mlflow_arn"] = tracking_uri(aws, deployed_recipe, team, hint, resource=True) or ""
            except TrainstackError as error:  # the team's tracking stack is not deployed (yet)
                values["mlflow_arn"] = PLACEHOLDER.format(f"the team's MLflow App ARN: {error}")
        if stacks.launcher.get("RecipeHash") != naming.recipe_hash(deployed_recipe):
            typer.echo(
                f"note: recipe {deployed_recipe.name} changed since it was deployed; `launch` would refuse "
                f"it until {hint}",
                err=True,
            )
    except TrainstackError as error:
        why = str(error)
    except (ClientError, BotoCoreError) as error:
        why = f"could not read the deployed stacks: {explain(error)}"
    placeholders = {}
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
        keep_alive_seconds=keep,
        region=region,
        previous_job_end="",
        **values,
    )
    # The job limit is fixed when the stack is deployed, by the deployed recipe's plan.
    body["StoppingCondition"] = request.stopping_condition(deployed_recipe)
    if placeholders:
        note = f"note: {', '.join(sorted(placeholders))} are placeholders (marked <placeholder: ...>): {why}"
        print(" ".join(note.split()), file=sys.stderr)
    from trainstack.planner.input_mode import input_plan

    inputs = input_plan(run_recipe)
    print(f"data input: {inputs.summary()}", file=sys.stderr)  # which input mode, and why
    if as_json:
        choice = {"mode": inputs.mode, "reason": inputs.reason}
        typer.echo(
            json.dumps({"request": body, "placeholders": sorted(placeholders), "input": choice}, indent=2)
        )
    else:
        typer.echo(json.dumps(body, indent=2))


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
    return definition["States"]["BuildRequest"]["Parameters"]["AlgorithmSpecification"]["TrainingImage"]


class _StillCreating(TrainstackError):
    """--wait ran out before the job existed; the launch itself started (exit 1, not 2)."""

    exit_code = 1


def _wait_for_job(aws, execution_arn: str, job_name: str, timeout_s: float = 120.0, echo=typer.echo) -> None:
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
            return
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
    raise _StillCreating(
        f"the launch started but no training job {job_name} exists after {timeout_s:.0f} s (the supervisor "
        f"retries while capacity or quota is short); follow it with `trainstack runs` or execution "
        f"{execution_arn}"
    )
