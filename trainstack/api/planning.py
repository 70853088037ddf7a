"""Planning a recipe before any GPU is paid for: `plan` (and its memory trace, `plan --trace`), `compare`
(`plan --compare`) and `validate`, the GitOps gate. Each resolves the recipe as its command does (name or
path, `team`, `overrides` for `--set`) and returns a frozen result; nothing here prints."""

from __future__ import annotations

import copy
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainstack.api.results import OnProgress, Result, report
from trainstack.errors import RecipeError, TrainstackError

if TYPE_CHECKING:
    from trainstack.planner import Plan
    from trainstack.planner.compare import CompareRow
    from trainstack.recipes.loader import ResolvedRecipe
    from trainstack.recipes.schema import Recipe

TUNING_CANDIDATES = 3  # what `plan` prices a tuning run at (trainstack tune's default)


def _environ(region: str | None) -> dict[str, str] | None:
    """The environment AWS is read with: AWS_REGION set to `region` (None: the process's own)."""
    import os

    return None if region is None else {**os.environ, "AWS_REGION": region}


def _noted(on_warning: OnProgress) -> tuple:
    """check_for_plan's `note` argument: the caller's on_warning, or nothing (its default, stderr)."""
    return () if on_warning is None else (on_warning,)


@dataclass(frozen=True)
class PlanResult(Result):
    """A recipe's plan, with what tuning runs measured for its layout and, from `trace`, the traced
    memory. `to_json()` is `trainstack plan --json` (with --trace: `memory.traced` added)."""

    resolved: ResolvedRecipe
    plan: Plan
    measured: dict[str, Any] | None
    tuning_run: dict[str, Any]
    warnings: tuple[str, ...]  # legal values that are almost surely wrong (trainstack.planner.sanity)
    local: bool = False
    region: str | None = None
    # A fine-tuning recipe (training.objective sft): epochs over its chat set, priced from the set's
    # manifest (trainstack.aws.chat_dataset), and the lines that say so; None for pretraining.
    fine_tuning: dict[str, Any] | None = None
    fine_tuning_lines: tuple[str, ...] = ()
    traced: dict[str, Any] | None = None  # trace(): memory.traced (or the planner fallback's reason)
    trace_lines: tuple[str, ...] = ()  # trace(): what the trace found, the verdict last
    trace_note: str | None = None  # trace(): why the planner's memory stands (a layout it cannot follow)

    @property
    def recipe(self) -> Recipe:
        return self.resolved.recipe

    @property
    def fits(self) -> bool:
        """The verdict: the trace's (traced + modelled) when a trace ran, else the planner's."""
        if self.traced and "fits" in self.traced:
            return bool(self.traced["fits"])
        return self.plan.fits

    @property
    def exit_code(self) -> int:
        """What `trainstack plan` exits with when the checks pass: 0 fits, 1 does not fit."""
        return 0 if self.fits else 1

    def to_document(self) -> dict[str, Any]:
        document = {**self.plan.to_dict(), "measured": self.measured, "tuning_run": self.tuning_run}
        if self.fine_tuning is not None:  # only a fine-tune's plan has the block (pretraining's is unchanged)
            document["fine_tuning"] = self.fine_tuning
        if self.trace_lines or self.traced is not None:
            document["memory"]["traced"] = copy.deepcopy(self.traced)
        return copy.deepcopy(document)

    def rerun_command(self, recipe: str, team: str | None, overrides: Sequence[str]) -> str:
        """How to re-run this plan, keeping the user's own --set flags the recommendation does not
        replace (what the recommendation's `to apply:` lines extend)."""
        replaced = {flag.split(" ", 1)[1].split("=", 1)[0] for flag in self.plan.recommendations.set_flags}
        words = ["trainstack", "plan", recipe] + (["--team", team] if team else [])
        for item in overrides:
            if item.split("=", 1)[0].strip() not in replaced:
                words += ["--set", item]
        return shlex.join(words)

    def enforce(self, on_warning: OnProgress = None) -> None:
        """The refusals `plan` prints after the plan itself (exit 2): over a team's budget cap, a request
        AWS would refuse, a base model (model.init_from) whose config.json differs from the shape. A
        base that cannot be read here is a note to `on_warning` (default: stderr, as the command)."""
        from trainstack.aws import request_check
        from trainstack.aws.base_model import check_for_plan
        from trainstack.planner import budget

        budget.enforce(self.resolved, self.plan)
        request_check.enforce(self.resolved)
        check_for_plan(self.recipe, self.local, _environ(self.region), *_noted(on_warning))


