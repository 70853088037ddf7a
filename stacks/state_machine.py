"""The launcher state machine: create the training job, then poll it until it ends.

    LoadRecipe (Pass: the recipe's hyperparameters) -> FirstAttempt (Attempt = {JobName, Number: 1})
      -> CreateTrainingJob (aws-sdk task; the full request from trainstack.request)
           retries on quota/throttling errors; a job of that name already exists -> AlreadyLaunched
      -> DescribeTrainingJob -> Finished? --InProgress/Stopping--> Wait -> DescribeTrainingJob
                                          --Completed--> Trained, --Stopped--> fail
                                          --Failed--> ReadFailure -> CapacityShortage?
           a CapacityError, attempts left: WaitForCapacity -> NextAttempt (`<JobName>-c<n>`)
                                           -> CreateTrainingJob
           anything else: TrainingFailed (the job's FailureReason as the cause)

Capacity attempts share the run's checkpoint prefix (named by the first job name), so a later attempt
resumes from whatever an earlier one saved.

The SDK integration plus a describe/wait loop (instead of the `.sync` integration) runs end to end in
the local emulator; at one poll a minute its transitions cost cents a day. ResultSelector keeps only
plain string fields (DescribeTrainingJob's datetimes break the emulator's DescribeExecution).
"""

from __future__ import annotations

from typing import Any

from aws_cdk import Duration, RemovalPolicy, Stack
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from stacks import nag
from trainstack.request import INPUT_HYPERPARAMETER_OVERRIDES, INPUT_JOB_NAME

CREATE = "arn:aws:states:::aws-sdk:sagemaker:createTrainingJob"
DESCRIBE = "arn:aws:states:::aws-sdk:sagemaker:describeTrainingJob"
POLL_SECONDS = 60
# Quota errors at creation (the account's instances of this type are all in use): wait for them to free
# up and try again, for up to about a day. Step Functions names SDK errors `SageMaker.<Code>Exception`.
CAPACITY_ERRORS = ["SageMaker.ResourceLimitExceededException", "SageMaker.ThrottlingException"]
ALREADY_EXISTS = ["SageMaker.ResourceInUseException"]
RECIPE_PATH = "$.Recipe"
HYPERPARAMETERS_EXPRESSION = (
    f"States.JsonMerge({RECIPE_PATH}.HyperParameters, $.{INPUT_HYPERPARAMETER_OVERRIDES}, false)"
)
JOB_NAME_PATH = f"$.{INPUT_JOB_NAME}"  # the run's name: checkpoints live under it
ATTEMPT_JOB_NAME_PATH = "$.Attempt.JobName"  # this attempt's training job
MAX_CAPACITY_ATTEMPTS = 4  # `-c2` .. `-c4` still fit SageMaker's 63 characters (trainstack.naming)
assert MAX_CAPACITY_ATTEMPTS <= 9  # one digit: naming.ATTEMPT_SUFFIX_MAX
CAPACITY_WAIT = Duration.minutes(15)
CAPACITY_FAILURE = "*CapacityError*"  # FailureReason "CapacityError: Unable to provision requested ..."


def logged_state_machine(
    scope: Construct,
    *,
    log_group_id: str,
    state_machine_id: str,
    definition: sfn.IChainable,
    key: kms.IKey,
    retention: logs.RetentionDays,
    timeout: Duration,
) -> tuple[logs.LogGroup, sfn.StateMachine]:
    """A state machine that logs ALL (execution data included) to a retained, KMS-encrypted log group,
    with X-Ray tracing. Both are created directly in `scope` under the given IDs (logical IDs stay)."""
    log_group = logs.LogGroup(
        scope, log_group_id, encryption_key=key, retention=retention, removal_policy=RemovalPolicy.RETAIN
    )
    state_machine = sfn.StateMachine(
        scope,
        state_machine_id,
        definition_body=sfn.DefinitionBody.from_chainable(definition),
        timeout=timeout,
        tracing_enabled=True,
        logs=sfn.LogOptions(destination=log_group, level=sfn.LogLevel.ALL, include_execution_data=True),
    )
    # CDK adds DependsOn the role next to the GetAtt of its ARN; cfn-lint flags the duplicate (W3005).
    # Keep only the dependency on the role's policy, which the GetAtt does not imply.
    policy = state_machine.role.node.find_child("DefaultPolicy").node.default_child
    state_machine.node.default_child.add_override("DependsOn", [Stack.of(scope).get_logical_id(policy)])
    return log_group, state_machine


