"""Monitoring for one recipe (and team): a dashboard, alarms and notifications.

A P6-B200 cluster costs on the order of a hundred dollars an hour per node, so an idle, stalled or
silently slow run has to reach a person within minutes. Composed into the launcher stack as
`Monitoring(...)`; it reads nothing from the environment, only the typed values it is given.

Job names exist only at run time (`ts-<team>-<recipe>--<recipe hash>-<suffix>`, see trainstack.naming),
so:
- the dashboard uses SEARCH expressions over `/aws/sagemaker/TrainingJobs` filtered on the prefix;
- the per-run alarms (idle GPUs, near OOM, slow, stalled, disk) are put for the exact job by a small
  state machine when SageMaker reports the job Training, and deleted when it ends (see RunAlarms);
- the job state rules match `detail.TrainingJobName` by the job-name prefix, which is exact: no other
  recipe's or team's job names start with it (see `this_recipe`).
Known limit: SEARCH matches tokens, not string prefixes (see `search_expression`), so the dashboard of
`8b-fp8` also draws the jobs of a recipe whose name extends it (`8b-fp8-128k`); the rules, the alarms'
IAM scope and `trainstack status` and `logs` (trainstack.runs.is_recipe_job) use the exact prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aws_cdk import Annotations, ArnFormat, Aws, Duration, Stack
from aws_cdk import aws_cloudwatch as cw
from aws_cdk import aws_cloudwatch_actions as cw_actions
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sns_subscriptions as subs
from aws_cdk import aws_stepfunctions as sfn
from aws_cdk import aws_stepfunctions_tasks as tasks
from constructs import Construct

from stacks import nag
from stacks.state_machine import logged_state_machine
from trainstack.metrics import FIELD_BY_KEY
from trainstack.naming import checkpoint_prefix, job_name_prefix
from trainstack.recipe import Recipe
from trainstack.runs import HOST_DIMENSION, JOB_DIMENSION, NAMESPACE

if TYPE_CHECKING:
    from trainstack.planner import Plan

JOB_STATE_CHANGE = "SageMaker Training Job State Change"
NOTIFY_STATES = ("Failed", "Stopped", "Completed")  # Completed is information; the others need a person


# --- Pure pieces: queries and patterns, tested without synthesis ----------------------------------


def quoted(identifier: str) -> str:
    """SEARCH needs double quotes around names with characters other than letters and digits."""
    return f'"{identifier}"'


def search_expression(
    metric: str, dimension: str, prefix: str, stat: str = "Average", period_s: int = 60
) -> str:
    """A dashboard SEARCH over this recipe's jobs: one line per job (or per host).

    `Host=<prefix>` unquoted is a partial match: CloudWatch splits the prefix and the dimension values
    into tokens at non-alphanumeric characters and matches the prefix's tokens appearing consecutively,
    so `ts-platform-30b-fp8` finds `ts-platform-30b-fp8--7eca0ce4-r1/algo-1` but not `ts-nlp-30b-fp8--...`.
    Separators are not tokens, so the `--` that ends the job-name prefix cannot make this exact:
    `ts-nlp-8b-fp8` also finds `ts-nlp-8b-fp8-128k--...` (SEARCH has no string-prefix operator).
    (Quoted, it would be an exact match of the whole value and find nothing.)
    """
    terms = prefix.rstrip("-")  # the tokens; a trailing separator adds nothing to match
    return (
        f"SEARCH('{{{quoted(NAMESPACE)},{dimension}}} MetricName={quoted(metric)} "
        f"{dimension}={terms}', '{stat}', {period_s})"
    )


def this_recipe(prefix: str) -> dict[str, Any]:
    """EventBridge `detail` conditions selecting this recipe's jobs: their names start with `prefix`.

    The job-name prefix (`ts-<team>-<recipe>--`) is exact, so `8b-fp8`'s rule does not match the jobs
    of `8b-fp8-128k` (`ts-<team>-8b-fp8-128k--...`) nor the same recipe's jobs of another team.
    """
    return {"TrainingJobName": [{"prefix": prefix}]}


def as_event_pattern(pattern: dict[str, Any]) -> events.EventPattern:
    """The CDK form of a pattern kept as a plain dict (the dict is what tests match real events against)."""
    return events.EventPattern(
        source=pattern["source"], detail_type=pattern["detail-type"], detail=pattern["detail"]
    )


def job_state_pattern(prefix: str) -> dict[str, Any]:
    """EventBridge pattern (CloudFormation form) for this recipe's jobs failing, stopping or completing."""
    return {
        "source": ["aws.sagemaker"],
        "detail-type": [JOB_STATE_CHANGE],
        "detail": {**this_recipe(prefix), "TrainingJobStatus": list(NOTIFY_STATES)},
    }


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
        )


