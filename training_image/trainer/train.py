"""The training loop: build, shard, resume, step, log, checkpoint, stop cleanly.

Exit codes: 0 finished, or stopped by SIGTERM (after a final save, or after logging which checkpoint
the next job resumes from when none fits; trainer.runtime.stopping); 1 the final save failed; 2 a mistake in
the recipe or the environment (one line naming the field); 3 the loss or gradient norm became NaN/inf
(found on the next log step or before the next save, whichever is first; nothing is saved from that
step on, the previous complete checkpoint stays the newest).

No stalls between steps: the host never waits on the GPU except on log steps (the metric line reads
the loss and the stragglers' CUDA events there) and at saves; micro-batches are read ahead on a
thread into pinned memory (trainer.data.loader.Prefetcher); a save's host copy goes to pinned memory on a
side stream and is awaited only before the next optimizer step (trainer.checkpoint.manager); Python's cyclic
GC runs every GC_EVERY_STEPS steps on every rank at once instead of whenever one rank's allocator
trips it.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.optim.lr_scheduler import LRScheduler

from trainer.checkpoint.manager import CheckpointManager, TrainerState
from trainer.checkpoint.resume import apply_changes, recipe_record, resume_checkpoint
from trainer.config import Layout, load_recipe, resolve_layout
from trainer.data import blend
from trainer.data.loader import (
    Batch,
    Prefetcher,
    TokenSource,
    micro_batch_indices,
    micro_batch_plan,
    open_source,
    same_data,
)
from trainer.data.packing import IGNORE_INDEX, PackedChat, open_chat
from trainer.distributed.comms import check_efa
from trainer.distributed.context_parallel import ContextParallel, apply_context_parallel, build_meshes
from trainer.distributed.parallel import (
    end_distributed,
    init_distributed,
    mesh_description,
    set_gradient_sync,
    shard_model,
)
from trainer.hf.conversion import start_from_base
from trainer.metrics.throughput import (
    BlockComputeTimer,
    current_host,
    host_number,
    peak_memory_gib,
    peak_reserved_gib,
    peak_tflops,
    slowest_rank,
)
from trainer.metrics.tracking import Tracking, open_tracking
from trainer.models.activation_checkpointing import (
    apply_activation_checkpointing,
    is_op_level,
)
from trainer.models.model import (
    PackedRows,
    Transformer,
    build_model,
    compile_blocks,
    compile_decision,
    select_backend,
)
from trainer.models.precision import autocast_factory, check_precision
from trainer.optim import build_optimizer, build_scheduler
from trainer.runtime import faults
from trainer.runtime.capacity import watch_capacity
from trainer.runtime.health import NonFiniteWatch, Trace
from trainer.runtime.stopping import EXIT_MARGIN_S, StopPlan, StopRequest, StopVote, plan_stop
from trainer.storage import open_storage
from trainer.validation import Validator, build_validator
from trainstack.errors import TrainstackError
from trainstack.planner import flops_per_token, plan
from trainstack.planner.run_plan import SIGTERM_GRACE_S
from trainstack.protocol.metrics import format_line, format_validation_line
from trainstack.recipes.schema import Recipe

log = logging.getLogger("trainer")
GC_EVERY_STEPS = 50  # torchtitan's default gc_freq


class AbandonedSave(Exception):
    """SIGTERM with a save in flight that cannot finish in time: exit 0 at once, leaving it unmarked."""


@dataclass(frozen=True)
class RunOptions:
    recipe: str | None
    overrides: tuple[str, ...]
    device: str | None
    max_steps: int | None
    checkpoint_location: str  # a local directory or an s3:// URI (trainer.storage)
    data_dir: Path | None
    synthetic: bool
    trace_dir: Path | None
    async_checkpoint: bool = True


def setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        stream=sys.stderr,
        force=True,
        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s",
    )


def run(options: RunOptions) -> int:
    recipe, source = load_recipe(options.recipe, options.overrides)
    device_type = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise TrainstackError("--device cuda: no CUDA device is available")
    stop = StopRequest()  # from the start: a SIGTERM while loading still ends in a clean save
    rank, world, device = init_distributed(device_type)
    try:
        setup_logging(rank)
        return _train(recipe, source, options, rank, world, device, stop)
    except AbandonedSave as exc:
        # The save thread is inside collectives that will never finish: no teardown, exit now.
        log.warning("%s", exc)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    finally:
        end_distributed()


def _train(
    recipe: Recipe,
    source: str,
    options: RunOptions,
    rank: int,
    world: int,
    device: torch.device,
    stop: StopRequest,
) -> int:
    layout = resolve_layout(recipe, world, source)
    if world != recipe.world_size:
        log.warning(
            "recipe %s plans %d GPUs (%s x %d); laying out the %d ranks running instead",
            recipe.name,
            recipe.world_size,
            recipe.compute.instance_type,
            recipe.compute.instance_count,
            world,
        )
    ac = recipe.activation_checkpointing
    backend = select_backend(device.type, needs_pytorch_ops=is_op_level(ac))
    check_precision(recipe.precision, device.type, backend.name)
    log.info("comms gate: %s", check_efa(device, rank, world))
    data_dir = None if options.synthetic else options.data_dir
    open_dataset = partial(_open_dataset, recipe)
    token_source = _open_training_data(recipe, options, open_dataset)
    # The (replicate, shard, cp) mesh and this rank's CP group (trainer.distributed.context_parallel);
    # at cp 1 the FSDP (or HSDP) mesh alone.
    meshes = build_meshes(device.type, world, layout.shard, layout.cp, recipe.training.seq_len)
    cp = meshes.cp
    split = cp.split if cp.enabled else None
    validator = build_validator(
        recipe, layout, rank, device, options.data_dir, options.synthetic, token_source, open_dataset, split
    )
    storage = open_storage(options.checkpoint_location)  # a bad URI or missing region: exit 2 before building
    # MLflow / TensorBoard from rank 0, on a background thread (trainer.metrics.tracking); never raises.
    tracking, job = open_tracking(
        recipe,
        rank,
        plan=plan(recipe),
        data_source=token_source.name,
        data_dir=data_dir,
        keep_at=storage.location,  # undelivered metrics are kept beside the checkpoints
        open_store=open_storage,
    )

    mesh = meshes.fsdp
    model, recomputed, compile_note = _build_sharded_model(recipe, backend, cp, mesh, device)
    optimizer = build_optimizer(model, recipe.training, device.type)
    scheduler = build_scheduler(optimizer, recipe.training)
    log.info(
        "model %s: %.1fM params, backend %s, precision %s%s, activation checkpointing %s (%d of %d "
        "blocks), compile %s",
        recipe.name,
        recipe.model.total_params / 1e6,
        backend.name,
        recipe.precision.dtype,
        f"/{recipe.precision.fp8_recipe}" if recipe.precision.fp8_recipe else "",
        f"{ac.mode}, policy op" if is_op_level(ac) else ac.mode,
        len(recomputed),
        recipe.model.layers,
        compile_note,
    )
    log.info(
        "layout: %s%s; micro_batch %d x %d ranks x %d accumulation = global_batch %d; data %s",
        mesh_description(mesh),
        f", context parallel {cp.size} (FSDP over shard x cp)" if cp.enabled else "",
        layout.micro_batch,
        layout.data_ranks,
        layout.grad_accum,
        layout.global_batch,
        token_source.name,
    )

    checkpoints = CheckpointManager(
        storage,
        recipe.checkpointing.keep,
        rank,
        world,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        asynchronous=options.async_checkpoint,
        run=os.environ.get("TRAINSTACK_RUN"),
    )
    state = TrainerState(
        step=0,
        samples_consumed=0,
        data_source=token_source.name,
        world_size=world,
        recipe=recipe_record(recipe),
        data_schedule=blend.schedule_of(token_source),
    )
    state, token_source = _resume_or_start(
        checkpoints, recipe, model, optimizer, scheduler, state, token_source
    )
    max_steps = options.max_steps if options.max_steps is not None else recipe.training.steps
    if isinstance(token_source, PackedChat):
        rows = len(token_source)
        log.info(
            "fine-tuning on %d conversations packed into %d rows of %d (%.1f%% not padding): "
            "%.3g steps per epoch at global_batch %d; training.steps %d is %.2f epochs",
            token_source.shards.count,
            rows,
            recipe.training.seq_len,
            100 * token_source.efficiency,
            rows / layout.global_batch,
            layout.global_batch,
            recipe.training.steps,
            recipe.training.steps * layout.global_batch / rows,
        )
    ctx = LoopContext(
        recipe=recipe,
        layout=layout,
        options=options,
        rank=rank,
        world=world,
        device=device,
        mesh=mesh,
        cp=cp,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        token_source=token_source,
        checkpoints=checkpoints,
        control=dist.new_group(backend="gloo"),
        timer=BlockComputeTimer(list(model.layers), device),
        validator=validator,
        tracking=tracking,
    )
    try:
        with tracking.session(stop, job.job_index):  # records how the job ended, drains (bounded)
            return _loop(ctx, state, max_steps, stop)
    except AbandonedSave:
        raise
    except BaseException:
        checkpoints.wait()  # a NaN or an error: a pending save of an earlier, good step still completes
        raise
    finally:
        if not checkpoints.abandoned:
            checkpoints.close()


def _open_dataset(recipe: Recipe, directory: Path | None, uri: str | None = None) -> TokenSource:
    """One prepared dataset (or, without a directory, the synthetic set) as this recipe reads it:
    under training.objective sft a chat dataset's packed rows (trainer.data.packing.open_chat)."""
    if recipe.training.objective == "sft":
        if directory is None:  # the schema requires data.train_s3_uri; --synthetic is refused earlier
            raise TrainstackError(
                "training.objective: sft needs a chat dataset (--data-dir or the train channel)"
            )
        return open_chat(
            directory,
            recipe.training.seq_len,
            recipe.model.vocab,
            recipe.training.seed,
            tokenizer=recipe.data.tokenizer,
            uri=uri,
        )
    return open_source(
        directory,
        recipe.training.seq_len,
        recipe.model.vocab,
        recipe.training.seed,
        tokenizer=recipe.data.tokenizer,
        uri=uri,
    )


