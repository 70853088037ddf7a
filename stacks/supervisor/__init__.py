"""The run supervisor: a run's jobs started, watched and continued until the run is done, by state
machines whose executions are short and end (the definitions: start_job.py, job_ended.py, reconcile.py,
stalled.py).

- **StartJob** registers job n of a run in the run registry and creates the training job. `trainstack
  launch` and `resume`, the launch-on-deploy rule and the reconciler start it. A launch records the
  run's CreateTrainingJob request; every later job of the run is built from that record.
- **JobEnded** is started by an EventBridge rule on `SageMaker Training Job State Change` (this recipe's
  exact job-name prefix, Completed | Failed | Stopped). It decides with trainstack.aws.supervisor's table,
  records the decision, starts the run's next job when the decision says so, and notifies last.
- **Reconcile**, every RECONCILE_MINUTES on an EventBridge Scheduler schedule, drives the runs whose
  event was lost or whose decision failed half-way (reconcile.py).
- **StopStalled**, started by the per-run Stalled alarm through EventBridge, stops a job that makes no
  progress so that its run continues (stalled.py).

No execution waits on a job, so none comes near Step Functions' 25,000-event history limit however long
a job or a run takes (tests/integration/test_supervisor_emulator.py counts them).
"""

from __future__ import annotations

import math
from typing import Any

from aws_cdk import ArnFormat, Aws, Duration, Stack
from aws_cdk import aws_dynamodb as dynamodb
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_scheduler as scheduler
from aws_cdk import aws_scheduler_targets as scheduler_targets
from aws_cdk import aws_sns as sns
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from stacks import nag
from stacks.monitoring.patterns import as_event_pattern, job_state_pattern
from stacks.retries import CAPACITY_RETRY, TRANSIENT
from stacks.roles import service_role
from stacks.state_machine import logged_state_machine
from stacks.supervisor.asl import SupervisorConstants
from stacks.supervisor.job_ended import job_ended_definition
from stacks.supervisor.reconcile import reconcile_definition
from stacks.supervisor.stalled import stalled_alarm_pattern, stalled_definition
from stacks.supervisor.start_job import start_job_definition
from trainstack.aws.supervisor import CAPACITY_WAIT_MAX_MINUTES, RECONCILE_MINUTES

# EventBridge retries a failed delivery to a target for up to 24 hours and 185 attempts (EventBridge user
# guide, "Retrying events": RetryPolicy MaximumEventAgeInSeconds 60-86400, MaximumRetryAttempts 0-185).
DELIVERY_RETRIES = 185
DELIVERY_MAX_AGE = Duration.hours(24)
# An execution's longest wait is a creation retried through a capacity shortage; allow that and slack.
EXECUTION_TIMEOUT = Duration.seconds(
    math.ceil(CAPACITY_RETRY.worst_case_seconds() + 10 * TRANSIENT.worst_case_seconds())
    + CAPACITY_WAIT_MAX_MINUTES * 60
).plus(Duration.hours(2))
# A reconciler pass reads the registry a page at a time and starts executions; it never waits on one.
RECONCILE_TIMEOUT = Duration.minutes(RECONCILE_MINUTES)


