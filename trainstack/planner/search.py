"""One joint recommendation: micro-batch x checkpointing x shard group x context parallelism x node
count, searched together.

The objective is the most tokens per dollar among layouts that fit within the planner's headroom and
finish no later than the recipe's own layout would (its node count is how long the user is willing to
wait; `deadline_hours` overrides that, e.g. for `plan --compare` on another instance type). Candidates
within `TIE` of the best are ties, broken by fewer nodes, then a shard group inside one node (FSDP
traffic on NVLink, the guide's "smallest shard group that fits"), then the larger micro-batch, then
tokens per dollar. Precision is not searched: the guide's rule by size is advice beside it. The
op-level checkpointing policy is offered to BF16 recipes only (`checkpointing_options`).

Context parallelism (`cp_options`): cp 2, 4 and 8 (inside one node: the CP ranks are the innermost
mesh dimension, so a CP group stays on NVLink) for sequences that stay at least CP_MIN_LOCAL_TOKENS
per GPU; it frees activation memory (and so a lighter checkpointing mode or a larger micro-batch) at
the price of a K/V exchange per block, which the throughput model counts. Ties prefer the smaller cp.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from trainstack.planner.memory import HEADROOM, ActivationPolicy, memory_breakdown, peak
from trainstack.planner.run_plan import SPOT_PRICE_FRACTION
from trainstack.planner.throughput import ThroughputPlan, throughput
from trainstack.recipes.hardware import Instance, get_instance
from trainstack.recipes.schema import ActivationCheckpointing, Recipe

TIE = 0.03  # candidates within 3% of the best tokens per dollar are ties
NODE_COUNTS = (1, 2, 4, 8, 16, 32, 64)  # what the search tries, with the recipe's own count
FP8_MIN_PARAMS = 6.0e9
# Context parallelism is searched only while each GPU keeps at least this many tokens of a sequence:
# below that the per-block K/V exchange outweighs the attention it overlaps, and GEMMs shrink (an
# assumption, in the spirit of the Llama 3 paper's CP 16 at 128K: 8K tokens per GPU).
CP_MIN_LOCAL_TOKENS = 8192
CP_OPTIONS = (1, 2, 4, 8)


def cp_options(seq_len: int, gpus_per_node: int) -> tuple[int, ...]:
    """Context-parallel degrees the search tries for this sequence length: 1, and each cp inside a
    node that cuts the sequence into 2 x cp equal chunks of at least CP_MIN_LOCAL_TOKENS / 2."""
    return tuple(
        cp
        for cp in CP_OPTIONS
        if cp == 1
        or (cp <= gpus_per_node and seq_len % (2 * cp) == 0 and seq_len // cp >= CP_MIN_LOCAL_TOKENS)
    )  # the guide: below ~7B FP8 gains little; from ~7B it pays (Llama 2 7B has 6.7B)


CHECKPOINTING_OPTIONS = (
    ActivationCheckpointing(mode="none"),
    ActivationCheckpointing(mode="selective", every=4),
    ActivationCheckpointing(mode="selective", every=2),
    ActivationCheckpointing(mode="selective", policy="op"),
    ActivationCheckpointing(mode="full"),
)


def checkpointing_options(dtype: str) -> tuple[ActivationCheckpointing, ...]:
    """What the search tries for a recipe of this precision: the op-level policy is BF16-only (the
    trainer runs FP8 inside Transformer Engine's fused modules, which a per-op policy cannot see into;
    trainstack.recipes.schema refuses the pair)."""
    if dtype == "fp8":
        return tuple(o for o in CHECKPOINTING_OPTIONS if o.policy != "op")
    return CHECKPOINTING_OPTIONS


def checkpointing_label(ac: ActivationCheckpointing) -> str:
    if ac.mode != "selective":
        return ac.mode
    return "selective op" if ac.policy == "op" else f"selective 1/{ac.every}"


def _same_checkpointing(a: ActivationCheckpointing, b: ActivationCheckpointing) -> bool:
    return checkpointing_label(a) == checkpointing_label(b)


@dataclass(frozen=True)
class Price:
    usd_per_instance_hour: float
    source: str
    date: str
    spot: bool  # the spot assumption lowered the catalogue price


def price(recipe: Recipe, instance: Instance | None = None) -> Price:
    """What one instance-hour costs: the team's `compute.usd_per_instance_hour` for the recipe's own
    instance type, else the catalogue's on-demand figure (times the spot assumption with spot: true)."""
    instance = instance or recipe.instance
    compute = recipe.compute
    if compute.usd_per_instance_hour is not None and instance.instance_type == compute.instance_type:
        return Price(compute.usd_per_instance_hour, "compute.usd_per_instance_hour", "set by the team", False)
    if compute.spot:
        return Price(
            instance.usd_per_hour * SPOT_PRICE_FRACTION,
            f"spot assumed at {SPOT_PRICE_FRACTION:.0%} of on-demand; on-demand: {instance.price_source}",
            instance.price_date,
            True,
        )
    return Price(instance.usd_per_hour, instance.price_source, instance.price_date, False)


