"""A training plan's capacity block ends: save and exit 0 before SageMaker takes the instances back.

What AWS documents (SageMaker developer guide, "Training plans utilization for SageMaker training
jobs", https://docs.aws.amazon.com/sagemaker/latest/dg/training-plan-utilization-for-training-jobs.html):
- "You have full access to all reserved instances until 30 minutes before the Reserved Capacity end
  time. When there are 30 minutes remaining in your Reserved Capacity, SageMaker training plans begin
  the process of terminating any running instances within that Reserved Capacity."
- The job learns the end time from the environment variable
  SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP; the guide's example reads it as whole Unix
  epoch seconds (`datetime.fromtimestamp(int(value))`) and treats "0" (or unset) as "no block".
  It names the *current* block: a plan of several blocks ends each one this way.

So with a training plan the job is reclaimed at expiry - 30 min, and nobody waits for a save: the
trainer requests its own stop at reclaim time - lead, where the lead is what the planner says a stop
takes (the last micro-step, the optimizer step and a whole save: `run.checkpoint.sigterm_seconds`)
doubled, since the planner's figures are estimates (and at least a minute: a block lasts days), plus
the exit margin. From there the stop is the
SIGTERM path (trainer.runtime.stopping): every rank agrees at the next micro-step, the state is saved, and the
trainer exits 0. The run's next job (on the plan's next block, or elsewhere) resumes from that save.

Not handled: a plan extended while the job runs moves the block's end, but the job's environment keeps
the old value; the job then stops early and the run's next job runs on the extension (one restart).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from trainer.runtime.stopping import StopRequest
from trainstack.planner.run_plan import EXIT_MARGIN_S

log = logging.getLogger("trainer.capacity")  # its log lines' name before the package move

EXPIRY_ENV = "SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"
RECLAIM_BEFORE_END_S = 30 * 60.0  # the guide: termination begins 30 minutes before the block ends
LEAD_FACTOR = 2.0  # the planned stop time is an estimate: start it this many times earlier
MIN_STOP_S = 60.0  # ... and never with less than this for the stop itself


@dataclass(frozen=True)
class CapacityDeadline:
    expires_at: float  # epoch seconds: the block's end, as SageMaker announced it
    reclaim_at: float  # epoch seconds: when SageMaker starts terminating the instances
    stop_at: float  # epoch seconds: when the trainer requests its own stop
    lead_s: float  # stop_at is this long before reclaim_at

    def describe(self) -> str:
        def utc(t: float) -> str:
            return f"{datetime.fromtimestamp(t, UTC):%Y-%m-%d %H:%M:%S} UTC"

        return (
            f"capacity block ends {utc(self.expires_at)}; SageMaker reclaims the instances from "
            f"{utc(self.reclaim_at)}; the trainer stops and saves at {utc(self.stop_at)} "
            f"({self.lead_s:.0f} s before)"
        )


def capacity_deadline(environ: Mapping[str, str], stop_seconds: float) -> CapacityDeadline | None:
    """The deadline SageMaker announced for this job's capacity block (pure), or None without one.

    `stop_seconds`: what a stop takes (the plan's `run.checkpoint.sigterm_seconds`)."""
    raw = environ.get(EXPIRY_ENV, "").strip()
    if raw in ("", "0"):
        return None
    try:
        expires = float(raw)
    except ValueError:
        log.warning("%s=%r is not epoch seconds: the capacity block's end is not watched", EXPIRY_ENV, raw)
        return None
    reclaim = expires - RECLAIM_BEFORE_END_S
    lead = max(LEAD_FACTOR * stop_seconds, MIN_STOP_S) + EXIT_MARGIN_S
    return CapacityDeadline(expires, reclaim, reclaim - lead, lead)


def watch_capacity(
    stop: StopRequest,
    stop_seconds: float,
    environ: Mapping[str, str] | None = None,
    clock: Callable[[], float] = time.time,
) -> threading.Timer | None:
    """Request the stop at the capacity block's deadline (a daemon timer; cancel it when training ends).
    A deadline already passed requests it now: the next micro-step stops."""
    deadline = capacity_deadline(os.environ if environ is None else environ, stop_seconds)
    if deadline is None:
        return None
    log.info("training plan: %s", deadline.describe())

    def fire() -> None:
        left = max(deadline.reclaim_at - clock(), 0.0)
        log.warning("capacity block: %.0f s until SageMaker reclaims the instances; stopping to save", left)
        stop.request(left)

    timer = threading.Timer(max(deadline.stop_at - clock(), 0.0), fire)
    timer.daemon = True
    timer.start()
    return timer
