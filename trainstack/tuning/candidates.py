"""The candidates of a tuning run: the planner's best layouts by predicted cost to finish the run.

Every candidate trains the same run: the same model, global batch, sequence length, data and seed;
only how each step is laid out on the GPUs changes (micro-batch, activation checkpointing mode and
frequency, shard group, FP8 recipe, compile), and only where the planner predicts it fits within its
headroom. The recipe's own layout is always a candidate (the reference every gain is stated against),
fitting or not: a recipe layout that runs out of memory is worth knowing too. Node count and instance
type stay the recipe's: the short jobs share one warm pool, which only a job of the same instance type
and count can reuse, and the node count is how long the user chose to wait.

Which n - 1 besides the recipe's: the cheapest predicted run first; then, among layouts whose predicted
cost is within the arithmetic's own error of the cheapest (its leave-one-out band, LOO_LOG_ERROR), the
ones that differ most from those already picked. Measuring three layouts the planner cannot tell apart
and that differ in one knob each teaches less than measuring layouts that differ in several: the tuning
run exists because the arithmetic's error is larger than the gaps between its best layouts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from trainstack.errors import TrainstackError
from trainstack.planner import (
    HEADROOM,
    LOO_LOG_ERROR,
    checkpointing_label,
    price,
    recipe_memory,
    recipe_throughput,
)
from trainstack.planner.memory import peak
from trainstack.planner.search import checkpointing_options
from trainstack.recipes.overrides import parse_set
from trainstack.recipes.schema import Recipe

FP8_RECIPES_BLACKWELL = ("mxfp8", "current", "delayed", "block")
FP8_RECIPES_HOPPER = ("current", "delayed")  # mxfp8 and block scaling need Blackwell's MX formats


@dataclass(frozen=True)
class Planned:
    """What the planner's arithmetic predicts for one candidate on the recipe's hardware."""

    step_time_s: float
    tokens_per_s: float  # per GPU
    peak_gib: float
    hours: float  # training hours of the whole run (recipe.training.steps)
    usd: float  # those hours at the cluster's price

    def to_dict(self) -> dict[str, float]:
        return {
            "step_time_s": round(self.step_time_s, 6),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "peak_mem_gib": round(self.peak_gib, 3),
            "hours": round(self.hours, 4),
            "usd": round(self.usd, 2),
        }


@dataclass(frozen=True)
class Candidate:
    name: str  # c0 is the recipe's own layout
    overrides: tuple[str, ...]  # `key=value`, as --set takes them; empty for the recipe's own
    describe: str  # the layout in words
    planned: Planned
    fits: bool
    knobs: tuple = ()  # (micro-batch, checkpointing, shard group, compile, fp8 recipe): for diversity

    @property
    def is_recipe(self) -> bool:
        return not self.overrides

    @property
    def changes(self) -> int:
        """How many knobs differ from the recipe's: the measure of `simpler` in a tie."""
        return len(self.overrides)


def apply(recipe: Recipe, overrides: tuple[str, ...] | list[str], source: str = "tuning") -> Recipe:
    """The recipe with `key=value` overrides applied and validated (a TrainstackError names the field)."""
    if not overrides:
        return recipe
    data = recipe.model_dump(mode="json", exclude={"extends"})
    _merge(data, parse_set(overrides, source))
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise TrainstackError(f"{source}: {where}: {first['msg'].removeprefix('Value error, ')}") from None


def _merge(into: dict[str, Any], overlay: dict[str, Any]) -> None:
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _knob_overrides(
    recipe: Recipe,
    mb: int,
    ac_mode: str,
    every: int,
    policy: str,
    group: int,
    compile_on: bool,
    fp8: str | None,
) -> tuple[str, ...]:
    """The --set overrides that turn the recipe's layout into this one (only what differs)."""
    tr, ac = recipe.training, recipe.activation_checkpointing
    out = []
    if mb != tr.micro_batch:
        out.append(f"training.micro_batch={mb}")
    if ac_mode != ac.mode:
        out.append(f"activation_checkpointing.mode={ac_mode}")
    if ac_mode == "selective" and policy == "block" and every != ac.every:
        out.append(f"activation_checkpointing.every={every}")
    if policy != ac.policy:
        out.append(f"activation_checkpointing.policy={policy}")
    if group != recipe.parallelism.shard_group:
        out.append(f"parallelism.shard_group={group}")
    own_compile = tr.compile if tr.compile is not None else True
    if compile_on != own_compile:
        out.append(f"training.compile={'true' if compile_on else 'false'}")
    if fp8 is not None and fp8 != recipe.precision.fp8_recipe:
        out.append(f"precision.fp8_recipe={fp8}")
    return tuple(out)