@dataclass(frozen=True)
class Layout:
    instance_type: str
    nodes: int
    micro_batch: int
    checkpointing: str  # label: none | selective 1/N | selective op | full
    mode: str
    every: int
    policy: str
    shard_group: int
    cp: int  # context-parallel degree
    fits: bool  # within the headroom
    peak_gib: float
    tokens_per_sec_per_gpu: float
    hours: float  # training hours
    tokens_per_usd: float

    def describe(self) -> str:
        return (
            f"{self.nodes} x {self.instance_type}, micro-batch {self.micro_batch}, {self.checkpointing}, "
            f"shard group {self.shard_group}" + (f", cp {self.cp}" if self.cp > 1 else "")
        )


@dataclass(frozen=True)
class Change:
    field: str
    recipe: str
    recommended: str
    matches: bool


@dataclass(frozen=True)
class Recommendations:
    recommended: Layout | None  # None: nothing in reach fits
    recipe_layout: Layout
    changes: tuple[Change, ...]  # each searched knob: the recipe's value beside the recommendation's
    set_flags: tuple[str, ...]  # the change as pasteable --set flags (empty: the recipe already matches)
    tokens_per_usd_gain: float | None  # recommended / recipe - 1
    deadline_hours: float
    considered: int  # layouts evaluated
    precision: str  # "bf16" or "fp8", by model size as the guide says
    precision_reason: str
    max_micro_batch: int | None  # largest that fits within the headroom at the recipe's other knobs
    notes: tuple[str, ...] = ()

    @property
    def matches(self) -> bool:
        return self.recommended is not None and not self.set_flags


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _layout(
    recipe: Recipe,
    instance: Instance,
    nodes: int,
    mb: int,
    ac: ActivationCheckpointing,
    group: int,
    cp: int,
    peak_gib: float,
    thr: ThroughputPlan,
    usd: float,
) -> Layout:
    budget = instance.gpu.usable_gib * (1 - HEADROOM)
    return Layout(
        instance_type=instance.instance_type,
        nodes=nodes,
        micro_batch=mb,
        checkpointing=checkpointing_label(ac),
        mode=ac.mode,
        every=ac.every,
        policy=ac.policy,
        shard_group=group,
        cp=cp,
        fits=peak_gib <= budget,
        peak_gib=peak_gib,
        tokens_per_sec_per_gpu=thr.tokens_per_sec_per_gpu,
        hours=recipe.training.steps * thr.step_time_s / 3600.0,
        tokens_per_usd=thr.tokens_per_sec_per_gpu * instance.gpus * 3600.0 / usd,
    )


class _Evaluator:
    """Memory and throughput of candidate layouts for one recipe on one instance type (cached)."""

    def __init__(self, recipe: Recipe, instance: Instance):
        self.recipe, self.instance = recipe, instance
        self.usd = price(recipe, instance).usd_per_instance_hour
        self.dtype = recipe.precision.dtype
        self.fp8_recipe = recipe.precision.fp8_recipe
        if self.dtype == "fp8" and self.fp8_recipe == "mxfp8" and not instance.gpu.supports_mxfp8:
            self.fp8_recipe = "current"  # MXFP8 needs Blackwell; current scaling is Hopper's equivalent
        self.compile = recipe.training.compile if recipe.training.compile is not None else True
        self._memory: dict[tuple, float] = {}
        self.evaluated = 0

    def peak_gib(self, mb: int, ac: ActivationCheckpointing, group: int, cp: int = 1) -> float:
        key = (mb, checkpointing_label(ac), group, cp)
        if key not in self._memory:
            tr = self.recipe.training
            parts = memory_breakdown(
                self.recipe.model,
                self.instance.gpu,
                seq_len=tr.seq_len,
                micro_batch=mb,
                shard_group=group,
                cp=cp,
                policy=ActivationPolicy.from_recipe(ac, self.recipe.model.layers),
                loss_chunk_tokens=tr.loss_chunk_tokens,
            )
            self._memory[key] = peak(parts)
        return self._memory[key]

    def layout(self, nodes: int, mb: int, ac: ActivationCheckpointing, group: int, cp: int = 1) -> Layout:
        tr = self.recipe.training
        self.evaluated += 1
        thr = throughput(
            self.recipe.model,
            self.instance,
            seq_len=tr.seq_len,
            micro_batch=mb,
            global_batch=tr.global_batch,
            world_size=nodes * self.instance.gpus,
            shard_group=group,
            cp=cp,
            dtype=self.dtype,
            fp8_recipe=self.fp8_recipe,
            policy=ActivationPolicy.from_recipe(ac, self.recipe.model.layers),
            compile=self.compile,
            loss_chunk_tokens=tr.loss_chunk_tokens,
        )
        peak_gib = self.peak_gib(mb, ac, group, cp)
        return _layout(self.recipe, self.instance, nodes, mb, ac, group, cp, peak_gib, thr, self.usd)


