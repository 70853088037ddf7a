"""Checkpoints with torch.distributed.checkpoint (DCP): sharded, async, complete-or-ignored, last K kept.

Layout of one checkpoint, under the run's location (trainer.storage: an s3:// prefix on SageMaker,
written straight from every rank; a local directory on CPU runs and in tests):

    step-000001000/
        __0_0.distcp ...           DCP shards of {"model", "optim"}: rank r writes __r_*.distcp
        .metadata                  DCP's index, written by rank 0 once every rank's shards are written
        rank-00000.pt ...          per-rank trainer state: step, data position, LR scheduler, RNG states
        manifest-rank00000.json    per rank, after its shards were written: its own files and sizes
        COMPLETE.json              rank 0, only after every rank reported its manifest written

A checkpoint is complete only when COMPLETE.json and all world_size manifests exist and every listed
file has exactly the listed size; anything else (killed mid-write, abandoned at SIGTERM, half-copied)
is skipped with a log line, and resume takes the newest complete one (rank 0 decides, every rank is
told). Small files are written whole or not at all (storage.py). The same rules hold for both
backends; with local directories that are one per node, each rank lists only its own files, so a
merge of every node's directory is complete exactly when every node finished.

A save, step by step (`_write`, on a background thread, over a gloo process group of its own so
nothing interleaves with the training loop's collectives; every rank runs the same collectives in
the same order whatever fails, so a failure never leaves one rank waiting):
 1. the state is staged to host memory: `DefaultStager` with pinned, cached buffers and a side CUDA
    stream, so the copy overlaps the next step's compute; the loop waits for it only before the next
    optimizer step (`wait_for_staging`), which is the first thing that changes what is being saved;
 2. rank-N.pt and the DCP shards are written; DCP returns on every rank once all shards and .metadata
    are written (and raises on every rank if any rank failed);
 3. each rank writes its manifest; an all-reduce tells every rank whether all did;
 4. rank 0 writes COMPLETE.json and says whether that worked; only then is the step counted complete;
 5. older checkpoints are pruned (below), by rank 0 on S3 or the first rank of each node locally.

Pruning keeps the newest `keep` checkpoints *known complete* (found complete at start, or finished
by step 4 in this job; the same list on every rank) and deletes everything older than the oldest of
them, plus incomplete directories between them. A directory merely present is never counted as one
of `keep`: a half-written newer checkpoint (an earlier job killed mid-save) must not push the last
complete one out. Incomplete directories newer than the newest complete one are left alone: they are
skipped on resume and removed once a newer checkpoint completes (or replaced when that step is saved
again).

Transformer Engine FP8 modules carry their scaling state as `_extra_state`, a byte tensor that is
empty until the module's first FP8 forward (TE's `get_extra_state` returns `torch.empty(0)` then).
A freshly built model therefore offers a 0-byte tensor where the checkpoint holds hundreds of bytes,
and DCP refuses the size change. On load the placeholders for every `_extra_state` are sized from the
checkpoint's own metadata, then handed to the module's `set_extra_state` through `set_state_dict`.
"""

from __future__ import annotations

import io
import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainer.storage import STEP_DIR, CheckpointStorage, LocalStorage, open_storage, step_dir_name

log = logging.getLogger(__name__)
MARKER = "COMPLETE.json"
EXTRA_STATE = "_extra_state"

__all__ = [
    "MARKER",
    "CheckpointError",
    "CheckpointManager",
    "TrainerState",
    "completeness_problem",
    "newest_complete",
    "prune_candidates",
    "step_dir_name",
    "step_dirs",
]


class CheckpointError(Exception):
    """A save that had to succeed (the final one) did not."""


@dataclass(frozen=True)
class TrainerState:
    step: int  # optimizer steps completed
    samples_consumed: int  # the data position: sample indices below this are used
    data_source: str  # name of the token source; resuming onto a different one is refused
    world_size: int
    recipe: str | None = None  # the resolved recipe (JSON) it was written with; trainer.resume compares
    data_schedule: str = ""  # a blend's weights by data position (trainer.blend.Schedule); "" otherwise


def manifest_name(rank: int) -> str:
    return f"manifest-rank{rank:05d}.json"