def _open_training_data(
    recipe: Recipe, options: RunOptions, open_dataset: Callable[..., TokenSource]
) -> TokenSource:
    """The training samples: a blend, one dataset, or the synthetic set; never synthetic by accident."""
    if options.synthetic and recipe.training.objective == "sft":
        raise TrainstackError(
            "--synthetic: training.objective is sft, which trains on a chat dataset's targets; there is no "
            "synthetic chat data (pass --data-dir)"
        )
    if options.synthetic:
        return open_dataset(None, recipe.data.train_s3_uri)
    if options.data_dir is None and recipe.data.train_s3_uri:
        raise TrainstackError(
            f"data.train_s3_uri is {recipe.data.train_s3_uri} but no --data-dir / training "
            "channel is mounted (pass --synthetic to train on synthetic tokens anyway)"
        )
    if recipe.data.sources:
        return blend.open_blend(recipe, options.data_dir, open_dataset)
    return open_dataset(options.data_dir, recipe.data.train_s3_uri)


def _build_sharded_model(
    recipe: Recipe, backend: Any, cp: ContextParallel, mesh: DeviceMesh, device: torch.device
) -> tuple[Transformer, list, str]:
    """The model as the recipe lays it out (`lay_out_model`), then materialized and initialized from
    the seed. Returns (model, the recomputed blocks, what compile did)."""
    torch.manual_seed(recipe.training.seed)
    model, recomputed, compile_note = lay_out_model(recipe, backend, cp, mesh, device)
    model.to_empty(device=device)
    model.init_weights()
    return model, recomputed, compile_note


