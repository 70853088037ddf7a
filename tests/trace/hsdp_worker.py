"""One tiny recipe at 2 x 2 HSDP (2 replicas of a 2-way shard) with gradient accumulation, for
tests/trace/test_trace_hsdp.py. Prints one JSON object.

    python hsdp_worker.py    # 4 gloo ranks, real CPU tensors: the step untracked, tracked by the
                             # trace's tracker, and tracked by torch's stock FSDPMemTracker; then
                             # the same step traced on fake tensors (trainer.trace.step.trace)

Every run is the training loop's own micro-steps (the all-reduce across replicas deferred to the
step's last micro-step, as trainer.train runs it) and update, two optimizer steps.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

WORLD = 4
TINY = (
    "model.layers=2",
    "model.hidden=64",
    "model.heads=4",
    "model.kv_heads=2",
    "model.ffn=128",
    "model.vocab=512",
    "training.seq_len=64",
    "training.micro_batch=2",
    "training.global_batch=32",  # 32 / (2 x 4 ranks): 4 micro-steps per step
    "training.loss_chunk_tokens=64",  # 2 chunks per micro-step: the head unit runs twice
    "compute.instance_count=1",
    "parallelism.shard_group=2",
    "activation_checkpointing.mode=none",
)


def recipe_and_layout():
    from trainer.config import load_recipe, resolve_layout

    root = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "1b-bf16.yaml")
    recipe, source = load_recipe(root, TINY)
    return recipe, source, resolve_layout(recipe, WORLD, source)


def _model(recipe, layout):
    from trainer.distributed.context_parallel import build_meshes
    from trainer.models.model import select_backend
    from trainer.train import lay_out_model

    meshes = build_meshes("cpu", WORLD, layout.shard, layout.cp, recipe.training.seq_len)
    torch.manual_seed(recipe.training.seed)
    model, _, _ = lay_out_model(
        recipe, select_backend("cpu", True), meshes.cp, meshes.fsdp, torch.device("cpu"), False
    )
    model.to_empty(device="cpu")
    model.init_weights()
    return model, meshes


def _untracked(recipe, layout) -> list[float]:
    """The step as trainer.train runs it, no tracker: the parameters' sums after two steps."""
    from trainer.optim import build_optimizer, build_scheduler
    from trainer.trace.step import STEPS, tokens
    from trainer.train import micro_step, update

    model, meshes = _model(recipe, layout)
    optimizer = build_optimizer(model, recipe.training, "cpu")
    scheduler = build_scheduler(optimizer, recipe.training)
    torch.manual_seed(1)
    for _ in range(STEPS):
        for micro in range(layout.grad_accum):
            inputs, targets = tokens(layout, recipe, meshes.cp)
            last = micro == layout.grad_accum - 1
            micro_step(model, meshes.fsdp, inputs, targets, nullcontext, layout.grad_accum, last)
        update(model, optimizer, scheduler, recipe.training.grad_clip)
    return [p.to_local().double().sum().item() for p in model.parameters()]


def _tracked(recipe, layout, stock: bool) -> dict:
    import trainer.trace.step as step

    model, meshes = _model(recipe, layout)
    torch.manual_seed(1)
    if stock:  # torch's own tracker, which hooks each module of a grouped unit alone
        original = step._PeakTracker
        step._PeakTracker = _Stock
    try:
        tracker, _ = step.run_tracked_steps(
            recipe, layout, meshes.cp, meshes.fsdp, model, progress=lambda line: None, count_flops=False,
            micro_steps=layout.grad_accum,
        )  # fmt: skip
    except Exception as error:  # noqa: BLE001 - the stock tracker's failure is what is recorded
        return {"error": f"{type(error).__name__}: {str(error)[:200]}"}
    finally:
        if stock:
            step._PeakTracker = original
    peak, grouped, _ = step.peak_categories(tracker)
    return {
        "peak_bytes": peak,
        "by_category_bytes": grouped,
        "parameter_sums": [p.to_local().double().sum().item() for p in model.parameters()],
    }


class _Stock(FSDPMemTracker):
    def __init__(self, model, optimizer) -> None:
        super().__init__(model, optimizer)
        self.place, self.peak_at = {}, {}


def _real_rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    recipe, _, layout = recipe_and_layout()
    results = {
        "layout": {"replicas": layout.replicas, "shard": layout.shard, "grad_accum": layout.grad_accum},
        "untracked_parameter_sums": _untracked(recipe, layout),
        "tracked": _tracked(recipe, layout, stock=False),
        "stock": _tracked(recipe, layout, stock=True),
    }
    dist.destroy_process_group()
    if rank == 0:  # the fake trace in this process too (its own fake world): one spawn, not two
        results["fake"] = fake()
        with open(out, "w") as f:
            json.dump(results, f)


def real() -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        mp.spawn(_real_rank, args=(port, out.name), nprocs=WORLD, join=True)
        with open(out.name) as f:
            return json.load(f)


def fake() -> dict:
    from trainer.trace.step import trace

    recipe, source, layout = recipe_and_layout()
    report = trace(recipe, source, world=WORLD, progress=lambda line: None, count_flops=False)
    return {"peak_bytes": report.peak_bytes, "by_category_bytes": report.by_category_bytes}


if __name__ == "__main__":
    print(json.dumps(real()))
