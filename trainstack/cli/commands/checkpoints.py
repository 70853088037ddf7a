"""`trainstack checkpoints RUN [--verify] [--local] [--json]`: every kept checkpoint of a run.

RUN is a run's name (resolved through its registry, as `stop` and `resume` do: the run's checkpoint
prefix), an s3:// prefix, or a local checkpoint directory. The listing and the states come from
trainstack.aws.checkpoints; the states are the trainer's own checks before it loads a checkpoint.
"""

from __future__ import annotations

import sys
from datetime import datetime
from typing import TYPE_CHECKING, Annotated

import typer

from trainstack.cli.commands.status import LocalOpt

if TYPE_CHECKING:
    from trainstack.aws.checkpoints import CheckpointView

STATE_STYLE = {"complete": "green", "incomplete": "yellow", "damaged": "bold red"}


def register(app: typer.Typer) -> None:
    app.command("checkpoints")(checkpoints)


def checkpoints(
    run: Annotated[
        str,
        typer.Argument(
            help="A run's name as `trainstack runs` lists it (ts-<team>-<recipe>--<run id>), its s3:// "
            "checkpoint prefix, or a local checkpoint directory.",
            show_default=False,
        ),
    ],
    verify: Annotated[
        bool,
        typer.Option(
            "--verify",
            help="Read every file of every complete checkpoint and compare its SHA-256 with the one "
            "recorded while it was written (reads everything: shows progress on stderr).",
        ),
    ] = False,
    local: LocalOpt = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the checkpoints as a JSON list.")] = False,
) -> None:
    """List every kept checkpoint of RUN, newest first: step, size, age and state.

    States: complete (what the trainer would resume from, newest first), incomplete (a save that never
    finished: skipped), damaged (a file missing, of another size, an inconsistent COMPLETE.json, or with
    --verify a file whose bytes changed: the file is named; skipped). Without --verify only the listing
    and the small COMPLETE.json are read; same-size damage shows with --verify (or when the trainer
    loads it). --json prints [{step, state, problem, size_bytes, files, modified, age_s, verified}].

    Exit status 0; 1 when --verify found a damaged checkpoint; 2 when RUN is unknown or AWS refuses.

    Examples:

      trainstack checkpoints ts-platform-30b-fp8--main

      trainstack checkpoints ts-platform-30b-fp8--main --verify --json

      trainstack checkpoints ./checkpoints
    """
    from trainstack import api

    def stderr(line: str) -> None:
        typer.echo(line, err=True)

    found = api.checkpoints(run, verify=verify, local=local, on_progress=stderr)
    sys.stderr.flush()
    if as_json:
        typer.echo(found.to_json())
    else:
        render(list(found.views), found.where, run, found.now, verify)
    raise typer.Exit(found.exit_code)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, scale in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= scale:
            return f"{seconds / scale:.1f} {unit}"
    return f"{seconds:.0f} s"


def render(views: list[CheckpointView], where: str, run: str, now: datetime, verified: bool) -> None:
    from rich.table import Table
    from rich.text import Text

    from trainstack.api.monitoring import size_text, state_text
    from trainstack.aws.checkpoints import resumable
    from trainstack.cli.commands.plan_options import console as make_console

    console = make_console()
    if not views:
        console.print(Text.assemble(("No checkpoints ", "bold yellow"), f"of {run} in {where}: a new run."))
        return
    title = (
        f"Checkpoints in {where}"
        if run.rstrip("/") == where.rstrip("/")
        else f"Checkpoints of {run} in {where}"
    )
    table = Table(title=f"{title}, newest first", title_justify="left")
    for column in ("step", "size", "age", "files", "state"):
        table.add_column(column, justify="right" if column in ("step", "size", "age", "files") else "left")
    for item in views:
        state = Text(state_text(item), style=STATE_STYLE.get(item.state, ""))
        table.add_row(str(item.step), size_text(item.size), _age(item.age_s(now)), str(item.files), state)
    console.print(table)
    newest = resumable(views)
    if newest is None:
        console.print(
            Text.assemble(
                ("No intact checkpoint: ", "bold red"),
                "the next job stops with exit 2 rather than start again at step 0 over these folders.",
            )
        )
    else:
        checked = "" if verified else " if its digests match (--verify reads them)"
        console.print(f"The next job resumes from step {newest.step}{checked}.")
