"""A restart as it happened: from the previous job's end to this job's first metric line, in parts.

The planner's figures (trainstack.planner.restart) are estimates; `trainstack status` shows each job's
measured restart beside them, from what SageMaker records (DescribeTrainingJob):
- the previous job of the run ended at its TrainingEndTime ("for failed jobs, the time when SageMaker
  detects a job failure"), else at the end of its last SecondaryStatusTransition;
- decision: from there to this job's CreationTime (the supervisor, and any capacity wait);
- provisioning: the `Starting` secondary status ("Launching requested ML instances", "Preparing the
  instances for training"); `Downloading` (input data in File mode) when there is one;
- to the first metric line: from the end of those (the `Training` status starts with "Downloading the
  training image") to the first `train:step` point CloudWatch holds: the image, the trainer's start,
  the checkpoint load and the first `training.log_every` steps (the first line comes after them).
Statuses, not status messages: SageMaker says messages "are subject to change" and should not be
parsed (SecondaryStatusTransition, StatusMessage). Billed (TrainingStartTime onwards, "You are billed
for the time interval between this time and the value of TrainingEndTime") is the part from
TrainingStartTime to the first metric line.

Pure functions of plain values (trainstack.aws.runs.Job); no AWS calls here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from trainstack.aws.runs import Job


@dataclass(frozen=True)
class MeasuredRestart:
    job: str
    previous: str | None  # the run's previous job; None for a run's first job (start-up only)
    parts: tuple[tuple[str, float], ...]  # (what, seconds), in order
    billed_seconds: float | None  # TrainingStartTime to the first metric line
    first_step: int | None  # the step of the first metric line

    @property
    def seconds(self) -> float:
        return sum(seconds for _, seconds in self.parts)

    def text(self, usd_per_hour: float, planned_s: float | None = None) -> str:
        """'14 min from job -1's end to the first metric line (step 10): decision 1, provisioning 8, ...'"""
        since = f"from {self.previous}'s end" if self.previous else "from its creation"
        parts = ", ".join(f"{name} {seconds / 60:.0f}" for name, seconds in self.parts)
        text = f"{self.seconds / 60:,.0f} min {since} to the first metric line (step {self.first_step})"
        text += f": {parts} min"
        if self.billed_seconds is not None:
            usd = usd_per_hour * self.billed_seconds / 3600
            text += f"; {self.billed_seconds / 60:.0f} min billed, {usd:,.0f} USD"
        if planned_s is not None:
            text += f"; plan {planned_s / 60:.0f} min"
        return text

    def as_dict(self) -> dict:
        return {
            "previous": self.previous,
            "seconds": self.seconds,
            "parts": dict(self.parts),
            "billed_seconds": self.billed_seconds,
            "first_step": self.first_step,
        }


def previous_job_name(job: Job) -> str | None:
    """The run's job before this one: `<run>-<n-1>` for job `<run>-<n>` (trainstack.recipes.naming)."""
    if not job.run:
        return None
    match = re.fullmatch(re.escape(job.run) + r"-(\d+)", job.name)
    if not match or int(match.group(1)) <= 1:
        return None
    return f"{job.run}-{int(match.group(1)) - 1}"


def ended_at(job: Job) -> datetime | None:
    if job.ended is not None:
        return job.ended
    ends = [end for _, _, end in job.transitions if end is not None]
    return max(ends) if ends else None


def measure_restart(
    job: Job, previous: Job | None, first_metric: tuple[datetime, float] | None
) -> MeasuredRestart | None:
    """The restart before `job` (pure), or None until its first metric line exists."""
    if first_metric is None:
        return None
    first_at, first_step = first_metric
    parts: list[tuple[str, float]] = []
    previous_end = ended_at(previous) if previous is not None else None
    if previous_end is not None:
        parts.append(("decision", max(0.0, (job.created - previous_end).total_seconds())))
    cursor = job.created
    for status in ("Starting", "Downloading"):
        spans = [(start, end) for name, start, end in job.transitions if name == status and end is not None]
        if spans:
            start, end = spans[0][0], spans[-1][1]
            parts.append(
                ("provisioning" if status == "Starting" else "downloading", (end - start).total_seconds())
            )
            cursor = max(cursor, end)
    parts.append(("to the first metric line", max(0.0, (first_at - cursor).total_seconds())))
    billed = max(0.0, (first_at - job.started).total_seconds()) if job.started else None
    return MeasuredRestart(
        job.name, previous.name if previous_end is not None else None, tuple(parts), billed, int(first_step)
    )
