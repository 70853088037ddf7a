"""Every alarm exists with its metric, its threshold from the recipe and plan, and the SNS action.

Per-run alarms are put by the alarm manager state machine for the exact job, so they are checked twice:
in the synthesized definition (each putMetricAlarm task's parameters) and, end to end, by running that
definition in the local emulator on a "Training" event and reading the alarms back (test_run_alarms_*).
"""

from __future__ import annotations

import json

import pytest
from monitoring_helpers import definition, manager, supervision_topic_ref, synth, tasks_of, topic_ref

from stacks.monitoring import run_alarm_specs
from trainstack.protocol.metrics import FIELD_BY_KEY
from trainstack.recipes.naming import job_name_prefix

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def s():
    return synth("30b-fp8")


def by_prefix(resources: dict, name: str) -> dict:
    matches = [r for logical_id, r in resources.items() if logical_id.startswith(f"MonitoringAlarms{name}")]
    assert len(matches) == 1, f"expected exactly one alarm {name}, found {len(matches)}"
    return matches[0]["Properties"]


def test_the_run_alarm_set_covers_every_way_a_run_wastes_money(s):
    names = {spec.name for spec in run_alarm_specs(s.recipe, s.plan)}
    assert names == {"GpuIdle", "NearOom", "Slow", "Stalled", "DiskNearlyFull", "Straggler"}


def test_each_run_alarm_is_put_with_its_metric_threshold_and_sns_action(s):
    asl = definition(s, {topic_ref(s)["Ref"]: "TOPIC"})
    puts = {
        n: t for n, t in tasks_of(asl).items() if t["Resource"].endswith("aws-sdk:cloudwatch:putMetricAlarm")
    }
    specs = run_alarm_specs(s.recipe, s.plan)
    assert set(puts) == {f"Put{spec.name}" for spec in specs}
    for spec in specs:
        params = puts[f"Put{spec.name}"]["Parameters"]
        expected = spec.request("JOB", "TOPIC", 1)
        if spec.host_metric is not None:  # metric math over two of the job's trainer metrics
            assert [m["Id"] for m in params["Metrics"]] == [m["Id"] for m in expected["Metrics"]]
            assert params["Metrics"][2]["Expression.$"] == "States.Format('IF(host == {}, value, 0)', $.host)"
            for ours, theirs in zip(params["Metrics"][:2], expected["Metrics"][:2], strict=True):
                assert ours["MetricStat"]["Metric"]["Dimensions"] == [
                    {"Name": "TrainingJobName", "Value.$": "$.job"}
                ]
                assert (
                    ours["MetricStat"]["Metric"]["MetricName"] == theirs["MetricStat"]["Metric"]["MetricName"]
                )
                assert ours["MetricStat"]["Period"] == theirs["MetricStat"]["Period"]
            continue
        for key in (
            "Namespace",
            "MetricName",
            "Statistic",
            "Period",
            "EvaluationPeriods",
            "Threshold",
            "ComparisonOperator",
            "TreatMissingData",
            "AlarmActions",
            "OKActions",
        ):
            assert params[key] == expected[key], (spec.name, key)
        (dimension,) = params["Dimensions"]
        assert dimension["Name"] == ("Host" if spec.per_host else "TrainingJobName")
        assert params["AlarmActions"] == ["TOPIC"]


def test_thresholds_come_from_the_recipe_and_the_plan(s):
    specs = {spec.name: spec for spec in run_alarm_specs(s.recipe, s.plan)}
    mon, gpus = s.recipe.monitoring, s.recipe.instance.gpus
    assert specs["Slow"].metric == FIELD_BY_KEY["tokens_per_sec"].metric_name
    assert specs["Slow"].threshold == pytest.approx(
        mon.slow_fraction * s.plan.throughput.tokens_per_sec_per_gpu
    )
    assert (
        specs["Slow"].evaluation_periods == mon.slow_minutes
        and specs["Slow"].comparison == "LessThanThreshold"
    )
    # SageMaker reports GPU utilization and GPU memory per host as 0..100 times the GPUs on the instance.
    assert specs["GpuIdle"].threshold == mon.gpu_idle_util_pct * gpus
    assert specs["GpuIdle"].evaluation_periods == mon.gpu_idle_minutes
    assert specs["NearOom"].threshold == mon.gpu_mem_high_pct * gpus
    assert specs["DiskNearlyFull"].threshold == mon.disk_high_pct
    stalled = specs["Stalled"]
    assert stalled.metric == FIELD_BY_KEY["step"].metric_name and stalled.statistic == "SampleCount"
    assert stalled.treat_missing == "breaching" and stalled.evaluation_periods == mon.stall_minutes
    assert all(spec.treat_missing == "notBreaching" for spec in specs.values() if spec.name != "Stalled")
    # One straggler alarm per host: the trainer's skew while that host is the one it names.
    straggler = specs["Straggler"]
    assert straggler.per_host and straggler.threshold == mon.straggler_skew
    assert straggler.metric == FIELD_BY_KEY["straggler_skew"].metric_name
    assert straggler.host_metric == FIELD_BY_KEY["straggler_host"].metric_name
    request = straggler.request("job-1", "TOPIC", 3)
    assert request["AlarmName"] == "job-1-Straggler-algo-3"
    assert request["Metrics"][2]["Expression"] == "IF(host == 3, value, 0)"
    # At least one metric line per period, and periods covering straggler_minutes.
    log_interval_s = s.recipe.training.log_every * s.plan.throughput.step_time_s
    period = request["Metrics"][1]["MetricStat"]["Period"]
    assert period % 60 == 0 and period >= log_interval_s and period - 60 < max(log_interval_s, 60)
    assert straggler.evaluation_periods * period >= mon.straggler_minutes * 60


