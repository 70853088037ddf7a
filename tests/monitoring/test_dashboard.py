"""The dashboard graphs the trainer's metrics under the names the MetricDefinitions give them, per host
metrics by SEARCH over this recipe's jobs, and the plan as horizontal lines."""

from __future__ import annotations

import json
import re

import pytest
from monitoring_helpers import synth

from trainstack.protocol.metrics import metric_definitions
from trainstack.recipes.naming import job_name_prefix

pytestmark = pytest.mark.fast


def body_of(s) -> dict:
    (dashboard,) = s.resources("AWS::CloudWatch::Dashboard").values()
    raw = dashboard["Properties"]["DashboardBody"]
    if isinstance(raw, dict):  # Fn::Join with the state machine's ARN inside
        parts = raw["Fn::Join"][1]
        raw = "".join(p if isinstance(p, str) else "TOKEN" for p in parts)
    return json.loads(raw)


@pytest.fixture(scope="module")
def s():
    return synth("30b-fp8")


@pytest.fixture(scope="module")
def widgets(s):
    return body_of(s)["widgets"]


def expressions(widgets) -> list[str]:
    return [
        m[0]["expression"]
        for w in widgets
        for m in w.get("properties", {}).get("metrics", [])
        if isinstance(m, list) and m and isinstance(m[0], dict) and "expression" in m[0]
    ]


def test_every_metric_definition_is_graphed_by_its_exact_name(s, widgets):
    searched = {re.search(r'MetricName="([^"]+)"', e).group(1) for e in expressions(widgets)}
    defined = {d["Name"] for d in metric_definitions()}
    assert defined <= searched, defined - searched


def test_trainer_metrics_are_searched_by_job_and_host_metrics_by_host(s, widgets):
    terms = job_name_prefix(s.recipe, None).rstrip("-")  # SEARCH matches tokens; separators are none
    defined = {d["Name"] for d in metric_definitions()}
    for e in expressions(widgets):
        metric = re.search(r'MetricName="([^"]+)"', e).group(1)
        dimension = "TrainingJobName" if metric in defined else "Host"
        assert e.startswith(f'SEARCH(\'{{"/aws/sagemaker/TrainingJobs",{dimension}}} '), e
        assert e.endswith(f" {dimension}={terms}', 'Average', 60)") or e.endswith(
            f" {dimension}={terms}', 'Maximum', 60)"
        ), e
    host_metrics = {re.search(r'MetricName="([^"]+)"', e).group(1) for e in expressions(widgets)} - defined
    assert host_metrics == {
        "GPUUtilization",
        "GPUMemoryUtilization",
        "CPUUtilization",
        "MemoryUtilization",
        "DiskUtilization",
    }


def annotations(widgets, title_part: str) -> dict[str, float]:
    (widget,) = [w for w in widgets if f"({title_part})" in w.get("properties", {}).get("title", "")]
    return {a["label"]: a["value"] for a in widget["properties"]["annotations"]["horizontal"]}


def test_plan_is_drawn_beside_the_actuals(s, widgets):
    thr, mem = s.plan.throughput, s.plan.memory
    tokens = annotations(widgets, "train:tokens_per_sec")
    assert tokens["plan"] == pytest.approx(thr.tokens_per_sec_per_gpu)
    assert min(tokens.values()) == pytest.approx(
        s.recipe.monitoring.slow_fraction * thr.tokens_per_sec_per_gpu
    )
    assert annotations(widgets, "train:mfu")["plan"] == pytest.approx(thr.mfu)
    assert annotations(widgets, "train:step_time_s")["plan"] == pytest.approx(thr.step_time_s)
    assert annotations(widgets, "train:tflops_per_gpu")["plan"] == pytest.approx(thr.model_tflops_per_gpu)
    memory = annotations(widgets, "train:mem_gib")
    assert memory["plan"] == pytest.approx(mem.peak_gib) and memory["usable"] == pytest.approx(mem.usable_gib)
    assert annotations(widgets, "train:step")["target"] == s.recipe.training.steps


def test_state_machine_executions_and_alarm_status_are_on_the_page(s, widgets):
    titles = [w.get("properties", {}).get("title", "") for w in widgets]
    title = "Run supervisor executions (jobs started, job ends decided)"
    assert title in titles
    (status,) = [w for w in widgets if w["type"] == "alarm"]
    assert len(status["properties"]["alarms"]) == 3  # supervisor failed / timed out, alarm manager failed
    (header,) = [w for w in widgets if w["type"] == "text"]
    for name in ("GpuIdle", "NearOom", "Slow", "Stalled", "DiskNearlyFull"):  # the per-run alarms, named
        assert name in header["properties"]["markdown"]
    assert "trainstack runs" in header["properties"]["markdown"]
    (executions,) = [w for w in widgets if w.get("properties", {}).get("title") == title]
    names = {m[1] for m in executions["properties"]["metrics"]}
    assert {"ExecutionsStarted", "ExecutionsFailed", "ExecutionsTimedOut"} <= names


def test_the_body_stays_within_what_putdashboard_accepts(widgets):
    """CloudWatch's Dashboard Body Structure: 0 to 500 widgets; each on a grid 24 units wide (width 1 to
    24, x from 0, x + width at most 24). moto accepts any body, so the limits are pinned here."""
    assert 0 < len(widgets) <= 500
    for w in widgets:
        assert 1 <= w["width"] <= 24 and w["x"] >= 0 and w["x"] + w["width"] <= 24, w.get("properties", {})
