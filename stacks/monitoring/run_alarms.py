"""Per-run alarms: their specification, and the state machine that puts them for the exact job."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aws_cdk import Annotations, ArnFormat, Duration, Stack
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_sns as sns
from aws_cdk import aws_stepfunctions as sfn
from aws_cdk import aws_stepfunctions_tasks as tasks
from constructs import Construct

from stacks import nag
from stacks.monitoring.patterns import as_event_pattern, run_state_pattern
from stacks.retries import TRANSIENT, TRANSIENT_ERRORS
from stacks.roles import service_role
from stacks.state_machine import logged_state_machine
from trainstack.aws.runs import HOST_DIMENSION, JOB_DIMENSION, NAMESPACE
from trainstack.protocol.metrics import FIELD_BY_KEY
from trainstack.recipes.naming import job_name_prefix
from trainstack.recipes.schema import Recipe

if TYPE_CHECKING:
    from trainstack.planner import Plan


@dataclass(frozen=True)
class Thresholds:
    """Alarm thresholds in the units CloudWatch reports, derived from the recipe and the plan."""

    gpu_idle_util: float  # GPUUtilization per host is 0..100 x GPUs per instance
    gpu_mem_high: float  # GPUMemoryUtilization per host, same scaling
    slow_tokens_per_sec: float  # per GPU, as the trainer prints it
    disk_high_pct: float  # DiskUtilization, 0..100
    gpu_idle_minutes: int
    slow_minutes: int
    stall_minutes: int
    straggler_skew: float  # the trainer's straggler_skew (slowest rank's compute over the median's, - 1)
    straggler_period_s: int  # at least one metric line per period (lines come every log_every steps)
    straggler_periods: int  # periods covering monitoring.straggler_minutes

    @classmethod
    def of(cls, recipe: Recipe, plan: Plan) -> Thresholds:
        gpus = recipe.instance.gpus
        mon = recipe.monitoring
        return cls(
            gpu_idle_util=mon.gpu_idle_util_pct * gpus,
            gpu_mem_high=mon.gpu_mem_high_pct * gpus,
            slow_tokens_per_sec=mon.slow_fraction * plan.throughput.tokens_per_sec_per_gpu,
            disk_high_pct=mon.disk_high_pct,
            gpu_idle_minutes=mon.gpu_idle_minutes,
            slow_minutes=mon.slow_minutes,
            stall_minutes=mon.stall_minutes,
            straggler_skew=mon.straggler_skew,
            straggler_period_s=(period := metric_line_period_s(recipe, plan)),
            straggler_periods=max(1, math.ceil(mon.straggler_minutes * 60 / period)),
        )


def metric_line_period_s(recipe: Recipe, plan: Plan) -> int:
    """The shortest CloudWatch period (a multiple of 60 s) that holds at least one metric line: the
    trainer prints one every `training.log_every` steps, so at 205 s a step (8b-fp8-128k) one about every
    34 minutes, and a one-minute period would be missing data most of the time."""
    interval_s = recipe.training.log_every * plan.throughput.step_time_s
    return 60 * max(1, math.ceil(interval_s / 60))


# --- Per-run alarms: specified here, created by a state machine when a job starts training --------
#
# CloudWatch alarms need exact dimension values, and the job name exists only at run time. Metrics
# Insights queries could aggregate "all jobs", but their WHERE clause documents only =, != (and AND/OR),
# no prefix match, so a deploy-time alarm could not be limited to this recipe's jobs. Instead, a small
# state machine (SDK integrations only, no Lambda) puts the alarms below for the exact job when
# SageMaker reports it Training, and deletes them when the job ends. That also makes "stalled" honest:
# the alarm exists only while the job trains, so missing metric lines can count as breaching.


@dataclass(frozen=True)
class AlarmSpec:
    """One CloudWatch alarm of a run, in PutMetricAlarm terms."""

    name: str  # alarm name suffix: "<job>-<name>" or "<job>-<name>-algo-<n>"
    per_host: bool  # built-in instance metrics have dimension Host=<job>/algo-<n>
    metric: str
    statistic: str
    period_s: int
    evaluation_periods: int
    threshold: float
    comparison: str
    treat_missing: str
    description: str
    # A per-host alarm on a trainer metric (dimension TrainingJobName only) that names its host in another
    # metric: the alarm watches `metric` only while `host_metric` equals this host (metric math below).
    host_metric: str | None = None
    # A job alarm on metric math over `metric` (Id `value`), e.g. DIFF(value): the alarm watches the
    # expression's datapoints instead of the metric's.
    expression: str | None = None

    def request(self, job: str, topic_arn: str, host: int | None = None) -> dict[str, Any]:
        """The PutMetricAlarm request for one concrete job (and host): what the state machine sends."""
        if self.expression is not None:
            return {
                "AlarmName": f"{job}-{self.name}",
                "AlarmDescription": self.description,
                "Metrics": self.expression_metrics(job),
                "EvaluationPeriods": self.evaluation_periods,
                "DatapointsToAlarm": self.evaluation_periods,
                "Threshold": self.threshold,
                "ComparisonOperator": self.comparison,
                "TreatMissingData": self.treat_missing,
                "AlarmActions": [topic_arn],
                "OKActions": [topic_arn],
            }
        if self.host_metric is not None:
            return {
                "AlarmName": f"{job}-{self.name}-algo-{host}",
                "AlarmDescription": self.description,
                "Metrics": self.host_metrics(job, self.host_expression(host)),
                "EvaluationPeriods": self.evaluation_periods,
                "DatapointsToAlarm": self.evaluation_periods,
                "Threshold": self.threshold,
                "ComparisonOperator": self.comparison,
                "TreatMissingData": self.treat_missing,
                "AlarmActions": [topic_arn],
                "OKActions": [topic_arn],
            }
        if self.per_host:
            alarm, dimension = (
                f"{job}-{self.name}-algo-{host}",
                {"Name": HOST_DIMENSION, "Value": f"{job}/algo-{host}"},
            )
        else:
            alarm, dimension = f"{job}-{self.name}", {"Name": JOB_DIMENSION, "Value": job}
        return {
            "AlarmName": alarm,
            "AlarmDescription": self.description,
            "Namespace": NAMESPACE,
            "MetricName": self.metric,
            "Dimensions": [dimension],
            "Statistic": self.statistic,
            "Period": self.period_s,
            "EvaluationPeriods": self.evaluation_periods,
            "DatapointsToAlarm": self.evaluation_periods,
            "Threshold": self.threshold,
            "ComparisonOperator": self.comparison,
            "TreatMissingData": self.treat_missing,
            "AlarmActions": [topic_arn],
            "OKActions": [topic_arn],
        }

    @staticmethod
    def host_expression(host: Any) -> str:
        """The value while this host is the one named, else 0 (`host` may be a run-time placeholder)."""
        return f"IF(host == {host}, value, 0)"

    def expression_metrics(self, job: Any) -> list[dict[str, Any]]:
        """PutMetricAlarm `Metrics`: the job's metric as `value`, and the expression the alarm watches."""
        return [
            {
                "Id": "value",
                "MetricStat": {
                    "Metric": {
                        "Namespace": NAMESPACE,
                        "MetricName": self.metric,
                        "Dimensions": [{"Name": JOB_DIMENSION, "Value": job}],
                    },
                    "Period": self.period_s,
                    "Stat": self.statistic,
                },
                "ReturnData": False,
            },
            {"Id": "rise", "Expression": self.expression or "", "Label": self.name, "ReturnData": True},
        ]

    def host_metrics(self, job: Any, expression: Any) -> list[dict[str, Any]]:
        """PutMetricAlarm `Metrics`: the named host and the value, both of the job, and the expression."""

        def stat(id_: str, metric: str) -> dict[str, Any]:
            return {
                "Id": id_,
                "MetricStat": {
                    "Metric": {
                        "Namespace": NAMESPACE,
                        "MetricName": metric,
                        "Dimensions": [{"Name": JOB_DIMENSION, "Value": job}],
                    },
                    "Period": self.period_s,
                    "Stat": self.statistic,
                },
                "ReturnData": False,
            }

        return [
            stat("host", self.host_metric or ""),
            stat("value", self.metric),
            {
                "Id": "onhost",
                "Expression": expression,
                "Label": f"{self.name} on this host",
                "ReturnData": True,
            },
        ]


