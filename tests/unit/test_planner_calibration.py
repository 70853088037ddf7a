"""Calibration you can trust: the constants on record are what the fit gives, every fitted constant is
named with a prior, the bench maps each published case faithfully, Megatron stays an upper bound."""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from trainstack.planner import CALIBRATION, LOO_LOG_ERROR, ActivationPolicy, Calibration
from trainstack.planner import calibration as calibration_module

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("planner_accuracy", ROOT / "bench" / "planner_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["planner_accuracy"] = module
    spec.loader.exec_module(module)
    return module


def test_every_fitted_constant_is_a_named_field_with_a_prior():
    names = {f.name for f in fields(Calibration)}
    assert set(calibration_module.FITTED) <= names
    for name, (mean, sd) in calibration_module.PRIORS.items():
        assert mean > 0 and sd > 0, name
    assert set(calibration_module.FIT) == set(calibration_module.FITTED)


def test_the_constants_on_record_are_what_the_fit_gives(bench):
    cases = bench.fit_cases(bench.load_cases())
    assert len(cases) >= 12
    fitted = bench.fit(cases)
    for name in calibration_module.FITTED:
        assert getattr(CALIBRATION, name) == pytest.approx(getattr(fitted, name), rel=1e-3), name


@pytest.mark.slow
def test_the_recorded_range_is_the_leave_one_out_error(bench):
    cases = bench.fit_cases(bench.load_cases())
    loo = bench.leave_one_out(cases, CALIBRATION)
    assert (min(loo.values()), max(loo.values())) == pytest.approx(LOO_LOG_ERROR, abs=1e-3)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("full", ActivationPolicy.full()),
        ("none", ActivationPolicy.none()),
        ("selective-op", ActivationPolicy.torchtitan_op_selective()),
    ],
)
def test_the_bench_maps_checkpointing_as_published(bench, mode, expected):
    policy = bench.policy_of({"id": "x", "activation_checkpointing": mode})
    assert policy == expected
    if mode == "full":
        assert policy.checkpointed_fraction == 1.0  # was planned as no checkpointing before


def test_every_shared_case_is_in_the_benchs_copy(bench):
    shared = ROOT.parent / "shared" / "calibration" / "published.yaml"
    if not shared.is_file():
        pytest.skip("../shared/calibration/published.yaml is not in this checkout")
    ids = {c["id"] for c in bench.load_cases()}  # load_cases exits if a shared case differs
    import yaml

    assert {c["id"] for c in yaml.safe_load(shared.read_text())["cases"]} <= ids


def test_the_fit_is_close_on_every_case_and_megatron_is_never_exceeded(bench):
    for row in bench.rows(bench.load_cases(), CALIBRATION, None):
        if row["role"] == "fit":
            assert abs(row["throughput_error"]) < math.exp(max(abs(v) for v in LOO_LOG_ERROR)) - 1, row["id"]
        elif row["role"] == "upper-bound":
            assert row["planned_tokens_per_sec_per_gpu"] <= row["measured_tokens_per_sec_per_gpu"], row["id"]


def test_the_cases_recompute_as_torchtitans_blocks_do_not_as_ours(bench, monkeypatch):
    # torchtitan's op policy keeps its own set (trainer_memory.torchtitan_op_selective_*), and its full
    # checkpointing is torch's non-reentrant checkpoint (fc2 not replayed), not our TE block's.
    from trainstack.planner import trainer_memory

    throughput_module = importlib.import_module("trainstack.planner.throughput")

    seen = []
    real = throughput_module.recompute_share
    monkeypatch.setattr(
        throughput_module,
        "recompute_share",
        lambda m, policy, backend=None: seen.append((policy, backend)) or real(m, policy, backend),
    )
    cases = {c["id"]: c for c in bench.load_cases()}
    for case_id in (
        "torchtitan-llama3-8b-h100-fsdp-bf16",
        "torchtitan-llama3-8b-h100-fsdp-float8-compile-32k-full-ckpt",
    ):
        seen.clear()
        bench.predict_tps(cases[case_id], CALIBRATION)
        assert seen and all(backend == "pytorch" for _, backend in seen), case_id
    assert {policy.torchtitan for policy, _ in seen} == {False}  # the full case
    op = ActivationPolicy.torchtitan_op_selective()
    m = bench.LLAMA_1B
    assert throughput_module.recompute_share(m, op) == trainer_memory.torchtitan_op_selective_recompute_share(
        m
    )
