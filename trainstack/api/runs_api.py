"""Runs: `tune` (short measured jobs choose the layout), `launch` (a run through the deployed supervisor),
`stop`, `resume` and `export`, and `wait_for_run` (until a run has ended), which launch and resume call
with `wait=True`. `wait_for_job` (until the first job exists: `launch --wait`) is the command's, and not
in trainstack.api's `__all__`.

Each takes what its command takes (a recipe name or path, `team`, `overrides` for `--set`, `local` for
the emulator, `region`) and returns a frozen result whose `to_json()` is exactly what the command's
`--json` prints; mistakes raise trainstack.errors.TrainstackError with the command's one line. Progress
lines (the ones the command prints while it works) go to `on_progress`, warnings and notes (the ones it
prints on stderr) to `on_warning`; both may be None. Nothing here prints.

The orchestration lives below: trainstack.aws.launching (start a run, its dry-run request, the waits),
trainstack.aws.run_control (stop, resume, export), trainstack.aws.tuning_driver (the tuning run's jobs on
SageMaker or the emulator) and trainstack.tuning (candidates, measurement, choice, the store).
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from trainstack.api.results import OnProgress, Result, report
from trainstack.aws.launching import StillCreating, StillRunning
from trainstack.aws.run_control import NotConfirmed
from trainstack.errors import RecipeError, TrainstackError

if TYPE_CHECKING:
    from trainstack.aws.registry import Run

LOCAL_WINDOW = 12  # steady steps per local CPU job: a spread from a dozen steps, 3 jobs in minutes
MAX_CANDIDATES = 8  # one warm pool, one after another: eight short jobs is already an hour on a P6
FIRST_JOB_WAIT_S = 120.0  # `launch --wait`


def _aws(local: bool, region: str | None) -> Any:
    """boto3 access for AWS (in `region`, else the configured one) or for the local emulator."""
    from trainstack.aws.session import Aws

    if region is None:
        return Aws(local=local)
    return Aws(local=local, environ={**os.environ, "AWS_REGION": region})


# --- results -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunAction(Result):
    """What launch, stop, resume and export did to a run: the job they act on and the Step Functions
    execution they started (stop: the one it stopped before it created its job, else None). `lines` are
    what the command prints for a person; `to_json()` is `{"run", "job", "execution"}` on one line."""

    JSON_INDENT: ClassVar[int | None] = None

    run: str
    job: str | None
    execution: str | None
    lines: tuple[str, ...] = ()

    def to_document(self) -> dict[str, Any]:
        return {"run": self.run, "job": self.job, "execution": self.execution}


@dataclass(frozen=True)
class RunState(Result):
    """A run as its registry records it once a wait saw it end (`record`: trainstack.aws.registry.Run,
    with its jobs, history, exports). `to_json()`: the fields below, indented."""

    run: str
    state: str  # completed, stopped or failed
    why: str
    step: int  # the step the newest ended job reported
    steps: int  # the run's steps
    current_job: str
    jobs: tuple[str, ...]
    checkpoint_uri: str
    mlflow_run_id: str
    record: Run

    @classmethod
    def of(cls, record: Run) -> RunState:
        return cls(
            run=record.run,
            state=record.state,
            why=record.why,
            step=record.step,
            steps=record.steps,
            current_job=record.current_job,
            jobs=tuple(j.name for j in record.jobs),
            checkpoint_uri=record.checkpoint_uri,
            mlflow_run_id=record.mlflow_run_id,
            record=record,
        )

    @property
    def succeeded(self) -> bool:
        return self.state == "completed"

    def to_document(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "state": self.state,
            "why": self.why,
            "step": self.step,
            "steps": self.steps,
            "current_job": self.current_job,
            "jobs": list(self.jobs),
            "checkpoint_uri": self.checkpoint_uri,
            "mlflow_run_id": self.mlflow_run_id,
        }


@dataclass(frozen=True)
class LaunchResult(RunAction):
    """A started run (launch, resume): `to_json()` is `{"run", "job", "execution"}` on one line. With
    `wait=True`, `final` is the run once it ended (completed, stopped or failed).

    `launch(..., dry_run=True)` starts nothing: `execution` is None and `request` is the first job's
    CreateTrainingJob request, `placeholders` which of its values only the deployed stacks know (when
    they cannot be read), `input_mode` the data input mode and why; `to_json()` is then `launch --dry-run
    --json` ({"request", "placeholders", "input"}, indented) and `request_json()` what it prints without."""

    checkpoint_uri: str = ""
    mlflow_run_id: str | None = None
    mlflow_tracking_uri: str | None = None
    notes: tuple[str, ...] = ()  # the warnings the command prints on stderr, in order
    final: RunState | None = None
    request: dict[str, Any] | None = None
    placeholders: tuple[str, ...] = ()
    input_mode: dict[str, str] | None = None

    @property
    def state(self) -> str:
        """`running` until a wait saw the run end, then completed, stopped or failed; `planned`: a dry run."""
        if self.request is not None:
            return "planned"
        return self.final.state if self.final is not None else "running"

    @property
    def succeeded(self) -> bool:
        return self.state == "completed"

    def to_document(self) -> dict[str, Any]:
        if self.request is None:
            return super().to_document()
        return {
            "request": copy.deepcopy(self.request),
            "placeholders": list(self.placeholders),
            "input": dict(self.input_mode or {}),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_document(), indent=None if self.request is None else 2)

    def request_json(self) -> str:
        """What `launch --dry-run` prints without --json: the request alone."""
        if self.request is None:
            raise TrainstackError(f"run {self.run} was launched, not planned: it has no dry-run request")
        return json.dumps(self.request, indent=2)


@dataclass(frozen=True)
class StopResult(RunAction):
    """A stop requested: `job` is the job it stopped (or found ended), `execution` the supervisor execution
    it stopped before that job was created, else None."""


@dataclass(frozen=True)
class ResumeResult(LaunchResult):
    """Job n+1 of a stopped or failed run started; `final` as launch's with `wait=True`."""