def extras_name(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def _json(data: bytes | None) -> dict | None:
    if data is None:
        return None
    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def storage_completeness_problem(storage: CheckpointStorage, step: int) -> str | None:
    """Why step `step` in `storage` is not a complete checkpoint, or None when it is."""
    marker = _json(storage.read(step, MARKER))
    if marker is None:
        present = storage.read(step, MARKER) is not None
        return f"unreadable {MARKER}" if present else f"no {MARKER} (interrupted while writing)"
    try:
        world = int(marker["world_size"])
    except (KeyError, TypeError, ValueError):
        return f"unreadable {MARKER}"
    listed: dict[str, int] = {}
    for rank in range(world):
        raw = storage.read(step, manifest_name(rank))
        if raw is None:
            return f"{manifest_name(rank)} is missing (rank {rank} had not finished)"
        manifest = _json(raw)
        if manifest is None or not isinstance(manifest.get("files"), dict):
            return f"unreadable {manifest_name(rank)}"
        listed.update(manifest["files"])
    present = storage.files(step)
    for name, size in listed.items():
        if name not in present:
            return f"{name} is missing"
        if present[name] != size:
            return f"{name} has {present[name]} bytes, expected {size} (truncated)"
    return None


def completeness_problem(directory: Path) -> str | None:
    """`storage_completeness_problem` for a local step directory (root/step-NNNNNNNNN)."""
    match = STEP_DIR.match(directory.name)
    if not match:
        return f"{directory.name} is not a step directory"
    return storage_completeness_problem(LocalStorage(directory.parent), int(match.group(1)))


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) for every step-N directory under a local root, newest first."""
    return [(step, root / step_dir_name(step)) for step in LocalStorage(root).steps()]


def newest_complete(root: Path) -> Path | None:
    """The newest complete checkpoint directory under a local root (incomplete ones logged)."""
    found = complete_steps(LocalStorage(Path(root)))
    return Path(root) / step_dir_name(found[0]) if found else None


def complete_steps(storage: CheckpointStorage) -> list[int]:
    """Every complete checkpoint's step, newest first; each incomplete one is logged and skipped."""
    found = []
    for step in storage.steps():
        problem = storage_completeness_problem(storage, step)
        if problem is None:
            found.append(step)
        else:
            log.warning(
                "skipping checkpoint %s/%s: %s", storage.location.rstrip("/"), step_dir_name(step), problem
            )
    return found


def prune_candidates(present: list[int], complete: list[int], keep: int) -> list[int]:
    """Steps to delete: older than the oldest of the newest `keep` complete checkpoints, or incomplete
    and older than the newest complete one. Nothing is deleted before one checkpoint is complete."""
    kept = sorted(complete, reverse=True)[:keep]
    if not kept:
        return []
    oldest_kept, newest = kept[-1], kept[0]
    return sorted(s for s in present if s < oldest_kept or (s not in kept and s < newest))


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def size_extra_states_from(metadata: Metadata, model_state: dict[str, Any], prefix: str = "model.") -> None:
    """Replace each `_extra_state` placeholder of a fresh model with one shaped as the checkpoint holds
    it: TE's is empty before the first FP8 forward, and DCP refuses a tensor whose size changed."""
    for key in list(model_state):
        if not key.endswith(EXTRA_STATE):
            continue
        saved = metadata.state_dict_metadata.get(prefix + key)
        if isinstance(saved, TensorStorageMetadata):
            model_state[key] = torch.empty(saved.size, dtype=saved.properties.dtype)
        elif isinstance(saved, BytesStorageMetadata):
            model_state[key] = io.BytesIO()


