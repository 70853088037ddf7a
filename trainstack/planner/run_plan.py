"""The run, planned: how many jobs it takes, and what its checkpoints cost in time.

A run is one recipe's whole token budget; a job is one SageMaker training job of it. A job ends at its
max runtime (SageMaker allows at most 28 days), on a spot interruption or on an infrastructure failure,
and the run's next job resumes from the newest complete checkpoint. So the plan needs, besides the
training hours: the job limit, the number of jobs, how long a checkpoint takes to save and to restore,
how often to save, whether a final save fits SageMaker's 120 s between SIGTERM and SIGKILL, and what
failures are expected to cost.

Checkpoints go straight from every rank to S3 (s3torchconnector's DCP writer): a save is staging (each
GPU copies its own shards into pinned host memory) and then the upload. An interval save is async: it
holds the loop only for the staging, and training continues while it uploads. The run's final save and
a save after SIGTERM are whole saves the trainer waits for. With HSDP, DCP writes each replicated shard
once, so a node uploads its share of one copy (while every rank stages its own shard); on resume every
GPU reads its own shards, so every replica reads the model again.

After SIGTERM (training_image/trainer/runtime/stopping.py) the trainer drops the step in flight (or, when its
last micro-step is already done, completes it), so at most one micro-step and an optimizer step run
before the save, and it keeps EXIT_MARGIN_S for the exit.

Pure arithmetic over a recipe and its planned step time; every constant names its source or says it is
an assumption (docs/planner.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainstack.errors import TrainstackError
from trainstack.planner.models_io import base_load_seconds
from trainstack.planner.restart import RestartPlan, plan_restart
from trainstack.recipes.schema import Recipe

GIB = float(2**30)
HOUR_S = 3600.0
MAX_RUNTIME_HOURS = 28 * 24  # SageMaker's ceiling for StoppingCondition.MaxRuntimeInSeconds
SIGTERM_GRACE_S = 120.0  # SageMaker: SIGTERM, then SIGKILL 120 s later (StoppingCondition docs)
# What the trainer keeps free after its last save for the process to exit: logs flushed, process
# groups torn down, torchrun and the entrypoint exiting (the trainer-loop engineer saw about 2 s on
# CPU; GPU teardown is slower). Defined here, where the planner can import it without torch;
# training_image/trainer/runtime/stopping.py imports it from here.
EXIT_MARGIN_S = 15.0

# What one checkpoint holds per parameter: FP32 master weights (4) and AdamW's m and v (8).
CHECKPOINT_BYTES_PER_PARAM = 4 + 8
# Staging: each GPU copies its shards into pinned host memory over its PCIe Gen5 x16 link (64 GB/s per
# direction on paper). Assumption: DCP's per-tensor copies reach about 25 GB/s per GPU.
STAGING_BYTES_PER_S_PER_GPU = 25e9
# Upload and restore: s3torchconnector's S3 client aims at `throughput_target_gbps`, 10 Gbit/s by
# default (awslabs/s3-connector-for-pytorch DEVELOPMENT.md, S3ClientConfig), and each rank has its own
# client: 8 ranks = 80 Gbit/s = 10 GB/s per node. Assumption: half of that target is sustained.
S3_TARGET_BYTES_PER_S_PER_RANK = 10e9 / 8
S3_ACHIEVED_FRACTION = 0.5
# A job's start-up before its first step (provisioning, image pull, trainer start, checkpoint load,
# compile): trainstack.planner.restart, each part with its source and range. Only the billed part
# (from TrainingStartTime) counts in the run's instance hours.
# Mean time between failures of one 8-GPU node: Llama 3 (arXiv:2407.21783, section 3.3.4) saw 419
# unexpected interruptions in 54 days on 16,384 GPUs (2,048 nodes): 54 x 24 x 2048 / 419 = 6,335 h.
NODE_MTBF_HOURS = 6335.0
# Spot: SageMaker managed spot training "can optimize the cost of training models up to 90% over
# on-demand instances" (SageMaker developer guide, managed spot training). Assumptions, not measured
# for P5/P6 capacity: the price is half of on-demand, and each node is interrupted once every 5 days.
SPOT_PRICE_FRACTION = 0.5
SPOT_INTERRUPTIONS_PER_NODE_HOUR = 1.0 / (5 * 24)
# The default job limit: the planned hours at the slow end of their range, plus this margin.
RUNTIME_MARGIN_HOURS = 2.0


class IntervalError(TrainstackError):
    """A checkpoint interval the run cannot keep (one clear line; the CLI names the file)."""

    def __init__(self, field: str, message: str):
        self.field, self.message = field, message
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class CheckpointPlan:
    gib_per_node: float  # what each node writes per checkpoint
    save_seconds: float  # one whole save: staging plus upload
    restore_seconds: float
    interval_minutes: float  # between saves, as the trainer will apply it
    interval_source: str  # "young-daly" | "checkpointing.interval_minutes" | "checkpointing.interval_steps"
    sigterm_fits: bool  # one micro-step, the optimizer step and a whole save fit 120 s less the exit margin
    work_at_risk_minutes: float  # training lost to a failure just before a save completes
    stage_seconds: float = 0.0  # what an interval save holds the loop for (its shard to pinned host memory)
    upload_seconds: float = 0.0  # the rest of an interval save, while training continues
    sigterm_seconds: float = 0.0  # after SIGTERM, at worst: the last micro-step, its optimizer step, a save
    sigterm_budget_seconds: float = SIGTERM_GRACE_S - EXIT_MARGIN_S  # what SIGTERM leaves for that
    pinned_gib_per_node: float = 0.0  # host memory the staging pins: every GPU's own shard
    restore_gib_per_node: float = 0.0  # what each node reads on resume (every replica reads its shards)
    node_mtbf_hours: float = NODE_MTBF_HOURS
    mtbf_source: str = "Llama 3 paper (arXiv:2407.21783): 6,335 h per 8-GPU node"


@dataclass(frozen=True)
class RunPlan:
    hours: float  # training hours: steps x planned step time
    jobs: int  # ceil(hours / max_runtime_hours)
    max_runtime_hours: float  # one job's limit
    max_runtime_source: str  # "compute.max_runtime_hours" | "plan"
    startup_hours_per_job: float  # billed start-up of a job before its first step, checkpoint load apart
    checkpoint: CheckpointPlan
    saves: int = 0  # interval checkpoints written over the run (the final save and SIGTERM saves apart)
    # Training time the loop waits for saves: each interval save's staging, the final save whole, and at
    # each job boundary (the max runtime's SIGTERM) a whole save if it fits, else the work since the
    # last interval save (half an interval, expected) done again.
    save_blocking_hours: float = 0.0
    expected_failures: float = 0.0  # node failures (and spot interruptions) expected over the run
    failure_hours: float = 0.0  # expected restarts, restores and lost work they cost
    spot_interruptions: float = 0.0  # of expected_failures, the ones spot adds (assumption)
    restart: RestartPlan | None = None  # a job's end to the next job's first step (planner.restart)
    validation_hours: float = 0.0  # every evaluation of the run (trainstack.planner.validation)

    @property
    def restarts(self) -> float:
        """Restarts expected over the run: every job boundary, every failure and interruption."""
        return max(0, self.jobs - 1) + self.expected_failures

    @property
    def restart_wall_hours(self) -> float:
        """Calendar time the restarts add to the run (the billed part is in `overhead_hours`)."""
        return self.restarts * (self.restart.seconds if self.restart else 0.0) / HOUR_S

    # The first job's copy and load of the base model (model.init_from; trainstack.planner.models_io).
    base_load_seconds: float = 0.0

    @property
    def overhead_hours(self) -> float:
        """Instance hours on top of training: starting and restoring jobs, waiting for saves (interval
        staging, the final save, SIGTERM saves at job boundaries), and the expected cost of failures."""
        restarts = self.jobs * self.startup_hours_per_job + max(0, self.jobs - 1) * (
            self.checkpoint.restore_seconds / HOUR_S
        )
        return restarts + self.save_blocking_hours + self.failure_hours + self.base_load_seconds / HOUR_S

    def summary(self) -> str:
        """One line: '238 h = 2 jobs; checkpoint 95 GiB/node every 40 min, 70 s to save'."""
        ck = self.checkpoint
        jobs = f"{self.jobs} job" + ("s" if self.jobs != 1 else "")
        return (
            f"{_hours(self.hours)} = {jobs}; checkpoint {ck.gib_per_node:,.0f} GiB/node every "
            f"{ck.interval_minutes:,.0f} min, {ck.save_seconds:,.0f} s to save "
            f"({ck.stage_seconds:,.0f} s blocking)"
        )


def _hours(hours: float) -> str:
    return f"{hours:,.0f} h" if hours >= 10 else f"{hours:.1f} h"


def checkpoint_gib_per_node(recipe: Recipe) -> float:
    return recipe.model.total_params * CHECKPOINT_BYTES_PER_PARAM / recipe.compute.instance_count / GIB


def young_daly_minutes(save_seconds: float, nodes: int, node_mtbf_hours: float) -> float:
    """sqrt(2 x save time x MTBF of the cluster) (Young 1974, Daly 2006), in minutes. `save_seconds` is
    the time training loses per save (with async saves: the staging)."""
    cluster_mtbf_s = node_mtbf_hours * HOUR_S / nodes
    return math.sqrt(2.0 * save_seconds * cluster_mtbf_s) / 60.0


def s3_bytes_per_s_per_node(recipe: Recipe) -> float:
    return recipe.instance.gpus * S3_TARGET_BYTES_PER_S_PER_RANK * S3_ACHIEVED_FRACTION


def plan_checkpoints(recipe: Recipe, step_time_s: float, micro_step_s: float | None = None) -> CheckpointPlan:
    """`micro_step_s`: one accumulation micro-step (default: the step over its micro-steps)."""
    nodes = recipe.compute.instance_count
    params = recipe.model.total_params
    shard = recipe.parallelism.shard_group * recipe.parallelism.tp
    gib = checkpoint_gib_per_node(recipe)
    shard_bytes = params * CHECKPOINT_BYTES_PER_PARAM / shard  # what one GPU stages
    stage_s = shard_bytes / STAGING_BYTES_PER_S_PER_GPU
    s3 = s3_bytes_per_s_per_node(recipe)
    upload_s = gib * GIB / s3
    save_s = stage_s + upload_s
    restore_gib = recipe.instance.gpus * params * CHECKPOINT_BYTES_PER_PARAM / shard / GIB
    restore_s = restore_gib * GIB / s3
    ck = recipe.checkpointing
    mtbf = ck.node_mtbf_hours or NODE_MTBF_HOURS
    mtbf_source = (
        "checkpointing.node_mtbf_hours"
        if ck.node_mtbf_hours
        else "Llama 3 paper (arXiv:2407.21783): 6,335 h per 8-GPU node"
    )
    if ck.interval_steps is not None:
        interval, source = ck.interval_steps * step_time_s / 60.0, "checkpointing.interval_steps"
        given = f"{ck.interval_steps} steps ({interval * 60:,.0f} s at {step_time_s:.1f} s per step)"
    elif ck.interval_minutes is not None:
        interval, source = ck.interval_minutes, "checkpointing.interval_minutes"
        given = f"{ck.interval_minutes:g} min"
    else:
        # The trainer keeps one save in flight: saving more often than a save takes would stall it.
        interval = max(young_daly_minutes(stage_s, nodes, mtbf), save_s / 60.0)
        source, given = "young-daly", ""
    if source != "young-daly" and interval * 60.0 < save_s:
        raise IntervalError(
            source,
            f"{given} is shorter than one checkpoint save ({stage_s:,.0f} s staging + {upload_s:,.0f} s "
            f"upload of {gib:,.0f} GiB per node = {save_s:,.0f} s); the trainer keeps one save in flight, "
            f"so use at least {math.ceil(save_s / 60.0)} min (or unset both for the Young/Daly interval)",
        )
    # After SIGTERM the trainer drops the step in flight, or completes it when only its optimizer step
    # is left: at worst the last micro-step and the per-step work (optimizer, replica all-reduce), then
    # a whole save, within what the exit margin leaves of SageMaker's 120 s.
    micro = step_time_s / recipe.grad_accum_steps if micro_step_s is None else micro_step_s
    accum = recipe.grad_accum_steps
    last_micro_and_step = max(micro, step_time_s - (accum - 1) * micro)
    sigterm_s = last_micro_and_step + save_s
    sigterm_fits = sigterm_s <= SIGTERM_GRACE_S - EXIT_MARGIN_S
    return CheckpointPlan(
        gib_per_node=gib,
        save_seconds=save_s,
        restore_seconds=restore_s,
        interval_minutes=interval,
        interval_source=source,
        sigterm_fits=sigterm_fits,
        work_at_risk_minutes=interval + save_s / 60.0,
        stage_seconds=stage_s,
        upload_seconds=upload_s,
        restore_gib_per_node=restore_gib,
        node_mtbf_hours=mtbf,
        mtbf_source=mtbf_source,
        sigterm_seconds=sigterm_s,
        pinned_gib_per_node=recipe.instance.gpus * shard_bytes / GIB,
    )


def plan_run(
    recipe: Recipe,
    step_time_s: float,
    slow_step_time_s: float | None = None,
    micro_step_s: float | None = None,
    validation_hours: float = 0.0,
    input_hours_per_job: float = 0.0,
) -> RunPlan:
    """The run at `step_time_s` per step; the default job limit is sized for `slow_step_time_s` (the
    slow end of the planner's range), so a planner that is optimistic within its error does not get
    the job stopped early. `micro_step_s`: one accumulation micro-step (for the SIGTERM window).
    `validation_hours`: the run's evaluations, inside its jobs like training; `input_hours_per_job`: a
    File-mode copy of the data before each job's first step (trainstack.planner.input_mode)."""
    hours = recipe.training.steps * step_time_s / HOUR_S
    checkpoint = plan_checkpoints(recipe, step_time_s, micro_step_s)
    restart = plan_restart(checkpoint.restore_seconds, compiled=recipe.training.compile is not False)
    startup_hours = restart.first_job_billed_seconds / HOUR_S
    # Interval saves (async: the loop waits for the staging); the last interval ends in the final save.
    saves = max(0, math.ceil(hours * 60.0 / checkpoint.interval_minutes) - 1)
    blocking = (saves * checkpoint.stage_seconds + checkpoint.save_seconds) / HOUR_S
    if recipe.compute.max_runtime_hours is not None:
        limit, source = recipe.compute.max_runtime_hours, "compute.max_runtime_hours"
    else:
        slow = recipe.training.steps * (slow_step_time_s or step_time_s) / HOUR_S
        first_job = slow * (1 + (blocking + validation_hours) / max(hours, 1e-9)) + startup_hours
        first_job += input_hours_per_job
        limit = min(MAX_RUNTIME_HOURS, math.ceil(first_job + RUNTIME_MARGIN_HOURS))
        source = "plan"
    jobs = max(1, math.ceil((hours + validation_hours) / limit))
    # Each job but the last ends at its max runtime with SIGTERM: a whole save, or (when it does not
    # fit) the work since the last interval save is lost and done again.
    boundary = checkpoint.save_seconds if checkpoint.sigterm_fits else checkpoint.interval_minutes * 30.0
    blocking += (jobs - 1) * boundary / HOUR_S
    nodes = recipe.compute.instance_count
    failures = nodes * hours / checkpoint.node_mtbf_hours
    interruptions = nodes * hours * SPOT_INTERRUPTIONS_PER_NODE_HOUR if recipe.compute.spot else 0.0
    # Each failure or interruption: a restart (its billed part: the image, the trainer's start, the
    # restore, the compile) and the work since the last save done again (on average half an interval,
    # plus the save that was in flight).
    per_failure = (
        restart.billed_seconds / HOUR_S
        + (checkpoint.interval_minutes / 2 + checkpoint.save_seconds / 60.0) / 60.0
    )
    return RunPlan(
        base_load_seconds=base_load_seconds(recipe, s3_bytes_per_s_per_node(recipe)),
        hours=hours,
        jobs=jobs,
        max_runtime_hours=float(limit),
        max_runtime_source=source,
        startup_hours_per_job=startup_hours + input_hours_per_job,
        checkpoint=checkpoint,
        saves=saves,
        save_blocking_hours=blocking,
        expected_failures=failures + interruptions,
        failure_hours=(failures + interruptions) * per_failure,
        spot_interruptions=interruptions,
        restart=restart,
        validation_hours=validation_hours,
    )