# --- Constructs -----------------------------------------------------------------------------------


class Notifications(Construct):
    """A KMS-encrypted SNS topic, an optional e-mail subscription, and the job state rule.

    The topic is also the place for chat: AWS Chatbot (Amazon Q Developer in chat applications)
    subscribes Slack or Teams channels to an SNS topic without any code in this stack.
    """

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        recipe: Recipe,
        team: str | None,
        key: kms.IKey,
        checkpoint_bucket: s3.IBucket | None = None,
    ) -> None:
        super().__init__(scope, id)
        prefix = job_name_prefix(recipe, team)
        team_name = team or recipe.tags.team
        self.topic = sns.Topic(
            self,
            "Topic",
            display_name=f"trainstack {team_name}/{recipe.name}",
            master_key=key,
            enforce_ssl=True,
        )
        # CloudWatch alarms publish to an encrypted topic only if they may use the key (the SnsTopic
        # rule target below grants EventBridge itself). Conditioned on this account rather than on the
        # alarm ARNs: the key usually lives in the stateful stack, and naming launcher resources in its
        # policy would make the stacks depend on each other both ways.
        slug = f"{recipe.name}{team_name}".replace("-", "")
        key.add_to_resource_policy(
            iam.PolicyStatement(
                sid=f"AlarmsPublish{slug}",
                principals=[iam.ServicePrincipal("cloudwatch.amazonaws.com")],
                actions=["kms:Decrypt", "kms:GenerateDataKey"],
                resources=["*"],  # in a key policy "*" means this key
                conditions={"StringEquals": {"aws:SourceAccount": Aws.ACCOUNT_ID}},
            )
        )
        if recipe.monitoring.notification_email:
            self.topic.add_subscription(subs.EmailSubscription(recipe.monitoring.notification_email))

        self.pattern = job_state_pattern(prefix)
        self.rule = events.Rule(
            self,
            "JobStateChanged",
            description=f"Training jobs of {team_name}/{recipe.name} failed, stopped or completed",
            event_pattern=as_event_pattern(self.pattern),
        )
        job = events.EventField.from_path("$.detail.TrainingJobName")
        if checkpoint_bucket is not None:
            # The launcher checkpoints each job under <bucket>/<checkpoint prefix>/<job name>
            # (trainstack.request), so the location is exact whether or not the event carries
            # CheckpointConfig.
            checkpoints = f"s3://{checkpoint_bucket.bucket_name}/{checkpoint_prefix(recipe, team)}/{job}"
        else:
            checkpoints = events.EventField.from_path("$.detail.CheckpointConfig.S3Uri")
        message = (
            f"trainstack: training job {job} of recipe {recipe.name} (team {team_name}) is "
            f"{events.EventField.from_path('$.detail.TrainingJobStatus')} "
            f"({events.EventField.from_path('$.detail.SecondaryStatus')}). "
            f"Failure reason: {events.EventField.from_path('$.detail.FailureReason')}. "
            f"Last checkpoint: the newest step under {checkpoints}. "
            f"Details: trainstack status {recipe.name}{f' --team {team}' if team else ''}; "
            f"trainstack logs {recipe.name}{f' --team {team}' if team else ''} --job {job}"
        )
        self.rule.add_target(targets.SnsTopic(self.topic, message=events.RuleTargetInput.from_text(message)))


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

    def request(self, job: str, topic_arn: str, host: int | None = None) -> dict[str, Any]:
        """The PutMetricAlarm request for one concrete job (and host): what the state machine sends."""
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


