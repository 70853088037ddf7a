"""The training loop: build, shard, resume, step, log, checkpoint, stop cleanly.

Exit codes: 0 finished or stopped by SIGTERM after a complete checkpoint; 2 a mistake in the recipe or
the environment (one line naming the field); 3 the loss or gradient norm became NaN/inf (nothing is
saved from that step on; the previous complete checkpoint stays the newest).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.optim.lr_scheduler import LRScheduler

from trainer.activation_checkpointing import (
    apply_activation_checkpointing,
    check_activation_checkpointing,
    is_op_level,
)
from trainer.checkpoint import CheckpointManager, TrainerState
from trainer.comms import check_efa
from trainer.config import Layout, load_recipe, resolve_layout
from trainer.data import TokenSource, load_batch, micro_batch_indices, open_source
from trainer.model import Transformer, build_model, compile_blocks, compile_decision, select_backend
from trainer.optim import build_optimizer, build_scheduler
from trainer.parallel import build_mesh, mesh_description, set_gradient_sync, shard_model
from trainer.precision import autocast_factory, check_precision
from trainer.throughput import peak_memory_gib, peak_tflops
from trainstack import exit_codes
from trainstack.errors import TrainstackError
from trainstack.metrics import format_line
from trainstack.planner import flops_per_token, plan
from trainstack.recipe import Recipe

log = logging.getLogger("trainer")
EXIT_NON_FINITE = exit_codes.NON_FINITE


class NonFiniteLoss(Exception):
    exit_code = EXIT_NON_FINITE


@dataclass(frozen=True)
class RunOptions:
    recipe: str | None
    overrides: tuple[str, ...]
    device: str | None
    max_steps: int | None
    checkpoint_dir: Path
    data_dir: Path | None
    synthetic: bool
    trace_dir: Path | None
    async_checkpoint: bool = True


class StopRequest:
    """Set by SIGTERM (SageMaker stop, spot reclaim, max runtime); acted on at the next step boundary."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.requested = True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device_type: str) -> tuple[int, int, torch.device]:
    """(rank, world, device); a single process without torchrun becomes a world of one."""
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        stream=sys.stderr,
        force=True,
        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s",
    )


class Trace:
    """Per-step loss (full precision) and sample indices, one JSON line per step per rank; for tests."""

    def __init__(self, directory: Path | None, rank: int):
        self.file = None
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            self.file = open(directory / f"rank{rank}.jsonl", "a")  # noqa: SIM115

    def write(self, step: int, loss: float, samples: list[int]) -> None:
        if self.file is not None:
            self.file.write(json.dumps({"step": step, "loss": loss, "samples": samples}) + "\n")
            self.file.flush()


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
    finally:
        dist.destroy_process_group()


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
    check_activation_checkpointing(ac, recipe.precision)
    backend = select_backend(device.type, needs_pytorch_ops=is_op_level(ac))
    check_precision(recipe.precision, device.type, backend.name)
    log.info("comms gate: %s", check_efa(device, rank, world))
    data_dir = None if options.synthetic else options.data_dir
    if data_dir is None and recipe.data.train_s3_uri and not options.synthetic:
        raise TrainstackError(
            f"data.train_s3_uri is {recipe.data.train_s3_uri} but no --data-dir / training "
            "channel is mounted (pass --synthetic to train on synthetic tokens anyway)"
        )
    token_source = open_source(data_dir, recipe.training.seq_len, recipe.model.vocab, recipe.training.seed)

    torch.manual_seed(recipe.training.seed)
    model = build_model(recipe.model, recipe.training.seq_len, backend, recipe.training.loss_chunk_tokens)
    recomputed = apply_activation_checkpointing(model, ac)
    compiled, compile_note = compile_decision(recipe.training.compile, device.type, backend.name)
    if compiled:  # per block, after checkpointing and before sharding, as torchtitan orders it
        compile_blocks(model)
    mesh = build_mesh(device.type, world, layout.shard)
    shard_model(model, mesh)
    model.to_empty(device=device)
    model.init_weights()
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
        "layout: %s; micro_batch %d x %d ranks x %d accumulation = global_batch %d; data %s",
        mesh_description(mesh),
        layout.micro_batch,
        world,
        layout.grad_accum,
        layout.global_batch,
        token_source.name,
    )

    checkpoints = CheckpointManager(
        options.checkpoint_dir,
        recipe.checkpointing.keep,
        rank,
        world,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        asynchronous=options.async_checkpoint,
    )
    state = TrainerState(step=0, samples_consumed=0, data_source=token_source.name, world_size=world)
    latest = checkpoints.newest_complete()
    if latest is not None:
        state = checkpoints.load(latest, model, optimizer, scheduler)
        if state.data_source != token_source.name:
            raise TrainstackError(
                f"{latest}: was trained on {state.data_source}, this run reads "
                f"{token_source.name}; use a new checkpoint directory for new data"
            )
        log.info("resumed from %s: step %d, data position %d", latest, state.step, state.samples_consumed)
    else:
        log.info("no complete checkpoint in %s: starting at step 0", options.checkpoint_dir)
    max_steps = options.max_steps if options.max_steps is not None else recipe.training.steps
    ctx = LoopContext(
        recipe=recipe,
        layout=layout,
        options=options,
        rank=rank,
        world=world,
        device=device,
        mesh=mesh,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        token_source=token_source,
        checkpoints=checkpoints,
    )
    try:
        return _loop(ctx, state, max_steps, stop)
    finally:
        checkpoints.wait()


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
    model: Transformer
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    token_source: TokenSource
    checkpoints: CheckpointManager


