"""What a restart costs: the time from one job's end to the next job's first step, and its price.

A run restarts at every job boundary (max runtime, a capacity block's end), after every failure and
spot interruption: the supervisor decides, SageMaker provisions the instances, every node pulls the
image, the trainer starts (rendezvous, process groups, model built), every rank reads its shards of
the checkpoint, and the first step compiles the blocks. Each part below is a range (low, planned, high)
with its source; most are estimates, because AWS publishes no start-up times for these instances.
`trainstack status` shows the measured ones (trainstack.aws.restarts), to replace these with figures.

Billing (DescribeTrainingJob, TrainingStartTime): "You are billed for the time interval between this
time and the value of TrainingEndTime. The start time in CloudWatch Logs might be later than this
time. The difference is due to the time it takes to download the training data and to the size of the
training container." So the decision and the provisioning (SecondaryStatus Starting) cost time, not
money; the image pull, the trainer's start, the checkpoint load and the compile are paid at the
cluster's price. What a restart costs in lost work (the steps since the last save) is the failure
term's (trainstack.planner.run_plan), not this one's.

Pure arithmetic; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = float(2**30)


@dataclass(frozen=True)
class RestartPart:
    name: str
    seconds: tuple[float, float, float]  # low, planned, high
    billed: bool  # after TrainingStartTime: paid at the cluster's price
    source: str  # where the figure comes from, or "estimate: ..." with why


@dataclass(frozen=True)
class RestartPlan:
    parts: tuple[RestartPart, ...]

    def _sum(self, index: int, billed_only: bool = False, without: str = "") -> float:
        counted = [p for p in self.parts if (p.billed or not billed_only) and p.name != without]
        return sum(p.seconds[index] for p in counted)

    @property
    def seconds(self) -> float:
        """From one job's end to the next job's first step (planned)."""
        return self._sum(1)

    @property
    def seconds_range(self) -> tuple[float, float]:
        return self._sum(0), self._sum(2)

    @property
    def billed_seconds(self) -> float:
        """Of `seconds`, what is paid at the cluster's price."""
        return self._sum(1, billed_only=True)

    @property
    def billed_seconds_range(self) -> tuple[float, float]:
        return self._sum(0, billed_only=True), self._sum(2, billed_only=True)

    @property
    def first_job_billed_seconds(self) -> float:
        """A run's first job: the same start-up, with no checkpoint to load."""
        return self._sum(1, billed_only=True, without=CHECKPOINT_LOAD)

    def describe(self) -> str:
        """'16 min (7-41) from a job's end to the next job's first step (decision 1, provisioning 8,
        image 2, trainer start 1, load 3, compile 1 min)'"""
        low, high = self.seconds_range
        parts = ", ".join(f"{p.name} {p.seconds[1] / 60:.0f}" for p in self.parts)
        return (
            f"{self.seconds / 60:,.0f} min ({low / 60:,.0f}-{high / 60:,.0f}) from a job's end to the next "
            f"job's first step ({parts} min)"
        )


CHECKPOINT_LOAD = "load"
# The supervisor's decision: EventBridge delivers the job's state change, JobEnded decides and runs
# CreateTrainingJob for the next job. Estimate: a minute (EventBridge delivery is seconds; the state
# machine's describe, registry writes and create are a few calls).
DECISION_S = (20.0, 60.0, 180.0)
# Provisioning (SecondaryStatus Starting: "Launching requested ML instances", "Preparing the instances
# for training"). Estimate: no published figure for P5/P6 clusters; EC2's own instance start is under a
# minute, SageMaker adds its instance preparation and health checks. Capacity waits come on top (the
# supervisor's Capacity rule) and are not part of a planned restart.
PROVISIONING_S = (180.0, 480.0, 1200.0)
# The image: the AWS Deep Learning Container for PyTorch training (GPU, SageMaker) was about 18 GB
# after a size cut in aws/deep-learning-containers PR #3337 (23.4 GB before; the image size check in
# PR #3270 used a 19.7 GB baseline), plus Transformer Engine. Estimate: 20 GiB.
IMAGE_GIB = 20.0
# Every node pulls it from ECR and unpacks it at once. Estimate: 75-300 MB/s per node (layer
# decompression is single-threaded per layer), 150 MB/s planned.
IMAGE_PULL_BYTES_PER_S = (300e6, 150e6, 75e6)  # fast, planned, slow
# torchrun's rendezvous, Python and Transformer Engine imports, process groups and NCCL's first
# communicators, the comms gate, the model built and sharded. Estimate (seen on CPU: about 5 s for a
# tiny model; GPU initialisation and NCCL over many nodes take longer).
TRAINER_START_S = (30.0, 60.0, 180.0)
# torch.compile of the blocks during the first step (training.compile, on by default on CUDA; one
# block's graph is compiled and reused by the others). Estimate.
COMPILE_S = (20.0, 60.0, 300.0)
# Checkpoint load: the plan's `restore_seconds` at half of s3torchconnector's 10 Gbit/s target per rank
# (run_plan.S3_ACHIEVED_FRACTION); the range is a quarter of the target to all of it.
LOAD_RANGE = (0.5, 1.0, 2.0)


def plan_restart(restore_seconds: float, compiled: bool) -> RestartPlan:
    """The restart of one job of a recipe whose checkpoint restores in `restore_seconds` (pure)."""
    image = tuple(IMAGE_GIB * GIB / rate for rate in IMAGE_PULL_BYTES_PER_S)
    parts = [
        RestartPart(
            "decision",
            DECISION_S,
            False,
            "estimate: EventBridge delivers the job's end, JobEnded runs CreateTrainingJob",
        ),
        RestartPart(
            "provisioning",
            PROVISIONING_S,
            False,
            "estimate: SecondaryStatus Starting; no published figure for P5/P6 clusters",
        ),
        RestartPart(
            "image",
            image,  # type: ignore[arg-type]
            True,
            f"estimate: {IMAGE_GIB:.0f} GiB (AWS DLC PyTorch training about 18 GB, "
            "aws/deep-learning-containers#3337, + Transformer Engine) at 75-300 MB/s per node",
        ),
        RestartPart("trainer start", TRAINER_START_S, True, "estimate: rendezvous, imports, NCCL, model"),
        RestartPart(
            CHECKPOINT_LOAD,
            tuple(restore_seconds * f for f in LOAD_RANGE),  # type: ignore[arg-type]
            True,
            "run.checkpoint.restore_seconds: s3torchconnector's 10 Gbit/s per rank target, half of it "
            "sustained (assumption; range a quarter to all of it)",
        ),
    ]
    if compiled:
        parts.append(RestartPart("compile", COMPILE_S, True, "estimate: torch.compile in the first step"))
    return RestartPlan(tuple(parts))
