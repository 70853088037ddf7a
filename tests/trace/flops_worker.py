"""One tiny recipe traced with and without counting FLOPs, for tests/trace/test_trace_flops.py.

python flops_worker.py RECIPE.yaml '["k=v", ...]'   -> {"counted": report, "uncounted": report}
"""

from __future__ import annotations

import json
import sys

from trainer.config import load_recipe
from trainer.trace.step import trace

if __name__ == "__main__":
    path, overrides = sys.argv[1], tuple(json.loads(sys.argv[2]))
    recipe, source = load_recipe(path, overrides)
    out = {}
    for name, count in (("counted", True), ("uncounted", False)):
        report = trace(recipe, source, world=2, progress=lambda line: None, count_flops=count)
        out[name] = {"peak_bytes": report.peak_bytes, "flops": report.flops}
    print(json.dumps(out))
