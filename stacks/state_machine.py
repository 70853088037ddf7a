"""The launcher state machine: create the training job, then poll it until it ends.

    LoadRecipe (Pass: the recipe's hyperparameters)
      -> CreateTrainingJob (aws-sdk task; the full request from trainstack.request)
           retries on capacity/quota/throttling errors; a job of that name already exists -> AlreadyLaunched
      -> DescribeTrainingJob -> Finished? --InProgress/Stopping--> Wait -> DescribeTrainingJob
                                          --Completed--> Trained, --Failed/Stopped--> fail

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
# Capacity and quota errors at creation: wait and try again, for up to about a day.
CAPACITY_ERRORS = ["SageMaker.ResourceLimitExceededException", "SageMaker.CapacityErrorException",
                   "SageMaker.ThrottlingException"]
ALREADY_EXISTS = ["SageMaker.ResourceInUseException"]
RECIPE_PATH = "$.Recipe"
HYPERPARAMETERS_EXPRESSION = (
    f"States.JsonMerge({RECIPE_PATH}.HyperParameters, $.{INPUT_HYPERPARAMETER_OVERRIDES}, false)"
)
JOB_NAME_PATH = f"$.{INPUT_JOB_NAME}"


class TrainingStateMachine(Construct):
    def __init__(self, scope: Construct, id: str, *, request: dict[str, Any], hyperparameters: dict[str, str],
                 execution_role: iam.IRole, job_name_prefix: str, key: kms.IKey, timeout: Duration) -> None:
        super().__init__(scope, id)
        stack = Stack.of(self)
        load = sfn.Pass(self, "LoadRecipe", result=sfn.Result.from_object({"HyperParameters": hyperparameters}),
                        result_path=RECIPE_PATH)
        create = sfn.CustomState(self, "CreateTrainingJob", state_json={
            "Type": "Task",
            "Resource": CREATE,
            "Parameters": request,
            "ResultSelector": {"TrainingJobArn.$": "$.TrainingJobArn"},
            "ResultPath": "$.Created",
        })
        create.add_retry(errors=CAPACITY_ERRORS, interval=Duration.minutes(5), backoff_rate=1.5,
                         max_attempts=12, max_delay=Duration.hours(2))
        create.add_catch(sfn.Succeed(self, "AlreadyLaunched", comment="a job of this name (recipe hash) exists"),
                         errors=ALREADY_EXISTS, result_path="$.Error")
        describe = sfn.CustomState(self, "DescribeTrainingJob", state_json={
            "Type": "Task",
            "Resource": DESCRIBE,
            "Parameters": {"TrainingJobName.$": JOB_NAME_PATH},
            "ResultSelector": {"Status.$": "$.TrainingJobStatus", "SecondaryStatus.$": "$.SecondaryStatus"},
            "ResultPath": "$.Job",
        })
        describe.add_retry(errors=["SageMaker.ThrottlingException", "States.Timeout"],
                           interval=Duration.seconds(30), backoff_rate=2, max_attempts=6)
        wait = sfn.Wait(self, "WaitForJob", time=sfn.WaitTime.duration(Duration.seconds(POLL_SECONDS)))
        finished = (
            sfn.Choice(self, "Finished")
            .when(sfn.Condition.string_equals("$.Job.Status", "Completed"), sfn.Succeed(self, "Trained"))
            .when(sfn.Condition.string_equals("$.Job.Status", "Failed"),
                  sfn.Fail(self, "TrainingFailed", error="TrainingFailed",
                           cause="the training job failed; see its FailureReason"))
            .when(sfn.Condition.string_equals("$.Job.Status", "Stopped"),
                  sfn.Fail(self, "TrainingStopped", error="TrainingStopped", cause="the training job was stopped"))
            .otherwise(wait.next(describe))
        )
        definition = load.next(create).next(describe).next(finished)

        self.log_group = logs.LogGroup(self, "Logs", encryption_key=key, retention=logs.RetentionDays.ONE_YEAR,
                                       removal_policy=RemovalPolicy.RETAIN)
        self.state_machine = sfn.StateMachine(
            self, "StateMachine",
            definition_body=sfn.DefinitionBody.from_chainable(definition),
            timeout=timeout,
            tracing_enabled=True,
            logs=sfn.LogOptions(destination=self.log_group, level=sfn.LogLevel.ALL, include_execution_data=True),
        )
        # CDK adds DependsOn the role next to the GetAtt of its ARN; cfn-lint flags the duplicate (W3005).
        # Keep only the dependency on the role's policy (the role's ARN is already referenced).
        policy = self.state_machine.role.node.find_child("DefaultPolicy").node.default_child
        self.state_machine.node.default_child.add_override("DependsOn", [stack.get_logical_id(policy)])
        jobs = stack.format_arn(service="sagemaker", resource="training-job", resource_name=f"{job_name_prefix}-*")
        self.state_machine.add_to_role_policy(iam.PolicyStatement(
            actions=["sagemaker:CreateTrainingJob", "sagemaker:DescribeTrainingJob", "sagemaker:StopTrainingJob",
                     "sagemaker:AddTags"],
            resources=[jobs]))
        self.state_machine.add_to_role_policy(iam.PolicyStatement(
            actions=["iam:PassRole"], resources=[execution_role.role_arn],
            conditions={"StringEquals": {"iam:PassedToService": "sagemaker.amazonaws.com"}}))
        nag.acknowledge(self, "AwsSolutions-IAM5:unscoped-actions", ["Resource::*"])
        nag.acknowledge(self, "AwsSolutions-IAM5:training-jobs",
                        [nag.arn_finding(self, "sagemaker", f"training-job/{job_name_prefix}-*")])
        # Encrypted volumes and output: SageMaker creates grants on the key for the job's resources.
        self.state_machine.add_to_role_policy(iam.PolicyStatement(
            actions=["kms:CreateGrant", "kms:DescribeKey"], resources=[key.key_arn],
            conditions={"Bool": {"kms:GrantIsForAWSResource": "true"}}))