class RunSupervisor(Construct):
    """StartJob, JobEnded, the reconciler, the stall handler, and what starts them, with least-privilege
    roles."""

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        constants: SupervisorConstants,
        request: dict[str, Any],
        hyperparameters: dict[str, str],
        execution_role: iam.IRole,
        job_name_prefix: str,
        key: kms.IKey,
        table: dynamodb.ITable,
        topic: sns.ITopic,
        on_complete: dict[str, Any] | None = None,
    ) -> None:
        """`on_complete`: a state JobEnded runs when a run completes, before it notifies (the model export
        of `export.on_complete`, stacks/export.py); it goes on to Notify whatever it does."""
        super().__init__(scope, id)
        self.prefix = job_name_prefix
        self.start_job = self._machine(
            "StartJob",
            start_job_definition(constants, request=request, hyperparameters=hyperparameters),
            key,
            f"start jobs of {self.prefix}* runs",
        )
        self.job_ended = self._machine(
            "JobEnded",
            job_ended_definition(constants, on_complete=on_complete),
            key,
            f"decide what {self.prefix}* runs do when a job ends",
        )
        volume_key = "VolumeKmsKeyId" in request["ResourceConfig"]  # none on local-NVMe instance types
        for machine in (self.start_job, self.job_ended):
            self._may_start_jobs(machine, execution_role, key, table, topic, volume_key=volume_key)
        self._may(
            self.job_ended, ["sagemaker:DescribeTrainingJob", "sagemaker:UpdateTrainingJob"], self._jobs_arn()
        )
        self.pattern = job_state_pattern(job_name_prefix)
        self.rule = events.Rule(
            self,
            "JobStateChanged",
            description=f"A training job of a {job_name_prefix}* run completed, failed or stopped",
            event_pattern=as_event_pattern(self.pattern),
        )
        self.rule.add_target(
            targets.SfnStateMachine(
                self.job_ended,
                role=service_role(self, "EventsRole", "events.amazonaws.com", "start JobEnded executions"),
                retry_attempts=DELIVERY_RETRIES,
                max_event_age=DELIVERY_MAX_AGE,
            )
        )
        self._reconciler(table, key)
        self._stall_handler(table, key)

    @property
    def state_machines(self) -> list[sfn.StateMachine]:
        return [self.start_job, self.job_ended, self.reconcile, self.stop_stalled]

    def _machine(
        self,
        name: str,
        definition: dict[str, Any],
        key: kms.IKey,
        description: str,
        timeout: Duration | None = None,
    ) -> sfn.StateMachine:
        _, machine = logged_state_machine(
            self,
            log_group_id=f"{name}Logs",
            state_machine_id=name,
            definition=definition,
            key=key,
            retention=logs.RetentionDays.ONE_YEAR,
            timeout=timeout or EXECUTION_TIMEOUT,
            description=description,
        )
        return machine

    def _reconciler(self, table: dynamodb.ITable, key: kms.IKey) -> None:
        self.reconcile = self._machine(
            "Reconcile",
            reconcile_definition(
                table_name=table.table_name,
                start_job_arn=self.start_job.state_machine_arn,
                job_ended_arn=self.job_ended.state_machine_arn,
            ),
            key,
            f"drive {self.prefix}* runs whose job end was not decided or whose next job was not created",
            timeout=RECONCILE_TIMEOUT,
        )
        machine = self.reconcile
        self._may(machine, ["dynamodb:Scan", "dynamodb:GetItem"], table.table_arn)
        self._may_decrypt_registry(machine, key)
        self._may(machine, ["sagemaker:StopTrainingJob"], self._jobs_arn())
        # ListTrainingJobs has no resource-level permissions (Resource "*", acknowledged in stacks/nag.py).
        self._may(machine, ["sagemaker:ListTrainingJobs"], "*")
        for target in (self.start_job, self.job_ended):
            self._may(machine, ["states:StartExecution"], target.state_machine_arn)
            self._may(machine, ["states:DescribeExecution"], self._executions_arn(target))
        self.schedule = scheduler.Schedule(
            self,
            "ReconcileSchedule",
            description=f"Reconcile the {self.prefix}* runs every {RECONCILE_MINUTES} minutes",
            schedule=scheduler.ScheduleExpression.rate(Duration.minutes(RECONCILE_MINUTES)),
            target=scheduler_targets.StepFunctionsStartExecution(
                machine,
                input=scheduler.ScheduleTargetInput.from_object({}),
                role=service_role(
                    self,
                    "ScheduleRole",
                    "scheduler.amazonaws.com",
                    "start the run reconciler on its schedule",
                ),
                retry_attempts=3,
            ),
        )

    def _stall_handler(self, table: dynamodb.ITable, key: kms.IKey) -> None:
        self.stop_stalled = self._machine(
            "StopStalled",
            stalled_definition(table_name=table.table_name),
            key,
            f"stop {self.prefix}* jobs that make no progress, so their runs continue",
            timeout=Duration.minutes(15),
        )
        machine = self.stop_stalled
        self._may(machine, ["sagemaker:DescribeTrainingJob", "sagemaker:StopTrainingJob"], self._jobs_arn())
        self._may(machine, ["dynamodb:GetItem", "dynamodb:UpdateItem"], table.table_arn)
        self._may_decrypt_registry(machine, key)
        self.stall_pattern = stalled_alarm_pattern(self.prefix)
        self.stall_rule = events.Rule(
            self,
            "JobStalled",
            description=f"A {self.prefix}* job's Stalled alarm went to ALARM",
            event_pattern=as_event_pattern(self.stall_pattern),
        )
        self.stall_rule.add_target(
            targets.SfnStateMachine(
                machine,
                role=service_role(
                    self, "StallEventsRole", "events.amazonaws.com", "start StopStalled executions"
                ),
                retry_attempts=DELIVERY_RETRIES,
                max_event_age=DELIVERY_MAX_AGE,
            )
        )
        for role_of in (self.reconcile, machine):
            nag.acknowledge(role_of.role, "AwsSolutions-IAM5:unscoped-actions", ["Resource::*"])
            nag.acknowledge(
                role_of.role,
                "AwsSolutions-IAM5:training-jobs",
                [nag.arn_finding(self, "sagemaker", f"training-job/{self.prefix}*")],
            )
        nag.acknowledge(
            self.reconcile.role,
            "AwsSolutions-IAM5:supervisor-executions",
            [f"Resource::{self._executions_finding(m)}" for m in (self.start_job, self.job_ended)],
        )

    def _may(self, machine: sfn.StateMachine, actions: list[str], resource: str) -> None:
        machine.add_to_role_policy(iam.PolicyStatement(actions=actions, resources=[resource]))

    def _may_decrypt_registry(self, machine: sfn.StateMachine, key: kms.IKey) -> None:
        machine.add_to_role_policy(
            iam.PolicyStatement(
                actions=["kms:Decrypt", "kms:Encrypt", "kms:GenerateDataKey"],
                resources=[key.key_arn],
                conditions={"StringEquals": {"kms:ViaService": f"dynamodb.{Aws.REGION}.amazonaws.com"}},
            )
        )

    def _executions_arn(self, machine: sfn.StateMachine) -> str:
        """Every execution of `machine` (execution names are made per attempt)."""
        return Stack.of(self).format_arn(
            service="states",
            resource="execution",
            resource_name=f"{machine.state_machine_name}:*",
            arn_format=ArnFormat.COLON_RESOURCE_NAME,
        )

    def _executions_finding(self, machine: sfn.StateMachine) -> str:
        name = Stack.of(self).get_logical_id(machine.node.default_child)
        return nag.arn_finding(self, "states", f"execution:<{name}.Name>:*").removeprefix("Resource::")

    def _jobs_arn(self) -> str:
        return Stack.of(self).format_arn(
            service="sagemaker", resource="training-job", resource_name=f"{self.prefix}*"
        )

    def _may_start_jobs(
        self,
        machine: sfn.StateMachine,
        execution_role: iam.IRole,
        key: kms.IKey,
        table: dynamodb.ITable,
        topic: sns.ITopic,
        *,
        volume_key: bool,
    ) -> None:
        region = Aws.REGION
        statements = [
            # AddTags: CreateTrainingJob with Tags needs it on the job.
            iam.PolicyStatement(
                actions=["sagemaker:CreateTrainingJob", "sagemaker:AddTags", "sagemaker:StopTrainingJob"],
                resources=[self._jobs_arn()],
            ),
            iam.PolicyStatement(
                actions=["iam:PassRole"],
                resources=[execution_role.role_arn],
                conditions={"StringEquals": {"iam:PassedToService": "sagemaker.amazonaws.com"}},
            ),
            iam.PolicyStatement(
                actions=["dynamodb:PutItem", "dynamodb:UpdateItem", "dynamodb:GetItem"],
                resources=[table.table_arn],
            ),
            iam.PolicyStatement(actions=["sns:Publish"], resources=[topic.topic_arn]),
            # The job's encrypted output (and volume): SageMaker checks the key. DescribeKey is not a grant
            # operation, so it carries no kms:GrantIsForAWSResource condition.
            iam.PolicyStatement(actions=["kms:DescribeKey"], resources=[key.key_arn]),
            # The registry table and the topic are encrypted with the same key; only through those services.
            iam.PolicyStatement(
                actions=["kms:Decrypt", "kms:Encrypt", "kms:GenerateDataKey"],
                resources=[key.key_arn],
                conditions={
                    "StringEquals": {
                        "kms:ViaService": [f"dynamodb.{region}.amazonaws.com", f"sns.{region}.amazonaws.com"]
                    }
                },
            ),
        ]
        if volume_key:
            # An EBS volume encrypted with the key: SageMaker creates a grant on it for the job's volume.
            # Only grant operations carry kms:GrantIsForAWSResource (KMS developer guide, grants).
            statements.append(
                iam.PolicyStatement(
                    actions=["kms:CreateGrant"],
                    resources=[key.key_arn],
                    conditions={"Bool": {"kms:GrantIsForAWSResource": "true"}},
                )
            )
        for statement in statements:
            machine.add_to_role_policy(statement)
        nag.acknowledge(machine.role, "AwsSolutions-IAM5:unscoped-actions", ["Resource::*"])
        nag.acknowledge(
            machine.role,
            "AwsSolutions-IAM5:training-jobs",
            [nag.arn_finding(self, "sagemaker", f"training-job/{self.prefix}*")],
        )
