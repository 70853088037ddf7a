#!/usr/bin/env python3
"""Export and import throughput and peak host memory against model size, on CPU (docs/benchmarks.md).

For each size: random Llama-shaped weights are written as a trainer checkpoint (DCP, one rank), then
timed in a fresh process each:

- export: `trainer.export.hf_folder.export` (one FP32 tensor at a time -> BF16 safetensors files of 2 GB at
  most),
  GB of BF16 output per second and the process's peak resident memory;
- import: `trainer.hf.conversion.load_base` of that folder into the FSDP-sharded model (a world of one, FP32
  masters), GB of BF16 read per second and peak resident memory (which holds the model itself: one
  rank of a world of one holds every shard).

Then the projection for 30b-fp8 and 64b-fp8 on AWS (hours, instance, dollars) from
trainstack.planner.models_io. Prints a Markdown table.

    .venv/bin/python bench/hf_export_import.py [--sizes 0.1,0.4,1.0] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # billions of parameters -> a Llama-style shape of about that size (vocab 32000)
    0.1: dict(layers=8, hidden=768, heads=12, kv_heads=4, ffn=2048, vocab=32000),
    0.4: dict(layers=12, hidden=1536, heads=12, kv_heads=4, ffn=4096, vocab=32000),
    1.0: dict(layers=16, hidden=2048, heads=16, kv_heads=8, ffn=5632, vocab=32000),
}


def _recipe(shape: dict):
    from trainstack.recipes.loader import resolve
    from trainstack.recipes.schema import ModelShape

    tiny = resolve(str(ROOT / "tests" / "trainer" / "fixtures" / "tiny.yaml")).recipe
    return tiny.model_copy(update={"model": ModelShape(**shape)})


def make_checkpoint(shape: dict, where: Path) -> None:
    import torch
    import torch.distributed as dist
    from trainer.checkpoint.manager import CheckpointManager, TrainerState
    from trainer.distributed.parallel import build_mesh, shard_model
    from trainer.models.model import build_model, pytorch_backend
    from trainer.optim import build_optimizer, build_scheduler

    recipe = _recipe(shape)
    dist.init_process_group("gloo", init_method=f"file://{where}/store", rank=0, world_size=1)
    model = build_model(recipe.model, 32, pytorch_backend(), 32)
    shard_model(model, build_mesh("cpu", 1, 1))
    model.to_empty(device="cpu")
    model.init_weights()
    optimizer = build_optimizer(model, recipe.training, "cpu")
    manager = CheckpointManager(where / "ck", keep=1, rank=0, world=1, asynchronous=False)
    manager.save(
        model,
        optimizer,
        build_scheduler(optimizer, recipe.training),
        TrainerState(1, 0, "s", 1),
        blocking=True,
    )
    manager.close()
    del model, optimizer
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    dist.destroy_process_group()


def run_export(shape: dict, where: Path) -> dict:
    from trainer.export.hf_folder import export

    started = time.perf_counter()
    result = export(_recipe(shape), str(where / "ck"), str(where / "hf"))
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "gb": result.bytes_written / 1e9, "peak_gb": _peak_gb()}


def run_import(shape: dict, where: Path) -> dict:
    import torch.distributed as dist
    from trainer.distributed.parallel import build_mesh, shard_model
    from trainer.hf.conversion import load_base
    from trainer.models.model import build_model, pytorch_backend

    recipe = _recipe(shape)
    dist.init_process_group("gloo", init_method=f"file://{where}/store2", rank=0, world_size=1)
    model = build_model(recipe.model, 32, pytorch_backend(), 32)
    shard_model(model, build_mesh("cpu", 1, 1))
    model.to_empty(device="cpu")
    model.init_weights()
    before = _peak_gb()
    started = time.perf_counter()
    loaded = load_base(model, where / "hf", recipe.model.model_copy(update={"init_from": None}))
    seconds = time.perf_counter() - started
    out = {"seconds": seconds, "gb": loaded.bytes_read / 1e9, "peak_gb": _peak_gb(), "model_gb": before}
    del model
    dist.destroy_process_group()
    return out


def _peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: KiB


def _child(step: str, size: float, where: Path, quiet: bool = False) -> dict:
    """`step` in a fresh process (so each peak RSS is its own)."""
    code = (
        "import json, sys; sys.path.insert(0, 'bench'); import hf_export_import as b; "
        f"print(json.dumps(b.{step}(b.SHAPES[{size}], __import__('pathlib').Path({str(where)!r}))))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return {} if quiet else json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="0.1,0.4,1.0")
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from trainstack.recipes.schema import ModelShape

    columns = ("model", "params", "export GB/s (BF16 out)", "export peak RSS", "import GB/s (BF16 in)")
    print("| " + " | ".join(columns) + " | import peak RSS (model itself) |")
    print("|---|---|---|---|---|---|")
    for size in (float(s) for s in args.sizes.split(",")):
        where = Path(tempfile.mkdtemp(prefix=f"hfbench-{size}-", dir=args.work))
        _child("make_checkpoint", size, where, quiet=True)
        out, into = _child("run_export", size, where), _child("run_import", size, where)
        params = ModelShape(**SHAPES[size]).total_params
        export_rate = f"{out['gb'] / out['seconds']:.2f} ({out['gb']:.2f} GB in {out['seconds']:.1f} s)"
        import_rate = f"{into['gb'] / into['seconds']:.2f} ({into['seconds']:.1f} s)"
        print(
            f"| {size}B-class | {params / 1e9:.2f} B | {export_rate} | {out['peak_gb']:.2f} GB "
            f"| {import_rate} | {into['peak_gb']:.2f} GB ({into['model_gb']:.2f} before the load) |"
        )
    from trainstack.planner.models_io import plan_export
    from trainstack.recipes.loader import resolve

    print("\n| recipe | export instance | est. peak | hours | USD |")
    print("|---|---|---|---|---|")
    for name in ("30b-fp8", "64b-fp8"):
        p = plan_export(resolve(name).recipe)
        instance = f"{p.instance_type} ({p.memory_gib:.0f} GiB)"
        print(f"| {name} | {instance} | {p.peak_gb:.1f} GB | {p.hours:.2f} | {p.usd:.2f} |")


if __name__ == "__main__":
    main()
