"""`trainstack stop RUN` and `trainstack resume RUN [--set key=value ...] [--from-step N]`.

stop: safe at any moment. The run's record asks the supervisor to end the run (a conditional write:
only a running run); then, by what SageMaker says of the current job:
- training: StopTrainingJob (SIGTERM, the trainer saves) and its warm pool released; the supervisor
  records the run stopped when the job has ended;
- already ended, its end not decided yet: nothing is overwritten; the supervisor decides that end
  (a job that completed or failed on its own keeps that end; any other stops the run);
- not created yet (a capacity wait, a creation in flight): the execution creating it is stopped, and
  the run is marked stopped by a write conditional on nothing having moved on; a job created at the
  last moment is stopped by its creator's own stop check, or by the reconciler.

resume: job n+1 of a stopped or failed run, from the request the run recorded at launch (never the one
deployed since), with a fresh allowance of compute.max_jobs jobs and of capacity wait. `--set` changes
what trainstack.recipes.changes lets change mid-run (refused otherwise, before AWS is asked anything);
`--from-step N` restarts from the complete checkpoint of step N. Both go into the run's history.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated, Any

import typer

from trainstack.cli.commands.run_access import (
    JsonOpt,
    RunArg,
    answer,
    caller,
    execution_name,
    find_run,
    registration_won,
    winner_line,
)
from trainstack.cli.commands.status import LocalOpt
from trainstack.errors import RecipeError, TrainstackError

RUNNING_JOB = ("InProgress", "Stopping")
ENDED_JOB = ("Completed", "Failed", "Stopped")


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


def release_warm_pool(sagemaker: Any, described: dict[str, Any]) -> bool:
    """End the job's warm pool (UpdateTrainingJob ResourceConfig.KeepAlivePeriodInSeconds=0, SageMaker
    API reference) so a stopped run pays for no idle instances. False when it has none to end."""
    from botocore.exceptions import ClientError

    if not described.get("ResourceConfig", {}).get("KeepAlivePeriodInSeconds"):
        return False
    if described.get("WarmPoolStatus", {}).get("Status") in ("Terminated", "Reused"):
        return False
    try:
        sagemaker.update_training_job(
            TrainingJobName=described["TrainingJobName"], ResourceConfig={"KeepAlivePeriodInSeconds": 0}
        )
    except ClientError as error:
        if error.response.get("Error", {}).get("Code") in ("ValidationException", "ResourceNotFound"):
            return False
        raise
    return True


def _stop_job(sagemaker: Any, described: dict[str, Any]) -> list[str]:
    """Stop a job that still trains and release its warm pool; what was done, in words."""
    done = []
    if described["TrainingJobStatus"] == "InProgress" and described.get("SecondaryStatus") != "Stopping":
        sagemaker.stop_training_job(TrainingJobName=described["TrainingJobName"])
        done.append("stopping (SIGTERM, then the trainer saves its checkpoint)")
    else:
        done.append("already stopping")
    if release_warm_pool(sagemaker, described):
        done.append("its warm pool released")
    return done


def stop(run: RunArg, local: LocalOpt = False, as_json: JsonOpt = False) -> None:
    """Stop RUN at any moment: its current job is stopped (SageMaker sends SIGTERM, the trainer saves)
    and its warm pool released; an end already recorded, or a job that has already ended, is never
    overwritten; a job still being created is not created.

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
    stopped_execution = None
    try:
        try:
            record = request_stop(dynamodb, where.table, run)
        except NotRunning:
            raise TrainstackError(
                f"run {run} is not running ({record.state}: {record.why}): nothing to stop"
            ) from None
        job = record.current_job
        described = _job(sagemaker, job)
        if described is None and record.creator:
            # Not created yet (the supervisor may be waiting for capacity): end the execution creating it.
            sfn = aws.client("stepfunctions")
            try:
                execution = sfn.describe_execution(executionArn=record.creator)
            except ClientError:
                execution = {"status": "GONE"}
            if execution["status"] == "RUNNING":
                sfn.stop_execution(
                    executionArn=record.creator, error="StoppedByUser", cause=f"trainstack stop {run}"
                )
                stopped_execution = record.creator
            described = _job(sagemaker, job)  # it may have been created meanwhile
        if described is not None and described["TrainingJobStatus"] in RUNNING_JOB:
            lines = [
                f"stopping run {run}: job {job} is {', '.join(_stop_job(sagemaker, described))}; the "
                "supervisor records the run stopped when the job has ended",
                f"continue it later with `trainstack resume {run}`",
            ]
        elif described is not None:
            # Ended, its end not decided yet: the supervisor decides it (never overwritten here).
            released = release_warm_pool(sagemaker, described)
            status = f"{described['TrainingJobStatus']} ({described.get('SecondaryStatus', '')})"
            lines = [
                f"stop requested for run {run}: job {job} has already ended {status}; the supervisor "
                "records that end (a job that completed, or failed in a way the next job would repeat, "
                "keeps it; any other end stops the run)" + ("; its warm pool released" if released else ""),
                f"see `trainstack runs {record.recipe}`; resume a stopped run with `trainstack resume {run}`",
            ]
        else:
            recorded = record_stopped(
                dynamodb,
                where.table,
                record,
                f"it was stopped by trainstack stop before job {job} was created",
                f"nothing until it is resumed: trainstack resume {run}",
            )
            late = _job(sagemaker, job)  # created at the very last moment: nobody would watch it
            if late is not None and late["TrainingJobStatus"] in RUNNING_JOB:
                _stop_job(sagemaker, late)
            lines = [
                f"stopped run {run} (job {job} was not created)"
                if recorded
                else f"stop requested for run {run}: it changed meanwhile (see `trainstack runs`)",
                f"continue it with `trainstack resume {run}`",
            ]
    except (ClientError, BotoCoreError) as error:
        raise TrainstackError(f"could not stop run {run} in {aws.where}: {explain(error)}") from None
    answer(as_json, run=run, job=job, execution=stopped_execution, lines=lines)