@dataclass(frozen=True)
class ExportResult(RunAction):
    """An export started: `job` is the export job the Export state machine creates, `folder` the Hugging
    Face folder it writes. With `wait=True`, `status` is how the job ended (Completed, Failed, Stopped)
    and `failure_reason` SageMaker's reason for a failure; `to_json()` then adds both."""

    folder: str | None = None
    status: str | None = None
    failure_reason: str | None = None

    @property
    def succeeded(self) -> bool:
        return self.status == "Completed"

    def to_document(self) -> dict[str, Any]:
        document = super().to_document()
        if self.status is not None:  # waited for: what a pipeline step decides on
            document |= {"status": self.status, "failure_reason": self.failure_reason}
        return document


@dataclass(frozen=True)
class TuneResult(Result):
    """A tuning run's choice (`choice`: {"candidates": [...], "chosen": {...} or None}, what `tune --json`
    prints), and where it is recorded. `reused`: an earlier tuning run's result for this recipe, team and
    image, measured again only with fresh=True."""

    choice: dict[str, Any]
    run: str  # the tuning run's id
    date: str
    hardware: str
    store_path: str
    reused: bool = False
    spent_usd: float = 0.0
    skipped: tuple[str, ...] = ()

    def to_document(self) -> dict[str, Any]:
        return copy.deepcopy(self.choice)

    @property
    def chosen(self) -> dict[str, Any] | None:
        return copy.deepcopy(self.choice["chosen"])

    @property
    def overrides(self) -> list[str] | None:
        """The chosen layout's `--set` values ([] for the recipe's own), None when nothing was chosen."""
        return list(self.choice["chosen"]["overrides"]) if self.choice["chosen"] else None

    @property
    def exit_code(self) -> int:
        """What `trainstack tune` exits with: 0 a layout was chosen, 1 no candidate completed."""
        return 0 if self.choice["chosen"] else 1


class NothingFits(TrainstackError):
    """No candidate fits by its trace: no job was run (exit 1; `trainstack tune` says it as progress)."""

    exit_code = 1


# --- launch --------------------------------------------------------------------------------------------


