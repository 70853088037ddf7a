"""Traces of several layouts of one recipe in one process, for tests/trace/test_trace_vs_plan.py.

python grid_worker.py RECIPE.yaml '[["k=v", ...], ...]'   -> one JSON list of {peak_bytes, ...}
"""

from __future__ import annotations

import json
import sys

from trainer.config import load_recipe
from trainer.trace.step import trace

if __name__ == "__main__":
    path, layouts = sys.argv[1], json.loads(sys.argv[2])
    reports = []
    for overrides in layouts:
        recipe, source = load_recipe(path, tuple(overrides))
        report = trace(recipe, source, progress=lambda line: None, count_flops=False)
        reports.append({"peak_bytes": report.peak_bytes, "peak_at": report.peak_at})
    print(json.dumps(reports))
