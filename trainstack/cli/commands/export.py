"""`trainstack export RUN [--step N]`: a run's checkpoint as a Hugging Face folder in S3 (docs/models.md).

Starts the deployment's Export state machine (stacks/export.py), which creates the export job (one CPU
instance sized from the model: trainstack.planner.models_io) and records it in the run registry, where
`trainstack runs` lists it. The folder lands in s3://<bucket>/exports/<team>/<recipe>/<run id>/step-N/.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from trainstack.cli.commands.run_access import JsonOpt, RunArg, answer, find_run, team_option
from trainstack.cli.commands.status import LocalOpt
from trainstack.errors import TrainstackError


def register(app: typer.Typer) -> None:
    app.command("export")(export)


def export(
    run: RunArg,
    step: Annotated[
        int | None,
        typer.Option("--step", min=1, help="The checkpoint to export (default: the newest complete one)."),
    ] = None,
    local: LocalOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Export RUN's checkpoint as a Hugging Face folder (safetensors, config.json, tokenizer) in S3.

    A SageMaker job on one CPU instance, sized to stream the largest tensor (not the whole model), runs
    `python -m trainer.export` from the training image. The instance, time and price it expects are printed.
    --json prints {run, job, execution}.

    Refused before any job starts (one line): a --step that is not a complete checkpoint of the run (the
    complete ones are listed), a run with none, and a run whose earlier export is still running (two
    exports of one run would write one folder).

    Exit status 0 when the export was started, 2 when RUN is unknown, has used its 9 exports, is refused
    as above, or AWS refuses.

    Examples:

      trainstack export ts-nlp-8b-fp8--lr-sweep-1

      trainstack export ts-platform-30b-fp8--7eca0ce4-rtpb8y7 --step 20000 --local
    """
    from botocore.exceptions import BotoCoreError, ClientError

    from trainstack.aws.export_job import EXPORTS_PER_RUN, export_input, export_job_name
    from trainstack.aws.run_request import recipe_of
    from trainstack.aws.session import Aws, explain
    from trainstack.planner.models_io import plan_export
    from trainstack.recipes.loader import resolve
    from trainstack.recipes.naming import parse_run_name

    aws = Aws(local=local)
    record, where = find_run(aws, run)
    machine = where.launcher.get("ExportStateMachineArn")
    if not machine:
        raise TrainstackError(
            f"run {run}: its launcher stack has no Export state machine: redeploy it with this version"
        )
    index = len(record.exports) + 1
    if index > EXPORTS_PER_RUN:
        raise TrainstackError(
            f"run {run} has {len(record.exports)} exports, the most a run has (job names -X1 to -X9)"
        )
    # The recipe the run trains is the one its request records (a recipe file's run, `make demo`'s
    # demo-tiny, has no name in recipes/); a record from before requests were kept is resolved by name,
    # as it was deployed (the default team has no team files: without --team).
    if record.request:
        recipe = recipe_of(record.request)
    else:
        name = parse_run_name(run)
        recipe = resolve(name.recipe, team_option(name.team)).recipe
    planned = plan_export(recipe)
    try:
        # Both before the export job exists, which fails on a missing checkpoint only after its instance
        # is paid for, and writes into the folder of a step another export may be writing.
        _refuse_a_running_export(aws, run, record, machine)
        step = _exportable_step(aws.client("s3"), run, record.checkpoint_uri, step)
    except (ClientError, BotoCoreError) as error:
        raise TrainstackError(
            f"could not read run {run}'s exports in {aws.where}: {explain(error)}"
        ) from None
    try:
        started = aws.client("stepfunctions").start_execution(
            stateMachineArn=machine,
            name=f"{run}-X{index}",
            input=json.dumps(export_input(run, record.run_id, step, "cli")),
        )
    except (ClientError, BotoCoreError) as error:
        raise TrainstackError(
            f"could not start the export of run {run} in {aws.where}: {explain(error)}"
        ) from None
    job = export_job_name(run, index)
    which = f"step {step}"
    size = (
        f"{planned.instance_type} ({planned.memory_gib:.0f} GiB for a peak of about {planned.peak_gb:.0f} GB)"
    )
    answer(
        as_json,
        run=run,
        job=job,
        execution=started["executionArn"],
        lines=[
            f"exporting run {run} ({which}) as job {job}",
            f"  {size}, about {planned.hours * 60:.0f} min, {planned.usd:.2f} USD ({planned.source})",
            f"  to {record.checkpoint_uri.replace('/checkpoints/', '/exports/', 1)}step-{step}/",
            f"execution: {started['executionArn']}",
        ],
    )


RUNNING = ("InProgress", "Stopping")


def _refuse_a_running_export(aws, run: str, record, machine: str) -> None:
    """One export of a run at a time: an earlier one whose job is still running, or whose start is still
    creating its job (an Export execution of the run, RUNNING), refuses this one in one line."""
    from botocore.exceptions import ClientError

    sagemaker = aws.client("sagemaker")
    for earlier in reversed(record.exports):
        job = earlier.get("job")
        if not job:
            continue
        try:
            status = sagemaker.describe_training_job(TrainingJobName=job)["TrainingJobStatus"]
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") in ("ValidationException", "ResourceNotFound"):
                continue  # recorded, never created (its refusal is in export_failures)
            raise
        if status in RUNNING:
            raise TrainstackError(
                f"run {run}: export job {job} is still running ({status}); wait for it to end (`trainstack "
                f"logs {record.recipe} --job {job}`) before exporting again: two exports of one run "
                "would write one folder"
            )
    paginator = aws.client("stepfunctions").get_paginator("list_executions")
    for page in paginator.paginate(stateMachineArn=machine, statusFilter="RUNNING"):
        for execution in page.get("executions", []):
            if execution["name"].startswith(f"{run}-X"):
                raise TrainstackError(
                    f"run {run}: export {execution['name']} is still starting its job; wait for it to end "
                    "before exporting again: two exports of one run would write one folder"
                )


def _exportable_step(s3, run: str, checkpoint_uri: str, step: int | None) -> int:
    """The step to export: --step when it is a complete checkpoint of the run, else the newest complete
    one; TrainstackError (one line, listing the complete ones) when there is none to export."""
    from trainstack.aws.checkpoints import S3Location, list_checkpoints
    from trainstack.protocol.checkpoint_format import COMPLETE

    views = list_checkpoints(S3Location(s3, checkpoint_uri))
    complete = [v.step for v in views if v.state == COMPLETE]
    listed = (
        f"complete checkpoints: {', '.join(str(s) for s in complete[:10])}"
        + (f" and {len(complete) - 10} older" if len(complete) > 10 else "")
        if complete
        else "it has no complete checkpoint"
    )
    if step is None:
        if not complete:
            raise TrainstackError(f"run {run}: nothing to export: {listed} under {checkpoint_uri}")
        return complete[0]
    found = next((v for v in views if v.step == step), None)
    if found is None:
        raise TrainstackError(f"run {run}: --step {step}: no checkpoint of step {step}; {listed}")
    if found.state != COMPLETE:
        raise TrainstackError(f"run {run}: --step {step}: {found.state} ({found.problem}); {listed}")
    return step
