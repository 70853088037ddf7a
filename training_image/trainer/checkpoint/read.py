"""One checkpoint loaded: every file verified against its digest, every rank agreeing on the outcome.

`CheckpointManager.resume` tries the newest complete checkpoint first; `read_step` loads one. One rank
verifies each file as DCP reads it (trainer.checkpoint.integrity). Before DCP's collectives and after
them, every rank learns whether any rank found a damaged file (then every rank raises
CheckpointDamaged, and the manager tries the next older checkpoint) or failed otherwise (then every
rank raises: a lost connection is not a reason to fall back to an older checkpoint).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainer.checkpoint.integrity import VerifiedReads
from trainer.checkpoint.state import (
    CheckpointDamaged,
    CheckpointError,
    TrainerState,
    extra_states_as_tensors,
    set_rng_state,
    size_extra_states_from,
)
from trainer.storage import CheckpointStorage
from trainstack.protocol.checkpoint_format import Inspection, extras_name

log = logging.getLogger("trainer.checkpoint")


def read_step(
    storage: CheckpointStorage,
    found: Inspection,
    group: dist.ProcessGroup,
    *,
    rank: int,
    world: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    describe: Callable[[int], str],
) -> TrainerState:
    """Load checkpoint `found.step` into model, optimizer and scheduler. Raises CheckpointDamaged on
    every rank when any file does not match its digest (the model and optimizer may then hold part of
    it: load another checkpoint before training)."""
    step = found.step
    if not found.usable:
        raise CheckpointDamaged(step, found.problem or "not a complete checkpoint")
    saved_world = found.marker.world_size
    if rank == 0 and found.marker.files is None:
        log.warning("%s has no digests (format 1): checked by file sizes only", describe(step))
    reader = storage.reader(step)
    verified = VerifiedReads(reader.fs, found.files, rank, world, lambda name: storage.open_read(step, name))
    reader.fs = verified
    model_state, optim_state = get_state_dict(model, optimizer)
    error: BaseException | None = None
    try:
        size_extra_states_from(reader.read_metadata(), model_state)
    except BaseException as exc:
        error = exc
    _agree(group, world, step, verified, error, describe)  # before DCP's collectives: every rank or none
    payload = {"model": model_state, "optim": optim_state}
    raw = b""
    try:
        dcp.load(payload, storage_reader=reader, process_group=group)
        # Rank r's own trainer state; ranks the saved world did not have take rank 0's (the
        # scheduler and data position are the same on every rank; RNG streams are not restored).
        raw = verified.read_whole(extras_name(rank if rank < saved_world else 0))
        verified.verify_rest()
    except BaseException as exc:
        error = exc
    _agree(group, world, step, verified, error, describe)
    extra_states_as_tensors(payload["model"])
    set_state_dict(model, optimizer, model_state_dict=payload["model"], optim_state_dict=payload["optim"])
    extras = torch.load(io.BytesIO(raw), weights_only=True)
    scheduler.load_state_dict(extras["scheduler"])
    state = TrainerState(**extras["trainer"])
    if state.world_size == world:
        set_rng_state(extras["rng"])
    elif rank == 0:  # resharded resume: model and optimizer reshard exactly; RNG streams cannot
        log.warning("checkpoint from %d ranks resumed on %d: RNG states start fresh", state.world_size, world)
    return state


def _agree(
    group: dist.ProcessGroup,
    world: int,
    step: int,
    verified: VerifiedReads,
    error: BaseException | None,
    describe: Callable[[int], str],
) -> None:
    """Every rank learns whether any rank found a damaged file (then all raise CheckpointDamaged)
    or failed otherwise (then all raise: a lost connection is not a reason to fall back)."""
    outcomes: list[Any] = [None] * world
    dist.all_gather_object(outcomes, (verified.problem, error is not None), group=group)
    problem = next((p for p, _ in outcomes if p), None)
    if problem is not None:
        raise CheckpointDamaged(step, problem) from None
    if error is not None:
        raise error
    if any(failed for _, failed in outcomes):
        raise CheckpointError(f"loading {describe(step)} failed on another rank")