def _resume_point(aws: Any, run: str, checkpoint_uri: str) -> int:
    """The step the run's next job starts at: its newest complete checkpoint (0 when it has none)."""
    from botocore.exceptions import BotoCoreError, ClientError

    from trainstack.aws.checkpoints import S3Location, list_checkpoints, resumable
    from trainstack.aws.session import explain

    try:
        newest = resumable(list_checkpoints(S3Location(aws.client("s3"), checkpoint_uri)))
    except (ClientError, BotoCoreError) as error:
        raise TrainstackError(f"could not read the checkpoints of {run}: {explain(error)}") from None
    return newest.step if newest is not None else 0


def image_problem(assignments: list[str]) -> None:
    """`--set image.*`, refused in one line before anything is read: image.uri is the image every later
    job of the run runs (the request's TrainingImage: trainstack.aws.run_request.changed_request), and
    must name one; the other image keys say how `cdk deploy` builds an image, which no running run
    sees."""
    for assignment in assignments:
        key, _, value = (part.strip() for part in assignment.partition("="))
        if key.startswith("image.") and key != "image.uri":
            raise RecipeError(
                f"--set {assignment}",
                key,
                "an image is built when a recipe is deployed, never for a running run: give the built "
                "image with --set image.uri=<image>",
            )
        if key == "image.uri" and value.strip("'\"") in ("", "null", "~"):
            raise RecipeError(f"--set {assignment}", key, "give the image the next job runs")