class TrainingStateMachine(Construct):
    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        request: dict[str, Any],
        hyperparameters: dict[str, str],
        execution_role: iam.IRole,
        job_name_prefix: str,
        key: kms.IKey,
        timeout: Duration,
    ) -> None:
        super().__init__(scope, id)
        stack = Stack.of(self)
        load = sfn.Pass(
            self,
            "LoadRecipe",
            result=sfn.Result.from_object({"HyperParameters": hyperparameters}),
            result_path=RECIPE_PATH,
        )
        first = sfn.Pass(
            self,
            "FirstAttempt",
            parameters={"JobName.$": JOB_NAME_PATH, "Number": 1},
            result_path="$.Attempt",
        )
        create = sfn.CustomState(
            self,
            "CreateTrainingJob",
            state_json={
                "Type": "Task",
                "Resource": CREATE,
                "Parameters": request,
                "ResultSelector": {"TrainingJobArn.$": "$.TrainingJobArn"},
                "ResultPath": "$.Created",
            },
        )
        create.add_retry(
            errors=CAPACITY_ERRORS,
            interval=Duration.minutes(5),
            backoff_rate=1.5,
            max_attempts=12,
            max_delay=Duration.hours(2),
        )
        create.add_catch(
            sfn.Succeed(self, "AlreadyLaunched", comment="a job of this name (recipe hash) exists"),
            errors=ALREADY_EXISTS,
            result_path="$.Error",
        )
        describe = sfn.CustomState(
            self,
            "DescribeTrainingJob",
            state_json={
                "Type": "Task",
                "Resource": DESCRIBE,
                "Parameters": {"TrainingJobName.$": ATTEMPT_JOB_NAME_PATH},
                "ResultSelector": {
                    "Status.$": "$.TrainingJobStatus",
                    "SecondaryStatus.$": "$.SecondaryStatus",
                },
                "ResultPath": "$.Job",
            },
        )
        describe.add_retry(
            errors=["SageMaker.ThrottlingException", "States.Timeout"],
            interval=Duration.seconds(30),
            backoff_rate=2,
            max_attempts=6,
        )
        wait = sfn.Wait(self, "WaitForJob", time=sfn.WaitTime.duration(Duration.seconds(POLL_SECONDS)))
        read_failure = sfn.CustomState(
            self,
            "ReadFailure",
            state_json={
                "Type": "Task",
                "Resource": DESCRIBE,
                "Parameters": {"TrainingJobName.$": ATTEMPT_JOB_NAME_PATH},
                "ResultSelector": {"FailureReason.$": "$.FailureReason"},
                "ResultPath": "$.Failure",
            },
        )
        read_failure.add_retry(
            errors=["SageMaker.ThrottlingException"],
            interval=Duration.seconds(30),
            backoff_rate=2,
            max_attempts=6,
        )
        next_attempt = sfn.Pass(
            self,
            "NextAttempt",
            parameters={
                "JobName.$": (
                    f"States.Format('{{}}-c{{}}', {JOB_NAME_PATH}, States.MathAdd($.Attempt.Number, 1))"
                ),
                "Number.$": "States.MathAdd($.Attempt.Number, 1)",
            },
            result_path="$.Attempt",
        )
        failed = sfn.Fail(
            self, "TrainingFailed", error="TrainingFailed", cause_path="$.Failure.FailureReason"
        )
        capacity = (
            sfn.Choice(self, "CapacityShortage")
            .when(
                sfn.Condition.and_(
                    sfn.Condition.string_matches("$.Failure.FailureReason", CAPACITY_FAILURE),
                    sfn.Condition.number_less_than("$.Attempt.Number", MAX_CAPACITY_ATTEMPTS),
                ),
                sfn.Wait(self, "WaitForCapacity", time=sfn.WaitTime.duration(CAPACITY_WAIT))
                .next(next_attempt)
                .next(create),
            )
            .otherwise(failed)
        )
        finished = (
            sfn.Choice(self, "Finished")
            .when(sfn.Condition.string_equals("$.Job.Status", "Completed"), sfn.Succeed(self, "Trained"))
            .when(sfn.Condition.string_equals("$.Job.Status", "Failed"), read_failure.next(capacity))
            .when(
                sfn.Condition.string_equals("$.Job.Status", "Stopped"),
                sfn.Fail(
                    self, "TrainingStopped", error="TrainingStopped", cause="the training job was stopped"
                ),
            )
            .otherwise(wait.next(describe))
        )
        definition = load.next(first).next(create).next(describe).next(finished)

        self.log_group, self.state_machine = logged_state_machine(
            self,
            log_group_id="Logs",
            state_machine_id="StateMachine",
            definition=definition,
            key=key,
            retention=logs.RetentionDays.ONE_YEAR,
            timeout=timeout,
        )
        jobs = stack.format_arn(
            service="sagemaker", resource="training-job", resource_name=f"{job_name_prefix}*"
        )
        self.state_machine.add_to_role_policy(
            iam.PolicyStatement(
                actions=[
                    "sagemaker:CreateTrainingJob",
                    "sagemaker:DescribeTrainingJob",
                    "sagemaker:StopTrainingJob",
                    "sagemaker:AddTags",
                ],
                resources=[jobs],
            )
        )
        self.state_machine.add_to_role_policy(
            iam.PolicyStatement(
                actions=["iam:PassRole"],
                resources=[execution_role.role_arn],
                conditions={"StringEquals": {"iam:PassedToService": "sagemaker.amazonaws.com"}},
            )
        )
        nag.acknowledge(self, "AwsSolutions-IAM5:unscoped-actions", ["Resource::*"])
        nag.acknowledge(
            self,
            "AwsSolutions-IAM5:training-jobs",
            [nag.arn_finding(self, "sagemaker", f"training-job/{job_name_prefix}*")],
        )
        # Encrypted volumes and output: SageMaker creates grants on the key for the job's resources.
        self.state_machine.add_to_role_policy(
            iam.PolicyStatement(
                actions=["kms:CreateGrant", "kms:DescribeKey"],
                resources=[key.key_arn],
                conditions={"Bool": {"kms:GrantIsForAWSResource": "true"}},
            )
        )
