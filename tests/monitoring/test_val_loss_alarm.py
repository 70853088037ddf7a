"""val_loss in monitoring: the ValLossRising run alarm (metric math over the job's val_loss) within
CloudWatch's documented limits, what its DIFF expression decides on a series of evaluations, the alarm
manager that puts it for the exact job, and the dashboard's loss graph with validation beside training."""

from __future__ import annotations

import json
import re

import pytest
from monitoring_helpers import definition, synth, tasks_of

from stacks.monitoring.run_alarms import ALARM_EVALUATION_MAX_S, run_alarm_specs, val_loss_rising_spec
from trainstack.aws.request_check import PLACEHOLDER_ACCOUNT, PLACEHOLDER_REGION, check_against_model
from trainstack.planner import plan
from trainstack.recipes.loader import resolve

pytestmark = pytest.mark.fast

SOURCES = json.dumps(
    [{"uri": "s3://corpus/tok/web/", "weight": 0.7}, {"uri": "s3://corpus/tok/code/", "weight": 0.3}]
)
OVERRIDES = (f"data.sources={SOURCES}", "validation.every_steps=100", "validation.batches=4")
TOPIC = f"arn:aws:sns:{PLACEHOLDER_REGION}:{PLACEHOLDER_ACCOUNT}:" + "t" * 256
JOB = "ts-platform-30b-fp8--" + "r" * 40 + "-99"


def rising(name: str = "30b-fp8", *overrides: str):
    recipe = resolve(name, overrides=[*OVERRIDES, *overrides]).recipe
    return recipe, plan(recipe), val_loss_rising_spec(recipe, plan(recipe))


def test_the_alarm_is_one_putmetricalarm_accepts_within_the_metric_math_limits():
    recipe, the_plan, spec = rising()
    request = spec.request(JOB, TOPIC)
    assert check_against_model("cloudwatch", "PutMetricAlarm", request) == []
    # Metric math alarms: at most 10 metrics and 20 queries, 10 of them expressions (CloudWatch limits,
    # pinned in tests/cdk/test_aws_limits.py); periods x evaluation periods at most one day.
    metrics = request["Metrics"]
    assert sum("MetricStat" in m for m in metrics) == 1 and sum("Expression" in m for m in metrics) == 1
    assert [m["ReturnData"] for m in metrics] == [False, True]  # the alarm watches the expression only
    (value,) = [m for m in metrics if "MetricStat" in m]
    assert value["Id"] == "value" and value["MetricStat"]["Metric"]["MetricName"] == "train:val_loss"
    assert value["MetricStat"]["Metric"]["Dimensions"] == [{"Name": "TrainingJobName", "Value": JOB}]
    assert [m["Expression"] for m in metrics if "Expression" in m] == ["DIFF(value)"]
    period = value["MetricStat"]["Period"]
    assert period % 60 == 0 and request["EvaluationPeriods"] * period <= ALARM_EVALUATION_MAX_S
    # One evaluation per period, as planned: every_steps steps plus the evaluation itself.
    assert abs(period - the_plan.validation.interval_s) <= 30
    assert request["EvaluationPeriods"] == request["DatapointsToAlarm"] == recipe.validation.alarm_rises
    assert (request["Threshold"], request["ComparisonOperator"]) == (0.0, "GreaterThanThreshold")
    assert request["TreatMissingData"] == "notBreaching"
    # Only with validation, and only where CloudWatch can watch that many evaluations.
    assert "ValLossRising" not in [
        s.name for s in run_alarm_specs(resolve("30b-fp8").recipe, plan(resolve("30b-fp8").recipe))
    ]
    _, _, too_long = rising("30b-fp8", "validation.every_steps=400", "validation.alarm_rises=5")
    assert too_long is None


def diff_alarm(values: list[float | None], rises: int) -> bool:
    """The alarm's documented semantics on one value per period (None: no evaluation that period):
    DIFF(value) is each datapoint minus the preceding one; the alarm is in ALARM when the newest `rises`
    datapoints of the expression all exceed 0 (missing ones are not breaching)."""
    present = [v for v in values if v is not None]
    diffs = [b - a for a, b in zip(present, present[1:], strict=False)]
    newest = diffs[-rises:]
    return len(newest) == rises and all(d > 0 for d in newest)


@pytest.mark.parametrize(
    ("series", "fires"),
    [
        ([3.0, 2.9, 2.8, 2.7, 2.6], False),  # learning
        ([3.0, 2.9, 2.95, 3.0, 3.1], True),  # three rises in a row
        ([3.0, 2.9, 2.95, 3.0], False),  # two rises
        ([3.0, 3.1, 3.2, 3.1, 3.2], False),  # a dip breaks the run
        ([3.0, None, 3.1, 3.2, None, 3.3], True),  # periods without an evaluation are skipped
    ],
)
def test_diff_over_val_loss_fires_after_k_rises_in_a_row_only(series, fires):
    _, _, spec = rising()
    assert spec.expression == "DIFF(value)" and spec.comparison == "GreaterThanThreshold"
    assert diff_alarm(series, spec.evaluation_periods) is fires


@pytest.fixture(scope="module")
def s():
    return synth("30b-fp8", with_nag=False, overrides=OVERRIDES)


def test_the_alarm_manager_puts_and_deletes_it_for_the_exact_job(s):
    tasks = tasks_of(definition(s))
    put = tasks["PutValLossRising"]["Parameters"]
    assert put["AlarmName.$"] == "States.Format('{}-ValLossRising', $.job)"
    (value,) = [m for m in put["Metrics"] if "MetricStat" in m]
    assert value["MetricStat"]["Metric"]["Dimensions"] == [{"Name": "TrainingJobName", "Value.$": "$.job"}]
    deleted = tasks["DeleteJobAlarms"]["Parameters"]["AlarmNames.$"]
    assert "{}-ValLossRising" in deleted


def test_the_loss_graph_draws_validation_per_source_beside_training_and_the_header_the_plan(s):
    (dashboard,) = s.resources("AWS::CloudWatch::Dashboard").values()
    raw = dashboard["Properties"]["DashboardBody"]
    parts = raw["Fn::Join"][1] if isinstance(raw, dict) else [raw]
    body = json.loads("".join(p if isinstance(p, str) else "TOKEN" for p in parts))
    (loss,) = [w for w in body["widgets"] if w.get("properties", {}).get("title", "").startswith("Loss:")]
    searched = [
        re.search(r'MetricName="([^"]+)"', m[0]["expression"]).group(1) for m in loss["properties"]["metrics"]
    ]
    assert searched == ["train:loss", "train:val_loss", "train:val_loss_web", "train:val_loss_code"]
    header = next(w for w in body["widgets"] if w["type"] == "text")["properties"]["markdown"]
    assert f"Validation {s.plan.validation.summary()}" in header and "ValLossRising" in header