def run_alarm_specs(recipe: Recipe, plan: Plan) -> tuple[AlarmSpec, ...]:
    """Every per-run alarm with its metric and threshold, from the recipe's monitoring section and plan."""
    t = Thresholds.of(recipe, plan)
    mon, gpus = recipe.monitoring, recipe.instance.gpus
    below, above = "LessThanThreshold", "GreaterThanThreshold"
    return (
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
    )


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
            parameters = {**concrete, "AlarmName": name, "Dimensions": [dimension]}
            return tasks.CallAwsService(
                self,
                f"Put{spec.name}",
                service="cloudwatch",
                action="putMetricAlarm",
                iam_resources=alarm_arns,
                parameters=parameters,
                result_path=sfn.JsonPath.DISCARD,
            )

        def delete(id_: str, names: Any) -> tasks.CallAwsService:
            task = tasks.CallAwsService(
                self,
                id_,
                service="cloudwatch",
                action="deleteAlarms",
                iam_resources=alarm_arns,
                parameters={"AlarmNames": names},
                result_path=sfn.JsonPath.DISCARD,
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
        self.rule.add_target(targets.SfnStateMachine(self.state_machine))
        nag.acknowledge(self.state_machine, "AwsSolutions-IAM5:unscoped-actions", ["Resource::*"])
        nag.acknowledge(
            self.state_machine,
            "AwsSolutions-IAM5:run-alarms",
            [nag.arn_finding(self, "cloudwatch", f"alarm:{prefix}*")],
        )


def run_state_pattern(prefix: str) -> dict[str, Any]:
    """Job state changes that create (Training) or delete (ended) a run's alarms."""
    return {
        "source": ["aws.sagemaker"],
        "detail-type": [JOB_STATE_CHANGE],
        "detail": {**this_recipe(prefix), "TrainingJobStatus": ["InProgress", *NOTIFY_STATES]},
    }


class Alarms(Construct):
    """Per-run alarms (through RunAlarms) and the alarms that exist for the deployment as a whole."""

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        recipe: Recipe,
        team: str | None,
        plan: Plan,
        state_machine: sfn.IStateMachine,
        topic: sns.ITopic,
        key: kms.IKey,
    ) -> None:
        super().__init__(scope, id)
        self.run_alarms = RunAlarms(self, "Run", recipe=recipe, team=team, plan=plan, topic=topic, key=key)
        self.thresholds = Thresholds.of(recipe, plan)
        action = cw_actions.SnsAction(topic)
        five = Duration.minutes(5)

        def alarm(name: str, metric: cw.IMetric, description: str) -> cw.Alarm:
            created = cw.Alarm(
                self,
                name,
                metric=metric,
                threshold=0,
                evaluation_periods=1,
                comparison_operator=cw.ComparisonOperator.GREATER_THAN_THRESHOLD,
                treat_missing_data=cw.TreatMissingData.NOT_BREACHING,
                alarm_description=description,
            )
            created.add_alarm_action(action)
            return created

        self.execution_failed = alarm(
            "ExecutionFailed",
            state_machine.metric_failed(period=five, statistic="Sum"),
            f"The {recipe.name} launcher state machine failed "
            "(capacity retries exhausted or the job failed).",
        )
        self.execution_timed_out = alarm(
            "ExecutionTimedOut",
            state_machine.metric_timed_out(period=five, statistic="Sum"),
            f"The {recipe.name} launcher state machine timed out.",
        )
        manager = self.run_alarms.state_machine
        self.alarm_manager_failed = alarm(
            "AlarmManagerFailed",
            cw.MathExpression(
                expression="failed + timedOut",
                using_metrics={
                    "failed": manager.metric_failed(period=five, statistic="Sum"),
                    "timedOut": manager.metric_timed_out(period=five, statistic="Sum"),
                },
                period=five,
            ),
            f"Putting or deleting the per-run alarms of {recipe.name} failed: a run may be unwatched.",
        )

    @property
    def static(self) -> list[cw.AlarmBase]:
        return [self.execution_failed, self.execution_timed_out, self.alarm_manager_failed]