def _node_counts(recipe: Recipe, at_least: int = 1) -> list[int]:
    counts = {*NODE_COUNTS, recipe.compute.instance_count}
    cap = recipe.budget.max_instance_count
    return sorted(n for n in counts if n >= at_least and (cap is None or n <= cap))


def _candidates(
    recipe: Recipe, ev: _Evaluator, options: Iterable[ActivationCheckpointing], at_least_nodes: int = 1
) -> list[Layout]:
    budget = ev.instance.gpu.usable_gib * (1 - HEADROOM)
    out = []
    per_node = ev.instance.gpus
    for nodes in _node_counts(recipe, at_least_nodes):
        world = nodes * per_node
        for cp in cp_options(recipe.training.seq_len, per_node):
            data_ranks = world // cp
            if recipe.training.global_batch % data_ranks:
                continue
            per_rank = recipe.training.global_batch // data_ranks
            groups = _divisors(data_ranks)
            for ac in options:
                for mb in _divisors(per_rank):
                    fitting = [g for g in groups if ev.peak_gib(mb, ac, g, cp) <= budget]
                    if not fitting:
                        continue
                    # Inside a node every group (x cp: FSDP shards over the CP ranks too) rides NVLink:
                    # try them all. Across nodes, only the smallest group that fits (a wider one moves
                    # more over EFA for no memory it needs).
                    inside = [g for g in fitting if g * cp <= per_node]
                    across = [g for g in fitting if g * cp > per_node][:1]
                    for g in inside + across:
                        out.append(ev.layout(nodes, mb, ac, g, cp))
    return out


def _distance(layout: Layout, recipe: Layout | None) -> int:
    """How many searched knobs differ from the recipe's (0 without a recipe to compare with)."""
    if recipe is None:
        return 0
    keys = ("nodes", "micro_batch", "checkpointing", "shard_group", "cp")
    return sum(getattr(layout, k) != getattr(recipe, k) for k in keys)


def _rank_key(layout: Layout, per_node: int, recipe: Layout | None) -> tuple:
    # The order (fewer nodes, a group inside one node, the larger micro-batch); then, among
    # what is still tied, the fewest changes to the recipe (no churn for a tie), then tokens per dollar.
    return (
        layout.nodes,
        layout.shard_group * layout.cp > per_node,
        layout.cp,  # context parallelism only where it pays: the smaller cp among ties
        -layout.micro_batch,
        _distance(layout, recipe),
        -layout.tokens_per_usd,
    )


def choose(
    candidates: list[Layout], deadline_hours: float, per_node: int, recipe: Layout | None = None
) -> tuple[Layout | None, str | None]:
    """The recommended layout among fitting candidates, and a note when the deadline could not be met."""
    if not candidates:
        return None, None
    in_time = [c for c in candidates if c.hours <= deadline_hours]
    note = None
    if not in_time:
        fastest = min(c.hours for c in candidates)
        in_time = [c for c in candidates if c.hours <= fastest * (1 + TIE)]
        note = (
            f"no layout that fits finishes within {deadline_hours:,.0f} h; the fastest ones "
            f"({fastest:,.0f} h) are compared"
        )
    best = max(c.tokens_per_usd for c in in_time)
    ties = [c for c in in_time if c.tokens_per_usd >= best * (1 - TIE)]
    return min(ties, key=lambda c: _rank_key(c, per_node, recipe)), note


def precision_advice(recipe: Recipe, instance: Instance) -> tuple[str, str]:
    n = recipe.model.total_params
    if n >= FP8_MIN_PARAMS:
        kind = "MXFP8 on Blackwell" if instance.gpu.supports_mxfp8 else "current scaling on Hopper"
        return "fp8", f"{n / 1e9:.1f}B parameters: from ~7B FP8 pays in throughput ({kind}); saves no memory"
    return "bf16", f"{n / 1e9:.1f}B parameters: below ~7B FP8 gains little or loses (small GEMMs)"


