"""Planner speed: time to plan every base recipe (the CLI's `recipes` and the GitOps diff do this).

    .venv/bin/python bench/planner_speed.py [--repeat N]

Prints, per pass over all base recipes: wall and CPU time for resolve (YAML + validation) and for
plan() (memory, throughput with its range, cost, the run plan and the joint recommendation search),
best and median of N passes; then `plan --compare` (a search per catalogued instance type) per recipe.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainstack.planner import plan  # noqa: E402
from trainstack.planner.compare import compare  # noqa: E402
from trainstack.recipes.loader import base_recipe_names, resolve  # noqa: E402


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    names = base_recipe_names()
    resolve_wall, resolve_cpu, plan_wall, plan_cpu = [], [], [], []
    per_recipe: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.repeat):
        recipes, wall, cpu = timed(lambda: [resolve(n).recipe for n in names])
        resolve_wall.append(wall)
        resolve_cpu.append(cpu)
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        for recipe in recipes:
            t0 = time.perf_counter()
            plan(recipe)
            per_recipe[recipe.name].append(time.perf_counter() - t0)
        plan_wall.append(time.perf_counter() - start_wall)
        plan_cpu.append(time.process_time() - start_cpu)

    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    print(f"{len(names)} base recipes, {args.repeat} passes\n")
    print(f"{'per pass over all recipes':32} {'best ms':>9} {'median ms':>10}")
    for label, values in (
        ("resolve (YAML + validation) wall", resolve_wall),
        ("resolve CPU", resolve_cpu),
        ("plan wall", plan_wall),
        ("plan CPU", plan_cpu),
    ):
        print(f"{label:32} {min(values) * 1e3:9.2f} {statistics.median(values) * 1e3:10.2f}")
    total = [a + b for a, b in zip(resolve_cpu, plan_cpu, strict=True)]
    print(f"{'resolve + plan CPU':32} {min(total) * 1e3:9.2f} {statistics.median(total) * 1e3:10.2f}")
    compare_ms: dict[str, float] = {}
    for recipe in recipes:
        times = []
        for _ in range(max(1, args.repeat // 4)):
            t0 = time.perf_counter()
            compare(recipe)
            times.append(time.perf_counter() - t0)
        compare_ms[recipe.name] = statistics.median(times) * 1e3
    print(f"\n{'recipe':16} {'plan median ms':>15} {'compare median ms':>18}")
    for name, values in per_recipe.items():
        print(f"{name:16} {statistics.median(values) * 1e3:15.2f} {compare_ms[name]:18.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
