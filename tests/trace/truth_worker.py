"""One tiny recipe's step, tracked by FSDPMemTracker on real CPU tensors (2 gloo ranks) or on fake
tensors (a fake world of 2), for tests/trace/test_trace_truth.py. Prints one JSON object.

    python truth_worker.py real MODE...           # the peaks of real 2-rank runs, one per checkpointing mode
    python truth_worker.py fake MODE...           # the same step traced (trainer.trace.step.trace)
    python truth_worker.py fake-trap MODE...      # traced without neutralising DTensor's fake-mode lookup
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
TINY = (
    "model.layers=2",
    "model.hidden=64",
    "model.heads=4",
    "model.kv_heads=2",
    "model.ffn=128",
    "model.vocab=512",
    "training.seq_len=64",
    "training.micro_batch=2",
    "training.global_batch=32",
    "training.loss_chunk_tokens=64",
    "compute.instance_count=1",
)


def recipe_for(mode: str):
    from trainer.config import load_recipe

    root = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "1b-bf16.yaml")
    return load_recipe(root, (*TINY, f"activation_checkpointing.mode={mode}"))


def _real_rank(rank: int, port: int, modes: list[str], out: str) -> None:
    from trainer.config import resolve_layout
    from trainer.distributed.context_parallel import build_meshes
    from trainer.models.model import select_backend
    from trainer.trace.step import peak_categories, run_tracked_steps
    from trainer.train import lay_out_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    results = {}
    for mode in modes:
        recipe, source = recipe_for(mode)
        layout = resolve_layout(recipe, WORLD, source)
        meshes = build_meshes("cpu", WORLD, layout.shard, layout.cp, recipe.training.seq_len)
        torch.manual_seed(recipe.training.seed)
        model, _, _ = lay_out_model(
            recipe, select_backend("cpu", True), meshes.cp, meshes.fsdp, torch.device("cpu"), False
        )
        model.to_empty(device="cpu")
        model.init_weights()
        tracker, _ = run_tracked_steps(
            recipe, layout, meshes.cp, meshes.fsdp, model, progress=lambda line: None, count_flops=False
        )
        peak, grouped, _ = peak_categories(tracker)
        results[mode] = {"peak_bytes": peak, "by_category_bytes": grouped}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def real(modes: list[str]) -> dict:
    import socket
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        mp.spawn(_real_rank, args=(port, modes, out.name), nprocs=WORLD, join=True)
        with open(out.name) as f:
            return json.load(f)


def fake(modes: list[str], neutralise: bool) -> dict:
    from contextlib import nullcontext

    import trainer.trace.step as step

    results = {}
    for mode in modes:
        recipe, source = recipe_for(mode)
        if not neutralise:  # the trap, left in place: sharding propagation runs in the trace's fake mode
            step.sharding_propagation_unfaked = nullcontext
        report = step.trace(recipe, source, world=WORLD, progress=lambda line: None, count_flops=False)
        results[mode] = {"peak_bytes": report.peak_bytes, "by_category_bytes": report.by_category_bytes}
    return results


if __name__ == "__main__":
    kind, modes = sys.argv[1], sys.argv[2:]
    if kind == "real":
        print(json.dumps(real(modes)))
    else:
        print(json.dumps(fake(modes, neutralise=kind == "fake")))
