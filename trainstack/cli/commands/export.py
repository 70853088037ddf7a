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

    Exit status 0 when the export was started, 2 when RUN is unknown, has used its 9 exports, is refused
    as above, or AWS refuses.

    Examples:

      trainstack export ts-nlp-8b-fp8--lr-sweep-1

      trainstack export ts-platform-30b-fp8--7eca0ce4-rtpb8y7 --step 20000 --local
    """
    from trainstack.api.runs_api import export as start_export

    answer(start_export(run, step=step, local=local), as_json)
