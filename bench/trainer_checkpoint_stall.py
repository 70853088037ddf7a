"""How long a checkpoint save holds up the step loop: blocking save vs the async path the loop uses.

    python bench/trainer_checkpoint_stall.py                    # CPU, ~100M parameters, local disk
    python bench/trainer_checkpoint_stall.py --params 400e6     # larger; needs ~6 bytes x params x 3 RAM

A world of one (gloo), a stack of Linear layers with AdamW state (12 bytes per parameter saved: FP32
weights and both moments, as the recipes), saved through trainer.checkpoint.manager.CheckpointManager to a
local directory. For each mode it prints the seconds the training thread is held:

- blocking: `save(..., blocking=True)` (what the final save and a SIGTERM save cost);
- async: `save()` returning plus `wait_for_staging()` (the host copy, awaited before the next
  optimizer step), then how long the background write took after that.

On CUDA the staging copy runs on a side stream into cached pinned memory while the GPU computes; this
CPU figure is the copy itself (no overlap to win on a CPU-only host), so it bounds the stall from
above for a CPU-side copy. Record results in docs/benchmarks.md (## Trainer loop).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for path in (REPO, REPO / "training_image"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from trainer.checkpoint.manager import CheckpointManager, TrainerState  # noqa: E402


def build(params: float, width: int = 2048) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    layers = max(1, round(params / (width * width)))
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    model(torch.randn(4, width)).square().mean().backward()
    optimizer.step()  # creates both moments
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return model, optimizer, scheduler


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ckbench-") as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        model, optimizer, scheduler = build(args.params)
        n = sum(p.numel() for p in model.parameters())
        results = {"machine": platform.processor() or platform.machine(), "params": n, "gib": n * 12 / 2**30}
        for mode in ("blocking", "async"):
            asynchronous = mode == "async"
            manager = CheckpointManager(Path(tmp) / mode, keep=1, rank=0, world=1, asynchronous=asynchronous)
            held, background = [], []
            for step in range(1, args.repeats + 1):
                state = TrainerState(step, step, "bench", 1)
                started = time.perf_counter()
                manager.save(model, optimizer, scheduler, state, blocking=mode == "blocking")
                manager.wait_for_staging()
                held.append(time.perf_counter() - started)
                released = time.perf_counter()
                manager.wait()
                background.append(time.perf_counter() - released)
            manager.close()
            results[mode] = {"held_s": held, "background_s": background}
            print(
                f"{mode:8s} {n / 1e6:.0f}M params ({results['gib']:.2f} GiB saved): training thread held "
                f"{min(held):.2f}-{max(held):.2f} s; written in the background for a further "
                f"{min(background):.2f}-{max(background):.2f} s"
            )
        dist.destroy_process_group()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