class Dashboard(Construct):
    """Actual against plan, per host and per job, on one page."""

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        recipe: Recipe,
        team: str | None,
        plan: Plan,
        state_machine: sfn.IStateMachine,
        alarms: Sequence[cw.AlarmBase],
        run_alarm_specs: Sequence[AlarmSpec] = (),
    ) -> None:
        super().__init__(scope, id)
        prefix = job_name_prefix(recipe, team)
        team_name = team or recipe.tags.team
        mon = recipe.monitoring
        gpus = recipe.instance.gpus
        planned_tflops = plan.throughput.model_tflops_per_gpu

        def search(label: str, metric: str, dimension: str, stat: str = "Average") -> cw.MathExpression:
            return cw.MathExpression(
                expression=search_expression(metric, dimension, prefix, stat),
                using_metrics={},
                label=label,
                period=Duration.minutes(1),
            )

        def line(label: str, value: float, color: str = cw.Color.GREEN) -> cw.HorizontalAnnotation:
            return cw.HorizontalAnnotation(value=value, label=label, color=color)

        def host_graph(
            title: str, metric: str, unit_note: str, annotations: Sequence[cw.HorizontalAnnotation] = ()
        ) -> cw.GraphWidget:
            return cw.GraphWidget(
                title=f"{title} per host ({unit_note})",
                left=[search(title, metric, HOST_DIMENSION)],
                left_annotations=list(annotations),
                width=8,
                height=6,
            )

        def trainer_graph(
            key: str, title: str, annotations: Sequence[cw.HorizontalAnnotation] = (), stat: str = "Average"
        ) -> cw.GraphWidget:
            return cw.GraphWidget(
                title=f"{title} ({FIELD_BY_KEY[key].metric_name})",
                left=[search(title, FIELD_BY_KEY[key].metric_name, JOB_DIMENSION, stat)],
                left_annotations=list(annotations),
                width=8,
                height=6,
            )

        header = (
            f"# trainstack {team_name}/{recipe.name}\n"
            f"{recipe.model.total_params / 1e9:.1f}B parameters, {recipe.precision.dtype}"
            f"{f' ({recipe.precision.fp8_recipe})' if recipe.precision.fp8_recipe else ''}, "
            f"{recipe.compute.instance_count} x {recipe.compute.instance_type} ({recipe.world_size} GPUs), "
            f"{recipe.training.steps:,} steps. Jobs `{prefix}*`.\n\n"
            f"Plan: {plan.throughput.tokens_per_sec_per_gpu:,.0f} tokens/s per GPU, "
            f"MFU {plan.throughput.mfu:.1%}, "
            f"step {plan.throughput.step_time_s:.2f} s, peak memory {plan.memory.peak_gib:.0f} of "
            f"{plan.memory.usable_gib:.0f} GiB per GPU. "
            "Green lines are the plan; red lines are alarm thresholds.\n\n"
            f"Each run gets its own alarms while it trains, named `<job>-<alarm>`: "
            f"{', '.join(a.name for a in run_alarm_specs)}."
        )
        self.widgets: list[list[cw.IWidget]] = [
            [
                cw.TextWidget(markdown=header, width=16, height=4),
                cw.AlarmStatusWidget(alarms=list(alarms), title="Alarms", width=8, height=4),
            ],
            [
                trainer_graph(
                    "tokens_per_sec",
                    "Tokens/s per GPU",
                    [
                        line("plan", plan.throughput.tokens_per_sec_per_gpu),
                        line(
                            f"slow (< {mon.slow_fraction:g} x plan)",
                            mon.slow_fraction * plan.throughput.tokens_per_sec_per_gpu,
                            cw.Color.RED,
                        ),
                    ],
                ),
                trainer_graph("mfu", "MFU", [line("plan", plan.throughput.mfu)]),
                trainer_graph("tflops_per_gpu", "TFLOP/s per GPU", [line("plan", planned_tflops)]),
            ],
            [
                trainer_graph("loss", "Loss"),
                trainer_graph("step_time_s", "Step time s", [line("plan", plan.throughput.step_time_s)]),
                trainer_graph(
                    "mem_gib",
                    "Peak GPU memory GiB",
                    [
                        line("plan", plan.memory.peak_gib),
                        line("usable", plan.memory.usable_gib, cw.Color.RED),
                    ],
                    stat="Maximum",
                ),
            ],
            [
                trainer_graph("step", "Step", [line("target", recipe.training.steps)], stat="Maximum"),
                trainer_graph("lr", "Learning rate"),
                host_graph(
                    "GPU utilization",
                    "GPUUtilization",
                    f"0..{100 * gpus}%",
                    [
                        line(
                            f"idle (< {mon.gpu_idle_util_pct:g}% per GPU)",
                            mon.gpu_idle_util_pct * gpus,
                            cw.Color.RED,
                        ),
                    ],
                ),
            ],
            [
                host_graph(
                    "GPU memory utilization",
                    "GPUMemoryUtilization",
                    f"0..{100 * gpus}%",
                    [
                        line(
                            "planned peak", 100 * gpus * plan.memory.peak_gib / recipe.instance.gpu.usable_gib
                        ),
                        line(
                            f"near OOM (> {mon.gpu_mem_high_pct:g}%)",
                            mon.gpu_mem_high_pct * gpus,
                            cw.Color.RED,
                        ),
                    ],
                ),
                host_graph("CPU utilization", "CPUUtilization", "0..100% per core, summed"),
                host_graph("Memory utilization", "MemoryUtilization", "0..100%"),
            ],
            [
                host_graph(
                    "Disk utilization",
                    "DiskUtilization",
                    "0..100%",
                    [
                        line(f"nearly full (> {mon.disk_high_pct:g}%)", mon.disk_high_pct, cw.Color.RED),
                    ],
                ),
                cw.GraphWidget(
                    title="Launcher state machine executions",
                    width=16,
                    height=6,
                    left=[
                        state_machine.metric_started(statistic="Sum", label="started"),
                        state_machine.metric_succeeded(statistic="Sum", label="succeeded"),
                        state_machine.metric_failed(statistic="Sum", label="failed"),
                        state_machine.metric_timed_out(statistic="Sum", label="timed out"),
                        state_machine.metric_aborted(statistic="Sum", label="aborted"),
                    ],
                ),
            ],
        ]
        self.dashboard = cw.Dashboard(
            self, "Dashboard", widgets=self.widgets, default_interval=Duration.hours(6)
        )


