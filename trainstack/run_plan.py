"""The run, planned: how many jobs it takes, and what its checkpoints cost in time.

A run is one recipe's whole token budget; a job is one SageMaker training job of it. A job ends at its
max runtime (SageMaker allows at most 28 days), on a spot interruption or on an infrastructure failure,
and the run's next job resumes from the newest complete checkpoint. So the plan needs, besides the
training hours: the job limit, the number of jobs, how long a checkpoint takes to save and to restore,
how often to save, and whether a save fits SageMaker's 120 s between SIGTERM and SIGKILL.

Pure arithmetic over a recipe and its planned step time; every constant names its source or says it is
an assumption (docs/planner.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainstack.recipe import Recipe

GIB = float(2**30)
HOUR_S = 3600.0
MAX_RUNTIME_HOURS = 28 * 24  # SageMaker's ceiling for StoppingCondition.MaxRuntimeInSeconds
SIGTERM_GRACE_S = 120.0  # SageMaker: SIGTERM, then SIGKILL 120 s later

# What one checkpoint holds per parameter: FP32 master weights (4) and AdamW's m and v (8). DCP writes
# a replicated (HSDP) tensor once, so the total does not grow with the replica count.
CHECKPOINT_BYTES_PER_PARAM = 4 + 8
# Assumption, not measured here: sustained S3 throughput of one node writing (and reading) its shards
# with many parallel multipart requests (s3torchconnector / AWS CRT). Refine from measurements.
S3_WRITE_GBPS_PER_NODE = 5.0  # GB/s
S3_READ_GBPS_PER_NODE = 5.0  # GB/s
# Provisioning, image pull and process start of one job before its first step (assumption; warm pools
# skip most of it, an InfraCheck adds to it).
JOB_STARTUP_HOURS = 0.25
# Mean time between failures of one 8-GPU node: Llama 3 (arXiv:2407.21783, section 3.3.4) saw 419
# unexpected interruptions in 54 days on 16,384 GPUs (2,048 nodes): 54 x 24 x 2048 / 419 = 6,335 h.
NODE_MTBF_HOURS = 6335.0
# The default job limit: the planned hours plus this margin (slow nodes, restores), capped at 28 days.
RUNTIME_MARGIN = 0.15
RUNTIME_MARGIN_HOURS = 2.0


@dataclass(frozen=True)
class CheckpointPlan:
    gib_per_node: float  # what each node writes per checkpoint (and reads on resume)
    save_seconds: float
    restore_seconds: float
    interval_minutes: float  # between saves, as the trainer will apply it
    interval_source: str  # "young-daly" | "checkpointing.interval_minutes" | "checkpointing.interval_steps"
    sigterm_fits: bool  # a final save fits SageMaker's 120 s after SIGTERM
    work_at_risk_minutes: float  # training lost to a failure just before a save completes


@dataclass(frozen=True)
class RunPlan:
    hours: float  # training hours: steps x planned step time
    jobs: int  # ceil(hours / max_runtime_hours)
    max_runtime_hours: float  # one job's limit
    max_runtime_source: str  # "compute.max_runtime_hours" | "plan"
    startup_hours_per_job: float
    checkpoint: CheckpointPlan

    @property
    def overhead_hours(self) -> float:
        """Instance hours spent starting and restoring jobs, on top of training."""
        return self.jobs * self.startup_hours_per_job + max(0, self.jobs - 1) * (
            self.checkpoint.restore_seconds / HOUR_S
        )


def checkpoint_gib_per_node(recipe: Recipe) -> float:
    return recipe.model.total_params * CHECKPOINT_BYTES_PER_PARAM / recipe.compute.instance_count / GIB


def young_daly_minutes(save_seconds: float, nodes: int, node_mtbf_hours: float) -> float:
    """sqrt(2 x save time x MTBF of the cluster) (Young 1974, Daly 2006), in minutes."""
    cluster_mtbf_s = node_mtbf_hours * HOUR_S / nodes
    return math.sqrt(2.0 * save_seconds * cluster_mtbf_s) / 60.0


def plan_checkpoints(recipe: Recipe, step_time_s: float) -> CheckpointPlan:
    nodes = recipe.compute.instance_count
    gib = checkpoint_gib_per_node(recipe)
    save_s = gib * GIB / (S3_WRITE_GBPS_PER_NODE * 1e9)
    restore_s = gib * GIB / (S3_READ_GBPS_PER_NODE * 1e9)
    ck = recipe.checkpointing
    if ck.interval_steps is not None:
        interval, source = ck.interval_steps * step_time_s / 60.0, "checkpointing.interval_steps"
    elif ck.interval_minutes is not None:
        interval, source = ck.interval_minutes, "checkpointing.interval_minutes"
    else:
        mtbf = ck.node_mtbf_hours or NODE_MTBF_HOURS
        interval, source = young_daly_minutes(save_s, nodes, mtbf), "young-daly"
    # After SIGTERM the trainer finishes (or drops) the step in flight, then saves.
    sigterm_fits = step_time_s + save_s <= SIGTERM_GRACE_S
    return CheckpointPlan(
        gib_per_node=gib,
        save_seconds=save_s,
        restore_seconds=restore_s,
        interval_minutes=interval,
        interval_source=source,
        sigterm_fits=sigterm_fits,
        work_at_risk_minutes=interval + save_s / 60.0,
    )


def plan_run(recipe: Recipe, step_time_s: float) -> RunPlan:
    hours = recipe.training.steps * step_time_s / HOUR_S
    checkpoint = plan_checkpoints(recipe, step_time_s)
    if recipe.compute.max_runtime_hours is not None:
        limit, source = recipe.compute.max_runtime_hours, "compute.max_runtime_hours"
    else:
        first_job = hours + JOB_STARTUP_HOURS
        limit = min(MAX_RUNTIME_HOURS, math.ceil(first_job * (1 + RUNTIME_MARGIN) + RUNTIME_MARGIN_HOURS))
        source = "plan"
    return RunPlan(
        hours=hours,
        jobs=max(1, math.ceil(hours / limit)),
        max_runtime_hours=float(limit),
        max_runtime_source=source,
        startup_hours_per_job=JOB_STARTUP_HOURS,
        checkpoint=checkpoint,
    )