def run_alarm_specs(recipe: Recipe, plan: Plan) -> tuple[AlarmSpec, ...]:
    """Every per-run alarm with its metric and threshold, from the recipe's monitoring section and plan."""
    t = Thresholds.of(recipe, plan)
    mon, gpus = recipe.monitoring, recipe.instance.gpus
    below, above = "LessThanThreshold", "GreaterThanThreshold"
    standard = (
        AlarmSpec(
            "Slow",
            False,
            FIELD_BY_KEY["tokens_per_sec"].metric_name,
            "Average",
            60,
            t.slow_minutes,
            t.slow_tokens_per_sec,
            below,
            "notBreaching",
            f"{recipe.name} slow: tokens/s per GPU below {mon.slow_fraction:g} x the planned "
            f"{plan.throughput.tokens_per_sec_per_gpu:,.0f} for {t.slow_minutes} min.",
        ),
        AlarmSpec(
            # One datapoint per metric line: none for N minutes while the job trains is a stall (hung
            # collective, dead data loader, stuck checkpoint). Missing data breaches on purpose.
            "Stalled",
            False,
            FIELD_BY_KEY["step"].metric_name,
            "SampleCount",
            60,
            t.stall_minutes,
            1,
            below,
            "breaching",
            f"{recipe.name} stalled: no trainer metric line for {t.stall_minutes} min "
            "while the job is Training.",
        ),
        AlarmSpec(
            "GpuIdle",
            True,
            "GPUUtilization",
            "Average",
            60,
            t.gpu_idle_minutes,
            t.gpu_idle_util,
            below,
            "notBreaching",
            f"GPUs of {recipe.name} idle: GPUUtilization below {mon.gpu_idle_util_pct:g}% per GPU "
            f"({t.gpu_idle_util:g} summed over {gpus} GPUs) for {t.gpu_idle_minutes} min.",
        ),
        AlarmSpec(
            "NearOom",
            True,
            "GPUMemoryUtilization",
            "Maximum",
            60,
            3,
            t.gpu_mem_high,
            above,
            "notBreaching",
            f"GPU memory of {recipe.name} above {mon.gpu_mem_high_pct:g}% per GPU ({t.gpu_mem_high:g} summed "
            f"over {gpus} GPUs) for 3 min (planned peak {plan.memory.peak_gib:.0f} of "
            f"{plan.memory.usable_gib:.0f} GiB).",
        ),
        AlarmSpec(
            "DiskNearlyFull",
            True,
            "DiskUtilization",
            "Maximum",
            300,
            2,
            t.disk_high_pct,
            above,
            "notBreaching",
            f"Training volume of {recipe.name} above {t.disk_high_pct:g}% full (checkpoints piling up?).",
        ),
        AlarmSpec(
            # The trainer names the rank whose own block compute was slowest on each log step, its host
            # and its skew against the median rank (collectives make every rank's wall time equal, so
            # only compute shows a bad GPU or link). One alarm per host, named for it: a node that stays
            # the slowest by more than the threshold for straggler_minutes.
            "Straggler",
            True,
            FIELD_BY_KEY["straggler_skew"].metric_name,
            "Maximum",
            t.straggler_period_s,
            t.straggler_periods,
            t.straggler_skew,
            above,
            "notBreaching",  # metric lines come every log_every steps; a quiet period says nothing
            f"One node of {recipe.name} slower than the rest: its slowest rank's compute more than "
            f"{mon.straggler_skew:.0%} over the median rank's for {mon.straggler_minutes} min (see "
            f"{FIELD_BY_KEY['straggler_rank'].metric_name}; replace the node or stop and resume the run).",
            host_metric=FIELD_BY_KEY["straggler_host"].metric_name,
        ),
    )
    rising = val_loss_rising_spec(recipe, plan)
    return standard + ((rising,) if rising is not None else ())