class Monitoring(Construct):
    """Dashboard, alarms and notifications of one recipe and team."""

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        recipe: Recipe,
        team: str | None,
        plan: Plan,
        state_machine: sfn.IStateMachine,
        key: kms.IKey,
        checkpoint_bucket: s3.IBucket | None = None,
    ) -> None:
        super().__init__(scope, id)
        self.notifications = Notifications(
            self,
            "Notifications",
            recipe=recipe,
            team=team,
            key=key,
            checkpoint_bucket=checkpoint_bucket,
        )
        self.topic = self.notifications.topic
        self.alarms = Alarms(
            self,
            "Alarms",
            recipe=recipe,
            team=team,
            plan=plan,
            state_machine=state_machine,
            topic=self.topic,
            key=key,
        )
        self.dashboard = Dashboard(
            self,
            "Dashboard",
            recipe=recipe,
            team=team,
            plan=plan,
            state_machine=state_machine,
            alarms=self.alarms.static,
            run_alarm_specs=self.alarms.run_alarms.specs,
        ).dashboard


__all__ = [
    "Alarms",
    "Dashboard",
    "Monitoring",
    "Notifications",
    "Thresholds",
    "AlarmSpec",
    "RunAlarms",
    "run_alarm_specs",
    "run_state_pattern",
    "job_state_pattern",
    "this_recipe",
    "search_expression",
]
