"""Stopping, resuming and exporting a run, below the command line (moved from trainstack/cli/commands/
stop_resume.py and export.py so trainstack.api can compose them). Each returns what it did: the job
it acts on, the Step Functions execution it started or stopped, and the lines a person is shown;
nothing here prints.

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
deployed since), with a fresh allowance of compute.max_jobs jobs and of capacity wait. Changes (`--set`)
are what trainstack.recipes.changes lets change mid-run (refused otherwise, before AWS is asked
anything); a `from_step` restarts from the complete checkpoint of that step. Both go into the run's
history.

export: the deployment's Export state machine (stacks/export.py) creates the export job (one CPU
instance sized from the model: trainstack.planner.models_io) and records it in the run registry. The
folder lands in s3://<bucket>/exports/<team>/<recipe>/<run id>/step-N/.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from trainstack.errors import RecipeError, TrainstackError

RUNNING_JOB = ("InProgress", "Stopping")
ENDED_JOB = ("Completed", "Failed", "Stopped")


@dataclass(frozen=True)
class Acted:
    """What stop, resume or export did: the job, the execution (started, or stopped: stop's), the lines
    for a person."""

    run: str
    job: str | None
    execution: str | None
    lines: tuple[str, ...]
    output: str | None = None  # export: the folder its job writes


class NotConfirmed(TrainstackError):
    """A resume from an earlier step that discards checkpoints was not confirmed (exit 1, nothing done)."""

    exit_code = 1


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


def stop_run(aws: Any, run: str) -> Acted:
    """Stop run `run` at any moment (see the module's docstring); one-line errors when it is unknown or
    not running, or AWS refuses."""
    from botocore.exceptions import BotoCoreError, ClientError

    from trainstack.aws.registry import NotRunning, record_stopped, request_stop
    from trainstack.aws.run_access import find_run
    from trainstack.aws.session import explain

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
    return Acted(run, job, stopped_execution, tuple(lines))


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


def check_resume_input(assignments: Sequence[str], from_step: int | None) -> None:
    """A resume's `--set` values and step, refused in one line before any AWS call: keys that may not
    change mid-run (trainstack.aws.run_request.safe_set_keys), image keys no job would see, a step below 0."""
    from trainstack.aws import run_request

    run_request.safe_set_keys(list(assignments))
    image_problem(list(assignments))
    run_request.resume_step_environment(from_step)


def resume_run(
    aws: Any,
    run: str,
    assignments: Sequence[str] = (),
    from_step: int | None = None,
    confirm: Callable[[str], bool] | None = None,
) -> Acted:
    """Start job n+1 of the stopped or failed run `run` (see the module's docstring). A `from_step`
    discards the checkpoints after it: `confirm` is asked with the warning and must answer True (None:
    confirmed), else NotConfirmed (exit 1) and nothing is started. Call check_resume_input first: its
    refusals need no AWS."""
    from botocore.exceptions import BotoCoreError, ClientError

    from trainstack.aws import request, run_request
    from trainstack.aws.checkpoints import step_problem
    from trainstack.aws.registry import history_with, resume_refusal
    from trainstack.aws.run_access import caller, execution_name, find_run, registration_won, winner_line
    from trainstack.aws.session import explain
    from trainstack.recipes import changes as recipe_changes
    from trainstack.recipes import naming

    assignments = list(assignments)
    job_environment = run_request.resume_step_environment(from_step)
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
        if confirm is not None and not confirm(warning + ". Continue?"):
            raise NotConfirmed(f"{warning}: not confirmed, nothing was started")
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
    return Acted(run, job, started["executionArn"], tuple(lines))


def export_run(aws: Any, run: str, step: int | None = None) -> Acted:
    """Start the export of run `run`'s checkpoint of `step` (default: its newest complete one) as a
    Hugging Face folder in S3; refused in one line before any job starts (see refuse_a_running_export
    and exportable_step), and when the run has used its exports or its stack has no Export machine."""
    from botocore.exceptions import BotoCoreError, ClientError

    from trainstack.aws.export_job import EXPORTS_PER_RUN, export_input, export_job_name
    from trainstack.aws.run_access import find_run, team_option
    from trainstack.aws.run_request import recipe_of
    from trainstack.aws.session import explain
    from trainstack.planner.models_io import plan_export
    from trainstack.recipes.loader import resolve
    from trainstack.recipes.naming import parse_run_name

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
        refuse_a_running_export(aws, run, record, machine)
        step = exportable_step(aws.client("s3"), run, record.checkpoint_uri, step)
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
    folder = f"{record.checkpoint_uri.replace('/checkpoints/', '/exports/', 1)}step-{step}/"
    size = (
        f"{planned.instance_type} ({planned.memory_gib:.0f} GiB for a peak of about {planned.peak_gb:.0f} GB)"
    )
    lines = (
        f"exporting run {run} (step {step}) as job {job}",
        f"  {size}, about {planned.hours * 60:.0f} min, {planned.usd:.2f} USD ({planned.source})",
        f"  to {folder}",
        f"execution: {started['executionArn']}",
    )
    return Acted(run, job, started["executionArn"], lines, folder)


def _described(sagemaker: Any, job: str) -> dict[str, Any] | None:
    """DescribeTrainingJob's answer for `job`, or None while it does not exist."""
    from botocore.exceptions import BotoCoreError, ClientError

    from trainstack.aws.session import explain

    try:
        return sagemaker.describe_training_job(TrainingJobName=job)
    except ClientError as error:
        if error.response.get("Error", {}).get("Code") not in ("ValidationException", "ResourceNotFound"):
            raise TrainstackError(f"could not read export job {job}: {explain(error)}") from None
        return None
    except BotoCoreError as error:
        raise TrainstackError(f"could not read export job {job}: {explain(error)}") from None


EXPORT_POLL_S = 10.0  # an export runs minutes to hours; DescribeTrainingJob's rate limit is generous


def wait_for_export(
    aws: Any,
    execution_arn: str,
    job: str,
    timeout_s: float | None = None,
    echo: Callable[[str], None] = lambda line: None,
    poll_s: float = EXPORT_POLL_S,
) -> dict[str, Any]:
    """Follow an export until its job has ended: the Export execution until SageMaker has the job (the
    state machine creates it), then the job until Completed, Failed or Stopped; DescribeTrainingJob's
    answer for it. Each change of status or secondary status is one line to `echo`. One line when the
    execution ended without creating the job; StillRunning (exit 1) when `timeout_s` passes first (the
    export goes on, untouched)."""
    import time

    from trainstack.aws.launching import StillRunning

    sfn, sagemaker = aws.client("stepfunctions"), aws.client("sagemaker")
    started = time.monotonic()
    said = None
    while True:
        described = _described(sagemaker, job)
        if described is None:
            execution = sfn.describe_execution(executionArn=execution_arn)
            if execution["status"] != "RUNNING":
                # The execution may have created the job since it was looked for: look once more.
                described = _described(sagemaker, job)
            if described is None and execution["status"] != "RUNNING":
                cause = f"{execution.get('error', '')} {execution.get('cause', '')}".strip()
                raise TrainstackError(
                    f"export job {job} was never created: its Export execution {execution['status'].lower()}"
                    + (f" ({cause[:300]})" if cause else "")
                    + "; `trainstack runs` lists the run's exports and why one failed"
                )
        if described is None:
            note = "being created"
        else:
            note = described["TrainingJobStatus"]
            if described.get("SecondaryStatus") not in (None, "", described["TrainingJobStatus"]):
                note += f" / {described['SecondaryStatus']}"
        if note != said:
            echo(f"export job {job}: {note} ({time.monotonic() - started:.0f} s)")
            said = note
        if described is not None and described["TrainingJobStatus"] in ENDED_JOB:
            return described
        if timeout_s is not None and time.monotonic() - started >= timeout_s:
            raise StillRunning(
                f"export job {job} has not ended after {timeout_s:.0f} s ({note}); it goes on: follow it "
                "with `trainstack runs`"
            )
        time.sleep(poll_s)


EXPORT_RUNNING = ("InProgress", "Stopping")


def refuse_a_running_export(aws, run: str, record, machine: str) -> None:
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
        if status in EXPORT_RUNNING:
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


def exportable_step(s3, run: str, checkpoint_uri: str, step: int | None) -> int:
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
