"""`trainstack checkpoints RUN [--verify] [--local] [--json]`: every kept checkpoint of a run.

RUN is a run's name (resolved through its registry, as `stop` and `resume` do: the run's checkpoint
prefix), an s3:// prefix, or a local checkpoint directory. The listing and the states come from
trainstack.aws.checkpoints; the states are the trainer's own checks before it loads a checkpoint.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from trainstack.cli.commands.status import LocalOpt
from trainstack.errors import TrainstackError

if TYPE_CHECKING:
    from trainstack.aws.checkpoints import CheckpointView, Location

PROGRESS_EVERY_S = 2.0
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
    from botocore.exceptions import BotoCoreError, ClientError

    from trainstack.aws.checkpoints import list_checkpoints
    from trainstack.aws.session import explain

    location = open_location(run, local)
    try:
        views = list_checkpoints(location)
        if verify and views:
            views = verify_all(location, views)
    except (ClientError, BotoCoreError) as error:
        raise TrainstackError(f"could not read checkpoints in {location.where}: {explain(error)}") from None
    now = datetime.now(UTC)
    if as_json:
        typer.echo(json.dumps([v.as_dict(now) for v in views], indent=2))
    else:
        render(views, location.where, run, now, verify)
    if verify and any(v.state == "damaged" for v in views):
        raise typer.Exit(1)


def open_location(run: str, local: bool) -> Location:
    """RUN as a place to list: a local directory, an s3:// prefix, or a run's own checkpoint prefix."""
    from trainstack.aws.checkpoints import LocalLocation, S3Location

    if not run.startswith("s3://") and ("/" in run or Path(run).is_dir()):
        if not Path(run).is_dir():
            raise TrainstackError(f"{run}: no such checkpoint directory")
        return LocalLocation(Path(run))
    from trainstack.aws.session import Aws

    aws = Aws(local=local)
    if run.startswith("s3://"):
        return S3Location(aws.client("s3"), run)
    from trainstack.cli.commands.run_access import find_run

    record, _ = find_run(aws, run)
    return S3Location(aws.client("s3"), record.checkpoint_uri)


def verify_all(location: Location, views: list[CheckpointView]) -> list[CheckpointView]:
    from trainstack.aws.checkpoints import verify

    todo = [v for v in views if v.state == "complete"]
    total = sum(v.inspection.size for v in todo if v.inspection is not None)
    done, last = 0, 0.0
    typer.echo(f"verifying {len(todo)} checkpoint(s), {_size(total)}: reading every byte", err=True)

    def progress(name: str, count: int) -> None:
        nonlocal done, last
        done += count
        if time.monotonic() - last >= PROGRESS_EVERY_S or done == total:
            last = time.monotonic()
            typer.echo(f"  {_size(done)} of {_size(total)} read ({name})", err=True)

    checked = []
    for item in views:
        result = verify(location, item, progress) if item.state == "complete" else item
        if item.state == "complete":
            typer.echo(f"  {_folder(item.step)}: {_state(result)}", err=True)
        checked.append(result)
    sys.stderr.flush()
    return checked


def _folder(step: int) -> str:
    from trainstack.protocol.checkpoint_format import step_dir_name

    return step_dir_name(step)


def _state(item: CheckpointView) -> str:
    if item.state == "complete":
        return "complete, verified" if item.verified else "complete"
    return f"{item.state}: {item.problem}"


def _size(count: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"


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
        state = Text(_state(item), style=STATE_STYLE.get(item.state, ""))
        table.add_row(str(item.step), _size(item.size), _age(item.age_s(now)), str(item.files), state)
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