def resume(
    run: RunArg,
    sets: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="Change the run's recipe on resume: key.path=value, repeatable; only what may change "
            "between two jobs of a run (learning rate and schedule, clipping, checkpoint interval and keep, "
            "instance count where the shard group allows, ...). Recorded in the run's history.",
        ),
    ] = None,
    from_step: Annotated[
        int | None,
        typer.Option(
            "--from-step",
            min=0,
            help="Restart from the complete checkpoint of this step (e.g. the one before a NaN), with the "
            "data position it recorded; checkpoints after it are discarded.",
        ),
    ] = None,
    yes: Annotated[
        bool, typer.Option("--yes", "-y", help="Do not ask before discarding checkpoints.")
    ] = False,
    local: LocalOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Continue a stopped or failed RUN with its next job, from the run's newest checkpoint (or from
    --from-step N), with the recipe the run recorded at launch and the changes given with --set.

    The job is `<RUN>-<n+1>`, created by the deployed supervisor from the run's recorded request (never
    from a recipe deployed since); the run gets compute.max_jobs more jobs and its capacity wait budget
    again. --json prints {run, job, execution}.

    Exit status 0 when the next job was started, 1 when a --from-step was not confirmed, 2 when RUN is
    unknown, running or completed (also when a concurrent resume won: the line names it and its
    changes), a --set key may not change mid-run or its value is invalid, the
    checkpoint of --from-step is not complete, or AWS refuses.

    Examples:

      trainstack resume ts-nlp-8b-fp8--lr-sweep-1

      trainstack resume ts-nlp-8b-fp8--main --set training.lr=1e-4 --from-step 1200
    """
    from botocore.exceptions import BotoCoreError, ClientError

    from trainstack.aws import request, run_request
    from trainstack.aws.checkpoints import step_problem
    from trainstack.aws.registry import history_with, resume_refusal
    from trainstack.aws.session import Aws, explain
    from trainstack.recipes import changes as recipe_changes
    from trainstack.recipes import naming

    assignments = list(sets or [])
    run_request.safe_set_keys(assignments)  # one line, exit 2, before any AWS call
    image_problem(assignments)
    job_environment = run_request.resume_step_environment(from_step)

    aws = Aws(local=local)
    record, where = find_run(aws, run)
    if record.state not in ("stopped", "failed"):
        # A stop asked of a run that then completed (its job finished first) stops nothing: only a
        # running run is still stopping.
        still_stopping = record.state == "running" and record.stop_requested
        hint = " (still stopping: wait for its job to end)" if still_stopping else ""
        last = record.history[-1] if record.history else None
        since = f"; its last change: {last.what} by {last.who} at {last.at}" if last else ""
        raise TrainstackError(
            f"run {run} is {record.state}{hint}: only a stopped or failed run can be resumed{since}"
        )
    if not record.request:
        raise TrainstackError(
            f"run {run} has no recorded request (it was launched before runs recorded theirs): launch a "
            "new run of its recipe"
        )
    before = run_request.recipe_of(record.request)
    after = run_request.apply_sets(before, assignments) if assignments else before
    found = recipe_changes.changes(before, after)
    if (refusal := resume_refusal(record, bool(found))) is not None:
        raise TrainstackError(refusal)
    if {c.key for c in found} & {"training.steps", "training.warmup_steps"}:
        start = from_step if from_step is not None else _resume_point(aws, run, record.checkpoint_uri)
        if (problem := recipe_changes.resume_problem(before, after, start)) is not None:
            key, why = problem
            keys = (key, "training.steps", "training.warmup_steps")  # the one judged, else what moved it
            label = next((a for k in keys for a in assignments if a.partition("=")[0].strip() == k), None)
            raise RecipeError(f"--set {label}" if label else "--set", key, why)
    changed = (
        run_request.changed_request(record.request, before, after, record.team) if found else record.request
    )
    index = record.job_index + 1
    if index > naming.JOB_INDEX_MAX:
        raise TrainstackError(f"run {run} has named all {naming.JOB_INDEX_MAX} jobs a run has room for")
    job = naming.job_of_run(run, index)
    if from_step is not None:
        try:
            problem = step_problem(aws.client("s3"), record.checkpoint_uri, from_step)
        except (ClientError, BotoCoreError) as error:
            raise TrainstackError(f"could not read the checkpoints of {run}: {explain(error)}") from None
        if problem is not None:
            raise TrainstackError(f"--from-step {from_step}: {problem}")
        warning = (
            f"resuming {run} from step {from_step}: its checkpoints after step {from_step} are discarded "
            "when the job starts, and the steps after it are trained again"
        )
        if not yes and not typer.confirm(warning + ". Continue?", err=True):
            raise typer.Exit(1)
    what = ["resume"]
    if found:
        what.append("changed " + run_request.describe_changes(found))
    if from_step is not None:
        what.append(f"from step {from_step} (later checkpoints discarded)")
    execution_input = request.execution_input(
        run,
        record.run_id,
        index,
        after.training.steps,
        record.overrides,
        int(changed.get("ResourceConfig", {}).get("KeepAlivePeriodInSeconds", record.keep_alive)),
        "resume",
        request=changed,
        job_environment={
            **job_environment,
            # What the trainer tags the MLflow run with (trainstack.aws.tracking: Environment values <= 512).
            request.PREVIOUS_JOB_END_ENV: f"resumed after the run {record.state}: {record.why}"[:512],
        },
        limits=request.run_limits(after),
        history=history_with(record, datetime.now(UTC).isoformat(), caller(aws), "; ".join(what)),
    )
    try:
        started = aws.client("stepfunctions").start_execution(
            stateMachineArn=where.start_job, name=execution_name(job), input=json.dumps(execution_input)
        )
        # Two resumes read the same stopped run: the registry lets one register job n+1; the other
        # exits 2 naming the resume that won and its changes.
        if not registration_won(aws, started["executionArn"], "resume"):
            from trainstack.aws.registry import read_run

            winner = read_run(aws.client("dynamodb"), where.table, run) or record
            raise TrainstackError(winner_line(winner, "resume", "; ".join(what)))
    except (ClientError, BotoCoreError) as error:
        raise TrainstackError(f"could not resume run {run} in {aws.where}: {explain(error)}") from None
    deployed_hash = where.launcher.get("RecipeHash")
    lines = [
        f"resuming run {run} ({record.state}: {record.why}): job {job} resumes from "
        f"{record.checkpoint_uri}" + (f" at step {from_step}" if from_step is not None else ""),
        f"execution: {started['executionArn']}",
    ]
    if found:
        lines.append("changes: " + run_request.describe_changes(found))
    if record.recipe_hash and deployed_hash and deployed_hash != record.recipe_hash:
        lines.append(
            f"note: the deployed recipe ({deployed_hash}) differs from the one this run was launched with "
            f"({record.recipe_hash}); the run keeps its own"
        )
    answer(as_json, run=run, job=job, execution=started["executionArn"], lines=lines)
