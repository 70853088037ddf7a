"""The run supervisor: a run's jobs started, watched and continued until the run is done, by two state
machines whose executions are short and end (the definitions: start_job.py, job_ended.py).

- **StartJob** registers job n of a run in the run registry and creates the training job. `trainstack
  launch` and `resume`, and the launch-on-deploy rule, start it.
- **JobEnded** is started by an EventBridge rule on `SageMaker Training Job State Change` (this recipe's
  exact job-name prefix, Completed | Failed | Stopped). It decides with trainstack.aws.supervisor's table,
  records the decision, notifies, and starts the run's next job when the decision says so.

No execution waits on a job, so none comes near Step Functions' 25,000-event history limit however long
a job or a run takes (tests/integration/test_supervisor_emulator.py counts them).
"""

from __future__ import annotations

import math
from typing import Any

from aws_cdk import Aws, Duration, Stack
from aws_cdk import aws_dynamodb as dynamodb
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_sns as sns
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from stacks import nag
from stacks.monitoring.patterns import as_event_pattern, job_state_pattern
from stacks.retries import CAPACITY_RETRY, TRANSIENT
from stacks.state_machine import logged_state_machine, service_role
from stacks.supervisor.asl import SupervisorConstants
from stacks.supervisor.job_ended import job_ended_definition
from stacks.supervisor.start_job import start_job_definition
from trainstack.aws.supervisor import CAPACITY_WAIT_MINUTES

# EventBridge retries a failed delivery to a target for up to 24 hours and 185 attempts (EventBridge user
# guide, "Retrying events": RetryPolicy MaximumEventAgeInSeconds 60-86400, MaximumRetryAttempts 0-185).
DELIVERY_RETRIES = 185
DELIVERY_MAX_AGE = Duration.hours(24)
# An execution's longest wait is a creation retried through a capacity shortage; allow that and slack.
EXECUTION_TIMEOUT = Duration.seconds(
    math.ceil(CAPACITY_RETRY.worst_case_seconds() + 10 * TRANSIENT.worst_case_seconds())
    + CAPACITY_WAIT_MINUTES * 60
).plus(Duration.hours(2))


class RunSupervisor(Construct):
    """StartJob, JobEnded and the rule that starts JobEnded, with least-privilege roles."""

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
        super().__init__(scope, id)
        self.prefix = job_name_prefix
        _, self.start_job = logged_state_machine(
            self,
            log_group_id="StartJobLogs",
            state_machine_id="StartJob",
            definition=start_job_definition(constants, request=request, hyperparameters=hyperparameters),
            key=key,
            retention=logs.RetentionDays.ONE_YEAR,
            timeout=EXECUTION_TIMEOUT,
            description=f"start jobs of {job_name_prefix}* runs",
        )
        _, self.job_ended = logged_state_machine(
            self,
            log_group_id="JobEndedLogs",
            state_machine_id="JobEnded",
            definition=job_ended_definition(
                constants, request=request, hyperparameters=hyperparameters, on_complete=on_complete
            ),
            key=key,
            retention=logs.RetentionDays.ONE_YEAR,
            timeout=EXECUTION_TIMEOUT,
            description=f"decide what {job_name_prefix}* runs do when a job ends",
        )
        volume_key = "VolumeKmsKeyId" in request["ResourceConfig"]  # none on local-NVMe instance types
        for machine in (self.start_job, self.job_ended):
            self._may_start_jobs(machine, execution_role, key, table, topic, volume_key=volume_key)
        self._may_read_ended_jobs(self.job_ended, table)
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

    @property
    def state_machines(self) -> list[sfn.StateMachine]:
        return [self.start_job, self.job_ended]

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
                actions=["sagemaker:CreateTrainingJob", "sagemaker:AddTags"], resources=[self._jobs_arn()]
            ),
            iam.PolicyStatement(
                actions=["iam:PassRole"],
                resources=[execution_role.role_arn],
                conditions={"StringEquals": {"iam:PassedToService": "sagemaker.amazonaws.com"}},
            ),
            iam.PolicyStatement(
                actions=["dynamodb:PutItem", "dynamodb:UpdateItem"], resources=[table.table_arn]
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

    def _may_read_ended_jobs(self, machine: sfn.StateMachine, table: dynamodb.ITable) -> None:
        machine.add_to_role_policy(
            iam.PolicyStatement(actions=["sagemaker:DescribeTrainingJob"], resources=[self._jobs_arn()])
        )
        machine.add_to_role_policy(
            iam.PolicyStatement(actions=["dynamodb:GetItem"], resources=[table.table_arn])
        )
