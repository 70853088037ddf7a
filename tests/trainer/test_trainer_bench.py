"""bench/trainer_gpu.py runs its real code path on CPU in --smoke mode (the GPU run needs a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from trainer_helpers import REPO, trainer_env

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("trainer")]


def test_smoke_run_measures_bf16_and_reports_the_planner_peak(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "bench/trainer_gpu.py", "--smoke", "--json", str(out)],
        cwd=REPO,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    (bf16,) = report["results"]  # no Transformer Engine on CPU: FP8 recipes are skipped, and said so
    assert bf16["precision"] == "bf16" and bf16["tokens_per_sec_per_gpu"] > 0 and bf16["mfu"] > 0
    assert bf16["loss_last"] < bf16["loss_first"]
    assert bf16["planned_peak_gib"] > 0
    assert result.stdout.count("skipped (needs Transformer Engine)") == 4
    assert "tokens/s/GPU" in result.stdout
