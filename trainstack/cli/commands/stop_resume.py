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

The work is trainstack.api.stop's and trainstack.api.resume's (trainstack.aws.run_control); these commands
parse their options, call them and print their results.
"""

from __future__ import annotations

from typing import Annotated

import typer

from trainstack.cli.commands.run_access import JsonOpt, RunArg, answer
from trainstack.cli.commands.status import LocalOpt


def register(app: typer.Typer) -> None:
    app.command("stop")(stop)
    app.command("resume")(resume)


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
    from trainstack.api.runs_api import stop as stop_run

    answer(stop_run(run, local=local), as_json)


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
    from trainstack.api.runs_api import NotConfirmed
    from trainstack.api.runs_api import resume as resume_run

    try:
        result = resume_run(
            run,
            overrides=sets or (),
            from_step=from_step,
            yes=yes,
            confirm=lambda question: typer.confirm(question, err=True),
            local=local,
        )
    except NotConfirmed:  # the person said no: nothing was started, nothing more to say
        raise typer.Exit(1) from None
    answer(result, as_json)