def launch(
    recipe: str,
    *,
    team: str | None = None,
    local: bool = False,
    region: str | None = None,
    name: str | None = None,
    max_steps: int | None = None,
    keep_alive: int | None = None,
    tuned: bool = False,
    dry_run: bool = False,
    recipes_dir: str | Path | None = None,
    wait: bool = False,
    timeout: float | None = None,
    on_progress: OnProgress = None,
    on_warning: OnProgress = None,
) -> LaunchResult:
    """Start a run of `recipe` through its deployed run supervisor (`trainstack launch`): job 1 now, the
    next jobs by the supervisor until the run's steps are done. `name`: the run id (default: the recipe
    hash and the launch time); `max_steps`: a short run of the same recipe (on a warm pool of
    `keep_alive` seconds, default 1800); `tuned`: the layout `tune` chose for this recipe and team.

    `dry_run=True` starts nothing and returns the first job's request (`result.request`), also without AWS.
    `wait=True` returns when the run has ended (its `final` record: completed, stopped or failed), or
    raises StillRunning (exit 1) after `timeout` seconds; `on_progress` gets a line per change of the
    run's state, job or step. The run is never stopped by a wait that ends."""
    from trainstack.aws import launching, request
    from trainstack.recipes import naming
    from trainstack.recipes.loader import resolve
    from trainstack.tuning.trace import trace_refusal

    notes: list[str] = []

    def warn(line: str) -> None:
        notes.append(line)
        report(on_warning, line)

    deployed_recipe = resolve(recipe, team=team, recipes_dir=recipes_dir).recipe
    run_recipe = _tuned(deployed_recipe, team, local, warn) if tuned else deployed_recipe
    if max_steps is not None:
        run_recipe = _with_steps(run_recipe, max_steps)
    keep = (
        keep_alive
        if keep_alive is not None
        else (
            max(request.WARM_POOL_SECONDS, deployed_recipe.compute.keep_alive_seconds)
            if max_steps is not None
            else deployed_recipe.compute.keep_alive_seconds
        )
    )
    if name is not None and (problem := naming.run_id_problem(name)) is not None:
        raise TrainstackError(f"--name: {problem}")
    run_id = name or naming.default_run_id(run_recipe, _suffix(max_steps))
    run = naming.run_name(deployed_recipe, team, run_id)
    job = naming.job_of_run(run, 1)
    from trainstack.aws.run_access import deploy_hint

    hint = deploy_hint(_context_recipe(recipe, deployed_recipe.name, recipes_dir), team, local)
    refusal = trace_refusal(run_recipe)  # its cached trace (plan --trace, tune) did not fit: as the planner's
    if refusal is not None:
        raise TrainstackError(refusal)

    if dry_run:
        planned = launching.first_job_request(
            deployed_recipe,
            run_recipe,
            team,
            run=run,
            run_id=run_id,
            job=job,
            keep_alive=keep,
            local=local,
            hint=hint,
            aws_factory=lambda: _aws(local, region),
        )
        for line in planned.notes:
            warn(line)
        return LaunchResult(
            run=run,
            job=job,
            execution=None,
            notes=tuple(notes),
            request=planned.request,
            placeholders=planned.placeholders,
            input_mode=planned.input_mode,
        )

    from urllib.parse import urlsplit

    aws = _aws(local, region)
    # EMULATOR: the emulator trains its stand-in (no base read) whether it was named by --local or by its
    # exported AWS_* variables (docs/runs.md's commands, run as written against it)
    emulator = local or urlsplit(aws.client("s3").meta.endpoint_url).hostname in ("localhost", "127.0.0.1")
    started = launching.start_run(
        aws,
        deployed_recipe,
        run_recipe,
        team,
        run=run,
        run_id=run_id,
        keep_alive=keep,
        hint=hint,
        emulator=emulator,
        warn=warn,
    )
    lines = (
        f"launched run {run}: job {job} ({run_recipe.training.steps:,} steps, warm pool {keep}s) "
        f"in {aws.where}",
        f"execution: {started.execution}",
        f"checkpoints: {started.checkpoint_uri}",
        *([f"mlflow: {started.mlflow_url}"] if started.mlflow_url is not None else []),
    )
    result = LaunchResult(
        run=run,
        job=job,
        execution=started.execution,
        lines=lines,
        checkpoint_uri=started.checkpoint_uri,
        mlflow_run_id=started.mlflow_run_id,
        mlflow_tracking_uri=started.mlflow_tracking_uri,
        notes=tuple(notes),
    )
    if not wait:
        return result
    final = _wait(aws, run, started.table, timeout, on_progress)
    return _ended(result, final)


def _with_steps(recipe: Any, steps: int) -> Any:
    """The recipe with training.steps set (--max-steps), refused in one line past the schema's bounds."""
    from pydantic import ValidationError

    from trainstack.recipes.schema import Recipe

    data = recipe.model_dump(mode="json", exclude={"extends"})
    data["training"]["steps"] = steps
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:  # past the schema's bound on training.steps (one line, exit 2)
        raise RecipeError(
            "--max-steps", "training.steps", exc.errors()[0]["msg"].removeprefix("Value error, ")
        ) from None


