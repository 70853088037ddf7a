"""The choice: projected cost to finish the whole run from what each candidate measured.

Projected cost of a candidate: the planner's run (trainstack.planner.run_plan: jobs, restarts, node
failures, saves) at the measured step time instead of the planned one, with the measured checkpoint
save in place of the planned one where the run waits for a whole save (the final save and each job
boundary), priced at the recipe's instance price for its nodes. Its range: the same at the step time
plus and minus the measured spread.

A winner only where it beats the runner-up beyond the noise: its projected cost at its slow end is
below the runner-up's at its fast end. Otherwise every candidate whose range overlaps the cheapest
one's is as good as measured, and the simpler layout is chosen: the fewest changes to the recipe (the
recipe's own is the simplest), then the cheaper. Candidates train the same run, so their losses must
agree: one whose mean loss over the common steps is more than LOSS_TOLERANCE away from the median of
all of them (of two: from the recipe's own layout's) is flagged, and never chosen. One that ran out
of memory is `oom`; any other failure `failed`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from trainstack.planner import price, recipe_throughput
from trainstack.planner.run_plan import HOUR_S, IntervalError, plan_run
from trainstack.recipes.schema import Recipe
from trainstack.tuning.candidates import Candidate, apply
from trainstack.tuning.measure import Measurement

# Same data, seed and model: the losses differ only by reduction order and precision (micro-batch,
# recompute, FP8 recipe). 2% of the mean loss over the window is well outside that on published runs
# and well inside what a wrong layout does (a broken accumulation doubles the early loss, or stalls it).
LOSS_TOLERANCE = 0.02


@dataclass(frozen=True)
class Outcome:
    candidate: Candidate
    measurement: Measurement
    status: str  # ok | oom | failed | flagged
    why: str = ""
    usd: float | None = None  # projected cost to finish the run
    usd_range: tuple[float, float] | None = None  # (fast end, slow end)
    hours: float | None = None

    def to_dict(self) -> dict:
        measured = self.measurement.to_dict() if self.measurement.ok else {}
        d = {
            "name": self.candidate.name,
            "overrides": list(self.candidate.overrides),
            "layout": self.candidate.describe,
            "status": self.status,
            "planned": self.candidate.planned.to_dict(),
            "measured": measured,
        }
        if self.why:
            d["why"] = self.why
        if self.usd is not None:
            d["projected"] = {
                "usd": round(self.usd, 2),
                "usd_range": [round(v, 2) for v in self.usd_range or (self.usd, self.usd)],
                "hours": round(self.hours or 0.0, 3),
            }
        return d


@dataclass(frozen=True)
class Choice:
    outcomes: tuple[Outcome, ...]
    chosen: Outcome | None
    why: str
    gain: float | None  # tokens per dollar of the chosen over the recipe's own layout (1.18 = 18% more)
    beyond_noise: bool  # the chosen beat the runner-up beyond the measured spread

    def to_dict(self) -> dict:
        return {
            "candidates": [o.to_dict() for o in self.outcomes],
            "chosen": None
            if self.chosen is None
            else {
                "name": self.chosen.candidate.name,
                "overrides": list(self.chosen.candidate.overrides),
                "why": self.why,
                "tokens_per_usd_gain": None if self.gain is None else round(self.gain, 4),
            },
        }


def projected_cost(recipe: Recipe, step_time_s: float, save_s: float | None = None) -> tuple[float, float]:
    """(USD, instance hours per node) to finish `recipe`'s run at `step_time_s` per step."""
    thr = recipe_throughput(recipe)
    micro = step_time_s * thr.micro_step_time_s / thr.step_time_s if thr.step_time_s else None
    try:
        run = plan_run(recipe, step_time_s, step_time_s, micro)
    except IntervalError:
        # At the measured speed the recipe's checkpoint interval is shorter than a save: the run
        # would need a longer one, so project it at the Young/Daly interval the planner would pick.
        unset = apply(recipe, ("checkpointing.interval_steps=", "checkpointing.interval_minutes="))
        run = plan_run(unset, step_time_s, step_time_s, micro)
    hours = run.hours + run.overhead_hours
    if save_s is not None:  # the run waits for a whole save at its end and at each job boundary
        hours += run.jobs * (save_s - run.checkpoint.save_seconds) / HOUR_S
    nodes = recipe.compute.instance_count
    return hours * nodes * price(recipe).usd_per_instance_hour, hours


