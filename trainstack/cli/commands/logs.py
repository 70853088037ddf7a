"""`trainstack logs RECIPE [--team T] [--job NAME] [--follow] [--local]`: a run's CloudWatch logs.

SageMaker writes each host's stdout and stderr to log group /aws/sagemaker/TrainingJobs, one stream per
host named `<job>/algo-<n>-<epoch>`. This prints the newest run's streams (or `--job`'s), each line
prefixed by its host when there are several; `--follow` keeps reading until the job ends or Ctrl-C.
"""

from __future__ import annotations

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
    from trainstack import api

    def stderr(line: str) -> None:
        typer.echo(line, err=True)

    try:
        found = api.logs(
            recipe,
            team=team,
            overrides=set_ or (),
            job=job,
            follow=follow,
            interval=interval,
            local=local,
            recipes_dir=recipes_dir,
            on_line=typer.echo,
            on_progress=stderr,
        )
    except KeyboardInterrupt:  # Ctrl-C while following: stop quietly
        return
    if found.no_run is not None:
        typer.echo(found.no_run)