@dataclass(frozen=True)
class CompareResult(Result):
    """The recipe re-planned on every catalogued instance type; `to_json()` is `plan --compare --json`."""

    resolved: ResolvedRecipe
    plan: Plan
    rows: tuple[CompareRow, ...]
    warnings: tuple[str, ...]
    local: bool = False
    region: str | None = None

    @property
    def fits(self) -> bool:
        """The recipe's own plan's verdict (`plan --compare` exits 1 when it does not fit)."""
        return self.plan.fits

    def to_document(self) -> list[dict[str, Any]]:
        return [row.to_dict() for row in self.rows]

    def enforce(self, on_warning: OnProgress = None) -> None:
        """As PlanResult.enforce (`plan --compare` refuses the same recipes after its table)."""
        from trainstack.aws import request_check
        from trainstack.aws.base_model import check_for_plan
        from trainstack.planner import budget

        budget.enforce(self.resolved, self.plan)
        request_check.enforce(self.resolved)
        check_for_plan(self.resolved.recipe, self.local, _environ(self.region), *_noted(on_warning))


def _resolve_and_plan(
    recipe: str,
    team: str | None,
    overrides: Sequence[str],
    recipes_dir: str | Path | None,
    on_warning: OnProgress,
) -> tuple[ResolvedRecipe, Plan, tuple[str, ...]]:
    from trainstack.planner import plan as make_plan
    from trainstack.planner import sanity
    from trainstack.planner.run_plan import IntervalError
    from trainstack.recipes.loader import resolve

    resolved = resolve(recipe, team=team, overrides=tuple(overrides), recipes_dir=recipes_dir)
    try:
        planned = make_plan(resolved.recipe)
    except IntervalError as error:  # name the file that set the interval
        raise RecipeError(resolved.source_of(error.field), error.field, error.message) from None
    warnings = tuple(sanity.lines(resolved, planned, None))
    for line in warnings:  # as soon as they are known: before a trace's minute of work
        report(on_warning, line)
    return resolved, planned, warnings


def plan(
    recipe: str,
    *,
    team: str | None = None,
    overrides: Sequence[str] = (),
    local: bool = False,
    region: str | None = None,
    ranks: int | None = None,
    recipes_dir: str | Path | None = None,
    enforce: bool = True,
    on_warning: OnProgress = None,
) -> PlanResult:
    """Plan `recipe`: memory per GPU and its verdict, throughput, time and cost with their ranges, the
    run, one recommendation, and what tuning runs measured for its layout (`local`: the figures measured
    on the emulator's CPU jobs, `ranks` of them per job; a CPU measurement never changes a GPU plan).
    A fine-tuning recipe's epochs are priced from its chat set's manifest.json (through the emulator's S3
    with `local`); one it cannot read leaves them unpriced (`fine_tuning["reason"]`), one that is not a
    chat set's raises.

    `enforce` (default): raise the one-line error `trainstack plan` prints after the plan when the
    recipe is over a team's budget cap, would be refused by AWS, or names a base model of another
    shape; without it, call `result.enforce()` yourself. A plan that does not fit is not an error:
    see `result.fits`. `on_warning` is called with each line of `result.warnings` (values that are
    legal but almost surely wrong) as soon as the plan is made."""
    from trainstack.aws.chat_dataset import fine_tuning_for_plan

    resolved, planned, warnings = _resolve_and_plan(recipe, team, overrides, recipes_dir, on_warning)
    # A fine-tune's chat set that is not one refuses the plan here, in one line naming data.train_s3_uri.
    fine_tuning, fine_tuning_lines = fine_tuning_for_plan(resolved.recipe, planned, local, _environ(region))
    result = PlanResult(
        resolved=resolved,
        plan=planned,
        measured=_measured(resolved.recipe, local, ranks),
        tuning_run=_tuning_run(resolved.recipe),
        warnings=warnings,
        local=local,
        region=region,
        fine_tuning=fine_tuning,
        fine_tuning_lines=tuple(fine_tuning_lines),
    )
    if enforce:
        result.enforce(on_warning)
    return result


