"""What a job resumes from, and what may have changed since: the trainer's side of `trainstack resume`.

A run trains the recipe it was launched with, and changes only through two doors (docs/runs.md):
`trainstack resume RUN --set key=value` (the next job's hyperparameters carry the changed recipe) and
`trainstack resume RUN --from-step N` (the next job's environment carries TRAINSTACK_RESUME_STEP=N).
This module makes the trainer honour both, before a single step runs:

1. Which checkpoint: the newest complete one, or, with TRAINSTACK_RESUME_STEP=N, complete checkpoint N
   with the data position it recorded. N that is not a complete checkpoint is one line and exit 2.
2. What changed: every checkpoint records the recipe it was written with (TrainerState.recipe, the
   resolved recipe as JSON). The job's recipe is compared with it key by key, and each difference is
   classified by trainstack.recipes.changes (the same table `resume --set` checks up front). An unsafe
   change (the model's shape, seq_len, global batch, seed, precision, data) is refused in one line
   naming the key, before and after: exit 2, the fatal marker (another job would repeat it), nothing
   loaded, nothing removed. Safe changes are logged one line each and take effect: the loop reads
   grad_clip, checkpoint cadence and keep, micro-batch and layout from the job's recipe anyway; the
   schedule (lr, min_lr_ratio, warmup_steps, steps, weight_decay) is put back onto the optimizer's
   param groups and the scheduler after the load, which restored the old ones
   (trainer.optim.follow_schedule).
3. The abandoned branch: resuming from N leaves the run's checkpoints after N meaning a history that
   no longer happened. They are removed before training, so no later job resumes from them and no
   new save of a step after N mixes with an old directory of that step: first every one of them loses
   its completeness marker (an atomic overwrite: from then on it is skipped on resume), then its files
   go, through the storage's own delete. A job killed half-way leaves them incomplete, never complete.

Rank 0 decides (it reads the checkpoint's record) and every rank is told, so every rank raises the same
one-line error, and every host writes the fatal marker (trainer.__main__).
"""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from pydantic import ValidationError

from trainer.checkpoint.discovery import NoIntactCheckpoint
from trainer.checkpoint.manager import MARKER, CheckpointDamaged, CheckpointManager, TrainerState, extras_name
from trainer.optim import follow_schedule
from trainstack.errors import TrainstackError
from trainstack.protocol.checkpoint_format import abandoned_marker_document, digest_of
from trainstack.recipes.changes import Change, changes, is_safe
from trainstack.recipes.schema import Recipe

log = logging.getLogger("trainer.resume")  # its log lines' name before the package move

RESUME_STEP_ENV = "TRAINSTACK_RESUME_STEP"
# What an abandoned checkpoint's marker is overwritten with: valid JSON without the fields a complete
# marker has, so the completeness check refuses it whatever else it checks.


@dataclass(frozen=True)
class ResumePlan:
    step: int | None  # the checkpoint to load; None: start at step 0
    chosen: bool  # TRAINSTACK_RESUME_STEP chose it (else: the newest complete one)
    abandoned: tuple[int, ...]  # step directories after `step` to remove (only when chosen)
    changes: tuple[Change, ...]  # safe differences between the checkpoint's recipe and the job's
    recorded: bool  # whether the checkpoint records its recipe (checkpoints before this did not)


def recipe_record(recipe: Recipe) -> str:
    """What a checkpoint records of the recipe it was written with (TrainerState.recipe)."""
    return recipe.model_dump_json(exclude={"extends"})


