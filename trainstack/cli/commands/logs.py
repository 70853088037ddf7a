"""`trainstack logs RECIPE [--team T] [--job NAME] [--follow] [--local]`: a run's CloudWatch logs.

SageMaker writes each host's stdout and stderr to log group /aws/sagemaker/TrainingJobs, one stream per
host named `<job>/algo-<n>-<epoch>`. This prints the newest run's streams (or `--job`'s), each line
prefixed by its host when there are several; `--follow` keeps reading until the job ends or Ctrl-C.
"""

from __future__ import annotations

import time
from typing import Annotated

import typer

from trainstack.cli.commands.plan_options import RecipeArg, RecipesDirOpt, SetOpt, TeamOpt
from trainstack.cli.commands.status import LocalOpt


def register(app: typer.Typer) -> None:
    app.command("logs")(logs)


def logs(
    recipe: RecipeArg,
    team: TeamOpt = None,
    set_: SetOpt = None,
    job: Annotated[
        str | None,
        typer.Option("--job", help="A training or export job of this recipe (default: the newest job)."),
    ] = None,
    follow: Annotated[
        bool,
        typer.Option("--follow", "-f", help="Keep printing new lines until the job ends (Ctrl-C stops)."),
    ] = False,
    interval: Annotated[
        float, typer.Option("--interval", min=0.5, help="Seconds between polls with --follow.")
    ] = 5.0,
    local: LocalOpt = False,
    recipes_dir: RecipesDirOpt = None,
) -> None:
    """Print the CloudWatch logs of the newest run of RECIPE (or of --job).

    Exit status 0, or 2 when the recipe is invalid, --job is not a run of RECIPE, or AWS cannot be read.

    Examples:

      trainstack logs 30b-fp8 --follow

      trainstack logs 30b-fp8 --job ts-platform-30b-fp8--5a5591dc-rtpb8y7
    """
    from botocore.exceptions import BotoCoreError, ClientError

    from trainstack.aws.runs import (
        LogCursor,
        aws_clients,
        find_jobs,
        job_from_description,
        log_streams,
        read_new_lines,
    )
    from trainstack.aws.session import explain
    from trainstack.errors import TrainstackError
    from trainstack.recipes.loader import resolve
    from trainstack.recipes.naming import job_name_prefix

    resolved = resolve(recipe, team=team, overrides=set_ or (), recipes_dir=recipes_dir)
    prefix = job_name_prefix(resolved.recipe, team)
    clients = aws_clients(local)
    hint = f" --team {team}" if team else ""
    try:
        if job is not None:
            # A run's jobs and its exports (`<run>-X<n>`, trainstack.aws.export_job) carry the prefix.
            if not job.startswith(prefix):
                raise TrainstackError(
                    f"--job {job} is not a run of {resolved.recipe.name}{hint} nor an export of one "
                    f"(its jobs and exports are named {prefix}<run id>-...)"
                )
            target = job_from_description(clients.sagemaker.describe_training_job(TrainingJobName=job))
        else:
            jobs = find_jobs(clients.sagemaker, prefix, limit=1)
            if not jobs:
                typer.echo(
                    f"No run of {resolved.recipe.name}{hint} yet on {clients.where}: no training job named "
                    f"{prefix}<recipe hash>-... exists. Start one with "
                    f"`trainstack launch {resolved.recipe.name}{hint}`."
                )
                return
            target = jobs[0]
        typer.echo(
            f"# {target.name}: {target.status} / {target.secondary_status or '-'} "
            f"(log group /aws/sagemaker/TrainingJobs on {clients.where})",
            err=True,
        )
        cursor = LogCursor()
        printed = 0
        try:
            while True:
                streams = log_streams(clients.logs, target.name)
                several = len(streams) > 1
                for stream, _ts, message in read_new_lines(clients.logs, streams, cursor):
                    host = stream.removeprefix(f"{target.name}/").rsplit("-", 1)[0]
                    typer.echo(f"[{host}] {message}" if several else message)
                    printed += 1
                if not follow:
                    break
                target = job_from_description(
                    clients.sagemaker.describe_training_job(TrainingJobName=target.name)
                )
                if not target.running:
                    # One last read: SageMaker flushes the final lines as the job ends.
                    for _stream, _ts, message in read_new_lines(
                        clients.logs, log_streams(clients.logs, target.name), cursor
                    ):
                        typer.echo(message)
                        printed += 1
                    typer.echo(
                        f"# {target.name} ended: {target.status}"
                        + (f" ({target.failure_reason})" if target.failure_reason else ""),
                        err=True,
                    )
                    break
                time.sleep(interval)
        except KeyboardInterrupt:
            pass
        if printed == 0 and not follow:
            typer.echo(
                f"# no log lines yet for {target.name} (SageMaker creates the streams once the "
                "container starts; the local emulator runs no container, so it never has any)",
                err=True,
            )
    except (BotoCoreError, ClientError) as error:
        raise TrainstackError(f"reading logs from {clients.where} failed: {explain(error)}") from None
