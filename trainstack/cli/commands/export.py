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

    Exit status 0 when the export was started, 2 when RUN is unknown, has used its 9 exports, or AWS refuses.

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
    which = f"step {step}" if step else "its newest complete checkpoint"
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
            f"  to {record.checkpoint_uri.replace('/checkpoints/', '/exports/', 1)}step-N/",
            f"execution: {started['executionArn']}",
        ],
    )
