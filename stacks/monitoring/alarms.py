"""Alarms of a deployment: the per-run alarm manager and the alarms on the launcher itself."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aws_cdk import Duration
from aws_cdk import aws_cloudwatch as cw
from aws_cdk import aws_cloudwatch_actions as cw_actions
from aws_cdk import aws_kms as kms
from aws_cdk import aws_sns as sns
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from stacks.monitoring.run_alarms import RunAlarms, Thresholds
from trainstack.recipe import Recipe

if TYPE_CHECKING:
    from trainstack.planner import Plan


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