def _changes(recipe: Recipe, rec: Layout) -> tuple[tuple[Change, ...], tuple[str, ...]]:
    ac = recipe.activation_checkpointing
    rows: list[Change] = []
    flags: list[str] = []

    def row(field: str, have, want, settable: bool = True) -> None:
        same = str(have) == str(want)
        rows.append(Change(field, str(have), str(want), same))
        if not same and settable:
            flags.append(f"--set {field}={want}")

    row("compute.instance_count", recipe.compute.instance_count, rec.nodes)
    row("training.micro_batch", recipe.training.micro_batch, rec.micro_batch)
    row("activation_checkpointing.mode", ac.mode, rec.mode)
    if rec.mode == "selective" and rec.policy == "block":
        row("activation_checkpointing.every", ac.every if ac.mode == "selective" else "-", rec.every)
    if "op" in (ac.policy, rec.policy):  # op is valid with mode selective only: set block otherwise
        row("activation_checkpointing.policy", ac.policy, rec.policy if rec.mode == "selective" else "block")
    row("parallelism.shard_group", recipe.parallelism.shard_group, rec.shard_group)
    row("parallelism.cp", recipe.parallelism.cp, rec.cp)
    return tuple(rows), tuple(flags)


def max_micro_batch(recipe: Recipe, instance: Instance | None = None) -> int | None:
    """Largest micro-batch that fits within the headroom at the recipe's other knobs (divisors of the
    per-rank batch); None when not even 1 does."""
    ev = _Evaluator(recipe, instance or recipe.instance)
    budget = ev.instance.gpu.usable_gib * (1 - HEADROOM)
    best = None
    for mb in _divisors(recipe.training.global_batch // recipe.data_parallel):
        par = recipe.parallelism
        if ev.peak_gib(mb, recipe.activation_checkpointing, par.shard_group, par.cp) > budget:
            break  # memory grows with the micro-batch
        best = mb
    return best


def recommend(
    recipe: Recipe,
    *,
    instance_type: str | None = None,
    deadline_hours: float | None = None,
    recipe_throughput: ThroughputPlan | None = None,
) -> Recommendations:
    """The joint recommendation for `recipe` (on `instance_type`, default its own)."""
    instance = get_instance(instance_type) if instance_type else recipe.instance
    ev = _Evaluator(recipe, instance)
    own = recipe.activation_checkpointing
    options = list(checkpointing_options(recipe.precision.dtype))
    if not any(_same_checkpointing(own, o) for o in options):
        options.append(own)

    par, tr = recipe.parallelism, recipe.training
    if recipe_throughput is None or instance_type:
        mine = ev.layout(recipe.compute.instance_count, tr.micro_batch, own, par.shard_group, par.cp)
    else:
        mine = _layout(
            recipe,
            instance,
            recipe.compute.instance_count,
            tr.micro_batch,
            own,
            par.shard_group,
            par.cp,
            ev.peak_gib(tr.micro_batch, own, par.shard_group, par.cp),
            recipe_throughput,
            ev.usd,
        )
    at_least = 1
    if deadline_hours is not None:
        deadline = deadline_hours
    elif mine.peak_gib <= instance.gpu.usable_gib:
        deadline = mine.hours * (1 + TIE)
    else:
        # A layout that does not fit sets no deadline (its speed is not on offer): the fix is the best
        # layout on the recipe's own nodes, more nodes only when nothing fits there.
        deadline, at_least = float("inf"), recipe.compute.instance_count
    candidates = _candidates(recipe, ev, options, at_least)
    chosen, note = choose(candidates, deadline, instance.gpus, None if instance_type else mine)
    notes = [note] if note else []
    if chosen is None:
        notes.append(
            "no layout in reach fits within the headroom, context parallelism inside a node included: "
            "the model needs tensor parallelism, which the trainer does not implement yet"
        )
        changes, flags, gain = (), (), None
    else:
        changes, flags = _changes(recipe, chosen)
        gain = chosen.tokens_per_usd / mine.tokens_per_usd - 1
    dtype, reason = precision_advice(recipe, instance)
    if recipe.precision.dtype != dtype:
        fp8 = "mxfp8" if instance.gpu.supports_mxfp8 else "current"
        hint = ""
        if dtype == "fp8":
            hint = f" (--set precision.dtype=fp8 --set precision.fp8_recipe={fp8}"
            if own.policy == "op":  # the schema refuses FP8 with the op policy
                hint += " --set activation_checkpointing.policy=block: policy op is BF16-only; the FP8 plan"
                hint += " then recommends its own checkpointing"
            hint += ")"
        notes.append(
            f"precision.dtype is {recipe.precision.dtype}; the guide suggests {dtype} at this size{hint}"
        )
    return Recommendations(
        recommended=chosen,
        recipe_layout=mine,
        changes=changes,
        set_flags=flags,
        tokens_per_usd_gain=gain,
        deadline_hours=deadline,
        considered=ev.evaluated,
        precision=dtype,
        precision_reason=reason,
        max_micro_batch=max_micro_batch(recipe, instance),
        notes=tuple(notes),
    )
