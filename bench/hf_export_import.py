#!/usr/bin/env python3
"""Export and import throughput and peak host memory against model size, on CPU (docs/benchmarks.md).

For each size: random Llama-shaped weights are written as a trainer checkpoint (DCP, one rank), then
timed in a fresh process each, side by side in one run:

- ours: `trainer.export.hf_folder.export` (the checkpoint's FP32 tensors read per parameter -> BF16
  safetensors files of 2 GB at most);
- naive: the whole-model export one would write first: `dcp.load` every model tensor (FP32), split
  into the Hugging Face tensors, cast to BF16, `safetensors.torch.save_file` per output file;
- raw: `safetensors.torch.save_file` of the same BF16 tensors already in memory (the writer alone: the
  ceiling of any export);

each as GB of BF16 output per second of wall time and per CPU-second (user + system: the machine is
shared, so CPU time is the steadier figure), and the process's peak resident memory; then the ratios
ours/raw and ours/naive. Each contender runs --repeat times, interleaved, each time after `sync` (so no
contender's writes are throttled by the one before's writeback), and the medians are printed;
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
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {  # billions of parameters -> a Llama-style shape of about that size (vocab 32000)
    0.1: dict(layers=8, hidden=768, heads=12, kv_heads=4, ffn=2048, vocab=32000),
    0.2: dict(layers=12, hidden=1024, heads=16, kv_heads=4, ffn=2816, vocab=32000),
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

    shutil.rmtree(where / "hf", ignore_errors=True)
    recipe = _recipe(shape)
    _settle()
    started, cpu = time.perf_counter(), _cpu_s()
    result = export(recipe, str(where / "ck"), str(where / "hf"))
    return _figures(started, cpu, result.bytes_written)


def run_naive(shape: dict, where: Path) -> dict:
    """dcp.load everything, split, cast, save_file per output file (the same files as ours)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from trainer.export.hf_folder import DEFAULT_MAX_SHARD_GB, plan_files
    from trainer.hf.conversion import parameter_shapes, pieces, to_hf
    from trainer.storage import LocalStorage, step_dir_name

    recipe = _recipe(shape)
    shutil.rmtree(where / "naive", ignore_errors=True)
    (where / "naive").mkdir()
    _settle()
    started, cpu = time.perf_counter(), _cpu_s()
    storage = LocalStorage(where / "ck")
    state = {f"model.{k}": torch.empty(v) for k, v in parameter_shapes(recipe.model).items()}
    dcp.load(state, checkpoint_id=str(where / "ck" / step_dir_name(storage.steps()[0])), no_dist=True)
    hf = to_hf({k[len("model.") :]: v for k, v in state.items()}, recipe.model)
    hf = {k: v.to(torch.bfloat16) for k, v in hf.items()}
    del state
    files = plan_files(pieces(recipe.model), 2, DEFAULT_MAX_SHARD_GB * 1e9)
    written = 0
    for index, group in enumerate(files, start=1):
        part = {p.hf: hf[p.hf] for p in group}
        save_file(part, str(where / "naive" / f"model-{index:05d}-of-{len(files):05d}.safetensors"))
        written += sum(t.numel() * 2 for t in part.values())
    return _figures(started, cpu, written)


def run_raw(shape: dict, where: Path) -> dict:
    """save_file of the same BF16 tensors, files as ours; only the writes are timed. The tensors are
    our export's output read back (so ours must have run first)."""
    from safetensors.torch import load_file, save_file

    shutil.rmtree(where / "raw", ignore_errors=True)
    (where / "raw").mkdir()
    files = sorted((where / "hf").glob("*.safetensors"))
    parts = [{k: v.clone() for k, v in load_file(str(f)).items()} for f in files]
    _settle()
    started, cpu = time.perf_counter(), _cpu_s()
    written = 0
    for f, part in zip(files, parts, strict=True):
        save_file(part, str(where / "raw" / f.name))
        written += sum(t.numel() * t.element_size() for t in part.values())
    return _figures(started, cpu, written)


