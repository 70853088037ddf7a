"""The trace: the training loop's own micro-steps and update, at the recipe's size, under FSDPMemTracker.

What runs is what trainer.train runs, from the same functions: `lay_out_model` (model code, CP split,
activation checkpointing, FSDP2/HSDP units), `build_optimizer` / `build_scheduler`, and per step
`micro_step` (gradient sync, forward with the chunked loss, scaled backward) then `update` (clip,
AdamW, schedule, gradients freed). Two optimizer steps run, so the optimizer state exists at the
second; each step runs min(grad_accum, 2) micro-steps, so a step with accumulation has the first
micro-step's gradient shards alive through the second one's backward, as in training.

What differs from the GPU run, by necessity (named in every report's `notes`):
- device: `cpu` with the GPU run's dtypes (FSDP2 on `cuda` calls torch.cuda.current_device(), which
  the CPU build cannot answer);
- the block: the pure-PyTorch block (Transformer Engine's modules run C++ kernels the fake mode cannot
  follow); an FP8 recipe's step is traced in BF16 and TE's FP8 terms are modelled
  (trainstack.planner.traced);
- torch.compile: eager (inductor cannot compile fake inputs, pytorch/pytorch#136586), so the trace
  is the uncompiled step's memory.

Peak categories (the tracker's, grouped): parameters = sharded FP32 parameters (the master copy) and
buffers; gradients = sharded FP32 gradients; optimizer = AdamW's state; activations = what forward and
recompute keep; temporary = backward's transient tensors and the inputs; communication = unsharded
parameters and gradients in flight and the all-gather / reduce-scatter buffers.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field

import torch
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from trainer.config import Layout, resolve_layout
from trainer.distributed.context_parallel import ContextParallel, build_meshes
from trainer.models.model import select_backend
from trainer.optim import build_optimizer, build_scheduler
from trainer.trace.fake import fake_world, sharding_propagation_unfaked
from trainer.train import lay_out_model, micro_step, update
from trainstack.recipes.schema import Recipe

STEPS = 2
MICRO_STEPS_PER_STEP = 2
GIB = float(2**30)
# The tracker's reference types (torch.distributed._tools.fsdp2_mem_tracker._FSDPRefType values),
# grouped into the categories trainstack reports.
CATEGORIES = {
    "parameters": ("Sharded Param", "Buffer"),
    "gradients": ("Sharded Grad",),
    "optimizer": ("OptState",),
    "activations": ("Activation",),
    "temporary": ("Temp", "Inputs"),
    "communication": ("Unsharded Param", "Unsharded Grad", "All Gather", "Reduce Scatter"),
}
PROGRESS_EVERY_S = 5.0


def to_stderr(line: str) -> None:
    print(f"trace: {line}", file=sys.stderr, flush=True)


@dataclass
class TraceReport:
    recipe: str
    world: int
    layout: dict
    peak_bytes: int
    by_category_bytes: dict[str, int]
    tracker_bytes: dict[str, int]  # the tracker's own reference types at the peak
    peak_at: dict  # module, phase (forward | backward | optimizer step), step, micro_step
    seconds: float
    max_rss_mib: float
    flops: dict  # per GPU for one micro-step: model, recompute (and their attention parts); tokens
    notes: list[str] = field(default_factory=list)
    torch_version: str = torch.__version__

    def to_dict(self) -> dict:
        return asdict(self)


class _PeakTracker(FSDPMemTracker):
    """FSDPMemTracker that also remembers where the global peak was set: the innermost module
    running, forward or backward (or the optimizer step), and which micro-step; and that keeps
    FSDP2's grouped units whole.

    Grouped units: torch 2.13's tracker predates grouped `fully_shard([norm, output])` (the trainer's
    head unit, trainer.distributed.parallel). It removes FSDP2's group hooks
    (`_register_group_forward_hooks`: the unit's post-forward runs once, when the last of its modules
    finishes) and hooks every module alone, so the unit's post-forward, and with it its pre- and
    post-backward, runs once per module call: after the norm and after every chunk of the chunked
    loss. Each post-backward then reduce-scatters part of the unit's gradient, and under HSDP with
    the all-reduce deferred (`set_requires_all_reduce(False)`, every micro-step but the last) the
    norm's partial reduce output is added to the head's and the step fails on the shape; without
    HSDP the step runs, but the head unit is reduced and resharded early, so an upper block's
    backward was traced without the head unit's FP32 reduce-scatter input (1.96 GiB for 8B) or,
    tied, the shared matrix that FSDP2 keeps unsharded until the end. Here a
    grouped unit keeps FSDP2's own group hooks, with the tracker's snapshots inside them, and its
    backward methods are wrapped once. tests/trace/test_trace_hsdp.py pins that the tracked step is
    then the untracked one (same parameters after two steps, real gloo ranks at 2 x 2 HSDP) and that
    the stock tracker still breaks the group."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(model, optimizer)
        self.place = {"step": 0, "micro_step": 0}
        self.peak_at: dict = {}
        self._groups_instrumented: list = []
        self._region_ends: list = []

    def _instrument_fsdp_module(self) -> None:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_state import _register_group_forward_hooks

        states: dict[int, tuple] = {}
        for module in self._root_mod.modules():
            if isinstance(module, FSDPModule):
                state = module._get_fsdp_state()
                if state._fsdp_param_group is not None:
                    states.setdefault(id(state), (state, module))
        for state, first in states.values():
            group = state._fsdp_param_group
            state._pre_forward_hook_handle.remove()  # a group's one handle removes all its hooks
            state._post_forward_hook_handle.remove()
            self._instrument_fsdp_sharded_params_grads(group)
            modules = state._modules
            pre = {m: self._fsdp_state_pre_forward(m, state._pre_forward) for m in modules}
            post = {m: self._fsdp_state_post_forward(m, state._post_forward) for m in modules}
            if len(modules) == 1:
                state._pre_forward_hook_handle = first.register_forward_pre_hook(
                    pre[first], prepend=True, with_kwargs=True
                )
                state._post_forward_hook_handle = first.register_forward_hook(
                    post[first], prepend=False, always_call=True
                )
            else:
                handle = _register_group_forward_hooks(
                    modules,
                    lambda module, args, kwargs, pre=pre: pre[module](module, args, kwargs),
                    lambda module, args, output, post=post: post[module](module, args, output),
                    state._modules_to_run_forward,
                    state._cast_output_dtype,
                )
                state._pre_forward_hook_handle = state._post_forward_hook_handle = handle
                # A recompute in backward (the chunked loss replays the head alone) takes the group's
                # partial path, which skips the tracker's post-forward: end its recompute region here,
                # or everything after it in backward would count as activations, not temporaries.
                for module in modules:
                    self._region_ends.append(
                        module.register_forward_hook(self._end_recompute, always_call=True)
                    )
            self._groups_instrumented.append((state, group.pre_backward, group.post_backward))
            group.pre_backward = self._fsdp_param_group_pre_backward(first, group.pre_backward)
            group.post_backward = self._deferred_as_gradient(
                group, self._fsdp_param_group_post_backward(first, group.post_backward)
            )
        for buffer in self._root_mod.buffers():
            self._update_and_maybe_create_winfos(buffer, _FSDPRefType.BUFFER)

    def _end_recompute(self, module, args, output) -> None:
        if self._mod_tracker.is_bw and self._ac_mod is not None and self._ac_mod() is module:
            self._ac_mod = None
            self._in_ac = False

    def _deferred_as_gradient(self, group, post_backward: Callable) -> Callable:
        """HSDP's deferred gradient (FSDP2's partial_reduce_output: the unit's reduce-scattered FP32
        gradient shard, held until the last micro-step all-reduces it) counted as a gradient: it is
        one, but FSDP2 does not set it as `.grad` until then, so the tracker would file it under
        whatever was running when it was made."""

        def run(*args, **kwargs):
            post_backward(*args, **kwargs)
            if group._partial_reduce_output is not None:
                self._update_and_maybe_create_winfos(group._partial_reduce_output, _FSDPRefType.SHARDED_GRAD)

        return run

    def _deregister_module_and_optimizer_hooks(self) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_state import _register_group_forward_hooks

        for state, pre_backward, post_backward in self._groups_instrumented:
            state._pre_forward_hook_handle.remove()
            state._post_forward_hook_handle.remove()
            modules = state._modules
            if len(modules) == 1:
                state._pre_forward_hook_handle = modules[0].register_forward_pre_hook(
                    state._pre_forward, prepend=True, with_kwargs=True
                )
                state._post_forward_hook_handle = modules[0].register_forward_hook(
                    state._post_forward, prepend=False
                )
            else:
                handle = _register_group_forward_hooks(
                    modules,
                    state._pre_forward,
                    state._post_forward,
                    state._modules_to_run_forward,
                    state._cast_output_dtype,
                )
                state._pre_forward_hook_handle = state._post_forward_hook_handle = handle
            state._fsdp_param_group.pre_backward = pre_backward
            state._fsdp_param_group.post_backward = post_backward
        self._groups_instrumented.clear()
        for handle in self._region_ends:
            handle.remove()
        self._region_ends.clear()
        if self._optimizer_hook_handles is not None:
            for handle in self._optimizer_hook_handles:
                handle.remove()
            self._optimizer_hook_handles = None

    def _update_peak_stats(self, peak_state) -> None:
        before = sum(self._peak_mem.values())
        super()._update_peak_stats(peak_state)
        if sum(self._peak_mem.values()) > before:
            parents = [p for p in self._mod_tracker.parents if p != "Global"]
            module = max(parents, key=lambda name: name.count("."), default="(outside every module)")
            if self._in_opt:
                phase = "optimizer step"
            else:
                phase = "backward" if self._mod_tracker.is_bw else "forward"
            self.peak_at = {"module": module, "phase": phase, **self.place}