def lay_out_model(
    recipe: Recipe,
    backend: Any,
    cp: ContextParallel,
    mesh: DeviceMesh,
    device: torch.device,
    compile_requested: bool | None = None,
) -> tuple[Transformer, list, str]:
    """The meta-device model as the recipe lays it out, in torchtitan's order: context parallelism,
    activation checkpointing, compile per block, FSDP2; nothing allocated yet. Shared by the training
    run and the memory trace (trainer.trace), which materializes it on fake tensors instead.
    `compile_requested`: None follows `training.compile`; the trace passes False (it runs eager).
    Returns (model, the recomputed blocks, what compile did)."""
    model = build_model(recipe.model, recipe.training.seq_len, backend, recipe.training.loss_chunk_tokens)
    apply_context_parallel(model, cp, device)  # before compile: the blocks trace the CP attention
    recomputed = apply_activation_checkpointing(model, recipe.activation_checkpointing)
    requested = recipe.training.compile if compile_requested is None else compile_requested
    compiled, compile_note = compile_decision(requested, device.type, backend.name)
    if compiled:  # per block, after checkpointing and before sharding, as torchtitan orders it
        compile_blocks(model)
    shard_model(model, mesh)
    return model, recomputed, compile_note


def _resume_or_start(
    checkpoints: CheckpointManager,
    recipe: Recipe,
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler,
    fresh: TrainerState,
    token_source: TokenSource,
) -> tuple[TrainerState, TokenSource]:
    """Where this job starts: the newest intact checkpoint (damaged ones skipped; exit 2 if none of
    several is intact) or TRAINSTACK_RESUME_STEP's, with unsafe recipe changes refused before anything
    loads (checkpoint/resume.py); else step 0, from the recipe's base model when it names one."""
    resuming, resumed = resume_checkpoint(checkpoints, recipe, model, optimizer, scheduler)
    if resumed is None:
        log.info("no checkpoint in %s: a new run, starting at step 0", checkpoints.location)
        if recipe.model.init_from:  # a new run from a base model; resuming ignores it
            base = start_from_base(
                model, recipe.model, int(os.environ.get("LOCAL_RANK", "0")), checkpoints.group
            )
            log.info(
                "loaded base model %s (%d tensors, %.2f GB read by this rank in %.1f s; fresh optimizer)",
                recipe.model.init_from,
                base.tensors,
                base.bytes_read / 1e9,
                base.seconds,
            )
        return fresh, token_source
    latest = resumed.step
    if not same_data(resumed.data_source, token_source.name):
        raise TrainstackError(
            f"{checkpoints.describe(latest)}: was trained on {resumed.data_source}, this run reads "
            f"{token_source.name}; use a new checkpoint location for new data"
        )
    token_source = blend.resumed_source(token_source, recipe, resumed.data_schedule, resumed.samples_consumed)
    log.info(
        "resumed from %s: step %d, data position %d",
        checkpoints.describe(latest),
        resumed.step,
        resumed.samples_consumed,
    )
    return apply_changes(resuming, resumed, recipe, optimizer, scheduler), token_source


