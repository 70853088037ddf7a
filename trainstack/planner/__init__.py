"""The planner: the P6-B200 tuning guide as arithmetic. Recipe in, Plan out; no I/O, no randomness.

    plan(recipe) -> Plan       memory breakdown and verdict, throughput with its range, cost, the run
                               (jobs, checkpoints), and one joint recommendation

Modules: `memory` (per-GPU memory by component), `throughput` (FLOPs and bytes by kind, each at its own
rate, with the FP8 cap and the sanity bound), `calibration` (every constant of the throughput model:
fitted, published or assumed), `search` (the joint recommender), `core` (plan and cost), `compare`
(one recipe on every catalogued instance type), `trainer_memory` (the terms that follow how our trainer is
written), `run_plan` (jobs, checkpoint cost, the SIGTERM window), and the judgements made of a recipe
with its plan: `budget` (a team's caps) and `sanity` (legal but likely wrong values). docs/planner.md
explains every formula and constant. May import `recipes` and `errors`; the training image imports it.
"""

from trainstack.planner.calibration import CALIBRATION, LOO_LOG_ERROR, Calibration
from trainstack.planner.core import CostPlan, Plan, compile_on, plan, recipe_memory, recipe_throughput
from trainstack.planner.memory import (
    GIB,
    HEADROOM,
    ActivationPolicy,
    MemoryPlan,
    memory_breakdown,
    memory_plan,
)
from trainstack.planner.search import (
    Change,
    Layout,
    Price,
    Recommendations,
    checkpointing_label,
    max_micro_batch,
    price,
    recommend,
)
from trainstack.planner.throughput import (
    ThroughputPlan,
    bound_tflops,
    flops_by_kind,
    flops_per_token,
    fp8_gain_cap,
    recompute_flops_per_token,
    recompute_share,
    throughput,
    trainer_backend,
)

__all__ = [
    "CALIBRATION",
    "GIB",
    "HEADROOM",
    "LOO_LOG_ERROR",
    "ActivationPolicy",
    "Calibration",
    "Change",
    "CostPlan",
    "Layout",
    "MemoryPlan",
    "Plan",
    "Price",
    "Recommendations",
    "ThroughputPlan",
    "bound_tflops",
    "checkpointing_label",
    "compile_on",
    "flops_by_kind",
    "flops_per_token",
    "fp8_gain_cap",
    "max_micro_batch",
    "memory_breakdown",
    "memory_plan",
    "plan",
    "price",
    "recipe_memory",
    "recipe_throughput",
    "recommend",
    "recompute_flops_per_token",
    "recompute_share",
    "throughput",
    "trainer_backend",
]