def _context_recipe(given: str, name: str, recipes_dir: Any) -> str:
    """What `-c recipe=` must say to deploy this recipe: its name when it is one of the project's recipes
    (the CDK app reads recipes/), else the file's absolute path (`cdk deploy` runs the app from the
    project's root, and a name outside recipes/ is unknown there)."""
    import shlex

    is_path = given.endswith((".yaml", ".yml")) or "/" in given  # the loader's rule (resolve)
    if is_path:
        return shlex.quote(str(Path(given).resolve()))
    if recipes_dir is not None:  # a name under another recipes folder: the app reads recipes/ only
        file = Path(recipes_dir) / f"{name}.yaml"
        return shlex.quote(str(file.resolve())) if file.is_file() else name
    return name


def _tuned(recipe: Any, team: str | None, local: bool, warn: Callable[[str], None]) -> Any:
    """The recipe with the layout its newest tuning run chose (on the emulator's CPU with --local, else
    on the recipe's GPU): a CPU choice never becomes a GPU run's layout."""
    from trainstack.tuning.candidates import apply
    from trainstack.tuning.store import Store

    store = Store()
    result = store.latest_result(recipe.name, team)
    wanted_gpu = "cpu" if local else recipe.instance.gpu.name
    if result is None or result["hardware"]["gpu"] != wanted_gpu or result.get("overrides") is None:
        raise TrainstackError(
            f"--tuned: no tuning result for {recipe.name}"
            + (f" (team {team})" if team else "")
            + f" on {wanted_gpu} in {store.path}: run `trainstack tune {recipe.name}"
            + (f" --team {team}" if team else "")
            + (" --local" if local else "")
            + "` first"
        )
    warn(
        f"tuned: the layout of tuning run {result['run']} ({result['date']}): "
        + (" ".join(f"--set {o}" for o in result["overrides"]) or "the recipe's own")
    )
    return apply(recipe, tuple(result["overrides"]), "--tuned")


def _suffix(max_steps: int | None) -> str:
    """`t<base36 seconds>` for a tuning run, `r<...>` for a full one: unique per second, 7 characters
    (naming.RUN_SUFFIX_MAX) until December 2038."""
    return ("t" if max_steps is not None else "r") + _base36(int(time.time()))


def _base36(n: int) -> str:
    digits = ""
    while n:
        n, d = divmod(n, 36)
        digits = "0123456789abcdefghijklmnopqrstuvwxyz"[d] + digits
    return digits


# --- waiting ---------------------------------------------------------------------------------------------


def wait_for_job(
    started: RunAction,
    *,
    local: bool = False,
    region: str | None = None,
    timeout: float = FIRST_JOB_WAIT_S,
    on_progress: OnProgress = None,
) -> str:
    """Wait until SageMaker has the job a launch or resume started (`launch --wait`); its status. Raises
    the one line `launch --wait` prints when the start failed, or StillCreating (exit 1: the run did
    start) when `timeout` seconds pass first (the supervisor retries while capacity or quota is short)."""
    from botocore.exceptions import BotoCoreError

    from trainstack.aws.launching import wait_for_job as follow
    from trainstack.aws.session import explain

    if started.execution is None or started.job is None:
        raise TrainstackError(f"run {started.run}: nothing was started to wait for")
    aws = _aws(local, region)
    try:
        return follow(aws, started.execution, started.job, timeout, lambda line: report(on_progress, line))
    except BotoCoreError as exc:  # ClientErrors are handled inside
        raise TrainstackError(
            f"lost contact with {aws.where} while waiting for {started.job}: {explain(exc)}"
        ) from None


def wait_for_run(
    run: str,
    *,
    local: bool = False,
    region: str | None = None,
    timeout: float | None = None,
    on_progress: OnProgress = None,
) -> RunState:
    """Wait until run `run` has ended (completed, stopped or failed: the supervisor starts no job of it
    after these) and return it as its registry records it (RunState). `on_progress`
    gets a line per change of state, job or reported step; after `timeout` seconds StillRunning (exit 1)
    is raised and the run goes on untouched."""
    from trainstack.aws.run_access import find_run

    aws = _aws(local, region)
    _record, where = find_run(aws, run)
    return _wait(aws, run, where.table, timeout, on_progress)


def _wait(aws: Any, run: str, table: str, timeout: float | None, on_progress: OnProgress) -> RunState:
    from trainstack.aws.launching import wait_for_end

    return RunState.of(wait_for_end(aws, table, run, timeout, lambda line: report(on_progress, line)))


