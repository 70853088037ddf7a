"""Checkpoints with torch.distributed.checkpoint (DCP): sharded, async, complete-or-ignored, last K kept.

Layout under the checkpoint directory (SageMaker syncs /opt/ml/checkpoints with S3):

    step-000001000/
        __0_0.distcp ...           DCP shards of {"model", "optim"}: rank r writes __r_*.distcp
        .metadata                  DCP's index, written by rank 0 once every rank's shards are on disk
        rank-00000.pt ...          per-rank trainer state: step, data position, LR scheduler, RNG states
        manifest-rank00000.json    per rank, after its save returned: its own files and their sizes
        COMPLETE.json              rank 0, after its save returned: step, data position, world size

Every file of a rank is listed by that rank, so the scheme holds whether the checkpoint directory is
one shared filesystem or, as on SageMaker, a local directory per node synced with one S3 prefix (and
downloaded whole to every node on restart). A directory is complete only when COMPLETE.json and all
world_size manifests exist and every listed file has exactly the listed size; anything else (killed
mid-write, half-synced from S3) is skipped with a log line, and resume takes the newest complete one
(rank 0 decides and tells the others). Manifests and the marker are written atomically (tmp +
rename) only after DCP's save has returned, which it does on every rank only once all shards and
.metadata are written.

Saves are asynchronous: state is staged to host memory in the step loop, files are written by a
background thread on a separate gloo process group (so the training collectives never interleave
with it). One save is in flight at a time. Old checkpoints are pruned at the start of the next save
(and after the final, blocking one), once a barrier shows every rank has finalized the newest, so
between saves keep + 1 directories can exist.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

log = logging.getLogger(__name__)
MARKER = "COMPLETE.json"
STEP_DIR = re.compile(r"^step-(\d{9})$")


@dataclass(frozen=True)
class TrainerState:
    step: int  # optimizer steps completed
    samples_consumed: int  # the data position: sample indices below this are used
    data_source: str  # name of the token source; resuming onto a different one is refused
    world_size: int


def step_dir_name(step: int) -> str:
    return f"step-{step:09d}"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def manifest_name(rank: int) -> str:
    return f"manifest-rank{rank:05d}.json"


def completeness_problem(directory: Path) -> str | None:
    """Why `directory` is not a complete checkpoint, or None when it is."""
    marker = directory / MARKER
    if not marker.is_file():
        return f"no {MARKER} (interrupted while writing)"
    try:
        world = int(json.loads(marker.read_text())["world_size"])
    except (ValueError, KeyError, TypeError):
        return f"unreadable {MARKER}"
    files: dict[str, int] = {}
    for rank in range(world):
        manifest = directory / manifest_name(rank)
        if not manifest.is_file():
            return f"{manifest.name} is missing (rank {rank} had not finished)"
        try:
            files.update(json.loads(manifest.read_text())["files"])
        except (ValueError, KeyError, TypeError):
            return f"unreadable {manifest.name}"
    for name, size in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, expected {size} (truncated)"
    return None


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) for every step-N directory, newest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return sorted(found, reverse=True)


def newest_complete(root: Path) -> Path | None:
    for _, directory in step_dirs(root):
        problem = completeness_problem(directory)
        if problem is None:
            return directory
        log.warning("skipping checkpoint %s: %s", directory, problem)
    return None


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class CheckpointManager:
    def __init__(
        self, root: Path, keep: int, rank: int, world: int, local_rank: int = 0, asynchronous: bool = True
    ):
        self.root, self.keep, self.rank, self.world = Path(root), keep, rank, world
        self.local_rank = local_rank
        self.asynchronous = asynchronous
        # A separate gloo group: the async writer thread's collectives must not share a communicator
        # with the training loop's (NCCL on GPU; on CPU the default group is gloo too).
        self.group = dist.new_group(backend="gloo")
        self._pending: tuple[Future, Path, TrainerState] | None = None

    # --- save ---------------------------------------------------------------------------------------
    def save(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        state: TrainerState,
        blocking: bool = False,
    ) -> Path:
        self.wait()
        directory = self.root / step_dir_name(state.step)
        dist.barrier(group=self.group)  # every rank has finalized every earlier save
        if self.local_rank == 0:
            if directory.exists():  # an interrupted earlier attempt: must not count as kept below
                shutil.rmtree(directory, ignore_errors=True)
            self._prune()
        dist.barrier(group=self.group)
        directory.mkdir(parents=True, exist_ok=True)  # on every node: the directory may be node-local
        extras = {"trainer": asdict(state), "scheduler": scheduler.state_dict(), "rng": _rng_state()}
        extras_path = directory / f"rank-{self.rank:05d}.pt"
        torch.save(extras, extras_path.with_name(extras_path.name + ".tmp"))
        os.replace(extras_path.with_name(extras_path.name + ".tmp"), extras_path)
        model_state, optim_state = get_state_dict(model, optimizer)
        payload = {"model": model_state, "optim": optim_state}
        if self.asynchronous and not blocking:
            response = dcp.async_save(payload, checkpoint_id=str(directory), process_group=self.group)
            self._pending = (getattr(response, "upload_completion", response), directory, state)
        else:
            dcp.save(payload, checkpoint_id=str(directory), process_group=self.group)
            self._finalize(directory, state)
            dist.barrier(group=self.group)
            if self.local_rank == 0:
                self._prune()
        return directory

    def poll(self) -> None:
        """Finalize a finished async save (rank 0 writes the marker); cheap when nothing is pending."""
        if self._pending is not None and self._pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Block until the in-flight save is on disk and marked complete (re-raises its error)."""
        if self._pending is None:
            return
        future, directory, state = self._pending
        self._pending = None
        future.result()
        self._finalize(directory, state)

    def _own_files(self, directory: Path) -> dict[str, int]:
        paths = [*directory.glob(f"__{self.rank}_*.distcp"), directory / f"rank-{self.rank:05d}.pt"]
        if self.rank == 0:
            paths.append(directory / ".metadata")
        return {p.name: p.stat().st_size for p in sorted(paths)}

    def _finalize(self, directory: Path, state: TrainerState) -> None:
        # DCP's save has returned: on every rank that means all shards and .metadata are written.
        manifest = {"step": state.step, "rank": self.rank, "files": self._own_files(directory)}
        _write_atomic(directory / manifest_name(self.rank), json.dumps(manifest, indent=1) + "\n")
        if self.rank == 0:
            marker = {
                "step": state.step,
                "samples_consumed": state.samples_consumed,
                "world_size": state.world_size,
                "data_source": state.data_source,
            }
            _write_atomic(directory / MARKER, json.dumps(marker, indent=1) + "\n")
            log.info("checkpoint complete: %s", directory)

    def _prune(self) -> None:
        """Keep the newest `keep` checkpoints this rank finished; drop every directory older than those.

        Called only after a barrier that follows every rank's `_finalize` of those saves: a rank's
        manifest is written at its own next step boundary, so pruning right after this rank's own
        finalize could delete the last complete checkpoint (keep: 1) while the newest still lacks
        another rank's manifest. Judged by this rank's own manifest, not COMPLETE.json: with
        node-local directories only node 0 holds the marker."""
        finished = [s for s, d in step_dirs(self.root) if (d / manifest_name(self.rank)).is_file()]
        if len(finished) <= self.keep:
            return
        oldest_kept = finished[self.keep - 1]
        for step, directory in step_dirs(self.root):
            if step < oldest_kept:
                shutil.rmtree(directory, ignore_errors=True)
                log.info("removed old checkpoint %s", directory)

    def newest_complete(self) -> Path | None:
        """The newest complete checkpoint as rank 0 sees it, agreed by every rank."""
        found = newest_complete(self.root) if self.rank == 0 else None
        choice = [str(found) if found is not None else None]
        dist.broadcast_object_list(choice, src=0, group=self.group)
        return Path(choice[0]) if choice[0] else None

    # --- load ---------------------------------------------------------------------------------------
    def load(
        self, directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
    ) -> TrainerState:
        model_state, optim_state = get_state_dict(model, optimizer)
        payload = {"model": model_state, "optim": optim_state}
        dcp.load(payload, checkpoint_id=str(directory), process_group=self.group)
        set_state_dict(model, optimizer, model_state_dict=payload["model"], optim_state_dict=payload["optim"])
        own = directory / f"rank-{self.rank:05d}.pt"
        extras = torch.load(own if own.is_file() else directory / "rank-00000.pt", weights_only=True)
        scheduler.load_state_dict(extras["scheduler"])
        state = TrainerState(**extras["trainer"])
        if state.world_size == self.world:
            _set_rng_state(extras["rng"])
        else:  # resharded resume: model and optimizer reshard exactly; per-rank RNG streams cannot
            log.warning(
                "checkpoint from %d ranks resumed on %d: RNG states start fresh", state.world_size, self.world
            )
        return state
