"""`trainstack tune --local` end to end, as a user runs it: real trainer jobs (local CPU processes: no
emulator runs in the test's directory), the choice, the store, and what `plan`, `show` and
`launch --tuned` then make of it. Two candidates keep it to about a minute on 2 cores;
bench/tune_local.py runs three on the emulator (docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "tests" / "trainer" / "fixtures" / "tiny.yaml")


def cli(*args: str, cwd: Path, store: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "TRAINSTACK_", "MLFLOW_"))}
    env.update(TRAINSTACK_TUNING_STORE=str(store), OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run(
        [sys.executable, "-m", "trainstack.cli.main", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
@pytest.mark.xdist_group("tune-local")
def test_tune_local_chooses_by_measurement_and_hands_the_layout_to_plan_show_and_launch(tmp_path):
    store = tmp_path / "tuning.json"
    done = cli("tune", TINY, "--local", "--candidates", "2", "--json", cwd=tmp_path, store=store)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "no local emulator is running" in done.stderr
    result = json.loads(done.stdout)
    # The shape.
    assert set(result) == {"candidates", "chosen"}
    assert len(result["candidates"]) == 2 and result["candidates"][0]["overrides"] == []
    for c in result["candidates"]:
        assert c["status"] == "ok", c
        assert {"tokens_per_s", "tokens_per_s_spread", "peak_mem_gib", "step_time_s"} <= set(c["measured"])
        assert c["measured"]["window_steps"] >= 8 and c["measured"]["checkpoint_save_s"] is not None
        assert c["measured"]["clock"] == "cpu"  # shared cores: the rank's CPU time, not its wall time
    chosen = next(c for c in result["candidates"] if c["overrides"] == result["chosen"]["overrides"])
    fastest = min(result["candidates"], key=lambda c: c["measured"]["step_time_s"])
    reach = fastest["measured"]["step_time_s"] + fastest["measured"]["step_time_spread_s"]
    assert (
        chosen is fastest
        or chosen["measured"]["step_time_s"] - chosen["measured"]["step_time_spread_s"] <= reach
    )
    assert result["chosen"]["why"]

    # plan --local: the chosen layout at its measured step time, said so; the GPU plan unchanged.
    sets = [a for o in result["chosen"]["overrides"] for a in ("--set", o)]
    planned = cli("plan", TINY, *sets, "--local", "--json", "-q", cwd=tmp_path, store=store)
    planned_json = json.loads(planned.stdout)
    measured = planned_json["measured"]
    assert planned_json["tuning_run"]["candidates"] == 3 and planned_json["tuning_run"]["usd"] > 0
    assert measured["exact"] and measured["step_time_s"] == pytest.approx(chosen["measured"]["step_time_s"])
    assert measured["source"].startswith("measured by tuning run tune-") and measured["clock"] == "cpu"
    gpu = cli("plan", TINY, *sets, "--json", "-q", cwd=tmp_path, store=store)
    assert json.loads(gpu.stdout)["measured"] is None  # a CPU measurement never changes a GPU plan

    shown = cli("show", TINY, "-q", cwd=tmp_path, store=store)
    assert "chosen by tuning run tune-" in shown.stdout and "(local, cpu)" in shown.stdout

    # A second tune reuses the result (no job runs), unless --fresh.
    started = time.monotonic()
    again = cli("tune", TINY, "--local", "--candidates", "2", "--json", cwd=tmp_path, store=store)
    assert again.returncode == 0 and "reusing tuning run" in again.stderr
    assert json.loads(again.stdout) == result and time.monotonic() - started < 60

    # launch --tuned: the chosen overrides in the first job's request (dry run: no AWS needed).
    launched = cli("launch", TINY, "--tuned", "--local", "--dry-run", "--json", cwd=tmp_path, store=store)
    assert launched.returncode == 0, launched.stderr
    hyper = json.loads(launched.stdout)["request"]["HyperParameters"]
    for override in result["chosen"]["overrides"]:
        key, value = override.split("=")
        assert hyper[key].strip('"') == value
    untuned = cli("launch", TINY, "--tuned", "--dry-run", cwd=tmp_path, store=store)
    assert untuned.returncode == 2 and "--tuned: no tuning result for tiny-cpu on H100" in untuned.stderr


def test_tune_refuses_bad_input_in_one_line(tmp_path):
    store = tmp_path / "tuning.json"
    for args, expected in (
        (("--candidates", "0"), "--candidates"),
        (("--budget-usd", "0.0001"), "--budget-usd: 0.00 USD does not cover even the recipe's own layout"),
    ):
        done = cli("tune", TINY, "--local", *args, cwd=tmp_path, store=store)
        assert done.returncode == 2, done.stderr
        lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and expected in lines[0], done.stderr
        assert "Traceback" not in done.stderr
    assert not store.exists()  # nothing half-written
    store.write_text("{damaged")
    done = cli("plan", TINY, "--local", "-q", cwd=tmp_path, store=store)
    assert done.returncode == 2 and "not a tuning store" in done.stderr and "Traceback" not in done.stderr
