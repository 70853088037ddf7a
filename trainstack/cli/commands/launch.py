"""`trainstack launch RECIPE [--team T] [--name NAME] [--max-steps N] [--local]`: start a run.

A run is one recipe's token budget trained to the end by as many SageMaker jobs as it takes
(docs/runs.md). `launch` starts the deployed run supervisor's StartJob state machine (stack
`<prefix>-Launcher`) for job 1 of a new run; the supervisor starts the next jobs itself. The run is
named `ts-<team>-<recipe>--<run id>` (the id is --name, or the run's recipe hash and the launch time),
its jobs `<run>-1`, `<run>-2`, ..., and all of them checkpoint under `checkpoints/<team>/<recipe>/<run id>/`.
A short tuning run is the same recipe with `training.steps` overridden (--max-steps), on a warm pool
so the next try skips provisioning.

The work is trainstack.api.launch's (starting and following the run: trainstack.aws.launching); this
command parses its options, calls it and prints its result.
"""

from __future__ import annotations

from typing import Annotated

import typer

from trainstack.cli.commands.plan_options import RecipeArg, RecipesDirOpt, TeamOpt
from trainstack.cli.commands.run_access import JsonOpt, answer
from trainstack.cli.commands.status import LocalOpt


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
    from trainstack.api.runs_api import launch as start
    from trainstack.api.runs_api import wait_for_job

    result = start(
        recipe,
        team=team,
        local=local,
        name=name,
        max_steps=max_steps,
        keep_alive=keep_alive,
        tuned=tuned,
        dry_run=dry_run,
        recipes_dir=recipes_dir,
        on_warning=lambda line: typer.echo(line, err=True),
    )
    if dry_run:
        typer.echo(result.to_json() if as_json else result.request_json())
        return
    answer(result, as_json)
    if wait:
        progress = (lambda line: typer.echo(line, err=True)) if as_json else typer.echo  # stdout carries JSON
        wait_for_job(result, local=local, on_progress=progress)
