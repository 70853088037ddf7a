"""Which checkpoints of a run can be resumed from: the cheap checks, per step, without loading tensors.

`inspect_step(storage, step)` is the one place that decides whether a step folder is a candidate:
the format's checks (trainstack.protocol.checkpoint_format.inspect: the marker parses and is
consistent, every file it lists is present with its size), then DCP's index: `.metadata`'s digest
(only then is it unpickled), that it is a DCP `Metadata`, and that every byte range it points at lies
inside a listed shard. What remains is checked on load, by the ranks that read the bytes
(trainer.checkpoint.integrity): every shard's, rank file's and manifest's digest.

Rank 0 runs these (trainer.checkpoint.manager.CheckpointManager.discover) and tells every rank the result.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
from pathlib import Path

from torch.distributed.checkpoint.metadata import Metadata

from trainer.storage import CheckpointStorage, LocalStorage
from trainstack.errors import TrainstackError
from trainstack.protocol.checkpoint_format import (
    DAMAGED,
    DCP_METADATA,
    STEP_DIR,
    FileRecord,
    Inspection,
    digest_of,
    inspect,
    step_dir_name,
)

log = logging.getLogger("trainer.checkpoint")
MESSAGE_STEPS = 6  # steps named in the no-intact-checkpoint line (SageMaker keeps 1,024 characters)


class NoIntactCheckpoint(TrainstackError):
    """The run's location holds checkpoints and none of them can be resumed from. Exit 2, fatal: another
    job would find the same; starting again at step 0 would silently discard the run's progress."""

    def __init__(self, location: str, unusable: dict[int, str]):
        self.location, self.unusable = location, dict(unusable)
        steps = sorted(unusable, reverse=True)
        named = "; ".join(f"{step_dir_name(s)}: {unusable[s]}" for s in steps[:MESSAGE_STEPS])
        more = f"; and {len(steps) - MESSAGE_STEPS} more" if len(steps) > MESSAGE_STEPS else ""
        super().__init__(
            f"{location.rstrip('/')}: no intact checkpoint to resume from, and the run's "
            f"{len(steps)} checkpoint folder(s) there would be overwritten by a start at step 0 "
            f"({named}{more}); restore the damaged files (the checkpoint bucket is versioned) or move "
            "the step folders away to start the run afresh (`trainstack checkpoints RUN --verify` "
            "lists them)"
        )


def metadata_problem(metadata: object, files: dict[str, FileRecord]) -> str | None:
    """Why a parsed `.metadata` is not the index of these files, or None."""
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        return f"{DCP_METADATA}: not a DCP checkpoint index"
    for index, where in metadata.storage_data.items():
        name = getattr(where, "relative_path", None)
        record = files.get(name) if isinstance(name, str) else None
        if record is None:
            return f"{DCP_METADATA}: {index.fqn} is stored in {name!r}, which the checkpoint does not list"
        if where.offset < 0 or where.length < 0 or where.offset + where.length > record.size:
            return (
                f"{DCP_METADATA}: {index.fqn} lies at bytes {where.offset}-{where.offset + where.length} "
                f"of {name}, which has {record.size}"
            )
    return None


def read_metadata(
    storage: CheckpointStorage, step: int, record: FileRecord
) -> tuple[Metadata | None, str | None]:
    """(DCP's index, None) of a step whose `.metadata` matches its record, else (None, why not)."""
    raw = storage.read(step, DCP_METADATA)
    if raw is None:
        return None, f"{DCP_METADATA} is missing"
    problem = record.problem(DCP_METADATA, len(raw), digest_of(raw) if record.sha256 else None)
    if problem is not None:
        return None, problem  # never unpickled
    try:
        metadata = pickle.loads(raw)
    except Exception as exc:  # format 1 only: no digest stood between garbage and the unpickler
        return None, f"{DCP_METADATA}: not a DCP checkpoint index ({type(exc).__name__})"
    return metadata, None


def inspect_step(storage: CheckpointStorage, step: int) -> Inspection:
    """Every check of step `step` that reads no tensor data (see the module docstring)."""
    found = inspect(step, storage.files(step), lambda name: storage.read(step, name))
    if not found.usable:
        return found
    metadata, problem = read_metadata(storage, step, found.files[DCP_METADATA])
    if problem is None:
        problem = metadata_problem(metadata, found.files)
    return found if problem is None else dataclasses.replace(found, state=DAMAGED, problem=problem)


def inspect_all(storage: CheckpointStorage) -> list[Inspection]:
    """`inspect_step` of every step folder present, newest first; each unusable one logged."""
    found = []
    for step in storage.steps():
        inspection = inspect_step(storage, step)
        if not inspection.usable:
            log.warning("skipping checkpoint %s: %s", describe(storage, step), inspection.problem)
        found.append(inspection)
    return found


def describe(storage: CheckpointStorage, step: int) -> str:
    return f"{storage.location.rstrip('/')}/{step_dir_name(step)}"


def storage_completeness_problem(storage: CheckpointStorage, step: int) -> str | None:
    """Why step `step` in `storage` is not a resumable checkpoint, or None when the cheap checks pass."""
    return inspect_step(storage, step).problem


def completeness_problem(directory: Path) -> str | None:
    """`storage_completeness_problem` for a local step directory (root/step-NNNNNNNNN)."""
    match = STEP_DIR.match(directory.name)
    if not match:
        return f"{directory.name} is not a step directory"
    return storage_completeness_problem(LocalStorage(directory.parent), int(match.group(1)))


def complete_steps(storage: CheckpointStorage) -> list[int]:
    """Every step that passes the cheap checks, newest first; each other one is logged and skipped."""
    return [i.step for i in inspect_all(storage) if i.usable]


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) for every step-N directory under a local root, newest first."""
    return [(step, root / step_dir_name(step)) for step in LocalStorage(root).steps()]


def newest_complete(root: Path) -> Path | None:
    """The newest complete checkpoint directory under a local root (incomplete ones logged)."""
    found = complete_steps(LocalStorage(Path(root)))
    return Path(root) / step_dir_name(found[0]) if found else None


def prune_candidates(present: list[int], complete: list[int], keep: int) -> list[int]:
    """Steps to delete: older than the oldest of the newest `keep` complete checkpoints, or incomplete
    and older than the newest complete one. Nothing is deleted before one checkpoint is complete."""
    kept = sorted(complete, reverse=True)[:keep]
    if not kept:
        return []
    oldest_kept, newest = kept[-1], kept[0]
    return sorted(s for s in present if s < oldest_kept or (s not in kept and s < newest))
