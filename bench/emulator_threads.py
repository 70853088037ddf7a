#!/usr/bin/env python3
"""Why the emulator gives each CPU rank CPUs / ranks threads (trainstack.emulator.jobs.threads_per_rank):
the same two-rank job at 1 and at 2 OMP threads per rank, side by side.

    .venv/bin/python bench/emulator_threads.py [--steps 12] [--repeats 2]

Runs the trainer as a local job's node runs it (torchrun, 2 CPU ranks, the tiny recipe
tests/trainer/fixtures/tiny.yaml, synthetic tokens), alternating OMP_NUM_THREADS=1 and 2 per rank, and
prints the median `step_time_s` (the trainer's own metric line, the first 3 steps left out) and the
ratio. On a machine with 2 cores, 2 threads a rank oversubscribe it (4 threads on 2 cores); on a
machine with many idle cores they would not. Figures go to docs/benchmarks.md ("Local emulator jobs").
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "trainer" / "fixtures" / "tiny.yaml"
WARMUP = 3


def step_times(threads: int, steps: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        env.pop("MLFLOW_TRACKING_URI", None)
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
             "trainer", "--recipe", str(TINY), "--device", "cpu", "--max-steps", str(steps),
             "--set", "training.log_every=1", "--set", "checkpointing.interval_steps=1000",
             "--checkpoint-dir", tmp],
            env=env, capture_output=True, text=True, timeout=1800,
        )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])
    found = [
        (int(m.group(1)), float(m.group(2)))
        for m in re.finditer(r"step=(\d+) .*?step_time_s=([0-9.]+)", done.stdout)
    ]
    return [t for step, t in found if step > WARMUP]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} (shared: varies)")
    times: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(args.repeats):
        for threads in (1, 2):
            times[threads] += step_times(threads, args.steps)
    for threads, found in times.items():
        print(f"{threads} thread(s) a rank: median step {statistics.median(found):.3f} s, {len(found)} steps")
    ratio = statistics.median(times[2]) / statistics.median(times[1])
    print(
        f"2 threads / 1 thread per rank, step time: {ratio:.2f}x; load average after {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