def _forward_backward(ctx: LoopContext, position: int, autocast: Callable) -> tuple[torch.Tensor, list[int]]:
    """One optimizer step's micro-steps from data position `position`: (summed loss, samples used).

    Each micro-step's mean loss is divided by the accumulation count, and FSDP2 averages gradients
    over the ranks, so the accumulated gradient is that of the mean loss over the global batch."""
    layout = ctx.layout
    loss_sum = torch.zeros((), device=ctx.device)
    used: list[int] = []
    for micro_step in range(layout.grad_accum):
        indices = micro_batch_indices(position, micro_step, ctx.rank, ctx.world, layout.micro_batch)
        batch = load_batch(ctx.token_source, indices, ctx.device)
        used.extend(batch.sample_indices)
        set_gradient_sync(ctx.model, ctx.mesh, last_micro_step=micro_step == layout.grad_accum - 1)
        with autocast():  # forward only: TE's autocast must not wrap backward
            loss = ctx.model(batch.inputs, batch.targets)
        (loss / layout.grad_accum).backward()
        loss_sum += loss.detach()
    return loss_sum, used


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
    tokens_per_rank_step = layout.micro_batch * layout.grad_accum * tr.seq_len
    step, position = state.step, state.samples_consumed
    interval_losses: list[float] = []
    interval_start = time.perf_counter()
    # Checkpoint every interval_steps steps, or every interval_minutes of wall time (the recipe's, else
    # the plan's Young/Daly optimum). Rank 0's clock decides, shared in the step's all-reduce below.
    save_every_steps = recipe.checkpointing.interval_steps
    save_every_s = None if save_every_steps else plan(recipe).run.checkpoint.interval_minutes * 60.0
    last_save = time.monotonic()
    if step >= max_steps:
        log.info("already at step %d of %d: nothing to do", step, max_steps)
    while step < max_steps:
        loss_sum, used = _forward_backward(ctx, position, autocast)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tr.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        # One collective for the step's loss and the stop flag, so every rank stops at the same step.
        save_due = ctx.rank == 0 and save_every_s is not None and time.monotonic() - last_save >= save_every_s
        flags = torch.tensor([float(stop.requested), float(save_due)], device=device)
        shared = torch.cat([(loss_sum / layout.grad_accum).reshape(1), flags])
        dist.all_reduce(shared)
        mean_loss, stopping = shared[0].item() / ctx.world, shared[1].item() > 0
        save_due = shared[2].item() > 0
        if not (math.isfinite(mean_loss) and math.isfinite(grad_norm.item())):
            raise NonFiniteLoss(
                f"non-finite loss or gradient at step {step + 1} (loss={mean_loss}, "
                f"grad_norm={grad_norm.item()}); "
                "stopped before the optimizer step, nothing saved from this step on "
                "(lower training.lr or raise warmup_steps, and check the data)"
            )
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        position += layout.global_batch
        trace.write(step, mean_loss, used)
        checkpoints.poll()
        interval_losses.append(mean_loss)
        if step % tr.log_every == 0 or step == max_steps or stopping:
            elapsed = time.perf_counter() - interval_start
            tokens_per_sec = tokens_per_rank_step * len(interval_losses) / elapsed
            tflops = tokens_per_sec * flops / 1e12
            line = format_line(
                step=step,
                loss=sum(interval_losses) / len(interval_losses),
                lr=lr,
                tokens_per_sec=tokens_per_sec,
                tflops_per_gpu=tflops,
                mfu=tflops / peak,
                mem_gib=peak_memory_gib(device),
                step_time_s=elapsed / len(interval_losses),
            )
            if ctx.rank == 0:
                print(line, flush=True)
            interval_losses, interval_start = [], time.perf_counter()
        state = TrainerState(step, position, ctx.token_source.name, ctx.world)
        final = stopping or step == max_steps
        if save_due or (save_every_steps and step % save_every_steps == 0) or final:
            checkpoints.save(model, optimizer, scheduler, state, blocking=final)
            last_save = time.monotonic()
        if stopping:
            log.info("SIGTERM: saved step %d and stopping", step)
            break
    return 0
