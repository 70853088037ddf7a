"""The tuning run end to end on this machine: 3 candidates of the tiny recipe, the choice, and the plan
checked against a fresh job of the chosen layout.

    .venv/bin/python bench/tune_local.py [--candidates 3] [--recipe tests/trainer/fixtures/tiny.yaml]
        [--fresh-jobs N]

1. `trainstack tune RECIPE --local --json --fresh` with a throwaway tuning store: on the emulator's
   training jobs when one runs here (`trainstack emulator start`), else as local trainer processes (the
   output's first line says which). Prints its wall time (the issue asks at most 5 minutes on 2 cores).
2. Whether the chosen candidate is the fastest measured or within its spread of it.
3. `trainstack plan RECIPE --set <chosen> --local --json`: the step time the plan now predicts for the
   chosen layout on this hardware (its own measurement), against the step time a fresh job of that
   layout measures (one more short job, the same runner): the ratio and whether it is within 10%; and
   the refit's prediction for it from the other candidates' measurements alone (leave-one-out).

Timing on a shared machine is noisy: the script prints each job's spread beside its median.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CLI = [sys.executable, "-m", "trainstack.cli.main"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", type=int, default=3)
    parser.add_argument("--recipe", default="tests/trainer/fixtures/tiny.yaml")
    parser.add_argument(
        "--fresh-jobs", type=int, default=1,
        help="fresh jobs of the chosen layout to run after tuning (more: their own spread, job to job)",
    )  # fmt: skip
    args = parser.parse_args()
    store = Path(tempfile.mkdtemp(prefix="tune-bench-")) / "tuning.json"
    env = {**os.environ, "TRAINSTACK_TUNING_STORE": str(store)}

    started = time.monotonic()
    tuned = subprocess.run(
        [*CLI, "tune", args.recipe, "--local", "--json", "--fresh", "--candidates", str(args.candidates)],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    wall = time.monotonic() - started
    print(tuned.stderr.splitlines()[0] if tuned.stderr else "(no progress lines)")
    if tuned.returncode != 0:
        print(tuned.stderr)
        sys.exit(f"tune exited {tuned.returncode}")
    result = json.loads(tuned.stdout)
    print(f"tune: {len(result['candidates'])} candidates in {wall:.0f} s wall (limit 300 s): "
          f"{'OK' if wall <= 300 else 'OVER'}")  # fmt: skip
    ok = [c for c in result["candidates"] if c["status"] == "ok"]
    for c in result["candidates"]:
        m = c["measured"]
        figures = f"step {m['step_time_s']:.4f} s +- {m['step_time_spread_s']:.4f}" if m else c.get("why", "")
        print(f"  {c['name']} {c['status']:>7}  {' '.join(c['overrides']) or '(recipe)'}: {figures}")
    chosen = next(c for c in ok if c["name"] == result["chosen"]["name"])
    fastest = min(ok, key=lambda c: c["measured"]["step_time_s"])
    reach = fastest["measured"]["step_time_s"] + fastest["measured"]["step_time_spread_s"]
    within = chosen["measured"]["step_time_s"] - chosen["measured"]["step_time_spread_s"] <= reach
    print(f"chosen {chosen['name']}: {result['chosen']['why']}")
    answer = "yes" if chosen is fastest or within else "NO"
    print(f"chosen is the fastest ({fastest['name']}) or within its spread: {answer}")

    sets = [a for o in chosen["overrides"] for a in ("--set", o)]
    planned = subprocess.run(
        [*CLI, "plan", args.recipe, *sets, "--local", "--json", "-q", "--ranks", str(_ranks(tuned.stderr))],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    measured = json.loads(planned.stdout)["measured"]
    print(f"plan --local: step {measured['step_time_s']:.4f} s ({measured['source']})")

    loo = _leave_one_out(args.recipe, chosen["overrides"], store, _ranks(tuned.stderr))
    if loo is not None:
        own = chosen["measured"]["step_time_s"]
        error = loo.step_time_s / own - 1
        print(f"refit without the chosen layout's own measurement: step {loo.step_time_s:.4f} s against "
              f"its measured {own:.4f} s: {error:+.1%} ({loo.source})")  # fmt: skip

    fresh_steps = []
    for n in range(args.fresh_jobs):
        fresh = _fresh_job(args.recipe, chosen["overrides"], env)
        fresh_steps.append(fresh.step_time_s)
        ratio = measured["step_time_s"] / fresh.step_time_s
        verdict = "within" if abs(ratio - 1) <= 0.10 else "NOT within"
        print(f"fresh job {n + 1} of the chosen layout: step {fresh.step_time_s:.4f} s "
              f"+- {fresh.step_time_spread:.4f}; plan / fresh = {ratio:.3f}: {verdict} 10%")  # fmt: skip
    if len(fresh_steps) > 1:
        import statistics

        middle, low, high = statistics.median(fresh_steps), min(fresh_steps), max(fresh_steps)
        print(f"fresh jobs: median step {middle:.4f} s, from {low:.4f} to {high:.4f} "
              f"({(high - low) / middle:.0%} of the median, job to job); "
              f"plan / median = {measured['step_time_s'] / middle:.3f}")  # fmt: skip


def _leave_one_out(recipe_path: str, overrides: list[str], store: Path, ranks: int):
    """The refit's prediction for the chosen layout from the other candidates' measurements only."""
    from trainstack.recipes.loader import resolve
    from trainstack.tuning.candidates import apply
    from trainstack.tuning.local import local_hardware
    from trainstack.tuning.store import Store, refit

    chosen = apply(resolve(recipe_path).recipe, overrides)
    return refit(chosen, local_hardware(ranks), Store(store), leave_out_own=True)


def _ranks(progress: str) -> int:
    import re

    match = re.search(r"\(cpu, (\d+) ranks", progress)
    return int(match.group(1)) if match else 1


def _fresh_job(recipe_path: str, overrides: list[str], env: dict):
    """One more short job of the chosen layout with the tuning run's own settings and runner."""
    from trainstack.api.runs_api import LOCAL_WINDOW
    from trainstack.aws.tuning_driver import SageMakerJobs, emulator_aws
    from trainstack.recipes.loader import resolve
    from trainstack.tuning.candidates import Candidate, apply, plan_layout
    from trainstack.tuning.engine import job_recipe, step_plan
    from trainstack.tuning.local import run_job
    from trainstack.tuning.measure import measure

    recipe = resolve(recipe_path).recipe
    aws = emulator_aws()
    jobs = SageMakerJobs(recipe, None, lambda line: None, aws) if aws is not None else None
    ranks = jobs.ranks if jobs else 1
    planned, fits = plan_layout(apply(recipe, overrides), ranks)
    candidate = Candidate("fresh", tuple(overrides), "the chosen layout", planned, fits)
    steps = step_plan(recipe, candidate, compiled=False, window=LOCAL_WINDOW)
    if jobs is not None:
        tuning_id = f"fresh-{int(time.time()) % 100000}"
        name = jobs.names(tuning_id, 1)[0]
        lines = jobs.run(name, tuning_id, candidate, job_recipe(recipe, candidate, steps), steps).lines
    else:
        work = Path(tempfile.mkdtemp())
        lines = run_job("fresh", job_recipe(recipe, candidate, steps), steps.max_steps, 1, work).lines
    return measure(lines, warmup=steps.warmup, final_step=steps.max_steps, clock="cpu")


if __name__ == "__main__":
    main()