class _StepFlops(FlopCounterMode):
    """FlopCounterMode with recompute counted apart: an op that runs inside backward (an autograd
    graph task is running) with grad mode on is a checkpoint's forward replay (non-reentrant
    checkpoint recomputes under enable_grad; backward's own ops run with grad mode off)."""

    def __init__(self) -> None:
        super().__init__(display=False)
        self.recompute = 0
        self.recompute_attention = 0  # the part of `recompute` that is attention (SDPA) replayed
        # torch counts the GPU attention kernels but not the CPU flash kernel the trace runs on; the
        # same formulas apply (its backward recomputes the score matrix, as flash attention does).
        aten = torch.ops.aten
        self.flop_registry[aten._scaled_dot_product_flash_attention_for_cpu] = flop_counter.sdpa_flop
        self.flop_registry[aten._scaled_dot_product_flash_attention_for_cpu_backward] = (
            flop_counter.sdpa_backward_flop
        )

    def _count_flops(self, func_packet, out, args, kwargs):
        if (
            func_packet in self.flop_registry
            and torch._C._current_graph_task_id() != -1
            and torch.is_grad_enabled()
        ):
            counted = self.flop_registry[func_packet](*args, **kwargs, out_val=out)
            self.recompute += counted
            if _is_attention(func_packet):
                self.recompute_attention += counted
            return out
        return super()._count_flops(func_packet, out, args, kwargs)

    @property
    def model(self) -> int:
        return self.get_total_flops()

    @property
    def attention(self) -> int:
        """The model FLOPs of attention (SDPA forward and backward; torch's formulas: the backward
        recomputes the score matrix, 2.5x the forward, and no causal halving)."""
        return sum(n for op, n in self.flop_counts["Global"].items() if _is_attention(op))


