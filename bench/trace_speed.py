"""How long the trace of the trainer's step takes, and how much memory the tracing process needs, at
full size (issue 39's goal on a 2-core machine: 8B <= 2 min, 64B <= 6 min, RSS <= 2 GB).

    .venv/bin/python bench/trace_speed.py                    # 8b-fp8 and 64b-fp8
    .venv/bin/python bench/trace_speed.py 1b-bf16 30b-fp8

Each recipe's trace runs as `trainstack plan --trace` runs it: `python -m trainer.trace` in a fresh
process (its import time counted), FLOPs counted, no cache. Wall and CPU seconds are the child's;
max RSS is the child's peak resident set (getrusage RUSAGE_CHILDREN, the largest child so far, so
recipes are run smallest first). The machine's load average is printed beside each: the 2 cores are
shared, and wall time stretches with the load while CPU time does not.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
GOALS_S = {"8b-fp8": 120, "64b-fp8": 360}
RSS_GOAL_MIB = 2048


def main() -> int:
    from trainstack.planner import recipe_memory
    from trainstack.planner.memory import GIB
    from trainstack.planner.traced import same_scope_gib
    from trainstack.recipes.loader import resolve

    names = sys.argv[1:] or ["8b-fp8", "64b-fp8"]
    failed = False
    for name in names:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        load = os.getloadavg()[0]
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "report.json"
            started = time.monotonic()
            done = subprocess.run(
                [sys.executable, "-m", "trainer.trace", "--recipe", str(ROOT / "recipes" / f"{name}.yaml"),
                 "--out", str(out)],
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
            wall = time.monotonic() - started
            report = json.loads(out.read_text()) if done.returncode == 0 else None
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        rss_mib = after.ru_maxrss / 1024
        if report is None:
            print(f"{name}: the trace exited with status {done.returncode}")
            failed = True
            continue
        recipe = resolve(name).recipe
        planned = same_scope_gib(recipe_memory(recipe), recipe)
        traced = report["peak_bytes"] / GIB
        goal = GOALS_S.get(name)
        verdict = "" if goal is None else (" (goal met)" if wall <= goal else f" (goal {goal} s NOT met)")
        print(
            f"{name:14s} wall {wall:6.1f} s{verdict}, CPU {cpu:6.1f} s, max RSS {rss_mib:6.0f} MiB "
            f"(goal {RSS_GOAL_MIB}), load average {load:.1f} at start, {os.getloadavg()[0]:.1f} at end; "
            f"traced {traced:.1f} GiB, planned same-scope {planned:.1f} GiB ({planned / traced - 1:+.1%}); "
            f"peak in {report['peak_at'].get('phase')} of {report['peak_at'].get('module')}",
            flush=True,
        )
        failed |= rss_mib > RSS_GOAL_MIB
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