def trace(
    recipe: str,
    *,
    team: str | None = None,
    overrides: Sequence[str] = (),
    local: bool = False,
    region: str | None = None,
    ranks: int | None = None,
    recipes_dir: str | Path | None = None,
    timeout: float | None = None,
    enforce: bool = True,
    on_warning: OnProgress = None,
) -> PlanResult:
    """`plan`, and the trainer's own step at full size on fake tensors (python -m trainer.trace under
    torch's FSDP memory tracker; cached), judging memory by traced + modelled against the GPU
    (`trainstack plan --trace`). The trace's progress goes to stderr; `timeout` bounds it (seconds).
    A layout the trace cannot follow keeps the planner's memory, with `trace_note` saying why."""
    from trainstack.tuning.trace import run_trace

    result = plan(
        recipe,
        team=team,
        overrides=overrides,
        local=local,
        region=region,
        ranks=ranks,
        recipes_dir=recipes_dir,
        enforce=False,
        on_warning=on_warning,
    )
    outcome = run_trace(result.recipe, timeout_s=timeout)
    if outcome.error is not None:
        raise TrainstackError(outcome.error)
    if outcome.report is None:
        knob, reason = outcome.unsupported["knob"], outcome.unsupported["reason"]
        memory = result.plan.memory
        note = (
            f"trace: could not follow {knob} ({reason}); memory is the planner's, not traced: "
            f"{memory.peak_gib:.1f} GiB of {memory.usable_gib:.0f}"
        )
        traced: dict[str, Any] = {"fallback": "planner", "knob": knob, "reason": reason}
        found = _replace(result, traced=traced, trace_note=note)
    else:
        from trainstack.planner.traced import counted_plan

        document, lines = _traced(result, outcome)
        # The plan's time, MFU and cost by the counted FLOPs where they differ from its own by over 2%.
        counted = counted_plan(result.recipe, result.plan, document["counted_flops"])
        found = _replace(result, plan=counted, traced=document, trace_lines=lines)
    if enforce:
        found.enforce(on_warning)
    return found


def _replace(result: PlanResult, **changes: Any) -> PlanResult:
    from dataclasses import replace

    return replace(result, **changes)