@dataclass(frozen=True)
class LoopContext:
    """Everything the step loop works with, built once by `_train` and never reassigned."""

    recipe: Recipe
    layout: Layout
    options: RunOptions
    rank: int
    world: int
    device: torch.device
    mesh: DeviceMesh
    cp: ContextParallel  # this rank's CP group (size 1: none)
    model: Transformer
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    token_source: TokenSource
    checkpoints: CheckpointManager
    control: dist.ProcessGroup  # gloo, host-side: stop votes, straggler times, agreements
    timer: BlockComputeTimer
    validator: Validator | None = None  # the recipe's validation section (trainer.validation)

    @property
    def data_rank(self) -> int:
        """This rank among the ranks that read different samples (CP ranks of a group share one)."""
        return self.rank // self.cp.size

    tracking: Tracking = field(default_factory=Tracking.off)  # rank 0's trackers; off elsewhere


@dataclass(frozen=True)
class MicroSteps:
    loss_sum: torch.Tensor  # pretrain: sum of the micro-steps' mean losses; sft: see step_loss
    samples: list[int]
    stop: bool  # every rank saw a stop request
    done: int  # micro-steps computed; < grad_accum: the step is dropped
    save_due: bool  # rank 0's checkpoint clock says save after this step
    # This rank's share of the step's loss, averaged over ranks by the metric line (device; not read
    # here). pretrain: the mean of its micro-steps' means; sft: its targets' summed loss x data ranks /
    # the global batch's target count, so the mean over ranks is the global batch's mean over targets.
    step_loss: torch.Tensor | None = None