def _cost_outcome(recipe: Recipe, candidate: Candidate, m: Measurement) -> Outcome:
    variant = apply(recipe, candidate.overrides)
    usd, hours = projected_cost(variant, m.step_time_s, m.checkpoint_save_s)
    fast, _ = projected_cost(variant, max(m.step_time_s - m.step_time_spread, 1e-9), m.checkpoint_save_s)
    slow, _ = projected_cost(variant, m.step_time_s + m.step_time_spread, m.checkpoint_save_s)
    return Outcome(candidate, m, "ok", usd=usd, usd_range=(fast, slow), hours=hours)


def choose(recipe: Recipe, candidates: list[Candidate], measurements: dict[str, Measurement]) -> Choice:
    """The layout to train `recipe`'s run with, from each candidate's measurement (by candidate name)."""
    outcomes: list[Outcome] = []
    for c in candidates:
        m = measurements.get(c.name)
        if m is None:
            outcomes.append(
                Outcome(c, Measurement("failed", "not run"), "failed", "not run (budget or stop)")
            )
        elif not m.ok:
            outcomes.append(Outcome(c, m, m.status, m.reason))
        else:
            outcomes.append(_cost_outcome(recipe, c, m))
    outcomes = _flag_losses(outcomes)
    ok = [o for o in outcomes if o.status == "ok"]
    if not ok:
        return Choice(tuple(outcomes), None, "no candidate completed with an agreeing loss", None, False)
    ranked = sorted(ok, key=lambda o: o.usd)
    best = ranked[0]
    if len(ranked) == 1:
        chosen, beyond = best, False
        why = f"{best.candidate.name} is the only candidate that completed with an agreeing loss"
    else:
        runner = ranked[1]
        if best.usd_range[1] < runner.usd_range[0]:
            chosen, beyond = best, True
            why = (
                f"{best.candidate.name} projects {best.usd:,.2f} USD to finish the run, "
                f"{runner.usd / best.usd - 1:.1%} below the runner-up {runner.candidate.name} "
                f"({runner.usd:,.2f} USD), beyond the measured spread"
            )
        else:
            tied = [o for o in ranked if o.usd_range[0] <= best.usd_range[1]]
            chosen = min(tied, key=lambda o: (o.candidate.changes, o.usd))
            beyond = False
            names = ", ".join(o.candidate.name for o in tied)
            why = (
                f"{names} are within the measured spread of the cheapest ({best.candidate.name}, "
                f"{best.usd:,.2f} USD): the simplest, {chosen.candidate.name} "
                f"({chosen.candidate.changes} change{'s' if chosen.candidate.changes != 1 else ''} to the "
                "recipe), is chosen"
            )
    own = next((o for o in outcomes if o.candidate.is_recipe), None)
    gain = None
    if own is not None and own.status == "ok":
        gain = own.usd / chosen.usd
        why += f"; {gain:.2f}x tokens per dollar over the recipe's layout"
    elif own is not None:
        why += f"; the recipe's own layout is {own.status}"
    return Choice(tuple(outcomes), chosen, why, gain, beyond)


def _flag_losses(outcomes: list[Outcome]) -> list[Outcome]:
    """Flag each completed candidate whose mean loss over the common steps is off the candidates' median."""
    ok = [o for o in outcomes if o.status == "ok" and o.measurement.losses]
    if len(ok) < 2:
        return outcomes
    common = set.intersection(*({s for s, _ in o.measurement.losses} for o in ok))
    if not common:
        return outcomes
    means = {
        o.candidate.name: statistics.fmean(v for s, v in o.measurement.losses if s in common) for o in ok
    }
    # The reference: the median of every completed candidate's mean (one wrong candidate of three or more
    # cannot move it); with two, the recipe's own layout where it is one of them.
    own = next((o.candidate.name for o in ok if o.candidate.is_recipe), None)
    reference = means[own] if len(means) == 2 and own else statistics.median(means.values())
    out = []
    for o in outcomes:
        if o.candidate.name not in means:
            out.append(o)
            continue
        off = abs(means[o.candidate.name] - reference) / abs(reference)
        if off > LOSS_TOLERANCE:
            why = (
                f"loss disagrees: mean {means[o.candidate.name]:.4f} over steps {min(common)}-{max(common)} "
                f"is {off:.1%} from the candidates' median {reference:.4f} (tolerance {LOSS_TOLERANCE:.0%})"
            )
            out.append(Outcome(o.candidate, o.measurement, "flagged", why, o.usd, o.usd_range, o.hours))
        else:
            out.append(o)
    return out
