"""One checkpoint written: shards, manifests, marker, every rank in step (steps 1-4 of a save).

`CheckpointManager.save` stages the state and runs `write_step` on its background thread, over a gloo
process group of its own so nothing interleaves with the training loop's collectives. Every rank runs
the same collectives in the same order whatever fails, so a failure never leaves one rank waiting:

 1. this rank's preparation (the staged host copy, a leftover folder of this step removed), then
    rank-N.pt (trainer state, scheduler, RNG);
 2. the DCP shards, each file's size and SHA-256 taken from the bytes as they stream out
    (trainer.checkpoint.integrity); DCP returns on every rank once all shards and .metadata are written
    (and raises on every rank if any rank failed);
 3. each rank writes its manifest (its files, sizes and digests); an all-reduce tells every rank
    whether all did;
 4. every rank's file table is gathered; rank 0 writes COMPLETE.json listing every file, and says
    whether that worked; only then is the step counted complete (and pruning, step 5, may run).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from trainer.checkpoint.integrity import DigestingWrites
from trainer.checkpoint.state import CheckpointError, TrainerState
from trainer.runtime import faults
from trainer.storage import CheckpointStorage
from trainstack.protocol.checkpoint_format import (
    MARKER,
    FileRecord,
    extras_name,
    manifest_document,
    manifest_name,
    marker_document,
    record_of,
)


def all_ranks(group: dist.ProcessGroup, ok: bool) -> bool:
    """Whether every rank of `group` says ok (a collective: every rank calls it)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


@contextmanager
def agreed(group: dist.ProcessGroup, failed: str) -> Iterator[None]:
    """One phase of a save on every rank of `group`: on leaving it, every rank learns whether any rank
    failed, and every rank raises CheckpointError(`failed`) if one did (chained to this rank's own error,
    if it had one), so no rank goes on to a phase the others never reach."""
    error: BaseException | None = None
    try:
        yield
    except BaseException as exc:
        error = exc
    if not all_ranks(group, error is None):
        raise CheckpointError(failed) from error


def write_step(
    storage: CheckpointStorage,
    group: dist.ProcessGroup,
    *,
    rank: int,
    world: int,
    prunes: bool,
    run: str | None,
    state: TrainerState,
    source: Any,
    extras: bytes,
) -> None:
    """Write checkpoint `state.step` from `source` (the state dict, or a Future of its staged copy) and
    `extras` (rank-N.pt's bytes); returns once its marker is written, raises CheckpointError on every
    rank otherwise. `prunes`: this rank removes a leftover folder of the same step first."""
    step = state.step
    with agreed(group, f"preparing step {step} failed on a rank"):  # 1. this rank's preparation
        state_dict = source.result() if isinstance(source, Future) else source
        if prunes and step in storage.steps():  # left by an earlier job: must not mix in
            storage.delete(step)
    own: dict[str, FileRecord] = {}
    with agreed(group, f"writing the trainer state of step {step} failed on a rank"):
        storage.prepare(step)
        storage.write(step, extras_name(rank), extras)
        own[extras_name(rank)] = record_of(extras)
    faults.point("before-shards", step, rank)
    # 2. the shards, each digested as it streams out: raises on every rank if any rank failed
    writer = storage.writer(step)
    digests = DigestingWrites(writer.fs, step, rank)
    writer.fs = digests
    dcp.save(state_dict, storage_writer=writer, process_group=group)
    faults.point("after-shards", step, rank)
    with agreed(group, f"a manifest of step {step} could not be written"):  # 3. this rank's, as written
        own.update(digests.written)
        manifest = manifest_document(step=step, rank=rank, world_size=world, files=own)
        storage.write(step, manifest_name(rank), manifest)
        own[manifest_name(rank)] = record_of(manifest)
    faults.point("after-manifests", step, rank)
    tables: list[Any] = [None] * world
    dist.all_gather_object(tables, own, group=group)
    # 4. the marker: every rank's files, once every rank's manifest is written
    with agreed(group, f"the marker of step {step} could not be written"):
        if rank == 0:
            files = {name: record for table in tables for name, record in table.items()}
            marker = marker_document(
                step=step,
                world_size=state.world_size,
                samples_consumed=state.samples_consumed,
                data_source=state.data_source,
                run=run,
                files=files,
            )
            faults.point("before-marker", step, rank)
            storage.write(step, MARKER, marker)
            faults.point("after-marker", step, rank)
