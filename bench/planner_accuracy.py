"""Planner accuracy: predicted vs measured peak memory and throughput for every published case.

    .venv/bin/python bench/planner_accuracy.py [--cases PATH] [--json]

Cases come from ../shared/calibration/published.yaml (or the vendored copy next to this file). Each
case is mapped onto the planner's explicit knobs (not onto a recipe: the published runs used trainers
and settings our recipes do not have):

- GPU: H100 -> ml.p5.48xlarge, B200 -> ml.p6-b200.48xlarge (the catalog's figures for that GPU).
- activation_checkpointing "selective-op" -> torchtitan's op-level policy (ActivationPolicy.op_selective);
  absent -> none (Megatron's default for 8B).
- Loss: these trainers materialise the whole micro-batch's logits, so the loss "chunk" is the whole
  micro-batch (loss_chunk_tokens = micro_batch x seq_len).
- precision: fp8-tensorwise and fp8-current-scaling -> fp8 with the "current" scaling recipe.
- global batch: as published, else micro_batch x GPUs (no accumulation).
- Memory: torchtitan reports torch.cuda.max_memory_reserved(), which excludes the CUDA context and
  NCCL's own buffers, so the comparison uses the planner's allocator peak (peak less those two); the
  full per-GPU peak is printed beside it.

Which measurements the throughput constants were fitted on is marked "fit"; for those, the error only
shows what the model's other terms (layer overhead, recompute accounting) add.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainstack.hardware import INSTANCES  # noqa: E402
from trainstack.planner import ActivationPolicy, MemoryPlan, _memory_plan, memory_breakdown, throughput  # noqa: E402
from trainstack.recipe import ModelShape  # noqa: E402

SHARED = ROOT.parent / "shared" / "calibration" / "published.yaml"
VENDORED = Path(__file__).resolve().parent / "calibration_published.yaml"
GPU_TO_INSTANCE = {"H100": "ml.p5.48xlarge", "H200": "ml.p5en.48xlarge", "B200": "ml.p6-b200.48xlarge"}
FP8_RECIPES = {
    "fp8-tensorwise": "current",
    "fp8-current-scaling": "current",
    "fp8-delayed": "delayed",
    "mxfp8": "mxfp8",
}
# Throughput constants in trainstack/planner.py were fitted on these cases (see docs/planner.md).
FITTED = {
    "torchtitan-llama3-8b-h100-fsdp-bf16-compile": "BF16 efficiency, Hopper",
    "torchtitan-llama3-8b-h100-fsdp-float8-compile": "FP8 gain, Hopper",
    "megatron-llama3-8b-b200-fp8cs": "FP8 gain, Blackwell",
    "megatron-llama3-8b-b200-bf16": "BF16 efficiency, Blackwell",
}

# Figures the AWS guide quotes for its 1B MXFP8 example at 8K tokens (shared README section 3). Its
# trainer, loss and whether tokens/s is per GPU are not published: shown for context, not scored.
GUIDE_ANCHORS = [
    {
        "id": "aws-guide-1b-mxfp8-b1-no-ckpt",
        "micro_batch": 1,
        "mode": "none",
        "memory_gb": 15.5,
        "tokens_per_s": 6000,
    },
    {
        "id": "aws-guide-1b-mxfp8-b16-ckpt",
        "micro_batch": 16,
        "mode": "full",
        "memory_gb": 22.8,
        "tokens_per_s": 51000,
    },
]
LLAMA_1B = ModelShape(
    layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256, tied_embeddings=True
)


def predict(case: dict) -> dict:
    instance = INSTANCES[GPU_TO_INSTANCE[case["gpu"]]]
    model = ModelShape(**case["model"])
    par = case.get("parallelism", {})
    shard, tp, cp = par.get("fsdp_shard", case["gpus"]), par.get("tp", 1), par.get("cp", 1)
    ac = case.get("activation_checkpointing", "none")
    policy = ActivationPolicy.op_selective() if ac == "selective-op" else ActivationPolicy(ac)
    mb, seq = case["micro_batch"], case["seq_len"]
    precision = case["precision"]
    dtype = "bf16" if precision == "bf16" else "fp8"
    parts = memory_breakdown(
        model,
        instance.gpu,
        seq_len=seq,
        micro_batch=mb,
        shard_group=shard,
        tp=tp,
        cp=cp,
        policy=policy,
        loss_chunk_tokens=mb * seq,
    )
    mem: MemoryPlan = _memory_plan(parts, instance.gpu)
    thr = throughput(
        model,
        instance,
        seq_len=seq,
        micro_batch=mb,
        global_batch=case.get("global_batch", mb * case["gpus"] // (tp * cp)),
        world_size=case["gpus"],
        shard_group=shard,
        tp=tp,
        cp=cp,
        dtype=dtype,
        fp8_recipe=FP8_RECIPES.get(precision),
        policy=policy,
    )
    measured = case.get("measured", {})
    row = {
        "id": case["id"],
        "gpu": case["gpu"],
        "precision": precision,
        "checkpointing": ac,
        "compile": case.get("compile"),
        "peak_gib": mem.peak_gib,
        "allocator_peak_gib": mem.allocator_peak_gib,
        "measured_peak_gib": measured.get("peak_memory_gib"),
        "tokens_per_sec_per_gpu": thr.tokens_per_sec_per_gpu,
        "measured_tokens_per_sec_per_gpu": measured.get("tokens_per_sec_per_gpu"),
        "fitted_on": FITTED.get(case["id"]),
        "breakdown": {k: round(v, 2) for k, v in parts.items()},
    }
    if row["measured_peak_gib"]:
        row["memory_error"] = row["allocator_peak_gib"] / row["measured_peak_gib"] - 1
    if row["measured_tokens_per_sec_per_gpu"]:
        row["throughput_error"] = row["tokens_per_sec_per_gpu"] / row["measured_tokens_per_sec_per_gpu"] - 1
    return row


def guide_rows() -> list[dict]:
    b200 = INSTANCES["ml.p6-b200.48xlarge"]
    rows = []
    for anchor in GUIDE_ANCHORS:
        policy = ActivationPolicy(anchor["mode"], 1.0 if anchor["mode"] == "full" else 0.0)
        parts = memory_breakdown(
            LLAMA_1B,
            b200.gpu,
            seq_len=8192,
            micro_batch=anchor["micro_batch"],
            shard_group=8,
            policy=policy,
            loss_chunk_tokens=8192,
        )
        thr = throughput(
            LLAMA_1B,
            b200,
            seq_len=8192,
            micro_batch=anchor["micro_batch"],
            global_batch=anchor["micro_batch"] * 8,
            world_size=8,
            shard_group=8,
            dtype="fp8",
            fp8_recipe="mxfp8",
            policy=policy,
        )
        rows.append(
            {
                **anchor,
                "peak_gb": sum(parts.values()) * 2**30 / 1e9,
                "predicted_tokens_per_s": thr.tokens_per_sec_per_gpu,
            }
        )
    return rows


def pct(x: float | None) -> str:
    return "" if x is None else f"{x:+.1%}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=Path, default=SHARED if SHARED.is_file() else VENDORED)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    cases = yaml.safe_load(args.cases.read_text())["cases"]
    rows = [predict(c) for c in cases]
    if args.json:
        print(json.dumps({"cases": rows, "guide": guide_rows()}, indent=2))
        return 0

    print(f"cases: {args.cases}")
    print("\nPeak memory per GPU (GiB). Compared: allocator peak (what torch reports) vs measured.")
    header = f"{'case':48} {'ckpt':13} {'plan total':>10} {'plan alloc':>10} {'measured':>9} {'error':>7}"
    print(header)
    print("-" * len(header))
    for r in rows:
        if r["measured_peak_gib"] is None:
            continue
        print(
            f"{r['id']:48} {r['checkpointing']:13} {r['peak_gib']:10.1f} {r['allocator_peak_gib']:10.1f} "
            f"{r['measured_peak_gib']:9.1f} {pct(r.get('memory_error')):>7}"
        )
    errors = [abs(r["memory_error"]) for r in rows if "memory_error" in r]
    print(
        f"memory: {len(errors)} cases, max |error| {max(errors):.1%}, "
        f"{sum(e <= 0.10 for e in errors)}/{len(errors)} within 10%"
    )

    print("\nThroughput (tokens/s per GPU).")
    header = f"{'case':48} {'precision':20} {'plan':>8} {'measured':>9} {'error':>7}  fitted on"
    print(header)
    print("-" * len(header))
    for r in rows:
        if r["measured_tokens_per_sec_per_gpu"] is None:
            continue
        print(
            f"{r['id']:48} {r['precision']:20} {r['tokens_per_sec_per_gpu']:8,.0f} "
            f"{r['measured_tokens_per_sec_per_gpu']:9,.0f} {pct(r.get('throughput_error')):>7}  "
            f"{r['fitted_on'] or '(not fitted: out of sample)'}"
        )

    print(
        "\nAWS guide 1B MXFP8 anchors (trainer, loss and tokens/s scope unpublished; context only, "
        "not scored)."
    )
    header = f"{'anchor':34} {'plan GB':>8} {'guide GB':>9} {'plan tok/s':>11} {'guide tok/s':>12}"
    print(header)
    print("-" * len(header))
    for g in guide_rows():
        print(
            f"{g['id']:34} {g['peak_gb']:8.1f} {g['memory_gb']:9.1f} {g['predicted_tokens_per_s']:11,.0f} "
            f"{g['tokens_per_s']:12,}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
