"""Start a training run when a deployment changes the recipe, with no Lambda and no one at a console.

CloudFormation publishes "CloudFormation Stack Status Change" events to EventBridge. A rule on this
stack's own CREATE_COMPLETE / UPDATE_COMPLETE starts the supervisor's StartJob state machine for the
run `<prefix><recipe hash>-deploy`, job 1. A deploy that changes nothing creates no event; an update
that leaves the recipe alone (say, a new alarm) sends the same run again, and StartJob's conditional
registration (no run of that name yet) ends it in AlreadyLaunched. So each resolved recipe trains once,
for as many jobs as the run takes.
"""

from __future__ import annotations

from aws_cdk import Stack
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from stacks.roles import service_role

DEPLOY_SUFFIX = "deploy"
STACK_STATUS_CHANGE = "CloudFormation Stack Status Change"
LAUNCH_STATUSES = ["CREATE_COMPLETE", "UPDATE_COMPLETE"]


class LaunchOnDeploy(Construct):
    def __init__(
        self, scope: Construct, id: str, *, state_machine: sfn.IStateMachine, execution_input: dict
    ) -> None:
        super().__init__(scope, id)
        stack = Stack.of(self)
        self.rule = events.Rule(
            self,
            "Rule",
            description="start the recipe's training run when this stack's deployment completes",
            event_pattern=events.EventPattern(
                source=["aws.cloudformation"],
                detail_type=[STACK_STATUS_CHANGE],
                detail={"stack-id": [stack.stack_id], "status-details": {"status": LAUNCH_STATUSES}},
            ),
            targets=[
                targets.SfnStateMachine(
                    state_machine,
                    input=events.RuleTargetInput.from_object(execution_input),
                    retry_attempts=3,
                    role=service_role(self, "EventsRole", "events.amazonaws.com", "launch the run on deploy"),
                )
            ],
        )
