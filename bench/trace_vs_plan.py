"""The planner against the trace: the planner's same-scope memory (what a trace can see: its peak less
fragmentation, CUDA context and NCCL buffers) beside the traced peak of the trainer's own step
(trainer.trace), for every base recipe and a grid of the layouts the recommender and the tuning run
consider. Goal (issue 39): every row within 5%.

    .venv/bin/python bench/trace_vs_plan.py                 # every base recipe x the grid, full depth
    .venv/bin/python bench/trace_vs_plan.py --layers 4      # the same shapes with 4 blocks (fast)
    .venv/bin/python bench/trace_vs_plan.py --recipes 8b-fp8 1b-bf16 --json

--layers N keeps every width, the vocabulary, the sequence and the layout and only shortens the stack:
both sides are then the N-block model's (every term but the per-block ones is unchanged, and those
scale with N), so it checks the same arithmetic in a fraction of the time. Rows the trainer refuses
(a layout that does not divide) are left out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "training_image"))

from trainstack.errors import TrainstackError  # noqa: E402
from trainstack.planner import recipe_memory  # noqa: E402
from trainstack.planner.memory import GIB  # noqa: E402
from trainstack.planner.traced import same_scope_gib  # noqa: E402

BASE = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
# The layouts the recommender (trainstack.planner.search) and the tuning run (trainstack.tuning.candidates)
# move: micro-batch, checkpointing mode and frequency, the op-level policy, shard group / HSDP replicas, cp.
GRID = {
    "recipe": (),
    "micro_batch x2": ("training.micro_batch=*2",),
    "micro_batch 1": ("training.micro_batch=1",),
    "ckpt none": ("activation_checkpointing.mode=none",),
    "ckpt full": ("activation_checkpointing.mode=full",),
    "ckpt 1 in 2": ("activation_checkpointing.mode=selective", "activation_checkpointing.every=2"),
    "ckpt op": (
        "activation_checkpointing.mode=selective",
        "activation_checkpointing.policy=op",
        "precision.dtype=bf16",
        "precision.fp8_recipe=null",
    ),
    "shard 4 (HSDP)": ("parallelism.shard_group=4",),
    "cp 2": ("parallelism.cp=2", "parallelism.shard_group=*/2"),
}
TOLERANCE = 0.05


def overrides(recipe, changes: tuple[str, ...]) -> tuple[str, ...]:
    out = []
    for change in changes:
        key, value = change.split("=", 1)
        if value.startswith("*/"):  # the recipe's value divided (shard group x cp stays the node's)
            value = str(max(1, recipe.parallelism.shard_group // int(value[2:])))
        elif value.startswith("*"):
            value = str(recipe.training.micro_batch * int(value[1:]))
        out.append(f"{key}={value}")
    return tuple(out)


def row(name: str, label: str, changes: tuple[str, ...], layers: int | None) -> dict | None:
    from trainer.config import load_recipe
    from trainer.trace.step import trace

    path = str(ROOT / "recipes" / f"{name}.yaml")
    base, _ = load_recipe(path, ())
    depth = (f"model.layers={layers}",) if layers else ()
    try:
        recipe, source = load_recipe(path, (*depth, *overrides(base, changes)))
        planned = same_scope_gib(recipe_memory(recipe), recipe)
        started = time.monotonic()
        report = trace(recipe, source, progress=lambda line: None, count_flops=False)
    except TrainstackError as error:
        print(f"  {name:16s} {label:16s} skipped: {error}", file=sys.stderr)
        return None
    traced = report.peak_bytes / GIB
    return {
        "recipe": name,
        "layout": label,
        "micro_batch": recipe.training.micro_batch,
        "checkpointing": recipe.activation_checkpointing.mode
        + (
            f"/{recipe.activation_checkpointing.policy}"
            if recipe.activation_checkpointing.mode == "selective"
            else ""
        ),
        "shard": recipe.parallelism.shard_group,
        "cp": recipe.parallelism.cp,
        "seq_len": recipe.training.seq_len,
        "traced_gib": round(traced, 2),
        "planned_gib": round(planned, 2),
        "error": round(planned / traced - 1, 4),
        "peak_at": report.peak_at,
        "by_category_gib": {k: round(v / GIB, 2) for k, v in report.by_category_bytes.items()},
        "seconds": round(time.monotonic() - started, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="*", default=BASE)
    parser.add_argument("--layouts", nargs="*", default=list(GRID))
    parser.add_argument("--layers", type=int, default=None, help="blocks per model (default: the recipe's)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for name in args.recipes:
        for label in args.layouts:
            result = row(name, label, GRID[label], args.layers)
            if result is None:
                continue
            rows.append(result)
            if not args.json:
                flag = "" if abs(result["error"]) <= TOLERANCE else "  <-- over 5%"
                print(
                    f"{name:16s} {label:16s} mb {result['micro_batch']:2d} {result['checkpointing']:14s} "
                    f"shard {result['shard']:2d} cp {result['cp']} seq {result['seq_len']:6d}  traced "
                    f"{result['traced_gib']:7.2f}  planned {result['planned_gib']:7.2f}  "
                    f"{result['error']:+6.1%}  ({result['seconds']:.0f} s){flag}",
                    flush=True,
                )
    worst = max((abs(r["error"]) for r in rows), default=0.0)
    within = sum(abs(r["error"]) <= TOLERANCE for r in rows)
    if args.json:
        print(json.dumps({"rows": rows, "worst": worst, "within": within}, indent=2))
    else:
        print(f"{within} of {len(rows)} layouts within {TOLERANCE:.0%}; worst {worst:.1%}")
    return 0 if within == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
