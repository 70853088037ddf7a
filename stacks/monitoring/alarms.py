"""Alarms of a deployment: the per-run alarm manager and the alarms on the run supervisor itself."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from aws_cdk import Duration
from aws_cdk import aws_cloudwatch as cw
from aws_cdk import aws_cloudwatch_actions as cw_actions
from aws_cdk import aws_events as events
from aws_cdk import aws_kms as kms
from aws_cdk import aws_sns as sns
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from stacks.monitoring.run_alarms import RunAlarms, Thresholds
from trainstack.recipes.schema import Recipe

if TYPE_CHECKING:
    from trainstack.planner import Plan


def summed(metrics: dict[str, cw.IMetric], period: Duration) -> cw.IMetric:
    """One metric that is the sum of several (so one alarm covers every state machine)."""
    if len(metrics) == 1:
        return next(iter(metrics.values()))
    return cw.MathExpression(expression=" + ".join(metrics), using_metrics=metrics, period=period)


class Alarms(Construct):
    """Per-run alarms (through RunAlarms) and the alarms that exist for the deployment as a whole.

    The supervisor's executions are short, so "the launcher failed" means a start or a decision failed
    (a job could not be created, a job's end could not be recorded): a run may be left without its next
    job. Events that EventBridge could not deliver to the supervisor (FailedInvocations of its rule,
    after its retries) leave a run waiting for the reconciler just the same.
    """

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        recipe: Recipe,
        team: str | None,
        plan: Plan,
        state_machines: Sequence[sfn.IStateMachine],
        topic: sns.ITopic,
        key: kms.IKey,
        job_rule: events.IRule | None = None,
        supervision_topic: sns.ITopic | None = None,
    ) -> None:
        super().__init__(scope, id)
        self.run_alarms = RunAlarms(self, "Run", recipe=recipe, team=team, plan=plan, topic=topic, key=key)
        self.thresholds = Thresholds.of(recipe, plan)
        # The supervisor's own alarms also go to the supervision topic (its own key): a failed publish to
        # the first topic is one of the failures they report.
        actions = [cw_actions.SnsAction(t) for t in (topic, supervision_topic) if t is not None]
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
            created.add_alarm_action(*actions)
            return created

        self.execution_failed = alarm(
            "ExecutionFailed",
            summed(
                {
                    f"failed{i}": m.metric_failed(period=five, statistic="Sum")
                    for i, m in enumerate(state_machines)
                },
                five,
            ),
            f"A {recipe.name} run supervisor execution failed (a job was not created, the end of a job "
            "was not decided, a notification failed, or the reconciler failed): the reconciler drives a run "
            "left without its next job within minutes; if this repeats, look at the executions.",
        )
        self.execution_timed_out = alarm(
            "ExecutionTimedOut",
            summed(
                {
                    f"timedOut{i}": m.metric_timed_out(period=five, statistic="Sum")
                    for i, m in enumerate(state_machines)
                },
                five,
            ),
            f"A {recipe.name} run supervisor execution timed out.",
        )
        self.undelivered: cw.Alarm | None = None
        if job_rule is not None:
            self.undelivered = alarm(
                "JobEventsUndelivered",
                cw.Metric(
                    namespace="AWS/Events",
                    metric_name="FailedInvocations",
                    dimensions_map={"RuleName": job_rule.rule_name},
                    statistic="Sum",
                    period=five,
                ),
                f"EventBridge could not start the {recipe.name} run supervisor for a job that ended: "
                "the run reconciler decides that end within minutes (trainstack runs shows it as deciding).",
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
        found = [self.execution_failed, self.execution_timed_out, self.alarm_manager_failed]
        return found + ([self.undelivered] if self.undelivered is not None else [])