def _forward_backward(
    ctx: LoopContext, position: int, autocast: Callable, batches: Prefetcher, vote: StopVote, save_due: bool
) -> MicroSteps:
    """One optimizer step's micro-steps from data position `position`, until done or stopped.

    Each micro-step's mean loss is divided by the accumulation count, and FSDP2 averages gradients
    over the ranks, so the accumulated gradient is that of the mean loss over the global batch. The
    stop vote posted after micro-step m is read after micro-step m + 1 is queued (and the last one
    before returning): no rank waits on the vote while it has compute to queue.

    Fine-tuning (packed rows): the step's micro-batches are read first and their target tokens
    counted and all-reduced, so every micro-step's summed loss is divided by the whole global batch's
    target count before its backward (`target_scale`; docs/trainer.md)."""
    layout = ctx.layout
    loss_sum = torch.zeros((), device=ctx.device)
    used: list[int] = []
    plan = [
        micro_batch_indices(position, index, ctx.data_rank, layout.data_ranks, layout.micro_batch)
        for index in range(layout.grad_accum)
    ]
    fine_tuning = ctx.recipe.training.objective == "sft"
    read: list[Batch] = [batches.next(indices) for indices in plan] if fine_tuning else []
    scale = target_scale(read, layout.data_ranks, ctx.cp.size) if fine_tuning else None
    for index in range(layout.grad_accum):  # not `micro_step`: that name is the function called below
        last = index == layout.grad_accum - 1
        batch = read[index] if fine_tuning else batches.next(plan[index])
        used.extend(batch.sample_indices)
        loss = micro_step(
            ctx.model,
            ctx.mesh,
            batch.inputs,
            batch.targets,
            autocast,
            layout.grad_accum,
            last,
            packed=batch.packed,
            scale=scale,
        )
        loss_sum += loss.detach()
        stopped, _ = vote.result()  # the previous micro-step's vote
        vote.post(save_due=save_due and last)
        if stopped and not last:
            vote.result()  # every rank reads the vote it posted: the group stays in step
            return MicroSteps(loss_sum, used, True, index + 1, False)
    stopped, due = vote.result()
    step_loss = loss_sum if fine_tuning else loss_sum / layout.grad_accum
    return MicroSteps(loss_sum, used, stopped, layout.grad_accum, due, step_loss)


def target_scale(batches: list[Batch], data_ranks: int, cp: int = 1) -> torch.Tensor:
    """data_ranks / (target tokens of the whole global batch): what each micro-step's summed loss is
    multiplied by before its backward. The count is this rank's micro-batches' labels that are not -100,
    all-reduced over every rank (the CP ranks of a group hold the same rows: divided by cp). FSDP
    averages gradients over the data-parallel ranks, hence the factor data_ranks: the accumulated
    gradient is that of (sum of every target's loss) / (global target count). A batch without any
    target (impossible from `data prepare`, which drops such examples) gives a zero loss, not NaN."""
    count = sum((b.targets != IGNORE_INDEX).sum() for b in batches)
    count = count.to(torch.float32)
    dist.all_reduce(count)
    return data_ranks / (count / cp).clamp_min(1.0)