Started = TypeVar("Started", bound="LaunchResult")


def _ended(result: Started, final: RunState) -> Started:
    return replace(result, final=final)


# --- stop, resume, export ------------------------------------------------------------------------------


def stop(run: str, *, local: bool = False, region: str | None = None) -> StopResult:
    """Stop run `run` at any moment (`trainstack stop`): its current job is stopped (SageMaker sends
    SIGTERM, the trainer saves) and its warm pool released; an end already recorded, or a job that has
    already ended, is never overwritten; a job still being created is not created. Continue it with
    `resume`."""
    from trainstack.aws.run_control import stop_run

    acted = stop_run(_aws(local, region), run)
    return StopResult(acted.run, acted.job, acted.execution, acted.lines)


def resume(
    run: str,
    *,
    overrides: Sequence[str] = (),
    from_step: int | None = None,
    yes: bool = False,
    confirm: Callable[[str], bool] | None = None,
    local: bool = False,
    region: str | None = None,
    wait: bool = False,
    timeout: float | None = None,
    on_progress: OnProgress = None,
) -> ResumeResult:
    """Continue the stopped or failed run `run` with its next job (`trainstack resume`), from its newest
    checkpoint or the complete one of `from_step`, with the recipe the run recorded at launch and the
    `overrides` (`--set key=value`: only what may change between two jobs of a run; refused in one line
    before AWS is asked anything otherwise).

    `from_step` discards the later checkpoints: pass `yes=True`, or a `confirm` callback that is asked
    the question and answers True; otherwise NotConfirmed (exit 1) is raised and nothing starts.
    `wait`, `timeout`, `on_progress`: as launch's."""
    from trainstack.aws.run_control import check_resume_input, resume_run

    assignments = list(overrides)
    check_resume_input(assignments, from_step)  # one line, exit 2, before any AWS call
    if from_step is not None and not yes and confirm is None:

        def confirm(question: str) -> bool:
            raise NotConfirmed(f"{question.removesuffix(' Continue?')} pass yes=True to confirm")

    aws = _aws(local, region)
    acted = resume_run(aws, run, assignments, from_step, None if yes else confirm)
    result = ResumeResult(acted.run, acted.job, acted.execution, acted.lines)
    if not wait:
        return result
    from trainstack.aws.run_access import find_run

    _record, where = find_run(aws, run)
    final = _wait(aws, run, where.table, timeout, on_progress)
    return _ended(result, final)


def export(
    run: str,
    *,
    step: int | None = None,
    local: bool = False,
    region: str | None = None,
    wait: bool = False,
    timeout: float | None = None,
    on_progress: OnProgress = None,
) -> ExportResult:
    """Export run `run`'s checkpoint of `step` (default: the newest complete one) as a Hugging Face folder
    (safetensors, config.json, tokenizer) in S3 (`trainstack export`): one CPU job sized to stream the
    largest tensor. Refused in one line before any job starts: a step that is not a complete checkpoint
    (the complete ones are listed), a run with none, a run whose earlier export still runs.
    `wait=True` returns when the export job has ended (`status`, `failure_reason`; `succeeded`), or
    raises StillRunning (exit 1) after `timeout` seconds; `on_progress` gets a line per change of the
    job's status. The export is never stopped by a wait that ends."""
    from trainstack.aws.run_control import export_run, wait_for_export

    aws = _aws(local, region)
    acted = export_run(aws, run, step)
    started = ExportResult(acted.run, acted.job, acted.execution, acted.lines, folder=acted.output)
    if not wait or acted.job is None or acted.execution is None:
        return started
    ended = wait_for_export(aws, acted.execution, acted.job, timeout, lambda line: report(on_progress, line))
    return replace(started, status=ended["TrainingJobStatus"], failure_reason=ended.get("FailureReason"))


# --- tune ----------------------------------------------------------------------------------------------