def _extra_states_as_tensors(model_state: dict[str, Any]) -> None:
    for key, value in model_state.items():
        if key.endswith(EXTRA_STATE) and isinstance(value, io.BytesIO):
            raw = value.getvalue()
            model_state[key] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0)


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
        """Every complete checkpoint as rank 0 sees it, agreed by every rank; the newest one's step."""
        found = complete_steps(self.storage) if self.rank == 0 else None
        shared = [found]
        dist.broadcast_object_list(shared, src=0, group=self.group)
        self.complete = list(shared[0] or [])
        return self.complete[0] if self.complete else None

    def newest_complete(self) -> int | None:
        return self.complete[0] if self.complete else None

    def describe(self, step: int | None) -> str:
        if step is None:
            return f"{self.location.rstrip('/')} (no complete checkpoint: step 0)"
        return f"{self.location.rstrip('/')}/{step_dir_name(step)}"

    def load(
        self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
    ) -> TrainerState:
        model_state, optim_state = get_state_dict(model, optimizer)
        size_extra_states_from(self.storage.reader(step).read_metadata(), model_state)
        payload = {"model": model_state, "optim": optim_state}
        dcp.load(payload, storage_reader=self.storage.reader(step), process_group=self.group)
        _extra_states_as_tensors(payload["model"])
        set_state_dict(model, optimizer, model_state_dict=payload["model"], optim_state_dict=payload["optim"])
        raw = self.storage.read(step, extras_name(self.rank)) or self.storage.read(step, extras_name(0))
        extras = torch.load(io.BytesIO(raw), weights_only=True)
        scheduler.load_state_dict(extras["scheduler"])
        state = TrainerState(**extras["trainer"])
        if state.world_size == self.world:
            _set_rng_state(extras["rng"])
        else:  # resharded resume: model and optimizer reshard exactly; per-rank RNG streams cannot
            log.warning(
                "checkpoint from %d ranks resumed on %d: RNG states start fresh", state.world_size, self.world
            )
        return state

    # --- save ---------------------------------------------------------------------------------------
    def save(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        state: TrainerState,
        blocking: bool = False,
    ) -> None:
        """Start saving `state` (return at once) or, with `blocking`, save it and raise CheckpointError
        unless it is complete. One save is in flight at a time: an earlier one is finished first."""
        self.wait()
        started = time.monotonic()
        model_state, optim_state = get_state_dict(model, optimizer)
        payload = {"model": model_state, "optim": optim_state}
        buffer = io.BytesIO()  # small, and it must capture this moment's scheduler and RNG state
        torch.save(
            {"trainer": asdict(state), "scheduler": scheduler.state_dict(), "rng": _rng_state()}, buffer
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
            source = payload  # DCP's writer copies each tensor to host as it writes
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
        log.info("checkpoint complete: %s (%.1f s)", self.describe(pending.step), seconds)
        return True

    def close(self) -> None:
        self.wait()
        self._executor.shutdown(wait=True)
        if self._stager is not None:
            self._stager.close()

    # --- the background part ------------------------------------------------------------------------
    def _all(self, ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def _write(self, state: TrainerState, source: Any, extras: bytes, started: float) -> float:
        storage, step, error = self.storage, state.step, None
        try:  # 1. this rank's preparation
            state_dict = source.result() if isinstance(source, Future) else source
            if self.prunes and step in storage.steps():  # left by an earlier job: must not mix in
                storage.delete(step)
        except BaseException as exc:
            state_dict, error = None, exc
        if not self._all(error is None):
            raise CheckpointError(f"preparing step {step} failed on a rank") from error
        try:
            storage.prepare(step)
            storage.write(step, extras_name(self.rank), extras)
        except BaseException as exc:
            error = exc
        if not self._all(error is None):
            raise CheckpointError(f"writing the trainer state of step {step} failed on a rank") from error
        # 2. the shards: raises on every rank if any rank failed
        dcp.save(state_dict, storage_writer=storage.writer(step), process_group=self.group)
        try:  # 3. this rank's manifest: its own files, as written
            own = {
                name: size
                for name, size in storage.files(step).items()
                if name.startswith(f"__{self.rank}_")
                or name == extras_name(self.rank)
                or (self.rank == 0 and name == ".metadata")
            }
            manifest = {"step": step, "rank": self.rank, "files": dict(sorted(own.items()))}
            storage.write(step, manifest_name(self.rank), (json.dumps(manifest, indent=1) + "\n").encode())
        except BaseException as exc:
            error = exc
        if not self._all(error is None):
            raise CheckpointError(f"a manifest of step {step} could not be written") from error
        try:  # 4. the marker, once every rank's manifest is written
            if self.rank == 0:
                marker = {
                    "step": step,
                    "samples_consumed": state.samples_consumed,
                    "world_size": state.world_size,
                    "data_source": state.data_source,
                    "run": self.run,
                }
                storage.write(step, MARKER, (json.dumps(marker, indent=1) + "\n").encode())
        except BaseException as exc:
            error = exc
        if not self._all(error is None):
            raise CheckpointError(f"the marker of step {step} could not be written") from error
        self.complete = sorted({*self.complete, step}, reverse=True)
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