def _is_attention(func_packet) -> bool:
    return "scaled_dot_product" in str(func_packet)


@contextmanager
def _block_progress(
    model: torch.nn.Module, progress: Callable[[str], None], label: list[str]
) -> Iterator[None]:
    """A line at most every PROGRESS_EVERY_S seconds while forward runs through the blocks."""
    last = [time.monotonic()]
    layers = len(model.layers)

    def hook(index: int):
        def report(module, args):
            now = time.monotonic()
            if now - last[0] >= PROGRESS_EVERY_S:
                last[0] = now
                progress(f"{label[0]}: forward, block {index + 1} of {layers}")

        return report

    handles = [block.register_forward_pre_hook(hook(i)) for i, block in enumerate(model.layers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def tokens(layout: Layout, recipe: Recipe, cp: ContextParallel) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch of this rank's (inputs, targets), as the loader hands them over: int64
    (micro_batch, seq_len / cp), this rank's CP chunks (made in the current mode: fake or real)."""
    full = torch.randint(0, recipe.model.vocab, (layout.micro_batch, recipe.training.seq_len))
    return cp.split(full), cp.split(full)


def run_tracked_steps(
    recipe: Recipe,
    layout: Layout,
    cp: ContextParallel,
    mesh,
    model: torch.nn.Module,
    progress: Callable[[str], None] = to_stderr,
    count_flops: bool = True,
    steps: int = STEPS,
    micro_steps: int | None = None,
) -> tuple[_PeakTracker, _StepFlops | None]:
    """`steps` optimizer steps of the training loop's micro-steps and update under the tracker (on
    whatever tensors `model` holds: fake in a trace, real in tests/trace's comparison), each of
    `micro_steps` micro-steps (default: min(grad_accum, MICRO_STEPS_PER_STEP), module doc)."""
    optimizer = build_optimizer(model, recipe.training, "cpu")
    scheduler = build_scheduler(optimizer, recipe.training)
    tracker = _PeakTracker(model, optimizer)
    flops = _StepFlops() if count_flops else None
    micro_steps = micro_steps or min(layout.grad_accum, MICRO_STEPS_PER_STEP)
    label = [""]
    start = time.monotonic()
    with tracker, _block_progress(model, progress, label):
        for step in range(1, steps + 1):
            for micro in range(1, micro_steps + 1):
                label[0] = f"step {step} of {steps}, micro-step {micro} of {micro_steps}"
                tracker.place = {"step": step, "micro_step": micro}
                inputs, targets = tokens(layout, recipe, cp)
                last_of_step = micro == micro_steps
                # The trainer's own gradient sync: under HSDP the all-reduce across replicas waits for
                # the step's last micro-step (set_gradient_sync); the first traced micro-step of a step
                # with accumulation is one of the deferred ones, the second the last. A middle
                # micro-step holds what the first does plus one unit's transient reduce output, as the
                # last does (FSDP2's partial_reduce_output), so two cover the step's peak.
                last = layout.grad_accum == 1 or last_of_step
                micro_step(model, mesh, inputs, targets, _no_autocast, layout.grad_accum, last)
                progress(f"{label[0]} done ({time.monotonic() - start:.0f} s)")
            tracker.place = {"step": step, "micro_step": micro_steps}
            update(model, optimizer, scheduler, recipe.training.grad_clip)
            if step == 1:
                tracker.reset_mod_stats()  # the optimizer state appears at the first step
    if flops is not None:
        # One more micro-step, untracked, under the FLOP counter alone: counted inside the tracker,
        # the counter's own module hooks keep tensors alive and the tracked peak grows (1b-bf16 at 2
        # blocks: 19.7 GiB counted against 16.8 without, tests/trace/test_trace_flops.py).
        label[0] = "FLOPs of one micro-step"
        with _block_progress(model, progress, label), flops:
            inputs, targets = tokens(layout, recipe, cp)
            micro_step(model, mesh, inputs, targets, _no_autocast, layout.grad_accum, True)
        progress(f"FLOPs counted ({time.monotonic() - start:.0f} s)")
    return tracker, flops


def _no_autocast():
    return nullcontext()


def peak_categories(tracker: FSDPMemTracker) -> tuple[int, dict[str, int], dict[str, int]]:
    """(peak bytes, bytes by trainstack category, bytes by the tracker's reference type) at the peak."""
    snapshot = tracker.get_tracker_snapshot("peak")
    raw: dict[str, int] = {}
    for per_device in snapshot.values():
        for key, value in per_device.items():
            name = getattr(key, "value", key)
            raw[name] = raw.get(name, 0) + int(value)
    peak = raw.pop("Total", sum(raw.values()))
    grouped = {category: sum(raw.get(name, 0) for name in names) for category, names in CATEGORIES.items()}
    return peak, grouped, raw


def notes_for(recipe: Recipe, layout: Layout | None = None) -> list[str]:
    notes = ["traced on fake CPU tensors with the GPU run's dtypes, pure-PyTorch block, eager"]
    if layout is not None and layout.replicas > 1 and layout.grad_accum > 1:
        notes.append(
            "HSDP: the all-reduce across replicas deferred to the step's last micro-step, as trained "
            "(the deferred gradient shard counted as a gradient)"
        )
    if recipe.precision.dtype == "fp8":
        notes.append(
            "FP8 recipe: the BF16 path is traced; Transformer Engine's FP8 caches are modelled, not traced"
        )
    if recipe.training.compile is not False:
        notes.append(
            "torch.compile not traced (inductor cannot compile fake inputs): the eager step's memory"
        )
    return notes


def trace(
    recipe: Recipe,
    source: str,
    world: int | None = None,
    progress: Callable[[str], None] = to_stderr,
    count_flops: bool = True,
) -> TraceReport:
    """Trace `recipe`'s training step at `world` ranks (default: the recipe's GPUs) on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    started = time.monotonic()
    world = world or recipe.world_size
    layout = resolve_layout(recipe, world, source)
    progress(
        f"{recipe.name}: {recipe.model.layers} blocks, {recipe.model.total_params / 1e9:.2f}B parameters, "
        f"{world} fake ranks ({layout.replicas} x {layout.shard}-way shard, cp {layout.cp}), micro-batch "
        f"{layout.micro_batch} x {recipe.training.seq_len} tokens, grad_accum {layout.grad_accum}"
    )
    with fake_world(world), sharding_propagation_unfaked():
        device = torch.device("cpu")
        meshes = build_meshes("cpu", world, layout.shard, layout.cp, recipe.training.seq_len)
        backend = select_backend("cpu", needs_pytorch_ops=True)
        model, _, _ = lay_out_model(recipe, backend, meshes.cp, meshes.fsdp, device, compile_requested=False)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device=device)
            model.init_rope()
            progress(f"model laid out and sharded ({time.monotonic() - started:.0f} s)")
            tracker, flops = run_tracked_steps(
                recipe, layout, meshes.cp, meshes.fsdp, model, progress, count_flops
            )
    peak, grouped, raw = peak_categories(tracker)
    local_tokens = layout.micro_batch * recipe.training.seq_len // layout.cp
    return TraceReport(
        recipe=recipe.name,
        world=world,
        layout={
            "shard": layout.shard,
            "replicas": layout.replicas,
            "cp": layout.cp,
            "micro_batch": layout.micro_batch,
            "grad_accum": layout.grad_accum,
            "seq_len": recipe.training.seq_len,
        },
        peak_bytes=peak,
        by_category_bytes=grouped,
        tracker_bytes=raw,
        peak_at=tracker.peak_at,
        seconds=round(time.monotonic() - started, 1),
        max_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        flops={
            "model": flops.model if flops else None,
            "recompute": flops.recompute if flops else None,
            "attention": flops.attention if flops else None,
            "recompute_attention": flops.recompute_attention if flops else None,
            "tokens": local_tokens,
        },
        notes=notes_for(recipe, layout),
    )