def tune(
    recipe: str,
    *,
    team: str | None = None,
    overrides: Sequence[str] = (),
    local: bool = False,
    region: str | None = None,
    candidates: int = 3,
    budget_usd: float | None = None,
    ranks: int = 1,
    parallel: bool = False,
    fresh: bool = False,
    mlflow: str | None = None,
    recipes_dir: str | Path | None = None,
    trace: bool = True,
    on_progress: OnProgress = None,
) -> TuneResult:
    """Measure the planner's best layouts of `recipe` on short jobs and choose the one that finishes the
    run for the least money, beyond the measured noise (`trainstack tune`; docs/tuning.md).

    `local`: on the local emulator's training jobs when one runs here, else as local trainer processes
    (`ranks` each); otherwise SageMaker jobs on the recipe's deployed stacks in `region`. `candidates`
    layouts (the recipe's own included) are traced first (`trace`) and never run when they do not fit;
    `budget_usd` caps the planned spend. A result for the same recipe, team and image is reused unless
    `fresh`. `on_progress` gets each line `tune` prints while it works: every candidate as it starts and
    what it measured. The result says what was chosen (`exit_code` 1: nothing); NothingFits (exit 1)
    when no candidate fits by its trace."""
    if not 1 <= candidates <= MAX_CANDIDATES:
        raise TrainstackError(f"--candidates: {candidates} is not in 1..{MAX_CANDIDATES}")
    from trainstack.recipes.loader import resolve
    from trainstack.tuning import candidates as cands
    from trainstack.tuning import engine
    from trainstack.tuning.store import Store

    def say(line: str) -> None:
        report(on_progress, line)

    base = resolve(recipe, team=team, overrides=overrides, recipes_dir=recipes_dir).recipe
    jobs, hardware = _tuning_jobs(base, team, local, region, ranks, say)
    store = Store()
    cached = None if fresh else store.result(base.name, team, hardware.image)
    if cached is not None:
        say(
            f"reusing tuning run {cached['run']} of {cached['date']} on {hardware.describe()} "
            "(--fresh measures again)"
        )
        return TuneResult(
            choice=cached["choice"],
            run=cached["run"],
            date=cached["date"],
            hardware=hardware.describe(),
            store_path=str(store.path),
            reused=True,
            spent_usd=float(cached.get("spent_usd") or 0.0),
            skipped=tuple(cached.get("skipped") or ()),
        )

    chosen_candidates = cands.candidates(
        base, candidates, world=hardware.ranks, compile_choices=not hardware.is_cpu
    )
    traced: dict[str, Any] = {}
    if trace:  # before any job starts: a candidate too large for the GPU by its trace is never run
        chosen_candidates, traced = _traced_candidates(base, chosen_candidates, say)
        if not chosen_candidates:
            raise NothingFits(
                "no candidate fits by its trace: nothing is run (trainstack plan --trace shows where)"
            )
    planned_usd = engine.tuning_cost_usd(base, chosen_candidates)
    say(
        f"tuning {base.name}: {len(chosen_candidates)} candidates on {hardware.describe()}; the plan prices "
        f"this tuning run at {planned_usd:,.2f} USD on {base.compute.instance_count} x "
        f"{base.compute.instance_type}"
        + (f" (budget {budget_usd:,.2f} USD)" if budget_usd is not None else "")
    )
    run_id = (
        f"tune-{_base36(int(time.time()))}"  # a run id (naming.RUN_ID), so its jobs are named like a run's
    )
    if parallel and hardware.is_cpu:
        say("note: --parallel on this machine: the jobs share its CPUs, and each measures the others' load")
    run_candidate = _candidate_runner(jobs, chosen_candidates, run_id, ranks, hardware, say)

    def progress(candidate: Any, m: Any, result: engine.JobResult) -> None:
        if m.ok:
            say(
                f"     {m.tokens_per_s:,.0f} +- {m.tokens_per_s_spread:,.0f} tokens/s, "
                f"step {m.step_time_s:.4f} s +- {m.step_time_spread:.4f}, "
                f"{_peak_words(m, traced.get(candidate.name), hardware.is_cpu)} ({result.seconds:.0f} s)"
            )
        else:
            say(f"     {m.status}: {m.reason}")

    outcome = engine.tune(
        base,
        chosen_candidates,
        run_candidate,
        run=run_id,
        budget_usd=budget_usd,
        compiled=False if hardware.is_cpu else None,  # the trainer never compiles on CPU
        window=LOCAL_WINDOW if hardware.is_cpu else None,  # GPU arithmetic cannot size a CPU window
        parallel=parallel,
        clock="cpu" if hardware.is_cpu else "wall",  # shared CPUs: wall time measures the neighbours
        on_result=progress,
    )
    choice = outcome.choice.to_dict()
    chosen = outcome.choice.chosen
    measured = [
        {
            "name": o.candidate.name,
            "overrides": list(o.candidate.overrides),
            "layout": _layout_key(base, o.candidate.overrides),
            "status": o.status,
            "planned": o.candidate.planned.to_dict(),
            "measured": _measured_memory(
                o.measurement.to_dict() if o.measurement.ok else {},
                traced.get(o.candidate.name),
                hardware.is_cpu,
            ),
            **({"traced": traced[o.candidate.name].to_json()} if o.candidate.name in traced else {}),
        }
        for o in outcome.choice.outcomes
    ]
    result = {
        "choice": choice,
        "overrides": list(chosen.candidate.overrides) if chosen else None,
        "why": outcome.choice.why,
        "gain": outcome.choice.gain,
        "spent_usd": outcome.spent_usd,
        "skipped": list(outcome.skipped),
    }
    store.record(run_id, outcome.date, base, team, hardware, measured, result)
    store.save()
    if outcome.skipped:
        say(f"not run within the budget: {', '.join(outcome.skipped)}")
    _record_mlflow(mlflow, local, jobs, base, team, run_id, outcome, choice, say)
    return TuneResult(
        choice=choice,
        run=run_id,
        date=outcome.date,
        hardware=hardware.describe(),
        store_path=str(store.path),
        spent_usd=outcome.spent_usd,
        skipped=tuple(outcome.skipped),
    )


