"""The planner agrees with the trace: the planner's same-scope memory (its peak less what no trace can
see) within 5% of the traced peak of the trainer's own step, over a small grid of the layouts the
recommender and the tuning run move (micro-batch, checkpointing mode and frequency, the op-level
policy, HSDP, context parallelism), at reduced sizes so it runs in seconds. bench/trace_vs_plan.py runs
every base recipe and the full grid; docs/benchmarks.md has its table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainstack.planner import recipe_memory
from trainstack.planner.memory import GIB
from trainstack.planner.traced import same_scope_gib
from trainstack.recipes.loader import resolve

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "8b-fp8.yaml"
# An 8B-like shape, narrowed: widths in the 8B ratios, a real vocabulary, 2K tokens.
SMALL = (
    "model.layers=3",
    "model.hidden=512",
    "model.heads=8",
    "model.kv_heads=2",
    "model.ffn=1792",
    "model.vocab=32000",
    "training.seq_len=2048",
    "training.loss_chunk_tokens=1024",
)
GRID = {
    "micro-batch 2, none": ("training.micro_batch=2", "activation_checkpointing.mode=none"),
    "micro-batch 4, full": ("training.micro_batch=4", "activation_checkpointing.mode=full"),
    "1 in 2": ("activation_checkpointing.mode=selective", "activation_checkpointing.every=2"),
    "op policy": (
        "activation_checkpointing.mode=selective",
        "activation_checkpointing.policy=op",
        "precision.dtype=bf16",
        "precision.fp8_recipe=null",
    ),
    "HSDP 2 x 4": ("parallelism.shard_group=4",),
    "cp 2": ("parallelism.cp=2", "parallelism.shard_group=4"),
}
TOLERANCE = 0.05


@pytest.fixture(scope="module")
def traced() -> dict[str, dict]:
    layouts = [[*SMALL, *changes] for changes in GRID.values()]
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("grid_worker.py")), str(RECIPE), json.dumps(layouts)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(zip(GRID, json.loads(done.stdout.strip().splitlines()[-1]), strict=True))


@pytest.mark.parametrize("layout", list(GRID))
def test_the_planners_same_scope_memory_is_within_5_percent_of_the_trace(traced, layout):
    recipe = resolve(str(RECIPE), overrides=[*SMALL, *GRID[layout]]).recipe
    planned = same_scope_gib(recipe_memory(recipe), recipe)
    measured = traced[layout]["peak_bytes"] / GIB
    assert abs(planned / measured - 1) <= TOLERANCE, (layout, planned, measured, traced[layout]["peak_at"])