def test_thresholds_follow_overrides_of_the_monitoring_section():
    s = synth(
        "30b-fp8",
        overrides=(
            "monitoring.slow_fraction=0.5",
            "monitoring.gpu_idle_util_pct=10",
            "monitoring.stall_minutes=45",
        ),
    )
    specs = {spec.name: spec for spec in run_alarm_specs(s.recipe, s.plan)}
    assert specs["Slow"].threshold == pytest.approx(0.5 * s.plan.throughput.tokens_per_sec_per_gpu)
    assert specs["GpuIdle"].threshold == 10 * s.recipe.instance.gpus
    puts = tasks_of(definition(s))
    assert puts["PutStalled"]["Parameters"]["EvaluationPeriods"] == 45
    assert puts["PutSlow"]["Parameters"]["Threshold"] == pytest.approx(specs["Slow"].threshold)


def test_alarms_are_put_when_training_starts_and_deleted_when_the_job_ends(s):
    asl = definition(s)
    choice = asl["States"][asl["StartAt"]]
    (when,) = choice["Choices"]
    assert {c["Variable"]: c["StringEquals"] for c in when["And"]} == {
        "$.detail.TrainingJobStatus": "InProgress",
        "$.detail.SecondaryStatus": "Training",
    }
    hosts = asl["States"]["Run"]["Parameters"]["hosts.$"]
    assert hosts == f"States.ArrayRange(1, {s.recipe.compute.instance_count}, 1)"
    deletes = [t for t in tasks_of(asl).values() if t["Resource"].endswith("aws-sdk:cloudwatch:deleteAlarms")]
    assert len(deletes) == 2


def test_the_manager_may_touch_only_this_recipes_alarms(s):
    prefix = job_name_prefix(s.recipe, None)
    role_policies = [
        p["Properties"]["PolicyDocument"]["Statement"]
        for k, p in s.resources("AWS::IAM::Policy").items()
        if k.startswith("MonitoringAlarmsRunAlarmManagerRole")
    ]
    (statements,) = role_policies
    cloudwatch = [st for st in statements if any(a.startswith("cloudwatch:") for a in _list(st["Action"]))]
    assert {a for st in cloudwatch for a in _list(st["Action"])} == {
        "cloudwatch:putMetricAlarm",
        "cloudwatch:deleteAlarms",
    }
    for st in cloudwatch:
        joined = json.dumps(st["Resource"])
        assert f":alarm:{prefix}*" in joined
    assert all("*" not in a for st in statements for a in _list(st["Action"]))


def _list(value):
    return value if isinstance(value, list) else [value]


def test_the_run_state_rule_starts_the_manager(s):
    manager_id, _ = manager(s)
    rules = [r["Properties"] for k, r in s.resources("AWS::Events::Rule").items() if "RunStateChanged" in k]
    (rule,) = rules
    (target,) = rule["Targets"]
    assert target["Arn"] == {"Ref": manager_id}
    assert rule["EventPattern"]["detail"]["TrainingJobName"] == [{"prefix": job_name_prefix(s.recipe, None)}]


def test_deployment_alarms_notify_on_launcher_and_manager_failures(s):
    alarms = s.resources("AWS::CloudWatch::Alarm")
    (launcher_id,) = [k for k in s.resources("AWS::StepFunctions::StateMachine") if k.startswith("Launcher")]
    for name, metric in (
        ("ExecutionFailed", "ExecutionsFailed"),
        ("ExecutionTimedOut", "ExecutionsTimedOut"),
    ):
        props = by_prefix(alarms, name)
        assert props["Namespace"] == "AWS/States" and props["MetricName"] == metric
        assert props["Dimensions"] == [{"Name": "StateMachineArn", "Value": {"Ref": launcher_id}}]
        assert props["Threshold"] == 0 and props["ComparisonOperator"] == "GreaterThanThreshold"
        # Also on a topic with its own key: a failed publish to the first is one of the failures.
        assert props["AlarmActions"] == [topic_ref(s), supervision_topic_ref(s)]
    manager_alarm = by_prefix(alarms, "AlarmManagerFailed")
    assert manager_alarm["AlarmActions"] == [topic_ref(s), supervision_topic_ref(s)]
    assert {
        m.get("MetricStat", {}).get("Metric", {}).get("MetricName") for m in manager_alarm["Metrics"]
    } >= {"ExecutionsFailed", "ExecutionsTimedOut"}


def test_a_team_deployment_manages_only_its_own_jobs_alarms():
    s = synth("30b-fp8", team="nlp")
    prefix = job_name_prefix(s.recipe, "nlp")
    assert prefix == "ts-nlp-30b-fp8--"
    (rule,) = [r["Properties"] for k, r in s.resources("AWS::Events::Rule").items() if "RunStateChanged" in k]
    assert rule["EventPattern"]["detail"]["TrainingJobName"] == [{"prefix": prefix}]