def _tuning_jobs(
    base: Any, team: str | None, local: bool, region: str | None, ranks: int, say: Callable[[str], None]
) -> tuple[Any, Any]:
    """(the SageMaker job driver, or None for local trainer processes; the hardware the jobs run on)."""
    from trainstack.aws.tuning_driver import SageMakerJobs, emulator_aws
    from trainstack.tuning.local import LOCAL_INSTANCE, local_hardware, trainer_digest
    from trainstack.tuning.store import Hardware, recipe_hardware

    if local:
        aws = emulator_aws()
        if aws is None:
            say(
                "note: no local emulator is running (`trainstack emulator start`): the candidates' trainer "
                "runs as local processes, as the emulator's jobs would run it"
            )
            return None, local_hardware(ranks)
        say(f"the candidates run as training jobs of {aws.where}")  # the SageMaker API, as on AWS
        jobs = SageMakerJobs(base, team, say, aws)
        return jobs, Hardware(LOCAL_INSTANCE, "cpu", trainer_digest(), jobs.ranks)
    jobs = SageMakerJobs(base, team, say, _aws(False, region))
    return jobs, recipe_hardware(base, jobs.image_uri)


def _candidate_runner(
    jobs: Any, candidates: list, run_id: str, ranks: int, hardware: Any, say: Callable[[str], None]
) -> Callable[[Any, Any, Any], Any]:
    """engine.tune's runner: each candidate's short job, announced, as a local trainer process or a
    SageMaker job; a job the emulator ran as a stand-in, or on other ranks than measured, measured nothing."""
    from trainstack.tuning import engine

    def announce(candidate: Any, steps: Any) -> None:
        say(
            f"  {candidate.name}: {candidate.describe} "
            f"({' '.join(candidate.overrides) or 'the recipe as it is'}): {steps.max_steps} steps "
            f"({steps.warmup} warm-up)"
        )

    if jobs is None:
        import tempfile

        from trainstack.tuning.local import run_job

        workdir = Path(tempfile.mkdtemp(prefix=f"trainstack-{run_id}-"))

        def run_local(candidate: Any, job_recipe: Any, steps: Any) -> engine.JobResult:
            announce(candidate, steps)
            log = run_job(candidate.name, job_recipe, steps.max_steps, ranks, workdir)
            return engine.JobResult(log.lines, log.exit_code != 0, log.failure_reason, log.seconds)

        return run_local

    from trainstack.tuning.measure import ranks_of

    names = dict(zip([c.name for c in candidates], jobs.names(run_id, len(candidates)), strict=True))

    def run_on_sagemaker(candidate: Any, job_recipe: Any, steps: Any) -> engine.JobResult:
        announce(candidate, steps)
        job = jobs.run(names[candidate.name], run_id, candidate, job_recipe, steps)
        failed, reason = job.status != "Completed", job.failure_reason
        stand_in = job.environment.get("TRAINSTACK_EMULATOR_STAND_IN")
        job_ranks = ranks_of(job.lines)
        if stand_in:  # the emulator trained a smaller model: nothing of this layout was measured
            failed, reason = True, f"not measured: the emulator trained a stand-in ({stand_in})"
        elif job_ranks is not None and job_ranks != hardware.ranks:
            failed, reason = True, f"ran on {job_ranks} ranks, the tuning run measures {hardware.ranks}"
        return engine.JobResult(job.lines, failed, reason, job.billable_seconds)

    return run_on_sagemaker