def plan_layout(recipe: Recipe, world: int | None = None) -> tuple[Planned, bool]:
    """The planner's prediction for a resolved recipe's layout, on `world` ranks (default its own)."""
    world = world or recipe.world_size
    thr = recipe_throughput(recipe, world_size=world)
    peak_gib = peak(recipe_memory(recipe))
    fits = peak_gib <= recipe.instance.gpu.usable_gib * (1 - HEADROOM)
    hours = recipe.training.steps * thr.step_time_s / 3600.0
    nodes = max(1, world // recipe.instance.gpus)
    usd = hours * nodes * price(recipe).usd_per_instance_hour
    return Planned(thr.step_time_s, thr.tokens_per_sec_per_gpu, peak_gib, hours, usd), fits


def candidates(
    recipe: Recipe, n: int = 3, world: int | None = None, compile_choices: bool = True
) -> list[Candidate]:
    """The recipe's own layout and the n - 1 other layouts the planner predicts finish the run for the
    least money, each predicted to fit. `world`: the ranks the short jobs run on (default the recipe's;
    a local CPU tuning run uses fewer), which bounds the micro-batch and the shard group.
    `compile_choices`: try compile on and off (off on CPU, where the trainer never compiles)."""
    if n < 1:
        raise TrainstackError(f"--candidates: {n}: at least 1 (the recipe's own layout)")
    world = world or recipe.world_size
    if recipe.training.global_batch % world:
        raise TrainstackError(
            f"training.global_batch: {recipe.training.global_batch} is not divisible by the {world} ranks "
            "the tuning jobs run on"
        )
    per_rank = recipe.training.global_batch // world
    own_planned, own_fits = plan_layout(recipe, world)
    own = Candidate("c0", (), _describe(recipe), own_planned, own_fits)
    dtype = recipe.precision.dtype
    fp8_options: tuple[str | None, ...] = (None,)
    if dtype == "fp8":
        fp8_options = FP8_RECIPES_BLACKWELL if recipe.instance.gpu.supports_mxfp8 else FP8_RECIPES_HOPPER
    own_compile = recipe.training.compile if recipe.training.compile is not None else True
    compiles = (True, False) if compile_choices else (own_compile,)
    if world < recipe.world_size:  # fewer ranks than planned (a local run): the shard group is moot there
        groups = [recipe.parallelism.shard_group]
    else:  # inside one node every group rides NVLink; wider ones only where the recipe already shards so
        groups = [
            g for g in _divisors(world) if g <= max(recipe.instance.gpus, recipe.parallelism.shard_group)
        ]
    seen = {()}
    found: list[Candidate] = []
    for ac in checkpointing_options(dtype):
        for mb in _divisors(per_rank):
            for group in groups:
                for compile_on in compiles:
                    for fp8 in fp8_options:
                        flags = _knob_overrides(
                            recipe, mb, ac.mode, ac.every, ac.policy, group, compile_on, fp8
                        )
                        if flags in seen:
                            continue
                        seen.add(flags)
                        try:
                            variant = apply(recipe, flags)
                        except TrainstackError:  # a combination the schema refuses (e.g. op policy with FP8)
                            continue
                        planned, fits = plan_layout(variant, world)
                        if fits:
                            found.append(
                                Candidate("", flags, _describe(variant), planned, fits, _knobs(variant))
                            )
    own = Candidate("c0", (), own.describe, own.planned, own.fits, _knobs(recipe))
    picked = pick(own, found, n - 1)
    return [own] + [
        Candidate(f"c{i + 1}", c.overrides, c.describe, c.planned, c.fits, c.knobs)
        for i, c in enumerate(picked)
    ]


def pick(own: Candidate, found: list[Candidate], k: int) -> list[Candidate]:
    """k of `found`: the cheapest predicted run, then the most different within the planner's error."""
    if k <= 0 or not found:
        return []
    order = sorted(found, key=lambda c: (c.planned.usd, c.changes, c.overrides))
    low, high = LOO_LOG_ERROR
    band = order[0].planned.usd * math.exp(high - low)  # costs the arithmetic cannot tell from the best
    within = [c for c in order if c.planned.usd <= band]
    picked = [order[0]]
    while len(picked) < k:
        rest = [c for c in (within if len(within) > len(picked) else order) if c not in picked]
        if not rest:
            break
        # The most knobs unlike every one picked so far (the recipe's included); then the cheaper.
        picked.append(max(rest, key=lambda c: (min(_distance(c, p) for p in [own, *picked]), -c.planned.usd)))
    return picked


def _distance(a: Candidate, b: Candidate) -> int:
    return sum(x != y for x, y in zip(a.knobs, b.knobs, strict=True))


def _knobs(recipe: Recipe) -> tuple:
    tr = recipe.training
    return (
        tr.micro_batch,
        checkpointing_label(recipe.activation_checkpointing),
        recipe.parallelism.shard_group,
        tr.compile if tr.compile is not None else True,
        recipe.precision.fp8_recipe,
    )


def _describe(recipe: Recipe) -> str:
    tr, par = recipe.training, recipe.parallelism
    compile_on = tr.compile if tr.compile is not None else True
    words = [
        f"micro-batch {tr.micro_batch}",
        checkpointing_label(recipe.activation_checkpointing),
        f"shard group {par.shard_group}",
        "compile" if compile_on else "no compile",
    ]
    if recipe.precision.fp8_recipe:
        words.append(f"fp8 {recipe.precision.fp8_recipe}")
    return ", ".join(words)
