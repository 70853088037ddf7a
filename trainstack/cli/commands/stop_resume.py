"""`trainstack stop RUN` and `trainstack resume RUN`: end a run's supervision, continue a run.

stop: the run's record asks the supervisor to end the run, and the current job is stopped (SageMaker
sends SIGTERM; the trainer saves its checkpoint; the supervisor records the run stopped when the job
ends). A job still being created is not created: its execution is stopped and the run marked stopped.

resume: job n+1 of a stopped or failed run starts from the run's newest checkpoint, through the same
supervisor, with the run's own overrides and a fresh allowance of compute.max_jobs jobs.
"""

from __future__ import annotations

import json
from typing import Any

import typer

from trainstack.cli.commands.run_access import JsonOpt, RunArg, answer, find_run
from trainstack.cli.commands.status import LocalOpt
from trainstack.errors import TrainstackError

RUNNING_JOB = ("InProgress", "Stopping")


def register(app: typer.Typer) -> None:
    app.command("stop")(stop)
    app.command("resume")(resume)


def _job(sagemaker: Any, name: str) -> dict[str, Any] | None:
    from botocore.exceptions import ClientError

    try:
        return sagemaker.describe_training_job(TrainingJobName=name)
    except ClientError as error:
        if error.response.get("Error", {}).get("Code") in ("ValidationException", "ResourceNotFound"):
            return None
        raise


def stop(run: RunArg, local: LocalOpt = False, as_json: JsonOpt = False) -> None:
    """Stop RUN: stop its current job (SageMaker sends SIGTERM, the trainer saves) and end its supervision.

    The run can be continued later with `trainstack resume RUN`. --json prints {run, job, execution}
    (execution: the supervisor execution stopped before it created the job, else null).

    Exit status 0 when the stop was requested, 2 when RUN is unknown or not running, or AWS refuses.

    Examples:

      trainstack stop ts-nlp-8b-fp8--lr-sweep-1

      trainstack stop ts-platform-30b-fp8--7eca0ce4-rtpb8y7 --local --json
    """
    from botocore.exceptions import BotoCoreError, ClientError

    from trainstack.aws.registry import NotRunning, record_stopped, request_stop
    from trainstack.aws.session import Aws, explain

    aws = Aws(local=local)
    record, where = find_run(aws, run)
    dynamodb, sagemaker = aws.client("dynamodb"), aws.client("sagemaker")
    try:
        try:
            record = request_stop(dynamodb, where.table, run)
        except NotRunning:
            raise TrainstackError(
                f"run {run} is not running ({record.state}: {record.why}): nothing to stop"
            ) from None
        job = record.current_job
        described = _job(sagemaker, job)
        stopped_execution = None
        if described is None and record.creator:
            # Not created yet (the supervisor may be waiting for capacity): end the execution creating it.
            execution = aws.client("stepfunctions").describe_execution(executionArn=record.creator)
            if execution["status"] == "RUNNING":
                aws.client("stepfunctions").stop_execution(
                    executionArn=record.creator, error="StoppedByUser", cause=f"trainstack stop {run}"
                )
                stopped_execution = record.creator
            described = _job(sagemaker, job)  # it may have been created meanwhile
        if described is not None and described["TrainingJobStatus"] in RUNNING_JOB:
            if described["TrainingJobStatus"] == "InProgress":
                sagemaker.stop_training_job(TrainingJobName=job)
            lines = [
                f"stopping run {run}: job {job} is stopping (SIGTERM, then the trainer saves its "
                "checkpoint); the supervisor records the run stopped when the job has ended",
                f"continue it later with `trainstack resume {run}`",
            ]
        else:
            status = described["TrainingJobStatus"] if described else "not created"
            record_stopped(
                dynamodb,
                where.table,
                record,
                f"it was stopped by trainstack stop (job {job}: {status})",
                f"nothing until it is resumed: trainstack resume {run}",
            )
            lines = [
                f"stopped run {run} (job {job}: {status})",
                f"continue it with `trainstack resume {run}`",
            ]
    except (ClientError, BotoCoreError) as error:
        raise TrainstackError(f"could not stop run {run} in {aws.where}: {explain(error)}") from None
    answer(as_json, run=run, job=job, execution=stopped_execution, lines=lines)


def resume(run: RunArg, local: LocalOpt = False, as_json: JsonOpt = False) -> None:
    """Continue a stopped or failed RUN with its next job, from the run's newest checkpoint.

    The job is `<RUN>-<n+1>`, created by the deployed supervisor with the run's own overrides and warm
    pool; the run gets compute.max_jobs more jobs. The deployed recipe must still be the one the run was
    launched with. --json prints {run, job, execution}.

    Exit status 0 when the next job was started, 2 when RUN is unknown, running or completed, its recipe
    was redeployed changed, or AWS refuses.

    Examples:

      trainstack resume ts-nlp-8b-fp8--lr-sweep-1

      trainstack resume ts-platform-30b-fp8--7eca0ce4-rtpb8y7 --local --json
    """
    from botocore.exceptions import BotoCoreError, ClientError

    from trainstack.aws import request
    from trainstack.aws.session import Aws, explain
    from trainstack.recipes import naming

    aws = Aws(local=local)
    record, where = find_run(aws, run)
    if record.state not in ("stopped", "failed"):
        hint = " (still stopping: wait for its job to end)" if record.stop_requested else ""
        raise TrainstackError(
            f"run {run} is {record.state}{hint}: only a stopped or failed run can be resumed"
        )
    deployed_hash = where.launcher.get("RecipeHash")
    if record.recipe_hash and deployed_hash != record.recipe_hash:
        raise TrainstackError(
            f"run {run} was launched with recipe {record.recipe} at hash {record.recipe_hash}, but the "
            f"deployed one is {deployed_hash}: resuming would train a different recipe on its checkpoints "
            "(deploy that recipe again, or launch a new run)"
        )
    index = record.job_index + 1
    if index > naming.JOB_INDEX_MAX:
        raise TrainstackError(
            f"run {run} has used all {naming.JOB_INDEX_MAX} job names: launch a new run (--name) instead"
        )
    job = naming.job_of_run(run, index)
    execution_input = request.execution_input(
        run,
        record.run_id,
        index,
        request.last_job(index, record.max_jobs),
        record.steps,
        record.overrides,
        record.keep_alive,
        "resume",
        # What the trainer tags the MLflow run with (trainstack.aws.tracking: Environment values <= 512).
        previous_job_end=f"resumed after the run {record.state}: {record.why}"[:512],
        mlflow_run_id=record.mlflow_run_id,
    )
    try:
        started = aws.client("stepfunctions").start_execution(
            stateMachineArn=where.start_job, name=job, input=json.dumps(execution_input)
        )
    except (ClientError, BotoCoreError) as error:
        raise TrainstackError(f"could not resume run {run} in {aws.where}: {explain(error)}") from None
    answer(
        as_json,
        run=run,
        job=job,
        execution=started["executionArn"],
        lines=[
            f"resuming run {run} ({record.state}: {record.why}): job {job} resumes from "
            f"{record.checkpoint_uri}",
            f"execution: {started['executionArn']}",
        ],
    )
