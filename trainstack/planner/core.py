"""plan(recipe): memory verdict, throughput with its range, cost with its range, the run, and advice."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

from trainstack.planner.calibration import LOO_LOG_ERROR
from trainstack.planner.input_mode import InputPlan, input_plan
from trainstack.planner.memory import GROWING, ActivationPolicy, MemoryPlan, memory_breakdown, memory_plan
from trainstack.planner.run_plan import RunPlan, plan_run
from trainstack.planner.search import Price, Recommendations, price, recommend
from trainstack.planner.storage import StoragePlan, plan_storage
from trainstack.planner.throughput import ThroughputPlan, recompute_share, throughput
from trainstack.planner.validation import ValidationPlan, plan_validation
from trainstack.recipes.schema import Recipe


@dataclass(frozen=True)
class CostPlan:
    instance_type: str
    instance_count: int
    usd_per_hour: float  # whole job
    tokens: int  # the recipe's token budget: steps x tokens per step
    hours: float  # instance hours per node: training plus start-ups, restores, staging, failures
    total_usd: float  # instances for `hours`, plus the run's checkpoint storage (storage_usd)
    price_source: str
    hours_range: tuple[float, float] = (0.0, 0.0)  # [low, high] from the throughput range
    total_usd_range: tuple[float, float] = (0.0, 0.0)
    usd_per_instance_hour: float = 0.0
    price_date: str = ""
    spot: bool = False  # the price is the spot assumption (see price_source)
    usd_per_restart: float = 0.0  # a restart's billed part (trainstack.planner.restart) at the cluster price
    usd_per_restart_range: tuple[float, float] = (0.0, 0.0)
    storage_usd: float = 0.0  # the run's checkpoints in S3 (Plan.storage), included in total_usd
    storage_usd_range: tuple[float, float] = (0.0, 0.0)


@dataclass(frozen=True)
class Plan:
    recipe: str
    instance_type: str
    gpus: int
    params: int
    fits: bool
    verdict: str
    memory: MemoryPlan
    throughput: ThroughputPlan
    cost: CostPlan
    recommendations: Recommendations
    run: RunPlan
    assumptions: tuple[str, ...] = field(default=())
    validation: ValidationPlan | None = None  # the recipe's validation section, costed
    inputs: InputPlan | None = None  # how the data channels reach the nodes
    storage: StoragePlan | None = None  # the run's checkpoints in S3 (trainstack.planner.storage)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["memory"]["utilisation"] = round(self.memory.utilisation, 4)
        d["memory"]["allocator_peak_gib"] = round(self.memory.allocator_peak_gib, 3)
        d["run"]["overhead_hours"] = self.run.overhead_hours
        if self.run.restart is not None:  # the restart's totals (its parts are plain fields)
            restart = self.run.restart
            d["run"]["restart"].update(
                seconds=restart.seconds,
                seconds_range=list(restart.seconds_range),
                billed_seconds=restart.billed_seconds,
                billed_seconds_range=list(restart.billed_seconds_range),
            )
            d["run"]["restarts"] = self.run.restarts
            d["run"]["restart_wall_hours"] = self.run.restart_wall_hours
        d["assumptions"] = list(self.assumptions)
        for key in ("tokens_per_sec_per_gpu_range", "limited_by"):
            d["throughput"][key] = list(d["throughput"][key])
        for key in ("hours_range", "total_usd_range", "usd_per_restart_range", "storage_usd_range"):
            d["cost"][key] = list(d["cost"][key])
        if d["storage"] is not None:
            for key in ("pruned_days", "tib_months_range", "usd_range"):
                d["storage"][key] = list(d["storage"][key])
        rec = d["recommendations"]
        for key in ("changes", "set_flags", "notes"):
            rec[key] = list(rec[key])
        if rec["deadline_hours"] == float("inf"):  # no deadline (the recipe does not fit); JSON has no inf
            rec["deadline_hours"] = None
        return d


def compile_on(recipe: Recipe) -> bool:
    """training.compile, where None means on (the recipe runs on CUDA)."""
    return recipe.training.compile if recipe.training.compile is not None else True


def recipe_memory(recipe: Recipe, **changes: Any) -> dict[str, float]:
    knobs = dict(
        seq_len=recipe.training.seq_len,
        micro_batch=recipe.training.micro_batch,
        shard_group=recipe.parallelism.shard_group,
        tp=recipe.parallelism.tp,
        cp=recipe.parallelism.cp,
        policy=ActivationPolicy.from_recipe(recipe.activation_checkpointing, recipe.model.layers),
        loss_chunk_tokens=recipe.training.loss_chunk_tokens,
        grad_accum=recipe.training.global_batch
        // max(1, recipe.training.micro_batch * recipe.world_size // recipe.parallelism.cp),
    )
    knobs.update(changes)
    return memory_breakdown(recipe.model, recipe.instance.gpu, **knobs)


def recipe_throughput(recipe: Recipe, **changes: Any) -> ThroughputPlan:
    tr, par = recipe.training, recipe.parallelism
    knobs = dict(
        seq_len=tr.seq_len,
        micro_batch=tr.micro_batch,
        global_batch=tr.global_batch,
        world_size=recipe.world_size,
        shard_group=par.shard_group,
        tp=par.tp,
        cp=par.cp,
        dtype=recipe.precision.dtype,
        fp8_recipe=recipe.precision.fp8_recipe,
        policy=ActivationPolicy.from_recipe(recipe.activation_checkpointing, recipe.model.layers),
        compile=compile_on(recipe),
        loss_chunk_tokens=tr.loss_chunk_tokens,
    )
    knobs.update(changes)
    return throughput(recipe.model, recipe.instance, **knobs)


def _cost(recipe: Recipe, thr: ThroughputPlan, run: RunPlan, unit: Price) -> tuple[CostPlan, StoragePlan]:
    nodes = recipe.compute.instance_count
    rate = unit.usd_per_instance_hour * nodes
    computing = run.hours + run.validation_hours
    hours = computing + run.overhead_hours
    low_tps, high_tps = thr.tokens_per_sec_per_gpu_range
    # Training and validation hours scale inversely with tokens/s; the overheads do not.
    fast = computing * thr.tokens_per_sec_per_gpu / high_tps + run.overhead_hours
    slow = computing * thr.tokens_per_sec_per_gpu / low_tps + run.overhead_hours
    restart_s = run.restart.billed_seconds if run.restart else 0.0
    restart_low, restart_high = run.restart.billed_seconds_range if run.restart else (0.0, 0.0)
    time_based = run.checkpoint.interval_source != "checkpointing.interval_steps"
    storage = plan_storage(run, nodes, recipe.checkpointing.keep, hours, (fast, slow), time_based)
    cost = CostPlan(
        instance_type=recipe.instance.instance_type,
        instance_count=nodes,
        usd_per_hour=rate,
        tokens=recipe.training.steps * recipe.tokens_per_step,
        hours=hours,
        total_usd=rate * hours + storage.usd,
        price_source=unit.source,
        hours_range=(fast, slow),
        total_usd_range=(rate * fast + storage.usd_range[0], rate * slow + storage.usd_range[1]),
        usd_per_instance_hour=unit.usd_per_instance_hour,
        price_date=unit.date,
        spot=unit.spot,
        usd_per_restart=rate * restart_s / 3600.0,
        usd_per_restart_range=(rate * restart_low / 3600.0, rate * restart_high / 3600.0),
        storage_usd=storage.usd,
        storage_usd_range=storage.usd_range,
    )
    return cost, storage


# Plans of recently planned recipes, by the recipe's JSON (a Recipe holds dicts, so it is not hashable).
# One request check plans the same recipe once per request variant, a synthesis once per construct that
# reads it: `trainstack validate` spent 28 of its 33 s re-planning 20 recipes 140 times. A plan is a pure
# function of the recipe (the planner's tables are constants), and a frozen result, so a kept one is
# the plan.
_PLANS: OrderedDict[str, Plan] = OrderedDict()
PLANS_KEPT = 64


def plan(recipe: Recipe) -> Plan:
    """Plan one resolved recipe: memory verdict, throughput, cost, the run and one recommendation.

    Raises trainstack.planner.run_plan.IntervalError (a TrainstackError) when the recipe's checkpoint interval
    is shorter than one save."""
    key = recipe.model_dump_json()
    found = _PLANS.get(key)
    if found is None:
        found = _plan(recipe)
        _PLANS[key] = found
        if len(_PLANS) > PLANS_KEPT:
            _PLANS.popitem(last=False)
    return found


def plan_with_throughput(recipe: Recipe, thr: ThroughputPlan) -> Plan:
    """plan(recipe) with its throughput given: a traced step's counted FLOPs re-time it
    (trainstack.planner.traced.throughput_with_counted_flops), and the run, time and cost follow. Not kept
    with the plans above (the recipe alone no longer decides it)."""
    return _plan(recipe, thr)


def _plan(recipe: Recipe, thr: ThroughputPlan | None = None) -> Plan:
    inst = recipe.instance
    parts = recipe_memory(recipe)
    mem = memory_plan(parts, inst.gpu)
    thr = thr or recipe_throughput(recipe)
    low_tps = thr.tokens_per_sec_per_gpu_range[0]
    slow_step = thr.step_time_s * thr.tokens_per_sec_per_gpu / low_tps
    validation = plan_validation(recipe, thr)
    inputs = input_plan(recipe, thr.tokens_per_sec_per_gpu)
    run = plan_run(
        recipe,
        thr.step_time_s,
        slow_step,
        thr.micro_step_time_s,
        validation_hours=validation.hours if validation else 0.0,
        input_hours_per_job=inputs.download_minutes / 60.0,
    )
    unit = price(recipe)
    cost, storage = _cost(recipe, thr, run, unit)
    rec = recommend(recipe, recipe_throughput=thr)

    if not mem.fits:
        breaking = max(GROWING, key=lambda k: parts[k])
        if rec.recommended is not None:
            chosen = rec.recommended
            fix = " ".join(rec.set_flags) + f" ({chosen.describe()}, peak {chosen.peak_gib:.1f} GiB)"
        else:
            fix = (
                "no layout in reach fits, context parallelism inside a node included: the model needs "
                "tensor parallelism (not implemented)"
            )
        mem = MemoryPlan(**{**asdict(mem), "breaking_component": breaking, "fix": fix})
        verdict = (
            f"does not fit: peak {mem.peak_gib:.1f} GiB > {mem.usable_gib:.0f} GiB usable; "
            f"{breaking} ({parts[breaking]:.1f} GiB) breaks it; fix: {fix}"
        )
    else:
        margin = mem.usable_gib - mem.peak_gib
        tight = " (tight: within the planner's 10% error)" if mem.peak_gib > mem.budget_gib else ""
        verdict = f"fits: peak {mem.peak_gib:.1f} of {mem.usable_gib:.0f} GiB, {margin:.1f} GiB spare{tight}"

    low, high = LOO_LOG_ERROR
    assumptions = (
        "memory: FSDP2 mixed precision (FP32 master, BF16 compute), flash attention, chunked loss "
        "recomputed per chunk",
        "throughput: FLOPs and bytes by kind at rates fitted on published FSDP2-class runs (torchtitan, "
        f"torchao); range = the fit's leave-one-out errors ({high:+.0%} / {low:+.0%})",
        "B200 rates come from torchao's power-limited B200 runs (limit unpublished): likely pessimistic; "
        "Megatron-Core's TP/PP-tuned runs are the upper bound",
        f"price: {unit.source} ({unit.date})",
        f"storage: checkpoints at {storage.usd_per_gib_month} USD per GiB-month ({storage.price_source}, "
        f"{storage.price_date}); pruned ones billed {storage.pruned_days[0]:.0f}-"
        f"{storage.pruned_days[1]:.0f} days until the bucket's lifecycle removes them; included in the cost",
    )
    policy = ActivationPolicy.from_recipe(recipe.activation_checkpointing, recipe.model.layers)
    if policy.op_level or policy.checkpointed_fraction > 0:
        block = "Transformer Engine" if thr.backend == "transformer_engine" else "pure-PyTorch"
        assumptions += (
            f"recompute: the {block} block's checkpoint replays {recompute_share(recipe.model, policy):.0%} "
            "of a checkpointed block's matmul FLOPs (trainstack.planner.trainer_memory)",
        )
    if run.jobs + run.expected_failures > recipe.compute.max_jobs:
        assumptions += (
            f"run: {run.jobs} jobs and {run.expected_failures:.1f} expected failures exceed "
            f"compute.max_jobs = {recipe.compute.max_jobs}: the launcher would stop the run early",
        )
    if recipe.compute.spot:
        assumptions += (
            f"spot: {run.spot_interruptions:.1f} interruptions expected over the run (assumption: one per "
            "node per 5 days), each costing a restart, a restore and the work since the last save",
        )
    if validation is not None:
        assumptions += (
            f"validation: forward-only FLOPs (a third of training's) at the training step's achieved FLOP "
            f"rate: {validation.hours:,.1f} h, {validation.hours / max(run.hours, 1e-9):.1%} of the training "
            "hours (trainstack.planner.validation)",
        )
        if (
            validation.seconds_per_evaluation + run.checkpoint.sigterm_seconds
            > run.checkpoint.sigterm_budget_seconds
        ):
            assumptions += (
                f"validation: one evaluation ({validation.seconds_per_evaluation:,.0f} s) plus the SIGTERM "
                f"save ({run.checkpoint.sigterm_seconds:,.0f} s) exceeds the "
                f"{run.checkpoint.sigterm_budget_seconds:.0f} s a stop leaves: a stop during an evaluation "
                "may end without a final save (fewer validation.batches keeps it inside)",
            )
    return Plan(
        recipe=recipe.name,
        instance_type=inst.instance_type,
        gpus=recipe.world_size,
        params=recipe.model.total_params,
        fits=mem.fits,
        verdict=verdict,
        memory=mem,
        throughput=thr,
        cost=cost,
        recommendations=rec,
        run=run,
        assumptions=assumptions,
        validation=validation,
        inputs=inputs,
        storage=storage,
    )
