"""The sanity bound and the ranges: no plan is busier than the best published B200 run of its precision,
and every tokens/s, hours and cost figure carries its [low, high]."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from trainstack.cli.commands.plan_options import duration_range, rate, usd_range
from trainstack.cli.main import app
from trainstack.planner import (
    LOO_LOG_ERROR,
    ActivationPolicy,
    bound_tflops,
    flops_per_token,
    plan,
    throughput,
)
from trainstack.recipes.hardware import INSTANCES
from trainstack.recipes.loader import resolve
from trainstack.recipes.schema import ModelShape

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]
BASE = [
    "1b-bf16",
    "3b-bf16",
    "7b-bf16",
    "8b-fp8",
    "14b-fp8",
    "30b-fp8",
    "64b-fp8",
    "8b-fp8-128k",
    "30b-fp8-128k",
    "64b-fp8-128k",
]
B200 = INSTANCES["ml.p6-b200.48xlarge"]


def test_the_bound_is_the_best_published_b200_run_of_each_precision():
    cases = {
        c["id"]: c
        for c in yaml.safe_load((ROOT / "bench" / "calibration_published.yaml").read_text())["cases"]
    }
    llama8b = ModelShape(**cases["megatron-llama3-8b-b200-bf16"]["model"])
    fpt = flops_per_token(llama8b, 8192)
    b200_runs = [c for c in cases.values() if c["gpu"] == "B200"]
    best = {
        "bf16": max(c["measured"]["tokens_per_sec_per_gpu"] for c in b200_runs if c["precision"] == "bf16"),
        "fp8": max(c["measured"]["tokens_per_sec_per_gpu"] for c in b200_runs if c["precision"] != "bf16"),
    }
    for dtype in ("bf16", "fp8"):
        assert bound_tflops(B200, dtype) == pytest.approx(best[dtype] * fpt / 1e12, rel=1e-3)
    # and docs/planner.md states both figures with their source
    doc = (ROOT / "docs" / "planner.md").read_text()
    assert "1,252" in doc and "1,773" in doc and "Megatron" in doc


@pytest.mark.parametrize("name", BASE)
def test_no_base_recipe_is_busier_than_the_best_published_run(name):
    t = plan(resolve(name).recipe).throughput
    assert t.achieved_tflops_per_gpu <= t.bound_tflops * (1 + 1e-9)
    high = t.tokens_per_sec_per_gpu_range[1]
    assert high * (t.flops_per_token + t.recompute_flops_per_token) / 1e12 <= t.bound_tflops * (1 + 1e-9)


SWEEP_MODELS = {
    "1b": ModelShape(
        layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256, tied_embeddings=True
    ),
    "8b": ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256),
    "64b": ModelShape(layers=72, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256),
}


@pytest.mark.parametrize("instance_type", sorted(INSTANCES))
def test_a_sweep_of_layouts_never_exceeds_the_bound(instance_type):
    instance = INSTANCES[instance_type]
    checked = 0
    for (name, model), mb, policy, (dtype, fp8), seq in itertools.product(
        SWEEP_MODELS.items(),
        (1, 4, 16),
        (ActivationPolicy.none(), ActivationPolicy.op_selective(), ActivationPolicy.full()),
        (("bf16", None), ("fp8", "current"), ("fp8", "mxfp8")),
        (2048, 8192),
    ):
        if fp8 == "mxfp8" and not instance.gpu.supports_mxfp8:
            continue
        t = throughput(
            model, instance, seq_len=seq, micro_batch=mb, global_batch=mb * 64, world_size=64,
            shard_group=8, dtype=dtype, fp8_recipe=fp8, policy=policy,
        )  # fmt: skip
        assert t.achieved_tflops_per_gpu <= t.bound_tflops * (1 + 1e-9), (name, mb, policy, dtype, seq)
        checked += 1
    assert checked >= 100


@pytest.mark.parametrize("name", BASE)
def test_every_tokens_hours_and_cost_figure_has_a_range_around_it(name):
    p = plan(resolve(name).recipe)
    low, high = p.throughput.tokens_per_sec_per_gpu_range
    assert low < p.throughput.tokens_per_sec_per_gpu <= high
    fast, slow = p.cost.hours_range
    assert fast <= p.cost.hours < slow
    # training hours scale inversely with tokens/s; the overheads (start-ups, restores, failures) do not
    assert slow - p.run.overhead_hours == pytest.approx(
        p.run.hours * p.throughput.tokens_per_sec_per_gpu / low
    )
    low_storage, high_storage = p.cost.storage_usd_range  # the run's checkpoints in S3, with their range
    assert low_storage < p.cost.storage_usd < high_storage
    assert p.cost.total_usd_range == pytest.approx(
        (fast * p.cost.usd_per_hour + low_storage, slow * p.cost.usd_per_hour + high_storage)
    )


def test_where_the_published_regimes_agree_the_range_is_the_leave_one_out_error():
    # H200 (ml.p5en): its published runs were at rated power, so only the fit's own error remains
    p = plan(
        resolve(
            "8b-fp8", overrides=["compute.instance_type=ml.p5en.48xlarge", "precision.fp8_recipe=current"]
        ).recipe
    )
    t = p.throughput
    low, high = LOO_LOG_ERROR
    assert t.tokens_per_sec_per_gpu_range[0] == pytest.approx(t.tokens_per_sec_per_gpu * math.exp(low))
    bound_tps = t.bound_tflops * 1e12 / (t.flops_per_token + t.recompute_flops_per_token)
    assert t.tokens_per_sec_per_gpu_range[1] == pytest.approx(
        min(t.tokens_per_sec_per_gpu * math.exp(high), bound_tps)
    )
    # a B200 plan is bracketed by torchao's power-limited B200s below and rated power above: wider
    b200 = plan(resolve("8b-fp8").recipe).throughput
    width = lambda r: r[1] / r[0]  # noqa: E731
    assert width(b200.tokens_per_sec_per_gpu_range) > width(t.tokens_per_sec_per_gpu_range) * 1.5


def test_json_carries_the_ranges_as_low_high_lists():
    result = CliRunner().invoke(app, ["plan", "8b-fp8", "--json"])
    assert result.exit_code == 0, result.output
    d = json.loads(result.stdout)
    for section, key in (
        ("throughput", "tokens_per_sec_per_gpu_range"),
        ("cost", "hours_range"),
        ("cost", "total_usd_range"),
    ):
        low, high = d[section][key]
        assert low < high
    assert d["throughput"]["tokens_per_sec_per_gpu_range"][0] < d["throughput"]["tokens_per_sec_per_gpu"]
    assert d["cost"]["hours_range"][0] <= d["cost"]["hours"] <= d["cost"]["hours_range"][1]


def test_table_formats_of_a_figure_and_its_range():
    assert rate(29_000, 24_000, 31_000) == "29.0k (24-31k)"
    assert rate(1_568, 1_411, 1_764) == "1.6k (1.4-1.8k)"
    assert rate(950, 800, 999) == "950.0 (800-999)"
    assert duration_range(41.0, 36.0, 48.0) == "41.0 h (36.0-48.0 h)"
    assert duration_range(24 * 26.2, 24 * 23.4, 24 * 29.1) == "26.2 days (23.4-29.1 days)"
    assert usd_range(286_271, 257_000, 319_000) == "286,271 USD (257-319k)"


def test_the_plan_table_shows_each_figure_with_its_range():
    result = CliRunner().invoke(app, ["plan", "8b-fp8"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    t = plan(resolve("8b-fp8").recipe)
    low, high = t.throughput.tokens_per_sec_per_gpu_range
    assert rate(t.throughput.tokens_per_sec_per_gpu, low, high) in result.stdout
    assert usd_range(t.cost.total_usd, *t.cost.total_usd_range) in result.stdout
