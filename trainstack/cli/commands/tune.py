"""`trainstack tune RECIPE`: short measured jobs choose the layout, correct the plan, hand off to the run.

The engine (docs/tuning.md): this command drives the candidates' short jobs one after another (on
AWS, SageMaker training jobs on one warm pool; with --local, CPU processes of the trainer as the
emulator's jobs run it), measures each from its log (trainstack.tuning.measure), chooses by projected
cost to finish the run (trainstack.tuning.choose), and records the measurements and the result in
the tuning store (trainstack.tuning.store), where `plan`, `show` and `launch --tuned` find them.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from trainstack.cli.commands.plan_options import RecipeArg, RecipesDirOpt, SetOpt, TeamOpt
from trainstack.errors import TrainstackError

LOCAL_WINDOW = 12  # steady steps per local CPU job: a spread from a dozen steps, 3 jobs in minutes
MAX_CANDIDATES = 8  # one warm pool, one after another: eight short jobs is already an hour on a P6


def register(app: typer.Typer) -> None:
    app.command("tune")(tune)


def tune(
    recipe: RecipeArg,
    team: TeamOpt = None,
    set_: SetOpt = None,
    n_candidates: Annotated[
        int,
        typer.Option(
            "--candidates",
            "-n",
            min=1,
            max=MAX_CANDIDATES,
            help="How many layouts to measure, the recipe's own included.",
        ),
    ] = 3,
    budget_usd: Annotated[
        float | None,
        typer.Option(
            "--budget-usd",
            min=0.0,
            help="The most the tuning run may spend (planned per job, at the recipe's price); a job that "
            "would pass it is not started.",
        ),
    ] = None,
    local: Annotated[
        bool,
        typer.Option(
            "--local",
            help="Run the jobs on the local AWS emulator (AWS_ENDPOINT_URL, or the one `trainstack emulator "
            "start` started here), whose jobs train on this machine's CPU; without one, as local trainer "
            "processes (the output's first line says which).",
        ),
    ] = False,
    ranks: Annotated[
        int,
        typer.Option(
            "--ranks", min=1, max=8, help="--local without an emulator: CPU processes per job (default 1)."
        ),
    ] = 1,
    parallel: Annotated[
        bool,
        typer.Option(
            "--parallel",
            help="Run the candidates' jobs at once, each on its own instances (no shared warm pool; needs "
            "the capacity for all of them). Locally they share this machine's CPUs and slow each other.",
        ),
    ] = False,
    fresh: Annotated[
        bool,
        typer.Option("--fresh", help="Measure again even where a result for this recipe and image exists."),
    ] = False,
    as_json: Annotated[
        bool,
        typer.Option("--json", help='Print {"candidates": [...], "chosen": {...}} as JSON.'),
    ] = False,
    mlflow_uri: Annotated[
        str | None,
        typer.Option(
            "--mlflow",
            metavar="URI",
            help="Record the tuning run in this MLflow tracker (default: the emulator's with --local, "
            "else the recipe's tracker when it has one).",
        ),
    ] = None,
    recipes_dir: RecipesDirOpt = None,
    trace: Annotated[
        bool,
        typer.Option(
            "--trace/--no-trace",
            help="Trace each candidate's step at the recipe's full size on fake tensors before any job "
            "starts (as `plan --trace`; cached) and never run one that does not fit by its trace.",
        ),
    ] = True,
) -> None:
    """Measure the planner's best layouts of RECIPE on short jobs and choose the one that finishes the run
    for the least money, beyond the measured noise.

    Candidates: the recipe's own layout and the planner's cheapest others that fit (micro-batch, activation
    checkpointing, shard group, FP8 recipe, compile); every candidate trains the same run. Each job runs
    past its warm-up into a steady window; the result is recorded per hardware and model shape, and reused
    by a second `tune` of the same recipe, team and image unless --fresh. Then `trainstack plan` shows the
    measured figures beside the arithmetic, and `trainstack launch --tuned` trains with the chosen layout.

    Exit status: 0 a layout was chosen, 1 no candidate completed, 2 invalid input or no AWS/emulator.

    Examples:

      trainstack tune 30b-fp8 --budget-usd 500

      trainstack tune tests/trainer/fixtures/tiny.yaml --local --json
    """
    from trainstack.recipes.loader import resolve
    from trainstack.tuning import candidates as cands
    from trainstack.tuning import engine
    from trainstack.tuning.store import Store

    resolved = resolve(recipe, team=team, overrides=set_ or (), recipes_dir=recipes_dir)
    base = resolved.recipe
    say = (lambda line: typer.echo(line, err=True)) if as_json else typer.echo
    jobs: _SageMakerJobs | None = None
    if local:
        from trainstack.tuning.local import local_hardware

        aws = _emulator()
        if aws is not None:  # the emulator runs training jobs: the SageMaker API, as on AWS
            say(f"the candidates run as training jobs of {aws.where}")
            jobs = _SageMakerJobs(base, team, say, aws)
            hardware = jobs.hardware
        else:
            say(
                "note: no local emulator is running (`trainstack emulator start`): the candidates' trainer "
                "runs as local processes, as the emulator's jobs would run it"
            )
            hardware = local_hardware(ranks)
    else:
        from trainstack.aws.session import Aws

        jobs = _SageMakerJobs(base, team, say, Aws(local=False))
        hardware = jobs.hardware
    store = Store()
    cached = None if fresh else store.result(base.name, team, hardware.image)
    if cached is not None:
        say(
            f"reusing tuning run {cached['run']} of {cached['date']} on {hardware.describe()} "
            "(--fresh measures again)"
        )
        _print(cached["choice"], as_json, say)
        raise typer.Exit(0 if cached["choice"]["chosen"] else 1)

    chosen_candidates = cands.candidates(
        base, n_candidates, world=hardware.ranks, compile_choices=not hardware.is_cpu
    )
    traced: dict[str, Any] = {}
    if trace:  # before any job starts: a candidate too large for the GPU by its trace is never run
        chosen_candidates, traced = _traced_candidates(base, chosen_candidates, say)
        if not chosen_candidates:
            say("no candidate fits by its trace: nothing is run (trainstack plan --trace shows where)")
            raise typer.Exit(1)
    planned_usd = engine.tuning_cost_usd(base, chosen_candidates)
    say(
        f"tuning {base.name}: {len(chosen_candidates)} candidates on {hardware.describe()}; the plan prices "
        f"this tuning run at {planned_usd:,.2f} USD on {base.compute.instance_count} x "
        f"{base.compute.instance_type}"
        + (f" (budget {budget_usd:,.2f} USD)" if budget_usd is not None else "")
    )
    run_id = _tuning_id()
    if parallel and hardware.is_cpu:
        say("note: --parallel on this machine: the jobs share its CPUs, and each measures the others' load")

    def announce(candidate: Any, steps: Any) -> None:
        say(
            f"  {candidate.name}: {candidate.describe} "
            f"({' '.join(candidate.overrides) or 'the recipe as it is'}): {steps.max_steps} steps "
            f"({steps.warmup} warm-up)"
        )

    if jobs is None:
        from trainstack.tuning.local import run_job

        workdir = Path(tempfile.mkdtemp(prefix=f"trainstack-{run_id}-"))

        def run_candidate(candidate: Any, job_recipe: Any, steps: Any) -> engine.JobResult:
            announce(candidate, steps)
            log = run_job(candidate.name, job_recipe, steps.max_steps, ranks, workdir)
            return engine.JobResult(log.lines, log.exit_code != 0, log.failure_reason, log.seconds)
    else:
        names = dict(
            zip([c.name for c in chosen_candidates], jobs.names(run_id, len(chosen_candidates)), strict=True)
        )

        def run_candidate(candidate: Any, job_recipe: Any, steps: Any) -> engine.JobResult:
            announce(candidate, steps)
            return jobs.run(names[candidate.name], run_id, candidate, job_recipe, steps)

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
    _record_mlflow(mlflow_uri, local, jobs, base, team, run_id, outcome, choice, say)
    _print(choice, as_json, say)
    say(f"recorded in {store.path} as tuning run {run_id}")
    raise typer.Exit(0 if chosen else 1)


def _traced_candidates(base: Any, candidates: list, say: Any) -> tuple[list, dict[str, Any]]:
    """(the candidates that fit by their trace, or that the trace could not follow; each traced
    candidate's TracedMemory). The trace is the trainer's own step at the recipe's GPU layout
    (trainstack.tuning.trace), so it guards the GPU run whatever machine the jobs run on."""
    from trainstack.planner import recipe_memory
    from trainstack.planner.traced import traced_memory
    from trainstack.tuning.candidates import apply
    from trainstack.tuning.trace import run_trace

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


def _tuning_id() -> str:
    """`tune-<base36 seconds>`: a run id (naming.RUN_ID: lowercase, digits, hyphens, at most 16), so
    the tuning run's jobs are named like a run's jobs; unique per second."""
    n, digits = int(time.time()), ""
    while n:
        n, d = divmod(n, 36)
        digits = "0123456789abcdefghijklmnopqrstuvwxyz"[d] + digits
    return f"tune-{digits}"


def _emulator() -> Any:
    """The emulator's Aws when one is running here (its jobs train for real), else None. Running: the
    recorded emulator's server process is alive (a busy one answers late: trainstack.emulator.endpoint
    .running waits for it), or AWS_ENDPOINT_URL names one that answers."""
    import os

    from trainstack.aws.session import Aws
    from trainstack.emulator import endpoint

    if os.environ.get("AWS_ENDPOINT_URL"):
        if not endpoint.answers(os.environ["AWS_ENDPOINT_URL"], timeout_s=15.0):
            return None
    elif endpoint.running() is None:
        return None
    try:
        return Aws(local=True)
    except TrainstackError:
        return None


EMULATOR_ROLE = "arn:aws:iam::123456789012:role/trainstack-tuning"  # the emulator checks no IAM
EMULATOR_BUCKET = "trainstack-tuning"


class _SageMakerJobs:
    """The candidates' short jobs as SageMaker training jobs, one after another: on AWS those of the
    recipe's deployed stacks (the execution role, the bucket and its key, the deployed training image);
    on the emulator the same where the stacks are deployed there, else a role and a bucket of its own
    (the emulator runs this checkout's trainer whatever the image URI says)."""

    def __init__(self, recipe: Any, team: str | None, say: Any, aws: Any):
        from trainstack.cli.commands.launch import _deployed_image
        from trainstack.cli.commands.run_access import deploy_hint, deployed
        from trainstack.recipes import naming
        from trainstack.tuning.store import Hardware, recipe_hardware

        self.recipe, self.team, self.say, self.aws = recipe, team, say, aws
        try:
            stacks = deployed(
                aws, naming.stack_prefix(recipe, team), deploy_hint(recipe.name, team, aws.local)
            )
            self.values = {
                "role_arn": stacks.launcher["ExecutionRoleArn"],
                "bucket_name": stacks.data["BucketName"],
                "kms_key_arn": stacks.data["KeyArn"],
                "image_uri": _deployed_image(aws, stacks.start_job),
            }
        except TrainstackError:
            if not aws.local:
                raise
            s3 = aws.client("s3")
            try:
                s3.head_bucket(Bucket=EMULATOR_BUCKET)
            except Exception:
                s3.create_bucket(Bucket=EMULATOR_BUCKET)
            self.values = {
                "role_arn": EMULATOR_ROLE,
                "bucket_name": EMULATOR_BUCKET,
                "kms_key_arn": None,
                "image_uri": "trainstack-local:emulator",
            }
        # Clients made once: boto3 clients may be shared by threads (--parallel), a session's factory not.
        self.sagemaker, self.logs = aws.client("sagemaker"), aws.client("logs")
        if aws.local:
            from trainstack.emulator import jobs as emulator_jobs
            from trainstack.emulator import stand_in
            from trainstack.tuning.local import LOCAL_INSTANCE, trainer_digest

            nodes = recipe.compute.instance_count
            ranks = stand_in.ranks_per_node(recipe, nodes, emulator_jobs.RANKS_PER_NODE) * nodes
            self.hardware = Hardware(LOCAL_INSTANCE, "cpu", trainer_digest(), ranks)
        else:
            self.hardware = recipe_hardware(recipe, self.values["image_uri"])

    def names(self, tuning_id: str, count: int) -> list[str]:
        from trainstack.aws.tuning_jobs import job_names

        return job_names(self.recipe, self.team, tuning_id, count)

    def run(self, name: str, tuning_id: str, candidate: Any, job_recipe: Any, steps: Any) -> Any:
        from trainstack.aws.tuning_jobs import run_training_job, tuning_job_request
        from trainstack.tuning import engine
        from trainstack.tuning.measure import ranks_of

        body = tuning_job_request(
            job_recipe,
            self.team,
            job_name=name,
            tuning_id=tuning_id,
            candidate=candidate.name,
            max_steps=steps.max_steps,
            planned_seconds=steps.max_steps * candidate.planned.step_time_s,
            region=self.aws.region,
            **self.values,
        )
        job = run_training_job(
            self.sagemaker,
            self.logs,
            body,
            poll_s=1.0 if self.aws.local else 15.0,
            echo=self.say,
        )
        failed, reason = job.status != "Completed", job.failure_reason
        stand_in = job.environment.get("TRAINSTACK_EMULATOR_STAND_IN")
        ranks = ranks_of(job.lines)
        if stand_in:  # the emulator trained a smaller model: nothing of this layout was measured
            failed, reason = True, f"not measured: the emulator trained a stand-in ({stand_in})"
        elif ranks is not None and ranks != self.hardware.ranks:
            failed, reason = True, f"ran on {ranks} ranks, the tuning run measures {self.hardware.ranks}"
        return engine.JobResult(job.lines, failed, reason, job.billable_seconds)


def _layout_key(base: Any, overrides: tuple[str, ...]) -> list:
    from trainstack.tuning.candidates import apply
    from trainstack.tuning.store import layout_key

    return layout_key(apply(base, overrides))


def _print(choice: dict, as_json: bool, say: Any) -> None:
    if as_json:
        typer.echo(json.dumps(choice, indent=2))
        return
    for c in choice["candidates"]:
        m = c["measured"]
        figures = (
            f"{m['tokens_per_s']:,.0f} +- {m['tokens_per_s_spread']:,.0f} tokens/s, "
            f"step {m['step_time_s']:.4f} s"
            if m
            else c.get("why", "")
        )
        typer.echo(f"{c['name']} {c['status']:>7}  {c['layout']}: {figures}")
    if choice["chosen"]:
        flags = " ".join(f"--set {o}" for o in choice["chosen"]["overrides"]) or "(the recipe's own layout)"
        typer.echo(f"chosen: {choice['chosen']['name']} {flags}")
        typer.echo(f"why: {choice['chosen']['why']}")
        typer.echo("next: trainstack launch ... --tuned (or paste the --set flags)")
    else:
        typer.echo("chosen: none (no candidate completed with an agreeing loss)")


def _record_mlflow(
    uri: str | None,
    local: bool,
    jobs: Any,
    recipe: Any,
    team: str | None,
    run_id: str,
    outcome: Any,
    choice: dict,
    say: Any,
) -> None:
    """The tuning run in MLflow, where a tracker is known: --mlflow, else the emulator's (--local), else
    the recipe's own tracker (tracking.mlflow; trainstack.cli.commands.mlflow_access). A tracker's
    trouble is one warning line: the measurements are already in the tuning store."""
    if uri is None and local:
        from trainstack.emulator import endpoint

        uri = (endpoint.read_state() or {}).get("mlflow")
    elif uri is None and jobs is not None:
        from trainstack.cli.commands import mlflow_access
        from trainstack.cli.commands.run_access import deploy_hint

        try:
            uri = mlflow_access.tracking_uri(jobs.aws, recipe, team, deploy_hint(recipe.name, team, False))
        except TrainstackError as error:
            say(f"warning: {error}; the tuning run is not recorded in MLflow")
            return
    if not uri:
        return
    from trainstack.aws import tracking

    summary = {
        "chosen": choice["chosen"]["name"] if choice["chosen"] else "none",
        "why": outcome.choice.why[:5000],
        "spent_usd": f"{outcome.spent_usd:.4f}",
    }
    tags = {"trainstack.recipe": recipe.name, "trainstack.team": tracking.team_of(recipe, team)}
    import contextlib
    import sys

    try:
        # MLflow prints a "View run" line per finished run on stdout, which carries --json's answer.
        with contextlib.redirect_stdout(sys.stderr):
            parent = tracking.record_tuning(
                uri, tracking.experiment_name(recipe, team), run_id, tags, summary, choice["candidates"]
            )
        say(f"mlflow: {tracking.run_url(uri, parent.experiment_id, parent.run_id)}")
    except Exception as error:  # the tracker's trouble never loses the measurements (already stored)
        say(f"warning: could not record the tuning run in MLflow {uri}: {type(error).__name__}: {error}")
