"""`trainstack export RUN [--step N]`: a run's checkpoint as a Hugging Face folder in S3 (docs/models.md).

Starts the deployment's Export state machine (stacks/export.py), which creates the export job (one CPU
instance sized from the model: trainstack.planner.models_io) and records it in the run registry, where
`trainstack runs` lists it. The folder lands in s3://<bucket>/exports/<team>/<recipe>/<run id>/step-N/.
The work is trainstack.api.export's (trainstack.aws.run_control); this command parses its options, calls
it and prints its result.
"""

from __future__ import annotations

from typing import Annotated

import typer

from trainstack.cli.commands.run_access import JsonOpt, RunArg, answer
from trainstack.cli.commands.status import LocalOpt


def register(app: typer.Typer) -> None:
    app.command("export")(export)


def export(
    run: RunArg,
    step: Annotated[
        int | None,
        typer.Option("--step", min=1, help="The checkpoint to export (default: the newest complete one)."),
    ] = None,
    wait: Annotated[
        bool,
        typer.Option(
            "--wait",
            help="Wait for the export job to end, showing its status; exit 1 unless it completed.",
        ),
    ] = False,
    timeout: Annotated[
        float | None,
        typer.Option("--timeout", min=1, help="With --wait: stop waiting after this many seconds (exit 1)."),
    ] = None,
    local: LocalOpt = False,
    as_json: JsonOpt = False,
) -> None:
    """Export RUN's checkpoint as a Hugging Face folder (safetensors, config.json, tokenizer) in S3.

    A SageMaker job on one CPU instance, sized to stream the largest tensor (not the whole model), runs
    `python -m trainer.export` from the training image. The instance, time and price it expects are printed.
    --json prints {run, job, execution}.

    Refused before any job starts (one line): a --step that is not a complete checkpoint of the run (the
    complete ones are listed), a run with none, and a run whose earlier export is still running (two
    exports of one run would write one folder).

    With --wait the command follows the export job until it ends (a line per change of status, on
    stderr) and prints how it ended; --json then adds {status, failure_reason}.

    Exit status 0 when the export was started (with --wait: when it completed), 1 with --wait when the
    job failed or was stopped, or --timeout passed first (the export goes on), 2 when RUN is unknown, has
    used its 9 exports, is refused as above, or AWS refuses.

    Examples:

      trainstack export ts-nlp-8b-fp8--lr-sweep-1

      trainstack export ts-platform-30b-fp8--7eca0ce4-rtpb8y7 --step 20000 --local

      trainstack export ts-nlp-8b-fp8--lr-sweep-1 --wait --timeout 7200
    """
    from trainstack.api.runs_api import export as start_export

    def progress(line: str) -> None:
        typer.echo(line, err=True)

    result = start_export(run, step=step, local=local, wait=wait, timeout=timeout, on_progress=progress)
    answer(result, as_json)
    if result.status is None:
        return
    if not as_json:
        why = f": {result.failure_reason}" if result.failure_reason else ""
        typer.echo(f"export job {result.job}: {result.status}{why}")
    if not result.succeeded:
        raise typer.Exit(1)
