"""Monitoring for one recipe (and team): a dashboard, alarms and notifications.

A P6-B200 cluster costs on the order of a hundred dollars an hour per node, so an idle, stalled or
silently slow run has to reach a person within minutes. Composed into the launcher stack as
`Monitoring(...)`; it reads nothing from the environment, only the typed values it is given.

Job names exist only at run time (`ts-<team>-<recipe>--<run id>-<n>`, see trainstack.recipes.naming), so:
- the dashboard uses SEARCH expressions over `/aws/sagemaker/TrainingJobs` filtered on the prefix;
- the per-run alarms (idle GPUs, near OOM, slow, stalled, disk) are put for the exact job by a small
  state machine when SageMaker reports the job Training, and deleted when it ends (see RunAlarms);
- the job state rules match `detail.TrainingJobName` by the job-name prefix, which is exact: no other
  recipe's or team's job names start with it (see `this_recipe`);
- the run supervisor (stacks/supervisor/) publishes one message per ended job to the topic.
Known limit: SEARCH matches tokens, not string prefixes (see `search_expression`), so the dashboard of
`8b-fp8` also draws the jobs of a recipe whose name extends it (`8b-fp8-128k`); the rules, the alarms'
IAM scope and `trainstack status` and `logs` (trainstack.aws.runs.is_recipe_job) use the exact prefix.

One module per construct family: patterns (pure), notifications, run_alarms, alarms, dashboard; this
module composes them in two steps, because the supervisor needs the topic and the alarms and the
dashboard need the supervisor: `Monitoring(...)` makes the topic, `watch(...)` the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from aws_cdk import aws_events as events
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from stacks.monitoring.alarms import Alarms
from stacks.monitoring.dashboard import Dashboard
from stacks.monitoring.notifications import Notifications
from stacks.monitoring.patterns import (
    JOB_STATE_CHANGE,
    NOTIFY_STATES,
    job_state_pattern,
    run_state_pattern,
    search_expression,
    this_recipe,
)
from stacks.monitoring.run_alarms import AlarmSpec, RunAlarms, Thresholds, run_alarm_specs
from trainstack.recipes.schema import Recipe

if TYPE_CHECKING:
    from trainstack.planner import Plan


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
        key: kms.IKey,
        checkpoint_bucket: s3.IBucket | None = None,
        state_machines: Mapping[str, sfn.IStateMachine] | None = None,
    ) -> None:
        super().__init__(scope, id)
        self._recipe, self._team, self._plan, self._key = recipe, team, plan, key
        self.notifications = Notifications(
            self,
            "Notifications",
            recipe=recipe,
            team=team,
            key=key,
            checkpoint_bucket=checkpoint_bucket,
        )
        self.topic = self.notifications.topic
        if state_machines is not None:
            self.watch(state_machines)

    def watch(
        self, state_machines: Mapping[str, sfn.IStateMachine], job_rule: events.IRule | None = None
    ) -> None:
        """The alarms and the dashboard over the supervisor's state machines (by label) and its rule."""
        self.alarms = Alarms(
            self,
            "Alarms",
            recipe=self._recipe,
            team=self._team,
            plan=self._plan,
            state_machines=list(state_machines.values()),
            topic=self.topic,
            key=self._key,
            job_rule=job_rule,
            supervision_topic=self.notifications.supervision_topic,
        )
        self.dashboard = Dashboard(
            self,
            "Dashboard",
            recipe=self._recipe,
            team=self._team,
            plan=self._plan,
            state_machines=state_machines,
            alarms=self.alarms.static,
            run_alarm_specs=self.alarms.run_alarms.specs,
        ).dashboard


__all__ = [
    "JOB_STATE_CHANGE",
    "NOTIFY_STATES",
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
