"""One tuning run: the candidates' short jobs one after another, measured, then the choice.

The jobs run through `run_job` (a local CPU process, or a SageMaker training job on the recipe's warm
pool: the CLI passes which). Sequential by default: P6 capacity is scarce, one warm pool is reused by
each next job of the same instance type and count, and a budget can stop the run between jobs; in
parallel where asked (all at once, each on its own instances, the budget checked before any starts). Every
job trains the same run with the same measurement settings (MEASUREMENT_SETTINGS): a metric line every
step, one checkpoint (the final save, measured whole), no validation, no experiment tracking of its
own (the tuning run records its figures itself).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass

from trainstack.errors import TrainstackError
from trainstack.planner import compile_on, price
from trainstack.planner.run_plan import HOUR_S, plan_run
from trainstack.recipes.schema import Recipe
from trainstack.tuning.candidates import Candidate, apply
from trainstack.tuning.choose import Choice, choose
from trainstack.tuning.measure import Measurement, StepPlan, measure, steps_for


def measurement_settings(steps: StepPlan) -> tuple[str, ...]:
    return (
        "training.log_every=1",
        f"checkpointing.interval_steps={steps.max_steps}",
        "validation=",
        "tracking.mlflow=off",
        "tracking.tensorboard=false",
    )


def job_recipe(recipe: Recipe, candidate: Candidate, steps: StepPlan) -> Recipe:
    """What a candidate's short job trains: the recipe, the candidate's layout, the measurement settings."""
    return apply(recipe, (*candidate.overrides, *measurement_settings(steps)), f"candidate {candidate.name}")


def step_plan(
    recipe: Recipe, candidate: Candidate, compiled: bool | None = None, window: int | None = None
) -> StepPlan:
    """The candidate's warm-up and window (trainstack.tuning.measure.steps_for); `window`: a fixed window
    instead (local CPU jobs, whose step time the GPU arithmetic does not predict)."""
    variant = apply(recipe, candidate.overrides)
    steps = steps_for(candidate.planned.step_time_s, compile_on(variant) if compiled is None else compiled)
    return steps if window is None else StepPlan(steps.warmup, window)


@dataclass(frozen=True)
class JobResult:
    lines: tuple[str, ...]
    failed: bool
    failure_reason: str
    seconds: float  # billed time of the job (start-up included)


def job_cost_usd(recipe: Recipe, candidate: Candidate, steps: StepPlan) -> float:
    """What one candidate's short job is planned to cost: a job's start-up and its steps at the
    planned step time, on the recipe's nodes (a warm pool makes the later jobs' start-up cheaper: this
    is the upper figure the budget is checked against)."""
    variant = apply(recipe, candidate.overrides)
    run = plan_run(variant, candidate.planned.step_time_s)
    hours = run.startup_hours_per_job + steps.max_steps * candidate.planned.step_time_s / HOUR_S
    hours += run.checkpoint.save_seconds / HOUR_S
    return hours * variant.compute.instance_count * price(variant).usd_per_instance_hour


def tuning_estimate_usd(recipe: Recipe, n: int = 3) -> float:
    """What `plan` prices a tuning run of `n` candidates at without searching them: n short jobs of the
    recipe's own layout (`tune` prints the exact figure for the candidates it picks)."""
    from trainstack.tuning.candidates import plan_layout

    planned, fits = plan_layout(recipe)
    own = Candidate("c0", (), "", planned, fits)
    return n * job_cost_usd(recipe, own, step_plan(recipe, own))


def tuning_cost_usd(recipe: Recipe, candidates: list[Candidate]) -> float:
    """The plan's price of the tuning run itself: every candidate's short job."""
    return sum(job_cost_usd(recipe, c, step_plan(recipe, c)) for c in candidates)


@dataclass(frozen=True)
class TuningRun:
    run: str
    date: str
    choice: Choice
    measurements: dict[str, Measurement]
    spent_usd: float  # the jobs' billed time at the recipe's price
    skipped: tuple[str, ...]  # candidates not run: the budget would have been exceeded


def tune(
    recipe: Recipe,
    candidates: list[Candidate],
    run_job: Callable[[Candidate, Recipe, StepPlan], JobResult],
    *,
    run: str,
    budget_usd: float | None = None,
    compiled: bool | None = None,
    window: int | None = None,
    parallel: bool = False,
    clock: str = "wall",
    on_result: Callable[[Candidate, Measurement, JobResult], None] | None = None,
) -> TuningRun:
    """Run each candidate's short job in order, measure it, and choose. `budget_usd`: a job is started
    only while the spend so far plus its planned cost stays within it. `compiled`: whether the jobs
    compile (None: as the recipe says; False for CPU jobs, where the trainer never compiles); `window`:
    steps measured per job, where the planned step time cannot size it (see step_plan)."""
    if budget_usd is not None and candidates:
        first = job_cost_usd(recipe, candidates[0], step_plan(recipe, candidates[0], compiled, window))
        if first > budget_usd:
            raise TrainstackError(
                f"--budget-usd: {budget_usd:,.2f} USD does not cover even the recipe's own layout's short "
                f"job (planned {first:,.2f} USD)"
            )
    usd_per_hour = recipe.compute.instance_count * price(recipe).usd_per_instance_hour
    spent, measurements, skipped = 0.0, {}, []
    planned_spend = 0.0
    jobs: list[tuple[Candidate, StepPlan]] = []
    for c in candidates:
        steps = step_plan(recipe, c, compiled, window)
        cost = job_cost_usd(recipe, c, steps)
        if parallel:  # nothing is spent yet when each starts: the planned costs are what is bounded
            if budget_usd is not None and planned_spend + cost > budget_usd:
                skipped.append(c.name)
                continue
            planned_spend += cost
        jobs.append((c, steps))

    def finish(c: Candidate, steps: StepPlan, result: JobResult) -> float:
        m = measure(
            result.lines,
            job_failed=result.failed,
            failure_reason=result.failure_reason,
            warmup=steps.warmup,
            final_step=steps.max_steps,
            clock=clock,
        )
        measurements[c.name] = m
        if on_result is not None:
            on_result(c, m, result)
        return result.seconds / HOUR_S * usd_per_hour

    if parallel:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=max(1, len(jobs))) as pool:
            futures = [
                (c, steps, pool.submit(run_job, c, job_recipe(recipe, c, steps), steps)) for c, steps in jobs
            ]
            for c, steps, future in futures:
                spent += finish(c, steps, future.result())
    else:
        for c, steps in jobs:
            if budget_usd is not None and spent + job_cost_usd(recipe, c, steps) > budget_usd:
                skipped.append(c.name)
                continue
            spent += finish(c, steps, run_job(c, job_recipe(recipe, c, steps), steps))
    choice = choose(recipe, candidates, measurements)
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return TuningRun(run, date, choice, measurements, spent, tuple(skipped))