# CloudWatch: "The number of evaluation periods for an alarm multiplied by the length of each evaluation
# period cannot exceed one day" (CloudWatch user guide, Using Amazon CloudWatch alarms, common features).
ALARM_EVALUATION_MAX_S = 86_400


def validation_period_s(plan: Plan) -> int:
    """The ValLossRising period: the planned time between two evaluations, in whole minutes, so that a
    period holds one val_loss datapoint (a run faster than planned puts two in some periods: their mean
    is compared; a slower one leaves some empty: DIFF skips them)."""
    assert plan.validation is not None
    return 60 * max(1, round(plan.validation.interval_s / 60))


def val_loss_rising_spec(recipe: Recipe, plan: Plan) -> AlarmSpec | None:
    """Validation loss rose `validation.alarm_rises` evaluations in a row: overfitting, a bad blend or a
    broken shard. Metric math: DIFF(value) is each val_loss datapoint minus the one before it (CloudWatch
    user guide, metric math functions), so K positive DIFF datapoints out of K are K rises in a row.
    Missing data counts as not breaching (fewer than K evaluations so far, or an empty period between
    them, says nothing). None when the recipe has no validation, or when K periods exceed CloudWatch's
    one day (RunAlarms warns then)."""
    if recipe.validation is None or plan.validation is None:
        return None
    rises = recipe.validation.alarm_rises
    period = validation_period_s(plan)
    if rises * period > ALARM_EVALUATION_MAX_S:
        return None
    return AlarmSpec(
        "ValLossRising",
        False,
        FIELD_BY_KEY["val_loss"].metric_name,
        "Average",
        period,
        rises,
        0.0,
        "GreaterThanThreshold",
        "notBreaching",
        f"{recipe.name}: validation loss rose {rises} evaluations in a row (every "
        f"{recipe.validation.every_steps} steps, about {period / 60:,.0f} min apart): overfitting, a bad "
        "data mix or a broken shard; see the Loss graph's per-source lines.",
        expression="DIFF(value)",
    )