def _traced(result: PlanResult, outcome: Any) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The trace's memory with the modelled terms (trainstack.planner.traced) as `memory.traced`, and
    the lines `plan --trace` prints after the plan, the verdict on traced + modelled last."""
    from trainstack.planner import recipe_memory
    from trainstack.planner.traced import counted_flops, counted_flops_lines, traced_memory

    recipe, planned = result.recipe, result.plan
    # The unrounded breakdown (the plan's is rounded to MiB: a CPU test's tiny model would plan 0).
    memory = traced_memory(
        recipe, recipe_memory(recipe), planned.memory.usable_gib, outcome.report, cached=outcome.cached
    )
    flops = counted_flops(outcome.report, planned.throughput)
    document = {**memory.to_json(), "counted_flops": flops}
    categories = ", ".join(f"{k} {v:.1f}" for k, v in memory.by_category_gib.items())
    modelled = ", ".join(f"{k} {v:.2f}" for k, v in memory.modelled.items())
    at = memory.peak_at
    lines = [
        f"traced step ({'cached' if memory.cached else 'run'}, {memory.seconds:.0f} s to trace): "
        f"{categories} GiB; "
        f"peak in {at.get('phase', '?')} of {at.get('module', '?')} (step {at.get('step', '?')}, "
        f"micro-step {at.get('micro_step', '?')}); the planner's same-scope figure "
        f"{memory.planned_same_scope_gib:.1f} GiB "
        f"({memory.planned_same_scope_gib / memory.traced_gib - 1:+.1%})",
        f"modelled (not traceable; docs/planner.md): {modelled} GiB",
        *(f"note: {note}" for note in memory.notes),
    ]
    lines.extend(counted_flops_lines(flops))
    lines.append(memory.verdict)
    return document, tuple(lines)


def compare(
    recipe: str,
    *,
    team: str | None = None,
    overrides: Sequence[str] = (),
    local: bool = False,
    region: str | None = None,
    recipes_dir: str | Path | None = None,
    enforce: bool = True,
    on_warning: OnProgress = None,
) -> CompareResult:
    """`recipe` re-planned on every catalogued instance type, each with the layout the recommender picks
    there for the same planned time (`trainstack plan --compare`). `enforce`: as for `plan`."""
    from trainstack.planner.compare import compare as compare_rows

    resolved, planned, warnings = _resolve_and_plan(recipe, team, overrides, recipes_dir, on_warning)
    rows = tuple(compare_rows(resolved.recipe, planned))
    result = CompareResult(resolved, planned, rows, warnings, local, region)
    if enforce:
        result.enforce(on_warning)
    return result


def _tuning_run(recipe: Recipe) -> dict[str, Any]:
    from trainstack.tuning.engine import tuning_estimate_usd

    return {"candidates": TUNING_CANDIDATES, "usd": round(tuning_estimate_usd(recipe, TUNING_CANDIDATES), 2)}


def _measured(recipe: Recipe, local: bool, ranks: int | None) -> dict[str, Any] | None:
    """What tuning runs measured for this layout on the hardware planned for (trainstack.tuning.store):
    the recipe's instance type and GPU, or with `local` the emulator's CPU jobs; None when nothing was."""
    from trainstack.tuning.store import Store, recipe_hardware, refit

    store = Store()
    if local:
        from trainstack.tuning.local import local_hardware

        # Without `ranks`: the ranks an emulator job of the recipe runs (what `tune --local` measures
        # on the emulator), else 1 (`tune --local` without an emulator, its --ranks default).
        counts = [ranks] if ranks is not None else list(dict.fromkeys((_emulator_ranks(recipe), 1)))
        for count in counts:
            hardware = local_hardware(count)
            found = refit(recipe, hardware, store)
            if found is not None:
                break
    else:
        hardware = recipe_hardware(recipe)
        found = refit(recipe, hardware, store)
    if found is None:
        return None
    return {
        "step_time_s": found.step_time_s,
        "tokens_per_s": found.tokens_per_s,
        "peak_mem_gib": found.peak_gib,
        "planned_step_time_s": found.planned_step_time_s,
        "exact": found.exact,
        "clock": found.clock,
        "source": found.source,
        "hardware": hardware.describe(),
        "run": found.run,
        "date": found.date,
    }


def _emulator_ranks(recipe: Recipe) -> int:
    """The ranks an emulator job of `recipe` runs (the count `tune --local` measured on the emulator
    records its figures under): a default of 1 found nothing after a tuning run on the emulator."""
    from trainstack.emulator import jobs as emulator_jobs
    from trainstack.emulator import stand_in

    nodes = recipe.compute.instance_count
    return stand_in.ranks_per_node(recipe, nodes, emulator_jobs.RANKS_PER_NODE) * nodes
