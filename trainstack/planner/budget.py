"""Budget guard: a team's caps on nodes and planned run cost, and the cost above which a human approves.

Pure functions over a Recipe and its Plan (trainstack.planner.plan). `trainstack validate` / `plan`, the
CDK app and the pipelines call `enforce`, so a recipe over its team's cap fails the same way everywhere:

    recipes/teams/nlp/30b-fp8.yaml: compute.instance_count: 8 instances is over the team cap
    budget.max_instance_count = 4 (set in recipes/teams/nlp/defaults.yaml)

The caps live in the recipe's `budget` section, normally written once in a team's defaults.yaml. The
cost compared is the plan's central figure, at the team's own price per instance-hour when its
defaults set `compute.usd_per_instance_hour` (the message gives the planner's range beside it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainstack.errors import RecipeError

if TYPE_CHECKING:  # the planner imports nothing from here; keep it that way
    from trainstack.planner import Plan
    from trainstack.recipes.loader import ResolvedRecipe
    from trainstack.recipes.schema import Recipe


@dataclass(frozen=True)
class Overrun:
    field: str  # the recipe field that is over its cap
    cap_field: str  # the budget field that sets the cap
    message: str


@dataclass(frozen=True)
class BudgetCheck:
    run_usd: float | None  # planned cost of the whole run, None without a plan
    approval_usd: float
    overruns: tuple[Overrun, ...]

    @property
    def ok(self) -> bool:
        return not self.overruns

    @property
    def needs_approval(self) -> bool:
        """Runs planned above the approval threshold wait for a human (GitHub environment, pipeline stage)."""
        return self.run_usd is not None and self.run_usd > self.approval_usd


def check(recipe: Recipe, plan: Plan | None) -> BudgetCheck:
    """Compare a recipe (and its plan's projected cost) with its budget caps. Never raises."""
    budget, compute = recipe.budget, recipe.compute
    overruns: list[Overrun] = []
    if budget.max_instance_count is not None and compute.instance_count > budget.max_instance_count:
        overruns.append(
            Overrun(
                "compute.instance_count",
                "budget.max_instance_count",
                f"{compute.instance_count} instances is over the team cap "
                f"budget.max_instance_count = {budget.max_instance_count}",
            )
        )
    cost = getattr(plan, "cost", None)  # None: no plan (or a test double without costs)
    run_usd = float(cost.total_usd) if cost is not None else None
    if budget.max_run_usd is not None and run_usd is not None and run_usd > budget.max_run_usd:
        price = (
            "the team's compute.usd_per_instance_hour" if compute.usd_per_instance_hour else "catalogue price"
        )
        overruns.append(
            Overrun(
                "budget.max_run_usd",
                "budget.max_run_usd",
                f"planned run cost {usd(run_usd)} ({compute.instance_count} x {compute.instance_type} for "
                f"{cost.hours:,.1f} h at {usd(cost.usd_per_hour)}/h, {price}{_range(cost)}) is over the "
                f"team cap budget.max_run_usd = {usd(budget.max_run_usd)}",
            )
        )
    return BudgetCheck(run_usd=run_usd, approval_usd=budget.approval_usd, overruns=tuple(overruns))


def enforce(resolved: ResolvedRecipe, plan: Plan | None) -> BudgetCheck:
    """`check`, raising a one-line RecipeError for the first overrun, naming the file and the cap's origin."""
    result = check(resolved.recipe, plan)
    if result.overruns:
        first = result.overruns[0]
        # The file that wrote the offending value; for cost, the recipe's most specific file.
        source = resolved.sources.get(first.field) if first.field != first.cap_field else None
        source = source or (resolved.files[-1] if resolved.files else resolved.source_of(first.field))
        cap_source = resolved.source_of(first.cap_field)
        raise RecipeError(source, first.field, f"{first.message} (set in {cap_source})")
    return result


def usd(value: float) -> str:
    return f"${value:,.0f}"


def _range(cost) -> str:
    """'; planner's range $257,000-$523,000' when the plan carries one (test doubles may not)."""
    low_high = getattr(cost, "total_usd_range", None)
    return f"; planner's range {usd(low_high[0])}-{usd(low_high[1])}" if low_high and low_high[1] else ""