def requested_step(environ: Mapping[str, str] | None = None) -> int | None:
    """N of TRAINSTACK_RESUME_STEP=N (the supervisor sets it for the first job after `resume --from-step
    N`), or None when unset."""
    raw = (os.environ if environ is None else environ).get(RESUME_STEP_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise TrainstackError(f"{RESUME_STEP_ENV}={raw!r}: expected the step number of a complete checkpoint")
    return int(raw)


def choose_step(complete: list[int], requested: int | None, location: str) -> int | None:
    """The checkpoint to resume from (pure): the newest complete one, or the requested one if complete."""
    if requested is None:
        return complete[0] if complete else None
    if requested not in complete:
        found = ", ".join(str(s) for s in complete) if complete else "none"
        raise TrainstackError(
            f"{RESUME_STEP_ENV}={requested}: step {requested} is not a complete checkpoint in "
            f"{location.rstrip('/')} (complete checkpoints: {found})"
        )
    return requested


def _flat(data: object, prefix: str = "") -> dict[str, object]:
    """Dotted keys of a recipe's JSON, as trainstack.recipes.changes.flatten names them."""
    flat: dict[str, object] = {}
    if isinstance(data, dict) and data:
        for key, child in data.items():
            flat.update(_flat(child, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(data, list) and data and all(isinstance(v, dict) for v in data):
        for i, child in enumerate(data):
            flat.update(_flat(child, f"{prefix}.{i}"))
    else:
        flat[prefix] = data
    return flat


def recipe_changes(recorded: str, recipe: Recipe) -> list[Change]:
    """Every difference between the recipe a checkpoint recorded and the job's (pure). A record this
    trainer's schema no longer reads (a field renamed since) is compared as plain keys."""
    try:
        return changes(Recipe.model_validate_json(recorded), recipe)
    except ValidationError:
        old, new = _flat(json.loads(recorded)), _flat(recipe.model_dump(mode="json"))
        keys = sorted((old.keys() | new.keys()) - {"name", "extends"})
        return [Change(k, old.get(k), new.get(k)) for k in keys if old.get(k) != new.get(k)]


def refusal(found: list[Change], where: str) -> str | None:
    """The one line refusing the unsafe changes among `found`, or None when all are safe (pure)."""
    bad = [change for change in found if not is_safe(change.key)]
    if not bad:
        return None
    more = f" (and {len(bad) - 1} more: {', '.join(c.key for c in bad[1:])})" if len(bad) > 1 else ""
    return (
        f"{where}: the job's recipe changes {bad[0]}{more}, which cannot change within a run (the "
        "checkpoint's tensors, data position or batch would mean something else); resume with the "
        "recipe the run was launched with, or launch a new run"
    )


def read_record(checkpoints: CheckpointManager, step: int) -> str | None:
    """The recipe checkpoint `step` recorded (rank 0's trainer state), or None for older checkpoints."""
    name = extras_name(0)
    raw = checkpoints.storage.read(step, name)
    if raw is None:
        return None
    # Verified before it is unpickled, as the load verifies every file: a damaged rank file is a
    # damaged checkpoint (skipped for an older one), not a crash of every job of the run.
    files = checkpoints.inspection(step).files or {}
    if name in files and (problem := files[name].problem(name, len(raw), digest_of(raw))) is not None:
        raise CheckpointDamaged(step, problem)
    try:
        extras = torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a format-1 checkpoint has no digest to tell damage first
        raise CheckpointDamaged(step, f"{name}: unreadable ({type(exc).__name__})") from None
    return extras.get("trainer", {}).get("recipe")


def _decide(checkpoints: CheckpointManager, recipe: Recipe, environ: Mapping[str, str] | None) -> ResumePlan:
    requested = requested_step(environ)
    step = choose_step(list(checkpoints.complete), requested, checkpoints.location)
    if step is None:
        return ResumePlan(None, False, (), (), False)
    recorded = read_record(checkpoints, step)
    found = recipe_changes(recorded, recipe) if recorded is not None else []
    problem = refusal(found, f"resuming from {checkpoints.describe(step)}")
    if problem is not None:
        raise TrainstackError(problem)
    abandoned = tuple(s for s in checkpoints.storage.steps() if s > step) if requested is not None else ()
    return ResumePlan(step, requested is not None, abandoned, tuple(found), recorded is not None)


def plan_resume(
    checkpoints: CheckpointManager, recipe: Recipe, environ: Mapping[str, str] | None = None
) -> ResumePlan:
    """Collectively (after `checkpoints.discover()`): rank 0 decides, every rank gets the same plan or
    raises the same one-line TrainstackError."""
    decision: list[object] = [None]
    if checkpoints.rank == 0:
        try:
            decision[0] = _decide(checkpoints, recipe, environ)
        except CheckpointDamaged as damaged:
            decision[0] = ("damaged", damaged.step, damaged.problem)
        except TrainstackError as exc:
            decision[0] = ("fatal", str(exc))
        except Exception as exc:  # noqa: BLE001 - e.g. an unreadable record: every rank must hear of it
            decision[0] = ("crash", f"reading the checkpoint to resume failed: {type(exc).__name__}: {exc}")
    dist.broadcast_object_list(decision, src=0, group=checkpoints.group)
    if isinstance(decision[0], tuple) and decision[0][0] == "damaged":
        raise CheckpointDamaged(decision[0][1], decision[0][2])
    if isinstance(decision[0], tuple):
        kind, message = decision[0]
        raise TrainstackError(message) if kind == "fatal" else RuntimeError(message)
    return decision[0]  # type: ignore[return-value]


def resume_checkpoint(
    checkpoints: CheckpointManager,
    recipe: Recipe,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> tuple[ResumePlan, TrainerState | None]:
    """Collectively: discover the run's checkpoints, choose one (`plan_resume`: the newest intact, or
    TRAINSTACK_RESUME_STEP's, its recipe changes checked before anything loads), load it verified, and
    only then remove the checkpoints after a chosen step. A newest checkpoint whose files turn out
    damaged on load is skipped for the next older one, its recipe checked in turn; a damaged chosen one
    is refused in one line. (None, plan) for a new run; NoIntactCheckpoint when step folders exist and
    none of them can be resumed from."""
    checkpoints.discover()
    unusable = {step: i.problem or "" for step, i in checkpoints.inspections.items() if not i.usable}
    requested = requested_step()
    while True:
        try:
            plan = plan_resume(checkpoints, recipe)
            if plan.step is None:
                if unusable:
                    raise NoIntactCheckpoint(checkpoints.location, unusable)
                return plan, None
            state = checkpoints.load(plan.step, model, optimizer, scheduler)
        except CheckpointDamaged as damaged:
            if requested is not None and damaged.step == requested:
                raise TrainstackError(
                    f"{RESUME_STEP_ENV}={damaged.step}: {checkpoints.describe(damaged.step)} is damaged "
                    f"({damaged.problem}); choose another step (trainstack checkpoints RUN --verify)"
                ) from None
            if checkpoints.rank == 0:
                log.warning("skipping checkpoint %s: %s", checkpoints.describe(damaged.step), damaged.problem)
            unusable[damaged.step] = damaged.problem
            checkpoints.forget(damaged.step, damaged.problem)
            continue
        abandon_after(checkpoints, plan)
        return plan, state


def abandon_after(checkpoints: CheckpointManager, plan: ResumePlan) -> None:
    """Remove the checkpoints after the chosen step (collectively): markers first, then the files.

    Done by the rank that prunes (rank 0 on S3; the first rank of each node with node-local
    directories, each on its own directory); every rank waits for it."""
    if not plan.chosen or plan.step is None:
        return
    storage, error = checkpoints.storage, None
    if checkpoints.prunes:
        try:
            later = [s for s in storage.steps() if s > plan.step]
            tombstone = abandoned_marker_document(plan.step)
            for step in later:  # from here on each is skipped on resume, whatever happens next
                storage.write(step, MARKER, tombstone)
            for step in later:
                storage.delete(step)
        except Exception as exc:  # noqa: BLE001 - reported on every rank below
            error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    failed = [error]
    gathered: list[list[str | None]] = [[None]] * dist.get_world_size(checkpoints.group)
    dist.all_gather_object(gathered, failed, group=checkpoints.group)
    problems = [g[0] for g in gathered if g[0]]
    checkpoints.complete = [s for s in checkpoints.complete if s <= plan.step]
    if problems:
        # The markers went first: what is left is incomplete and skipped, and pruned once a newer
        # checkpoint completes. Not fatal: the next job would find the same storage.
        log.warning("removing the checkpoints after step %d: %s", plan.step, problems[0])
    if plan.abandoned:
        log.info(
            "%s=%d: removed the checkpoints after it (steps %s), so no later job resumes from them",
            RESUME_STEP_ENV,
            plan.step,
            ", ".join(str(s) for s in plan.abandoned),
        )


def apply_changes(
    plan: ResumePlan,
    state: TrainerState,
    recipe: Recipe,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> TrainerState:
    """After the load: log each safe change, put the job's schedule onto the optimizer and scheduler,
    and record the job's recipe in the state from now on."""
    if not plan.recorded:
        log.warning(
            "checkpoint of step %d records no recipe (written before checkpoints did): changes since "
            "cannot be checked; training on with the job's recipe",
            state.step,
        )
    for change in plan.changes:
        log.info("recipe changed on resume, takes effect from step %d: %s", state.step + 1, change)
    follow_schedule(optimizer, scheduler, recipe.training, state.step)
    return replace(state, recipe=recipe_record(recipe))
