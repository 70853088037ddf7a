"""`trainstack plan RECIPE --trace`: the trainer's step traced in a subprocess, judged as traced +
modelled, cached by layout, torch and trainer code (a second run starts no trace), and the refusal
`launch` makes of a recipe whose cached trace does not fit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "tests" / "trainer" / "fixtures" / "tiny.yaml")
CATEGORIES = {"parameters", "gradients", "optimizer", "activations", "temporary", "communication"}


def cli(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "TRAINSTACK_", "MLFLOW_"))}
    env.update(TRAINSTACK_TRACE_CACHE=str(cache), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "trainstack.cli.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("traces")


@pytest.fixture(scope="module")
def first(cache) -> tuple[dict, float]:
    started = time.monotonic()
    done = cli("plan", TINY, "--trace", "--json", "-q", cache=cache)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trace: tiny-cpu" in done.stderr  # progress while it runs
    return json.loads(done.stdout), time.monotonic() - started


def test_plan_trace_json_adds_the_traced_memory_by_category(first):
    traced = first[0]["memory"]["traced"]
    assert set(traced["by_category_gib"]) == CATEGORIES
    assert sum(traced["by_category_gib"].values()) == pytest.approx(traced["peak_gib"], abs=0.01)
    assert traced["peak_gib"] > 0 and traced["seconds"] > 0 and not traced["cached"]
    assert traced["planned_same_scope_gib"] > 0
    assert traced["total_gib"] == pytest.approx(traced["peak_gib"] + traced["modelled_gib"], abs=0.01)
    assert set(traced["modelled"]) == {"allocator fragmentation", "CUDA context", "NCCL buffers"}
    assert traced["peak_at"]["phase"] in {"forward", "backward", "optimizer step"}
    assert traced["counted_flops"]["model_per_token"] > 0


def test_a_second_plan_trace_reads_the_cache(first, cache):
    started = time.monotonic()
    done = cli("plan", TINY, "--trace", "--json", "-q", cache=cache)
    assert done.returncode == 0, done.stderr[-3000:]
    traced = json.loads(done.stdout)["memory"]["traced"]
    assert traced["cached"] and traced["peak_gib"] == first[0]["memory"]["traced"]["peak_gib"]
    assert "trace: tiny-cpu" not in done.stderr  # no trace ran
    assert time.monotonic() - started < first[1]


def test_plain_output_ends_with_traced_plus_modelled_and_the_verdict(first, cache):
    done = cli("plan", TINY, "--trace", "-q", cache=cache)
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("traced ") and " GiB + modelled " in last and last.endswith(": fits")


def test_launch_refuses_a_recipe_whose_cached_trace_does_not_fit(first, cache, monkeypatch):
    from trainstack.recipes.loader import resolve
    from trainstack.tuning import trace

    monkeypatch.setenv("TRAINSTACK_TRACE_CACHE", str(cache))
    recipe = resolve(TINY).recipe
    assert trace.trace_refusal(recipe) is None  # traced, and it fits
    # The same cached report with a peak past the GPU: what a layout too large for it would leave.
    (path,) = cache.glob("*.json")
    report = json.loads(path.read_text())
    path.write_text(json.dumps({**report, "peak_bytes": 200 * 2**30}))
    refusal = trace.trace_refusal(recipe)
    assert refusal is not None and "does not fit by its trace" in refusal and "of 80" in refusal
    assert trace.trace_refusal(resolve(TINY, overrides=["training.micro_batch=1"]).recipe) is None  # untraced


def test_a_cached_trace_whose_gemm_flops_differ_re_times_the_plans_time_and_cost(first, cache):
    """The counted FLOPs are used, not only printed: a cached report whose GEMM FLOPs are 20% above the
    time model's re-times the plan (step time, tokens/s, hours, cost) that `plan --trace` prints."""
    plain = cli("plan", TINY, "--json", "-q", cache=cache)
    assert plain.returncode in (0, 1), plain.stderr[-3000:]  # 1: the refusal test's oversized report
    (path,) = cache.glob("*.json")
    original = path.read_text()
    report = json.loads(original)
    flops = report["flops"]
    flops["model"] += round(0.2 * (flops["model"] - flops["attention"]))
    path.write_text(json.dumps(report))
    try:
        done = cli("plan", TINY, "--trace", "--json", "-q", cache=cache)
    finally:
        path.write_text(original)
    assert done.returncode in (0, 1), done.stderr[-3000:]
    before, after = json.loads(plain.stdout), json.loads(done.stdout)
    counted = after["memory"]["traced"]["counted_flops"]
    assert counted["by_kind"]["GEMMs"]["used"] == "counted" and counted["time"] == "counted"
    assert after["throughput"]["step_time_s"] == pytest.approx(counted["step_time_s"])
    assert after["throughput"]["step_time_s"] > before["throughput"]["step_time_s"]
    assert after["throughput"]["tokens_per_sec_per_gpu"] < before["throughput"]["tokens_per_sec_per_gpu"]
    assert after["cost"]["total_usd"] > before["cost"]["total_usd"]
