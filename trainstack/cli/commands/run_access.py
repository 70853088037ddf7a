"""What `launch`, `runs`, `stop`, `resume` and `export` share on the command line: the run argument, --json,
and printing a run action's result. Finding a run's deployment and registry lives in
trainstack.aws.run_access (re-exported here for the commands that import it from this module)."""

from __future__ import annotations

from typing import Annotated, Any

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


def answer(result: Any, as_json: bool) -> None:
    """Print a run action's result (trainstack.api.runs_api.RunAction): its lines for a person, or
    `result.to_json()` ({run, job, execution}) for a script."""
    if as_json:
        typer.echo(result.to_json())
    else:
        for line in result.lines:
            typer.echo(line)