def retried(task: tasks.CallAwsService) -> tasks.CallAwsService:
    """The task, retrying CloudWatch throttling and server faults (stacks/retries.py), inside the Map too."""
    task.add_retry(
        errors=list(TRANSIENT_ERRORS["aws-sdk:cloudwatch"]),
        interval=Duration.seconds(TRANSIENT.interval_seconds),
        backoff_rate=TRANSIENT.backoff_rate,
        max_attempts=TRANSIENT.max_attempts,
        max_delay=Duration.seconds(TRANSIENT.max_delay_seconds or 0),
        jitter_strategy=sfn.JitterType.FULL,
    )
    return task


class RunAlarms(Construct):
    """The state machine that puts a run's alarms when it starts training and deletes them at its end."""

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        recipe: Recipe,
        team: str | None,
        plan: Plan,
        topic: sns.ITopic,
        key: kms.IKey,
    ) -> None:
        super().__init__(scope, id)
        prefix = job_name_prefix(recipe, team)
        self.specs = run_alarm_specs(recipe, plan)
        hosts = recipe.compute.instance_count
        log_interval_s = recipe.training.log_every * plan.throughput.step_time_s
        if recipe.validation is not None and val_loss_rising_spec(recipe, plan) is None:
            Annotations.of(self).add_warning_v2(
                "trainstack:ValLossRisingWindow",
                f"validation.alarm_rises ({recipe.validation.alarm_rises}) evaluations about "
                f"{validation_period_s(plan) / 60:,.0f} min apart exceed CloudWatch's one day of evaluation "
                "periods: no ValLossRising alarm (fewer alarm_rises or a smaller every_steps restores it).",
            )
        if recipe.monitoring.stall_minutes * 60 < 2 * log_interval_s:
            Annotations.of(self).add_warning_v2(
                "trainstack:StallWindow",
                f"monitoring.stall_minutes ({recipe.monitoring.stall_minutes}) is under twice the planned "
                f"interval between metric lines ({log_interval_s / 60:.1f} min): the Stalled alarm may fire "
                "on a healthy run.",
            )
        stack = Stack.of(self)
        alarm_arns = [
            stack.format_arn(
                service="cloudwatch",
                resource="alarm",
                resource_name=f"{prefix}*",
                arn_format=ArnFormat.COLON_RESOURCE_NAME,
            )
        ]

        def put(spec: AlarmSpec, job_path: str, host_path: str | None) -> tasks.CallAwsService:
            if spec.per_host:
                name = sfn.JsonPath.format(
                    f"{{}}-{spec.name}-algo-{{}}",
                    sfn.JsonPath.string_at(job_path),
                    sfn.JsonPath.string_at(host_path or ""),
                )
                value = sfn.JsonPath.format(
                    "{}/algo-{}", sfn.JsonPath.string_at(job_path), sfn.JsonPath.string_at(host_path or "")
                )
                dimension = {"Name": HOST_DIMENSION, "Value": value}
            else:
                name = sfn.JsonPath.format(f"{{}}-{spec.name}", sfn.JsonPath.string_at(job_path))
                dimension = {"Name": JOB_DIMENSION, "Value": sfn.JsonPath.string_at(job_path)}
            concrete = spec.request("JOB", topic.topic_arn, 1)
            if spec.expression is not None:
                parameters = {
                    **concrete,
                    "AlarmName": name,
                    "Metrics": spec.expression_metrics(sfn.JsonPath.string_at(job_path)),
                }
            elif spec.host_metric is not None:
                expression = sfn.JsonPath.format(
                    spec.host_expression("{}"), sfn.JsonPath.string_at(host_path or "")
                )
                metrics = spec.host_metrics(sfn.JsonPath.string_at(job_path), expression)
                parameters = {**concrete, "AlarmName": name, "Metrics": metrics}
            else:
                parameters = {**concrete, "AlarmName": name, "Dimensions": [dimension]}
            return retried(
                tasks.CallAwsService(
                    self,
                    f"Put{spec.name}",
                    service="cloudwatch",
                    action="putMetricAlarm",
                    iam_resources=alarm_arns,
                    parameters=parameters,
                    result_path=sfn.JsonPath.DISCARD,
                )
            )

        def delete(id_: str, names: Any) -> tasks.CallAwsService:
            task = retried(
                tasks.CallAwsService(
                    self,
                    id_,
                    service="cloudwatch",
                    action="deleteAlarms",
                    iam_resources=alarm_arns,
                    parameters={"AlarmNames": names},
                    result_path=sfn.JsonPath.DISCARD,
                )
            )
            # A job that ended before it trained never had alarms.
            task.add_catch(sfn.Pass(self, f"{id_}None"), errors=["CloudWatch.ResourceNotFoundException"])
            return task

        job_specs = [s for s in self.specs if not s.per_host]
        host_specs = [s for s in self.specs if s.per_host]
        run = {
            "job": sfn.JsonPath.string_at("$.detail.TrainingJobName"),
            "hosts": sfn.JsonPath.array_range(1, hosts, 1),
        }
        per_host_item = {
            "job": sfn.JsonPath.string_at("$.job"),
            "host": sfn.JsonPath.string_at("$$.Map.Item.Value"),
        }

        create_hosts = sfn.Map(
            self,
            "PutHostAlarms",
            items_path="$.hosts",
            item_selector=per_host_item,
            result_path=sfn.JsonPath.DISCARD,
        )
        chain = sfn.Chain.start(put(host_specs[0], "$.job", "$.host"))
        for spec in host_specs[1:]:
            chain = chain.next(put(spec, "$.job", "$.host"))
        create_hosts.item_processor(chain)
        create = sfn.Parallel(self, "PutAlarms", result_path=sfn.JsonPath.DISCARD)
        for spec in job_specs:
            create.branch(put(spec, "$.job", None))
        create.branch(create_hosts)

        delete_hosts = sfn.Map(
            self,
            "DeleteHostAlarms",
            items_path="$.hosts",
            item_selector=per_host_item,
            result_path=sfn.JsonPath.DISCARD,
        )
        delete_hosts.item_processor(
            delete(
                "DeleteHostAlarmsOfHost",
                sfn.JsonPath.array(
                    *[
                        sfn.JsonPath.format(
                            f"{{}}-{s.name}-algo-{{}}",
                            sfn.JsonPath.string_at("$.job"),
                            sfn.JsonPath.string_at("$.host"),
                        )
                        for s in host_specs
                    ]
                ),
            )
        )
        delete_job = delete(
            "DeleteJobAlarms",
            sfn.JsonPath.array(
                *[sfn.JsonPath.format(f"{{}}-{s.name}", sfn.JsonPath.string_at("$.job")) for s in job_specs]
            ),
        )

        started = sfn.Condition.and_(
            sfn.Condition.string_equals("$.detail.TrainingJobStatus", "InProgress"),
            sfn.Condition.string_equals("$.detail.SecondaryStatus", "Training"),
        )
        definition = (
            sfn.Choice(self, "TrainingOrEnded")
            .when(started, sfn.Pass(self, "Run", parameters=run).next(create))
            .otherwise(sfn.Pass(self, "EndedRun", parameters=run).next(delete_job).next(delete_hosts))
        )

        self.log_group, self.state_machine = logged_state_machine(
            self,
            log_group_id="Executions",
            state_machine_id="AlarmManager",
            definition=definition,
            key=key,
            retention=logs.RetentionDays.THREE_MONTHS,
            timeout=Duration.minutes(10),
        )
        self.pattern = run_state_pattern(prefix)
        self.rule = events.Rule(
            self,
            "RunStateChanged",
            description=f"Put and delete the alarms of {prefix}* training jobs",
            event_pattern=as_event_pattern(self.pattern),
        )
        self.rule.add_target(
            targets.SfnStateMachine(
                self.state_machine,
                role=service_role(
                    self, "EventsRole", "events.amazonaws.com", "start alarm manager executions"
                ),
            )
        )
        nag.acknowledge(self.state_machine.role, "AwsSolutions-IAM5:unscoped-actions", ["Resource::*"])
        nag.acknowledge(
            self.state_machine.role,
            "AwsSolutions-IAM5:run-alarms",
            [nag.arn_finding(self, "cloudwatch", f"alarm:{prefix}*")],
        )
