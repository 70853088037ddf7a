"""trainstack's Python API: one function per thing a user does, each taking what its command takes.

    from trainstack import api

    result = api.plan("8b-fp8", team="nlp", overrides=["training.micro_batch=2"])
    print(result.fits, result.to_json())  # to_json(): exactly what `trainstack plan ... --json` prints

Every function takes a recipe name or path, `team=`, `overrides=` (the command's `--set` values),
`local=` (the local emulator instead of AWS) and `region=` where its command does, and returns a typed,
frozen result (trainstack.api.results.Result) whose `to_json()` is the command's `--json` output.
Mistakes raise trainstack.errors.TrainstackError (or a subclass) carrying the one line the command
prints after `error:`. Long operations take `on_progress` (called with each progress line) and
`wait`/`timeout`.

`__all__` is the public surface: tests/api/test_public_surface.py fails when a public function's
signature changes without a CHANGELOG.md entry naming it. The `trainstack` command line
(trainstack/cli/) is a shell over this package: each command parses its options, calls one function
here and prints the result.

May import: aws, gitops, emulator, tuning, planner, recipes, protocol (and trainstack.errors/units);
never trainstack.cli.
"""

from __future__ import annotations

from trainstack.api.data import DataPrepareResult, data_prepare
from trainstack.api.monitoring import (
    CheckpointsResult,
    LogsResult,
    RunsResult,
    StatusResult,
    checkpoints,
    logs,
    runs,
    status,
)
from trainstack.api.planning import CompareResult, PlanResult, compare, plan, trace
from trainstack.api.recipes_view import DiffResult, ShowResult, diff, show
from trainstack.api.results import DocumentResult, OnProgress, Result
from trainstack.api.runs_api import (
    ExportResult,
    LaunchResult,
    NotConfirmed,
    NothingFits,
    ResumeResult,
    RunAction,
    RunState,
    StillCreating,
    StillRunning,
    StopResult,
    TuneResult,
    export,
    launch,
    resume,
    stop,
    tune,
    wait_for_run,
)
from trainstack.api.validation import Invalid, ValidateResult, validate
from trainstack.errors import RecipeError, TrainstackError

__all__ = [
    "CheckpointsResult",
    "CompareResult",
    "DataPrepareResult",
    "DiffResult",
    "DocumentResult",
    "ExportResult",
    "Invalid",
    "LaunchResult",
    "LogsResult",
    "NotConfirmed",
    "NothingFits",
    "OnProgress",
    "PlanResult",
    "RecipeError",
    "Result",
    "ResumeResult",
    "RunAction",
    "RunState",
    "RunsResult",
    "ShowResult",
    "StatusResult",
    "StillCreating",
    "StillRunning",
    "StopResult",
    "TrainstackError",
    "TuneResult",
    "ValidateResult",
    "checkpoints",
    "compare",
    "data_prepare",
    "diff",
    "export",
    "launch",
    "logs",
    "plan",
    "resume",
    "runs",
    "show",
    "status",
    "stop",
    "trace",
    "tune",
    "validate",
    "wait_for_run",
]