def _traced_candidates(
    base: Any, candidates: list, say: Callable[[str], None]
) -> tuple[list, dict[str, Any]]:
    """(the candidates that fit by their trace, or that the trace could not follow; each traced
    candidate's TracedMemory). The trace is the trainer's own step at the recipe's GPU layout
    (trainstack.tuning.trace), so it guards the GPU run whatever machine the jobs run on."""
    from trainstack.planner import recipe_memory
    from trainstack.planner.traced import traced_memory
    from trainstack.tuning.candidates import apply
    from trainstack.tuning.trace import counted_candidate, run_trace

    kept, traced = [], {}
    for candidate in candidates:
        recipe = apply(base, candidate.overrides)
        outcome = run_trace(recipe, quiet=True)
        if outcome.error is not None:
            raise TrainstackError(outcome.error)
        if outcome.report is None:
            knob, reason = outcome.unsupported["knob"], outcome.unsupported["reason"]
            say(f"  {candidate.name}: trace could not follow {knob} ({reason}); the planner's verdict stands")
            kept.append(candidate)
            continue
        memory = traced_memory(
            recipe,
            recipe_memory(recipe),
            recipe.instance.gpu.usable_gib,
            outcome.report,
            cached=outcome.cached,
        )
        traced[candidate.name] = memory
        candidate = counted_candidate(candidate, recipe, outcome.report)  # re-timed by its counted FLOPs
        say(f"  {candidate.name}: {memory.verdict}" + (" (cached)" if memory.cached else ""))
        if memory.fits:
            kept.append(candidate)
        else:
            say(f"  {candidate.name}: not run (does not fit by its trace)")
    return kept, traced


def _peak_words(m: Any, traced: Any, is_cpu: bool) -> str:
    """A job's peak memory as the progress line says it: on CPU the trace's per-GPU figure, labelled
    (a CPU process's RSS says nothing of a GPU's memory), else the GPU's measured peak."""
    if not is_cpu:
        return f"peak {m.peak_mem_gib:.2f} GiB"
    if traced is None:
        return "peak per GPU: not traced"
    return f"peak per GPU {traced.total_gib:.2f} GiB by trace"


def _measured_memory(measured: dict, traced: Any, is_cpu: bool) -> dict:
    """On CPU the measured peak is replaced by the trace's (labelled `peak_mem_source: trace`), never
    the CPU job's RSS; None where the candidate was not traced."""
    if not is_cpu or not measured:
        return measured
    peak = round(traced.total_gib, 4) if traced is not None else None
    return {**measured, "peak_mem_gib": peak, "peak_mem_source": "trace" if traced is not None else None}


def _layout_key(base: Any, overrides: tuple[str, ...]) -> list:
    from trainstack.tuning.candidates import apply
    from trainstack.tuning.store import layout_key

    return layout_key(apply(base, overrides))


def _record_mlflow(
    uri: str | None,
    local: bool,
    jobs: Any,
    recipe: Any,
    team: str | None,
    run_id: str,
    outcome: Any,
    choice: dict,
    say: Callable[[str], None],
) -> None:
    """The tuning run in MLflow, where a tracker is known: `mlflow`, else the emulator's (local), else the
    recipe's own tracker; a tracker's trouble is one warning line (the measurements are stored already)."""
    from trainstack.aws.tuning_driver import record_in_mlflow, tracking_uri_for_tuning

    uri = tracking_uri_for_tuning(uri, local, jobs, recipe, team, say)
    if not uri:
        return
    summary = {
        "chosen": choice["chosen"]["name"] if choice["chosen"] else "none",
        "why": outcome.choice.why[:5000],
        "spent_usd": f"{outcome.spent_usd:.4f}",
    }
    record_in_mlflow(uri, recipe, team, run_id, summary, choice["candidates"], say)


__all__ = [
    "ExportResult",
    "LaunchResult",
    "NotConfirmed",
    "NothingFits",
    "ResumeResult",
    "RunAction",
    "RunState",
    "StillCreating",
    "StillRunning",
    "StopResult",
    "TuneResult",
    "export",
    "launch",
    "resume",
    "stop",
    "tune",
    "wait_for_run",
]
