"""Checkpoints with torch.distributed.checkpoint (DCP): sharded, async, digested, verified, last K kept.

The folder's format (file names, COMPLETE.json and manifest schema, SHA-256 per file) is defined in
trainstack.protocol.checkpoint_format; where it lives (a local directory or an s3:// prefix written
straight from every rank) in trainer.storage; which folders are candidates in
trainer.checkpoint.discovery; how digests are computed while writing and checked while reading in
trainer.checkpoint.integrity.

A save: `save` stages the state to host memory (`DefaultStager` with pinned, cached buffers and a side
CUDA stream, so the copy overlaps the next step's compute; the loop waits for it only before the next
optimizer step, `wait_for_staging`, the first thing that changes what is being saved) and writes it on
a background thread (trainer.checkpoint.write: shards, manifests, marker); then older checkpoints are
pruned (below), by rank 0 on S3 or the first rank of each node locally. With `asynchronous=False`
(--sync-checkpoints) every save is blocking instead: written from the live state while the loop
waits, so what is marked complete is exactly the step it names.

No step-0 checkpoint is ever written: a stop before the first step has nothing the recipe's seed does
not already give, and DCP's `get_state_dict` would first give the fresh optimizer a step of its own
(torch initialises optimizer state by running `step()` with zero gradients), so a resume from it
would count one step too many.

Resume (`resume`): rank 0 inspects every step folder (trainer.checkpoint.discovery) and tells every
rank; the newest candidate is loaded with every file verified against its digest by one rank
(trainer.checkpoint.read); a mismatch anywhere makes every rank skip that checkpoint, log which file,
and load the next older one. When the location holds step folders but none can be resumed from, the
job stops (exit 2, fatal for the supervisor: `NoIntactCheckpoint`) instead of starting again at step 0
over the run's history; an empty location is a new run.

Pruning keeps the newest `keep` checkpoints *known complete* (found complete at start, or finished
by a save in this job; the same list on every rank) and deletes everything older than the oldest of
them, plus incomplete directories between them. A directory merely present is never counted as one
of `keep`: a half-written newer checkpoint (an earlier job killed mid-save) must not push the last
complete one out. Incomplete or damaged directories newer than the newest complete one are left
alone: they are skipped on resume and replaced when that step is saved again.

What a checkpoint holds besides the shards (TrainerState, Transformer Engine's `_extra_state`):
trainer.checkpoint.state.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict

from trainer.checkpoint.discovery import (
    NoIntactCheckpoint,
    complete_steps,
    completeness_problem,
    inspect_all,
    inspect_step,
    newest_complete,
    prune_candidates,
    step_dirs,
    storage_completeness_problem,
)
from trainer.checkpoint.read import read_step
from trainer.checkpoint.state import (
    CheckpointDamaged,
    CheckpointError,
    TrainerState,
    rng_state,
    size_extra_states_from,
)
from trainer.checkpoint.write import write_step
from trainer.storage import CheckpointStorage, open_storage
from trainstack.protocol.checkpoint_format import (
    DAMAGED,
    MARKER,
    Inspection,
    extras_name,
    manifest_name,
    step_dir_name,
)
from trainstack.protocol.metrics import checkpoint_saved_line

log = logging.getLogger("trainer.checkpoint")  # its log lines' name before the package move

__all__ = [
    "MARKER",
    "CheckpointDamaged",
    "CheckpointError",
    "CheckpointManager",
    "NoIntactCheckpoint",
    "TrainerState",
    "complete_steps",
    "completeness_problem",
    "extras_name",
    "inspect_step",
    "manifest_name",
    "newest_complete",
    "prune_candidates",
    "size_extra_states_from",
    "step_dir_name",
    "step_dirs",
    "storage_completeness_problem",
]


@dataclass
class _Pending:
    step: int
    staging: Future | None  # the host copy; done before the next optimizer step may run
    write: Future  # -> seconds the whole save took, or raises
    started: float


class CheckpointManager:
    def __init__(
        self,
        storage: CheckpointStorage | Path | str,
        keep: int,
        rank: int,
        world: int,
        local_rank: int = 0,
        asynchronous: bool = True,
        run: str | None = None,
    ):
        self.storage = storage if hasattr(storage, "steps") else open_storage(storage)
        self.keep, self.rank, self.world, self.run = keep, rank, world, run
        self.asynchronous = asynchronous
        # S3 is one store: one rank prunes. Local directories may be one per node: each node's first.
        self.prunes = rank == 0 if self.storage.shared else local_rank == 0
        # A separate gloo group: the writer thread's collectives must never share a communicator with
        # the training loop's (NCCL on GPU; on CPU the default group is gloo too).
        self.group = dist.new_group(backend="gloo")
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._pending: _Pending | None = None
        self.abandoned = False  # set when SIGTERM left a save behind: close() would wait forever
        self.complete: list[int] = []  # known complete, newest first; the same list on every rank
        self.inspections: dict[int, Inspection] = {}  # every step folder found at start, as rank 0 saw it
        self.measured_save_s: float | None = None  # the slowest save of this job, for SIGTERM decisions
        cuda = torch.cuda.is_available()
        self._stager = (
            DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda,
                    use_shared_memory=False,
                    use_async_staging=True,
                    use_non_blocking_copy=cuda,
                )
            )
            if asynchronous
            else None
        )

    @property
    def location(self) -> str:
        return self.storage.location

    # --- discover and load --------------------------------------------------------------------------
    def discover(self) -> int | None:
        """Every step folder as rank 0 inspects it (trainer.checkpoint.discovery), agreed by every rank; the
        newest candidate's step."""
        found = inspect_all(self.storage) if self.rank == 0 else None
        shared = [found]
        dist.broadcast_object_list(shared, src=0, group=self.group)
        self.inspections = {i.step: i for i in shared[0] or []}
        self.complete = [i.step for i in shared[0] or [] if i.usable]
        return self.complete[0] if self.complete else None

    def inspection(self, step: int) -> Inspection:
        """Step `step`'s inspection, agreed by every rank (from `discover`, else made now by rank 0)."""
        if step not in self.inspections:
            shared = [inspect_step(self.storage, step) if self.rank == 0 else None]
            dist.broadcast_object_list(shared, src=0, group=self.group)
            self.inspections[step] = shared[0]
        return self.inspections[step]

    def newest_complete(self) -> int | None:
        return self.complete[0] if self.complete else None

    def describe(self, step: int | None) -> str:
        if step is None:
            return f"{self.location.rstrip('/')} (no complete checkpoint: step 0)"
        return f"{self.location.rstrip('/')}/{step_dir_name(step)}"

    def resume(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
    ) -> TrainerState | None:
        """Load the newest checkpoint that is intact, skipping (and logging) each damaged newer one.
        None for an empty location (a new run); NoIntactCheckpoint when step folders exist but none can
        be resumed from."""
        self.discover()
        unusable = {step: i.problem or "" for step, i in self.inspections.items() if not i.usable}
        for step in list(self.complete):
            try:
                return self.load(step, model, optimizer, scheduler)
            except CheckpointDamaged as damaged:
                if self.rank == 0:
                    log.warning("skipping checkpoint %s: %s", self.describe(step), damaged.problem)
                unusable[step] = damaged.problem
                self.forget(step, damaged.problem)
        if unusable:
            raise NoIntactCheckpoint(self.location, unusable)
        return None

    def forget(self, step: int, problem: str) -> None:
        """Count step `step` as unusable from now on (it is never one of `keep`)."""
        self.complete = [s for s in self.complete if s != step]
        if step in self.inspections:
            self.inspections[step] = dataclasses.replace(
                self.inspections[step], state=DAMAGED, problem=problem
            )

    def load(
        self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
    ) -> TrainerState:
        """Load step `step` into model, optimizer and scheduler, every file verified against its digest
        by one rank (trainer.checkpoint.read). Raises CheckpointDamaged on every rank when any file does
        not match (the model and optimizer may then hold part of it: load another checkpoint first)."""
        return read_step(
            self.storage,
            self.inspection(step),
            self.group,
            rank=self.rank,
            world=self.world,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            describe=self.describe,
        )

    # --- save ---------------------------------------------------------------------------------------
    def save(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        state: TrainerState,
        blocking: bool = False,
    ) -> None:
        """Start saving `state` (return at once) or, with `blocking` or a synchronous manager, save it
        and raise CheckpointError unless it is complete. One save is in flight at a time: an earlier
        one is finished first."""
        if state.step < 1:
            raise ValueError("no step-0 checkpoint: nothing trained yet (see trainer.checkpoint.manager)")
        blocking = blocking or not self.asynchronous
        self.wait()
        started = time.monotonic()
        model_state, optim_state = get_state_dict(model, optimizer)
        payload = {"model": model_state, "optim": optim_state}
        buffer = io.BytesIO()  # small, and it must capture this moment's scheduler and RNG state
        torch.save(
            {"trainer": asdict(state), "scheduler": scheduler.state_dict(), "rng": rng_state()}, buffer
        )
        staging = None
        if self._stager is not None and not blocking:
            if torch.cuda.is_available():
                # The side stream's copies must follow the optimizer step queued on the compute stream.
                stream = getattr(self._stager, "_staging_stream", None)
                if stream is not None:
                    stream.wait_stream(torch.cuda.current_stream())
                else:
                    torch.cuda.current_stream().synchronize()
            staging = self._stager.stage(payload)
            source: Any = staging
        else:
            source = payload  # blocking: the loop waits, so the live state is this step's state
        write = self._executor.submit(self._write, state, source, buffer.getvalue(), started)
        self._pending = _Pending(state.step, staging, write, started)
        if blocking:
            self.wait(raise_on_failure=True)

    def wait_for_staging(self) -> None:
        """Block until the in-flight save's host copy is taken: call before the optimizer changes state."""
        if self._pending is not None and self._pending.staging is not None:
            self._pending.staging.result()
            self._pending.staging = None

    def poll(self) -> None:
        """Report a finished background save; cheap when nothing is pending or it is still writing."""
        if self._pending is not None and self._pending.write.done():
            self.wait()

    def in_flight(self) -> tuple[int, float] | None:
        """(step, seconds since it started) of the save still writing, or None."""
        if self._pending is None or self._pending.write.done():
            return None
        return self._pending.step, time.monotonic() - self._pending.started

    def wait(self, raise_on_failure: bool = False, timeout: float | None = None) -> bool:
        """Finish the in-flight save; True when it completed (or nothing was pending). A failed save is
        logged and training goes on (the previous complete checkpoint stays the newest), unless
        `raise_on_failure`. With `timeout`, gives up waiting (the save is then abandoned) and
        returns False."""
        if self._pending is None:
            return True
        pending = self._pending
        try:
            seconds = pending.write.result(timeout=timeout)
        except FutureTimeout:
            return False
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            self._pending = None
            reason = " ".join(str(exc).split())[:400]
            message = (
                f"checkpoint of step {pending.step} failed ({type(exc).__name__}: {reason}); "
                f"the newest complete checkpoint stays {self.describe(self.newest_complete())}"
            )
            if raise_on_failure:
                raise CheckpointError(message) from exc
            log.error("%s", message)
            return False
        self._pending = None
        self.measured_save_s = max(self.measured_save_s or 0.0, seconds)
        log.info("%s", checkpoint_saved_line(self.describe(pending.step), seconds))
        return True

    def close(self) -> None:
        self.wait()
        self._executor.shutdown(wait=True)
        if self._stager is not None:
            self._stager.close()

    def delete_step(self, step: int) -> None:
        """Delete checkpoint `step` (its marker first) where this rank prunes; every rank forgets it."""
        if self.prunes:
            self.storage.delete(step)
        self.complete = [s for s in self.complete if s != step]
        self.inspections.pop(step, None)

    # --- the background part ------------------------------------------------------------------------
    def _write(self, state: TrainerState, source: Any, extras: bytes, started: float) -> float:
        """The save's background part: the checkpoint written (trainer.checkpoint.write), counted
        complete on every rank, older ones pruned (5.); returns the seconds the whole save took."""
        write_step(
            self.storage,
            self.group,
            rank=self.rank,
            world=self.world,
            prunes=self.prunes,
            run=self.run,
            state=state,
            source=source,
            extras=extras,
        )
        self.complete = sorted({*self.complete, state.step}, reverse=True)
        if self.prunes:  # 5.
            self._prune()
        return time.monotonic() - started

    def _prune(self) -> None:
        try:
            for step in prune_candidates(self.storage.steps(), self.complete, self.keep):
                self.storage.delete(step)
                log.info("removed old checkpoint %s", self.describe(step))
        except Exception as exc:  # an old checkpoint left behind costs storage, not correctness
            log.warning("pruning old checkpoints failed: %s", exc)
