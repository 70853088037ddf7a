"""SIGTERM inside SageMaker's 120 s: notice it within a micro-step, agree on it, then finish or drop.

SageMaker stops a job (StopTrainingJob, max runtime, spot reclaim) with SIGTERM and kills it 120 s
later. What happens in between:

1. Every rank's SIGTERM handler only sets a flag (`StopRequest`), with the time it arrived.
2. The flag is all-reduced after every accumulation micro-step (`StopVote`: a gloo all-reduce of two
   host numbers on a group of its own, posted after a micro-step's backward is queued and read after
   the next one's, so it never waits on the GPU and its latency hides behind a micro-step). Every
   rank therefore sees the stop at the same micro-step. Rank 0's checkpoint clock rides along.
3. A step whose micro-steps are not all done is dropped (gradients discarded, data position and
   optimizer unchanged: the resumed job computes it whole); a step whose micro-steps are all done
   is completed (only its optimizer step remains).
4. `plan_stop` (pure; rank 0 decides, every rank follows) spends what is left of the 120 s: an
   async save in flight is finished if its expected remainder fits, else abandoned (it stays without
   COMPLETE.json and is skipped on resume); then a final save is made if its expected time fits and
   the state is not already saved (never before the first step: no step-0 checkpoint, see
   trainer.checkpoint.manager), else the trainer says which checkpoint the next job resumes from and exits
   0. Expected times: the slowest save this job measured, else the plan's
   `run.checkpoint.save_seconds` (its `sigterm_fits` tells the user before launch).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.runtime import faults

# EXIT_MARGIN_S: kept free after the last save for the process to exit (logs flushed, process groups
# torn down, torchrun and the entrypoint exiting). Defined with SageMaker's grace in
# trainstack.planner.run_plan, so the planner's `run.checkpoint.sigterm_fits` uses the very figure the
# trainer keeps.
from trainstack.planner.run_plan import EXIT_MARGIN_S, SIGTERM_GRACE_S


class StopRequest:
    """Set by SIGTERM; acted on at the next micro-step boundary. `at`: when it first arrived.

    The container's entrypoint starts torchrun with SIGTERM blocked (trainer.entrypoint), and a blocked
    signal stays blocked across fork and exec, so the trainer unblocks it here, once its handler is
    set: a SIGTERM that arrived while the process was starting is delivered now, to this handler."""

    def __init__(self) -> None:
        self.requested = False
        self.at: float | None = None
        self.grace_s = SIGTERM_GRACE_S  # from `at` until the process is killed
        self.no_time = (
            faults.sigterm_no_time()
        )  # test-only (trainer.runtime.faults); also validates the variable
        signal.signal(signal.SIGTERM, self._handle)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        if faults.sigterm_at_start():
            os.kill(os.getpid(), signal.SIGTERM)

    def _handle(self, signum: int, frame: object) -> None:
        self.request(SIGTERM_GRACE_S)

    def request(self, grace_s: float) -> None:
        """Stop as on SIGTERM, with `grace_s` until the kill (trainer.runtime.capacity: a capacity block
        ends); a second request can only bring the kill closer."""
        if not self.requested or grace_s < self.seconds_left():
            self.at, self.grace_s = time.monotonic(), grace_s
        self.requested = True

    def seconds_left(self, grace_s: float | None = None) -> float:
        if self.no_time and self.at is not None:
            return EXIT_MARGIN_S  # as if it had arrived with only the exit margin left
        grace = self.grace_s if grace_s is None else grace_s
        return grace if self.at is None else grace - (time.monotonic() - self.at)


class StopVote:
    """The all-reduced (MAX) stop flag and save-due flag of one micro-step, read one micro-step later."""

    def __init__(self, group: dist.ProcessGroup, stop: StopRequest):
        self.group, self.stop = group, stop
        self._buffer = torch.zeros(2)
        self._work = None

    def post(self, save_due: bool = False) -> None:
        self._buffer = torch.tensor([float(self.stop.requested), float(save_due)])
        self._work = dist.all_reduce(self._buffer, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def result(self) -> tuple[bool, bool]:
        """(stop, save due) of the last post; (False, False) when nothing was posted."""
        if self._work is None:
            return False, False
        self._work.wait()
        self._work = None
        stop, due = self._buffer.tolist()  # a host tensor: no device sync
        return stop > 0, due > 0


@dataclass(frozen=True)
class StopPlan:
    finish_in_flight: bool  # wait for the async save in flight (False: abandon it, if there is one)
    final_save: bool  # save the current state before exiting
    resume_step: int | None  # the checkpoint the next job resumes from, if this plan works out
    reason: str


def plan_stop(
    seconds_left: float,
    step: int,
    newest_complete: int | None,
    in_flight: tuple[int, float] | None,
    save_s: float,
) -> StopPlan:
    """How to spend what is left of the SIGTERM window (pure).

    seconds_left: until SIGKILL; step: the state in memory (steps done); in_flight: (step, seconds
    since it started) of an async save still writing; save_s: what one save is expected to take."""
    budget = seconds_left - EXIT_MARGIN_S
    covered, finish, notes = newest_complete, False, []
    if in_flight is not None:
        in_flight_step, elapsed = in_flight
        remaining = max(save_s - elapsed, 0.0)
        if remaining <= budget:
            finish, covered = True, in_flight_step
            budget -= remaining
            notes.append(f"finishing the save of step {in_flight_step} (about {remaining:.0f} s left)")
        else:
            notes.append(
                f"abandoning the save of step {in_flight_step} (about {remaining:.0f} s left, "
                f"{max(budget, 0):.0f} s to spend)"
            )
    if covered == step:
        return StopPlan(finish, False, covered, "; ".join([*notes, f"step {step} is saved"]))
    if step == 0:  # nothing trained: the next job starts from the recipe's seed exactly as this one did
        notes.append("nothing to save before the first step (the next job starts at step 0 too)")
        return StopPlan(finish, False, covered, "; ".join(notes))
    if save_s <= budget:
        notes.append(f"saving step {step} (about {save_s:.0f} s of {budget:.0f} s)")
        return StopPlan(finish, True, step, "; ".join(notes))
    notes.append(f"no time to save step {step} (needs about {save_s:.0f} s, {max(budget, 0):.0f} s left)")
    return StopPlan(finish, False, covered, "; ".join(notes))
