"""What `launch`, `runs`, `stop` and `resume` share: finding a run's deployment and registry, one-line
errors for a run that does not exist, and the `{run, job, execution}` answer of --json."""

from __future__ import annotations

import json
from typing import Annotated

import typer

# What the commands share below the command line lives in trainstack.aws.run_access (the API uses it
# too); these names stay importable from here.
from trainstack.aws.run_access import (  # noqa: F401
    CREATED_AT,
    HISTORY_PAGE_MAX,
    LOST_AT,
    Deployed,
    caller,
    deploy_hint,
    deployed,
    execution_name,
    find_run,
    registration_won,
    team_option,
    winner_line,
)
from trainstack.aws.run_access import Undecided as _Undecided  # noqa: F401

JsonOpt = Annotated[bool, typer.Option("--json", help="Print {run, job, execution} as JSON.")]
RunArg = Annotated[
    str,
    typer.Argument(
        help="The run's name as `trainstack runs` lists it: ts-<team>-<recipe>--<run id>.",
        show_default=False,
    ),
]


def answer(as_json: bool, *, run: str, job: str | None, execution: str | None, lines: list[str]) -> None:
    """Print the command's result: the lines for a person, or {run, job, execution} for a script."""
    if as_json:
        typer.echo(json.dumps({"run": run, "job": job, "execution": execution}))
    else:
        for line in lines:
            typer.echo(line)
