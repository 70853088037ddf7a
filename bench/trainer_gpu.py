"""Trainer throughput and memory on one NVIDIA GPU, against the planner's prediction.

    python bench/trainer_gpu.py            # one GPU, under 8 minutes
    python bench/trainer_gpu.py --smoke    # CPU, tiny shape: exercises the same code path (tests)

An 8B-width slice (Llama 3.1 8B's hidden 4096, ffn 14336, 32 heads / 8 kv heads, vocab 128256, but
--layers blocks, default 4, so it fits one GPU) at 8K tokens, through the trainer's own modules:
the same model, FSDP2 wrapping (a world of one), mixed-precision policy, chunked loss, AdamW and TE
autocast. BF16 first, then every FP8 recipe this GPU supports (mxfp8 on Blackwell only). For each it
prints tokens/s per GPU, TFLOP/s (PaLM FLOPs, trainstack.planner.flops_per_token), MFU against the
GPU's dense peak (trainstack.hardware), peak memory (allocated and reserved), and the planner's peak
for the same per-GPU configuration (a one-node recipe with shard_group 1: every GPU holds what this
one does) with the error against the measured reserved peak. One known modelling difference: the
planner treats shard_group 1 as unsharded (BF16 copies of every block resident), while FSDP2 over a
world of one gathers about two blocks at a time; the JSON output carries the planner's breakdown.

Where Transformer Engine does not import, it tries `pip install --only-binary=:all:
transformer_engine[pytorch,core_cu1X]` (wheels only, bounded time: TE's PyTorch extension is often
published only as a source distribution, too slow to compile here); failing that it runs the
pure-PyTorch path in BF16 only and says so. Record results in docs/benchmarks.md (## Trainer).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for path in (REPO, REPO / "training_image"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from trainer.activation_checkpointing import apply_activation_checkpointing  # noqa: E402
from trainer.data import SyntheticTokens, load_batch  # noqa: E402
from trainer.model import build_model, pytorch_backend, transformer_engine_backend  # noqa: E402
from trainer.optim import build_optimizer  # noqa: E402
from trainer.parallel import build_mesh, shard_model  # noqa: E402
from trainer.precision import autocast_factory, fp8_recipe_supported  # noqa: E402
from trainer.throughput import GIB, detected_gpu, peak_memory_gib, peak_tflops  # noqa: E402
from trainer.train import init_distributed  # noqa: E402

from trainstack.planner import flops_per_token  # noqa: E402
from trainstack.recipe import Recipe  # noqa: E402

TE_VERSION = "2.20.2"  # the version training_image/Dockerfile pins
FP8_RECIPES = ("current", "delayed", "block", "mxfp8")
INSTANCE_FOR_GPU = {"B200": "ml.p6-b200.48xlarge", "H100": "ml.p5.48xlarge", "H200": "ml.p5en.48xlarge"}
SLICE_8B = {"hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, "vocab": 128256, "rope_theta": 500000.0}
SMOKE = {"hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 176, "vocab": 256, "rope_theta": 10000.0}


def bench_recipe(
    shape: dict,
    layers: int,
    seq_len: int,
    micro_batch: int,
    dtype: str,
    fp8_recipe: str | None,
    ac: str,
    instance_type: str,
) -> Recipe:
    """The per-GPU configuration as a recipe the planner understands: one node, shard_group 1 (each GPU
    holds the whole model, as the single benchmark GPU does), global batch = micro_batch x 8."""
    return Recipe.model_validate(
        {
            "name": "bench-trainer-gpu",
            "model": {**shape, "layers": layers},
            "training": {
                "seq_len": seq_len,
                "micro_batch": micro_batch,
                "global_batch": micro_batch * 8,
                "steps": 1000,
                "loss_chunk_tokens": min(8192, seq_len * micro_batch),
            },
            "precision": {"dtype": dtype, "fp8_recipe": fp8_recipe},
            "activation_checkpointing": {"mode": ac},
            "parallelism": {"shard_group": 1},
            "compute": {"instance_type": instance_type, "instance_count": 1},
        }
    )


def ensure_transformer_engine(allow_install: bool) -> tuple[object | None, str]:
    backend = transformer_engine_backend()
    if backend is not None:
        import transformer_engine

        return backend, f"transformer_engine {transformer_engine.__version__}"
    if not allow_install:
        return None, "transformer_engine not installed (install skipped)"
    # TE ships its core as wheels (per CUDA major) but its PyTorch extension as a source distribution
    # (TE install docs); compiling it takes far longer than this benchmark's budget, so wheels only.
    core = "core_cu13" if (torch.version.cuda or "").startswith("13") else "core_cu12"
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--only-binary=:all:",
        f"transformer_engine[pytorch,{core}]=={TE_VERSION}",
    ]
    print(f"# transformer_engine missing: {' '.join(command)}", flush=True)
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        return None, "transformer_engine install timed out"
    backend = transformer_engine_backend() if result.returncode == 0 else None
    if backend is None:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["?"]
        return None, f"transformer_engine could not be installed from wheels ({tail[0][:160]})"
    return backend, f"transformer_engine {TE_VERSION} (installed from wheels by this run)"


def measure(recipe: Recipe, backend, device: torch.device, warmup: int, steps: int) -> dict:
    """Train `steps` optimizer steps after `warmup` through the trainer's modules; time and memory."""
    tr = recipe.training
    torch.manual_seed(0)
    model = build_model(recipe.model, tr.seq_len, backend, tr.loss_chunk_tokens)
    apply_activation_checkpointing(model, recipe.activation_checkpointing)
    shard_model(model, build_mesh(device.type, 1, 1))
    model.to_empty(device=device)
    model.init_weights()
    optimizer = build_optimizer(model, tr, device.type)
    autocast = autocast_factory(recipe.precision)
    source = SyntheticTokens(recipe.model.vocab, tr.seq_len, tr.seed)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    losses, started = [], None
    for step in range(warmup + steps):
        if step == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
        batch = load_batch(source, range(step * tr.micro_batch, (step + 1) * tr.micro_batch), device)
        with autocast():
            loss = model(batch.inputs, batch.targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tr.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # syncs: the step is done
    elapsed = time.perf_counter() - started
    tokens_per_sec = tr.micro_batch * tr.seq_len * steps / elapsed
    flops = flops_per_token(recipe.model, tr.seq_len)
    peak, peak_of = peak_tflops(recipe, device)
    result = {
        "tokens_per_sec_per_gpu": tokens_per_sec,
        "tflops_per_gpu": tokens_per_sec * flops / 1e12,
        "mfu": tokens_per_sec * flops / 1e12 / peak,
        "mfu_against": peak_of,
        "peak_allocated_gib": peak_memory_gib(device),
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB if device.type == "cuda" else None,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "step_time_s": elapsed / steps,
    }
    del model, optimizer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def planned(recipe: Recipe) -> dict:
    try:
        from trainstack.planner import plan
    except ImportError:
        return {"planned_peak_gib": None, "note": "trainstack.planner.plan not available"}
    p = plan(recipe)
    return {
        "planned_peak_gib": p.memory.allocator_peak_gib,
        "planned_total_gib": p.memory.peak_gib,
        "planned_tokens_per_sec_per_gpu": p.throughput.tokens_per_sec_per_gpu,
        "planned_mfu": p.throughput.mfu,
        "planned_breakdown_gib": p.memory.breakdown,
    }


def format_row(row: dict, device_type: str) -> str:
    text = (
        f"{row['precision']:>8}: {row['tokens_per_sec_per_gpu']:10.1f} tokens/s/GPU  "
        f"{row['tflops_per_gpu']:9.4g} TFLOP/s  MFU {row['mfu']:.4g} (vs {row['mfu_against']})  "
        f"peak {row['peak_allocated_gib']:.3g} GiB"
    )
    text += f" alloc / {row['peak_reserved_gib']:.3g} reserved" if row["peak_reserved_gib"] else " (RSS)"
    if row.get("planned_peak_gib") is not None:
        text += f"  planner {row['planned_peak_gib']:.3g} GiB"
    if "planner_memory_error" in row:
        text += f" (error {row['planner_memory_error']:+.1%})"
    elif device_type == "cpu":
        text += " (error n/a: CPU RSS is not GPU memory)"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shape, BF16: the code path only")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--checkpointing", choices=["none", "selective", "full"], default="none")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--no-install", action="store_true", help="never pip install transformer_engine")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)

    if args.smoke:
        shape, layers, seq_len, device_type = SMOKE, 2, 64, "cpu"
        args.warmup, args.steps = min(args.warmup, 2), min(args.steps, 3)
    else:
        if not torch.cuda.is_available():
            print("error: no CUDA GPU here; run with --smoke on CPU", file=sys.stderr)
            return 2
        shape, layers, seq_len, device_type = SLICE_8B, args.layers, args.seq_len, "cuda"
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    _, _, device = init_distributed(device_type)
    try:
        gpu = detected_gpu(device)
        instance_type = INSTANCE_FOR_GPU.get(gpu.name if gpu else "", "ml.p6-b200.48xlarge")
        if device_type == "cuda":
            te_backend, te_note = ensure_transformer_engine(not args.no_install)
        else:
            te_backend, te_note = None, "CPU smoke run: pure PyTorch"
        backend = te_backend or pytorch_backend()
        configs = [("bf16", None)]
        skipped = []
        for name in FP8_RECIPES:
            if te_backend is None:
                skipped.append((name, "needs Transformer Engine"))
                continue
            ok, reason = fp8_recipe_supported(name)
            (configs.append(("fp8", name)) if ok else skipped.append((name, reason)))
        cpu = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
        header = {
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "machine": platform.node(),
            "device": torch.cuda.get_device_name(device) if device_type == "cuda" else cpu,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "backend": backend.name,
            "transformer_engine": te_note,
            "shape": {**shape, "layers": layers},
            "seq_len": seq_len,
            "micro_batch": args.micro_batch,
            "activation_checkpointing": args.checkpointing,
            "planner_instance": instance_type,
        }
        print(json.dumps(header), flush=True)
        if te_backend is None and device_type == "cuda":
            print(f"# {te_note}: running the pure-PyTorch path in BF16 only", flush=True)
        for name, reason in skipped:
            print(f"# fp8 {name}: skipped ({reason})", flush=True)
        results = []
        for dtype, fp8_recipe in configs:
            recipe = bench_recipe(
                shape, layers, seq_len, args.micro_batch, dtype, fp8_recipe, args.checkpointing, instance_type
            )
            row = {
                "precision": fp8_recipe or dtype,
                **measure(recipe, backend, device, args.warmup, args.steps),
                **planned(recipe),
            }
            measured_peak = row["peak_reserved_gib"] or row["peak_allocated_gib"]
            if row.get("planned_peak_gib") is not None and device_type == "cuda":
                row["planner_memory_error"] = (row["planned_peak_gib"] - measured_peak) / measured_peak
            results.append(row)
            print(format_row(row, device_type), flush=True)
        bf16 = results[0]["tokens_per_sec_per_gpu"]
        for row in results[1:]:
            print(f"# {row['precision']} speed-up over bf16: {row['tokens_per_sec_per_gpu'] / bf16:.2f}x")
        if args.json:
            args.json.write_text(json.dumps({"header": header, "results": results}, indent=1) + "\n")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