def _settle() -> None:
    """Write back what the contender before left dirty, so its writeback does not throttle this one's
    writes (each starts from a clean page cache: measured 0.2-0.5 s of difference at 0.4B otherwise)."""
    os.sync()


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _figures(started: float, cpu: float, written: int) -> dict:
    return {
        "seconds": time.perf_counter() - started,
        "cpu_s": _cpu_s() - cpu,
        "gb": written / 1e9,
        "peak_gb": _peak_gb(),
    }


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


def _median(runs: list[dict]) -> dict:
    """Each figure's median over the runs (the peak: the largest)."""
    middle = len(runs) // 2
    return {
        "seconds": sorted(r["seconds"] for r in runs)[middle],
        "cpu_s": sorted(r["cpu_s"] for r in runs)[middle],
        "gb": runs[0]["gb"],
        "peak_gb": max(r["peak_gb"] for r in runs),
    }


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
    parser.add_argument(
        "--sizes",
        default="0.1,0.2,0.4",
        help="1.0 writes its checkpoint from a process of about 16 GB: not on a shared 24 GiB machine",
    )
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--no-import", action="store_true", help="export figures only")
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="runs of each contender, interleaved; the median of each figure is printed (default 3)",
    )
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from trainstack.recipes.schema import ModelShape

    rows, imports = [], []
    for size in (float(s) for s in args.sizes.split(",")):
        where = Path(tempfile.mkdtemp(prefix=f"hfbench-{size}-", dir=args.work))
        _child("make_checkpoint", size, where, quiet=True)
        runs: dict[str, list[dict]] = {"run_export": [], "run_naive": [], "run_raw": []}
        for _ in range(args.repeat):
            for step, kept in runs.items():  # interleaved: a slow minute of the machine hits all three
                kept.append(_child(step, size, where))
                print(
                    f"{size}B {step}: {kept[-1]['seconds']:.2f} s, {kept[-1]['cpu_s']:.2f} CPU-s",
                    file=sys.stderr,
                    flush=True,
                )
        ours, naive, raw = (_median(kept) for kept in runs.values())
        params = ModelShape(**SHAPES[size]).total_params
        rows.append((size, params, ours, naive, raw))
        if not args.no_import:
            imports.append((size, params, _child("run_import", size, where)))
        shutil.rmtree(where, ignore_errors=True)

    def rate(r: dict) -> str:
        return f"{r['gb'] / r['seconds']:.2f} / {r['gb'] / r['cpu_s']:.2f}"

    print(f"Export, BF16 output: GB/s of wall time / per CPU-second (medians of {args.repeat}); peak RSS")
    print(
        "| model | params | GB out | raw save_file | naive whole-model | ours | ours/raw (wall, CPU) "
        "| ours/naive (wall, CPU) | peak RSS raw / naive / ours |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for size, params, ours, naive, raw in rows:

        def ratio(a: dict, b: dict) -> str:
            return f"{b['seconds'] / a['seconds']:.2f}x, {b['cpu_s'] / a['cpu_s']:.2f}x"

        print(
            f"| {size}B-class | {params / 1e9:.2f} B | {ours['gb']:.2f} | {rate(raw)} | {rate(naive)} "
            f"| {rate(ours)} | {ratio(ours, raw)} | {ratio(ours, naive)} "
            f"| {raw['peak_gb']:.2f} / {naive['peak_gb']:.2f} / {ours['peak_gb']:.2f} GB |"
        )
    if imports:
        print("\n| model | params | import GB/s (BF16 in) | import peak RSS (model itself) |")
        print("|---|---|---|---|")
        for size, params, into in imports:
            print(
                f"| {size}B-class | {params / 1e9:.2f} B | {into['gb'] / into['seconds']:.2f} "
                f"({into['seconds']:.1f} s) | {into['peak_gb']:.2f} GB "
                f"({into['model_gb']:.2f} before the load) |"
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