def micro_step(
    model: Transformer,
    mesh: DeviceMesh,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    autocast: Callable,
    grad_accum: int,
    last: bool,
    packed: PackedRows | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One micro-step's forward and backward (the training loop's, and the memory trace's): gradient
    sync as the micro-step's place in the step says, the loss scaled by the accumulation count.
    Returns the micro-step's mean loss (not divided).

    Packed rows (fine-tuning): the model gives the summed loss of the micro-batch's targets, multiplied
    by `scale` (`target_scale`) before the backward; returns that scaled sum."""
    set_gradient_sync(model, mesh, last_micro_step=last)
    if packed is not None:
        with autocast():
            summed = model(inputs, targets, packed=packed)
        loss = summed * scale
        loss.backward()
        return loss
    with autocast():  # forward only: TE's autocast must not wrap backward
        loss = model(inputs, targets)
    (loss / grad_accum).backward()
    return loss


def _loop(ctx: LoopContext, state: TrainerState, max_steps: int, stop: StopRequest) -> int:
    recipe, layout, device = ctx.recipe, ctx.layout, ctx.device
    model, optimizer, scheduler, checkpoints = ctx.model, ctx.optimizer, ctx.scheduler, ctx.checkpoints
    autocast = autocast_factory(recipe.precision)
    trace = Trace(ctx.options.trace_dir, ctx.rank)
    tr = recipe.training
    flops = flops_per_token(recipe.model, tr.seq_len)
    peak, peak_of = peak_tflops(recipe, device)
    log.info(
        "MFU against %s dense %s peak %.0f TFLOP/s; %.3g FLOPs/token (PaLM 6N+12LHQT)",
        peak_of,
        recipe.precision.dtype,
        peak,
        flops,
    )
    run_plan = plan(recipe).run
    log.info(
        "on SIGTERM a final save is planned to take %.0f s per node (%.1f GiB): it %s in SageMaker's %.0f s",
        run_plan.checkpoint.save_seconds,
        run_plan.checkpoint.gib_per_node,
        "fits" if run_plan.checkpoint.sigterm_fits else "does NOT fit",
        SIGTERM_GRACE_S,
    )
    capacity = watch_capacity(stop, run_plan.checkpoint.sigterm_seconds)  # a training plan's block ends
    hosts = [0] * ctx.world
    dist.all_gather_object(hosts, host_number(current_host()), group=ctx.control)
    step, position = state.step, state.samples_consumed
    interval_loss, interval_steps = torch.zeros((), device=device), 0
    interval_start = time.perf_counter()
    interval_cpu = time.process_time()  # this process's CPU time (every thread): what a CPU step costs
    watch = NonFiniteWatch(ctx.control)
    # Checkpoint every interval_steps steps, or every interval_minutes of wall time (the recipe's, else
    # the plan's Young/Daly optimum). Rank 0's clock decides, shared in the stop vote.
    save_every_steps = recipe.checkpointing.interval_steps
    save_every_s = None if save_every_steps else run_plan.checkpoint.interval_minutes * 60.0
    last_save = time.monotonic()
    batches = Prefetcher(
        ctx.token_source,
        micro_batch_plan(
            position,
            layout.grad_accum,
            layout.global_batch,
            ctx.data_rank,
            layout.data_ranks,
            layout.micro_batch,
        ),
        device,
        split=ctx.cp.split if ctx.cp.enabled else None,
    )
    vote = StopVote(ctx.control, stop)

    def print_metrics(step: int, lr: float, grad_norm: torch.Tensor, validation: dict, validation_s: float):
        """The metric line of the steps since the last one, ending at `step` (every rank: it reduces)."""
        nonlocal interval_loss, interval_steps, interval_start, interval_cpu
        elapsed = time.perf_counter() - interval_start - validation_s  # tokens/s of training only
        line = _metric_line(
            ctx,
            step,
            lr,
            interval_loss,
            interval_steps,
            elapsed,
            hosts,
            peak,
            validation,
            data_wait_s=batches.waited_s,
            cpu_time_s=time.process_time() - interval_cpu,
        )
        batches.waited_s = 0.0
        interval_cpu = time.process_time()
        if ctx.rank == 0:
            print(line, flush=True)
            if ctx.tracking.on:  # the same values, queued for MLflow / TensorBoard
                ctx.tracking.log_line(step, line, grad_norm=float(grad_norm))
        interval_loss, interval_steps = torch.zeros((), device=device), 0
        interval_start = time.perf_counter()

    # Python's cyclic GC at a moment of its choosing stalls one rank and so every rank: run it on a
    # schedule instead (torchtitan's pattern), the same step on every rank.
    gc.disable()
    gc.collect(1)
    if step >= max_steps:
        log.info("already at step %d of %d: nothing to do", step, max_steps)
    stopping = False  # agreed by every rank (the vote), never this rank's own flag
    lr, grad_norm = 0.0, torch.zeros((), device=device)  # the newest step's (a line reads them after one)
    try:
        if step == 0 and ctx.validator is not None and ctx.validator.due(0):  # validation.at_start
            values, _ = ctx.validator.run_if_due(0, model, autocast)
            if ctx.rank == 0:
                line = format_validation_line(0, recipe.data.source_names, **values)
                print(line, flush=True)
                if ctx.tracking.on:
                    ctx.tracking.log_line(0, line)
        while step < max_steps:
            validating = ctx.validator is not None and ctx.validator.due(step + 1)
            log_step = (step + 1) % tr.log_every == 0 or step + 1 == max_steps or validating
            if log_step:
                ctx.timer.arm()
            save_due = (
                ctx.rank == 0 and save_every_s is not None and time.monotonic() - last_save >= save_every_s
            )
            if faults.oom_at(step + 1):  # test-only (trainer.faults): a layout too big for the GPU
                raise torch.OutOfMemoryError(f"fault injection: out of memory at step {step + 1}")
            faults.raise_at(step + 1)  # test-only: an uncaught error of a class (trainer.runtime.faults)
            done = _forward_backward(ctx, position, autocast, batches, vote, save_due)
            if done.done < layout.grad_accum:
                optimizer.zero_grad(set_to_none=True)
                log.info(
                    "SIGTERM during step %d after micro-step %d of %d: the partial step is dropped",
                    step + 1,
                    done.done,
                    layout.grad_accum,
                )
                ctx.timer.collect()
                stopping = True
                if interval_steps:  # the step it saves had no line: the job's final metrics name it
                    print_metrics(step, lr, grad_norm, {}, 0.0)
                break
            grad_norm, lr = _optimizer_step(ctx, step + 1)
            step += 1
            position += layout.global_batch
            step_loss = done.step_loss  # this rank's share (MicroSteps.step_loss)
            watch.add(step, step_loss, grad_norm)
            interval_loss += step_loss
            interval_steps += 1
            if trace.file is not None:  # tests only: a host sync per step
                mean = step_loss.detach().clone()
                dist.all_reduce(mean)
                trace.write(step, mean.item() / ctx.world, done.samples)
            if step % GC_EVERY_STEPS == 0:
                gc.collect(1)
            checkpoints.poll()
            validation, validation_s = {}, 0.0
            if validating and not done.stop:  # a stop goes straight to its save
                validation, validation_s = ctx.validator.run_if_due(step, model, autocast)
            if log_step or done.stop:
                watch.check()
                print_metrics(step, lr, grad_norm, validation, validation_s)
            state = TrainerState(
                step,
                position,
                ctx.token_source.name,
                ctx.world,
                recipe=state.recipe,
                data_schedule=blend.schedule_of(ctx.token_source),
            )
            if done.stop:
                log.info("SIGTERM during step %d after its last micro-step: the step is completed", step)
                stopping = True
                break
            if done.save_due or (save_every_steps and step % save_every_steps == 0) or step == max_steps:
                watch.check()  # never save a state that came from a non-finite step
                checkpoints.save(model, optimizer, scheduler, state, blocking=step == max_steps)
                last_save = time.monotonic()
        if stopping:
            watch.check()
            _stop(ctx, state, stop, run_plan.checkpoint.save_seconds)
    finally:
        batches.close()
        gc.enable()
        if capacity is not None:
            capacity.cancel()
    return 0


def _optimizer_step(ctx: LoopContext, step: int) -> tuple[torch.Tensor, float]:
    """Step `step`'s update: gradients clipped, optimizer and schedule stepped, gradients freed.
    Returns (the gradient norm before clipping, the learning rate the step used)."""
    ctx.checkpoints.wait_for_staging()  # the optimizer step changes what an in-flight save copies
    if faults.nan_gradients_at(step):  # test-only (trainer.runtime.faults): a diverged step
        next(ctx.model.parameters()).grad.mul_(float("nan"))
    return update(ctx.model, ctx.optimizer, ctx.scheduler, ctx.recipe.training.grad_clip)


def update(
    model: Transformer, optimizer: torch.optim.Optimizer, scheduler: LRScheduler, grad_clip: float
) -> tuple[torch.Tensor, float]:
    """The optimizer update after a step's micro-steps (the training loop's, and the memory trace's):
    gradients clipped, optimizer and schedule stepped, gradients freed.
    Returns (the gradient norm before clipping, the learning rate the step used)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, lr


def _metric_line(
    ctx: LoopContext,
    step: int,
    lr: float,
    interval_loss: torch.Tensor,
    steps: int,
    elapsed: float,
    hosts: list[int],
    peak: float,
    validation: dict[str, float] | None = None,
    data_wait_s: float = 0.0,
    cpu_time_s: float = 0.0,
) -> str:
    """The log step's metric line; reads the loss and the block timers (the log step's host syncs).
    `data_wait_s`: this rank's wait for micro-batches over the interval (trainer.data.loader.Prefetcher);
    `cpu_time_s`: this process's CPU time over the interval (on CPU, the step's cost without the wait for
    other processes sharing the cores)."""
    tr = ctx.recipe.training
    total = interval_loss.detach().clone()
    dist.all_reduce(total)
    times = [0.0] * ctx.world
    dist.all_gather_object(times, ctx.timer.collect(), group=ctx.control)
    slowest = slowest_rank(times, hosts)
    # Tokens this GPU computed: its 1 / cp of each sequence under context parallelism.
    tokens_per_sec = (
        ctx.layout.micro_batch * ctx.layout.grad_accum * tr.seq_len / ctx.cp.size * steps / elapsed
    )
    tflops = tokens_per_sec * flops_per_token(ctx.recipe.model, tr.seq_len) / 1e12
    return format_line(
        ctx.recipe.data.source_names,
        **(validation or {}),
        step=step,
        loss=total.item() / ctx.world / steps,
        lr=lr,
        tokens_per_sec=tokens_per_sec,
        tflops_per_gpu=tflops,
        mfu=tflops / peak,
        mem_gib=peak_memory_gib(ctx.device),
        step_time_s=elapsed / steps,
        straggler_host=slowest.host,
        straggler_rank=slowest.rank,
        straggler_compute_s=slowest.compute_s,
        straggler_skew=slowest.skew,
        mem_reserved_gib=peak_reserved_gib(ctx.device),
        data_wait_s=data_wait_s / steps,
        cpu_time_s=cpu_time_s / steps,
    )


def _stop(ctx: LoopContext, state: TrainerState, stop: StopRequest, planned_save_s: float) -> None:
    """Spend what is left of the SIGTERM window as `plan_stop` says (rank 0 decides for all)."""
    checkpoints = ctx.checkpoints
    decision = [None]
    if ctx.rank == 0:
        save_s = checkpoints.measured_save_s or planned_save_s
        decision[0] = plan_stop(
            stop.seconds_left(), state.step, checkpoints.newest_complete(), checkpoints.in_flight(), save_s
        )
    dist.broadcast_object_list(decision, src=0, group=ctx.control)
    choice: StopPlan = decision[0]
    log.info("SIGTERM at step %d: %s", state.step, choice.reason)
    finished = True
    if checkpoints.in_flight() is not None or choice.finish_in_flight:
        finished = choice.finish_in_flight and checkpoints.wait(
            timeout=max(stop.seconds_left() - EXIT_MARGIN_S, 0)
        )
    agreed = torch.tensor([1 if finished else 0])
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=ctx.control)
    if not int(agreed):
        checkpoints.abandoned = True
        raise AbandonedSave(
            f"SIGTERM: abandoned the save in flight; the next job resumes from "
            f"{checkpoints.describe(checkpoints.newest_complete())}"
        )
    if choice.final_save:
        checkpoints.save(ctx.model, ctx.optimizer, ctx.scheduler, state, blocking=True)
        log.info("SIGTERM: saved step %d and stopping", state.step)
    else:
        log.info(
            "SIGTERM: stopping without a final save; the next job resumes from %s",
            checkpoints.describe(checkpoints.newest_complete()),
        )
