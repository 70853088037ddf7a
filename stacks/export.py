"""The Export state machine: one export of a run's checkpoint as a Hugging Face folder (docs/models.md).

    ReadRun -> Registered? -> Counted (n = exports so far + 1) -> WithinLimit? -> CreateExportJob -> Record

Started by `trainstack export RUN [--step N]` and, for a recipe with `export: {on_complete: true}`, by
the run supervisor's JobEnded machine when a run completes (the one state `export_on_complete_state`
returns). It creates the export training job (trainstack.aws.export_job: CPU instance, the training
image's `python -m trainer.export`) and appends the export to the run's registry item (`exports`), which
`trainstack runs` lists. Its executions end once the job is created: nothing waits on the job.
"""

from __future__ import annotations

from typing import Any

from aws_cdk import Aws, Duration, Stack
from aws_cdk import aws_dynamodb as dynamodb
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_sns as sns
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from stacks import nag
from stacks.retries import retriers
from stacks.state_machine import logged_state_machine
from stacks.supervisor.asl import CREATE, GET_ITEM, PUBLISH, UPDATE_ITEM, fmt, task
from trainstack.aws.export_job import EXPORTS_PER_RUN, STEP_ARGUMENT, export_job_request, exports_prefix
from trainstack.aws.request import Runtime
from trainstack.aws.supervisor import EXPORT_OF_ENV, EXPORT_SUBJECT, export_failed_template
from trainstack.recipes.schema import Recipe

START_EXECUTION = "arn:aws:states:::states:startExecution"


def export_definition(
    request: dict[str, Any],
    table_name: str,
    exports_base: str,
    topic_arn: str | None = None,
    message_template: str = "",
) -> dict[str, Any]:
    """The ASL document; `request` is export_job_request with the Runtime markers below, `exports_base`
    `s3://<bucket>/exports/<team>/<recipe>/` (each run's exports go under its run id there). When
    SageMaker refuses the export job, the refusal is appended to the run's `export_failures` and, with
    `topic_arn`, published there (an on-complete export has no one waiting on it) before it fails;
    `message_template`: trainstack.aws.supervisor.export_failed_template of the deployment."""
    key = {"run": {"S.$": "$.Run"}}
    refused = "export job {} was not created: {}"
    not_created: dict[str, Any] = {
        "RecordNotCreated": task(
            UPDATE_ITEM,
            {
                "TableName": table_name,
                "Key": key,
                "UpdateExpression": (
                    "SET #failures = list_append(if_not_exists(#failures, :none), :failure)"
                ),
                "ExpressionAttributeNames": {"#failures": "export_failures"},
                "ExpressionAttributeValues": {
                    ":none": {"L": []},
                    ":failure": {
                        "L": [
                            {
                                "M": {
                                    "job": {"S.$": "$.Export.Job"},
                                    "status": {"S": "NotCreated"},
                                    "reason": {"S.$": "$.Error.Cause"},
                                    "at": {"S.$": "$$.State.EnteredTime"},
                                }
                            }
                        ]
                    },
                },
            },
            ResultPath=None,
            Catch=[
                {
                    "ErrorEquals": ["States.ALL"],
                    "Next": "NotifyNotCreated" if topic_arn else "NotCreated",
                    "ResultPath": None,
                }
            ],
            Next="NotifyNotCreated" if topic_arn else "NotCreated",
        ),
        "NotCreated": {"Type": "Fail", "Error": "ExportNotCreated", "CausePath": "$.Error.Cause"},
    }
    if topic_arn:
        not_created["NotifyNotCreated"] = task(
            PUBLISH,
            {
                "TopicArn": topic_arn,
                "Subject.$": fmt(EXPORT_SUBJECT, "$.Run"),
                "Message.$": fmt(
                    message_template, "$.Run", fmt(refused, "$.Export.Job", "$.Error.Cause"), "$.Run"
                ),
            },
            ResultPath=None,
            Catch=[{"ErrorEquals": ["States.ALL"], "Next": "NotCreated", "ResultPath": None}],
            Next="NotCreated",
        )
    return {
        "Comment": "Export a run's checkpoint as a Hugging Face folder (a CPU training job)",
        "StartAt": "ReadRun",
        "States": {
            "ReadRun": task(
                GET_ITEM,
                {"TableName": table_name, "Key": key, "ConsistentRead": True},
                ResultPath="$.Registry",
                Next="Registered",
            ),
            "Registered": {
                "Type": "Choice",
                "Choices": [{"Variable": "$.Registry.Item.request", "IsPresent": True, "Next": "Recorded"}],
                "Default": "NoSuchRun",
            },
            "NoSuchRun": {
                "Type": "Fail",
                "Error": "NoSuchRun",
                "Cause": "the run is not in the run registry (or has no recorded request)",
            },
            # Every export setting (export.dtype, export.tokenizer, the model) is the run's own recorded
            # request's, as resumes changed it: never the recipe deployed since.
            "Recorded": {
                "Type": "Pass",
                "Parameters": {"Request.$": "States.StringToJson($.Registry.Item.request.S)"},
                "ResultPath": "$.Recorded",
                "Next": "HasExports",
            },
            "HasExports": {
                "Type": "Choice",
                "Choices": [{"Variable": "$.Registry.Item.exports", "IsPresent": True, "Next": "Counted"}],
                "Default": "First",
            },
            "First": {
                "Type": "Pass",
                "Result": {"Index": 1},
                "ResultPath": "$.Export",
                "Next": "WithinLimit",
            },
            "Counted": {
                "Type": "Pass",
                "Parameters": {"Index.$": "States.MathAdd(States.ArrayLength($.Registry.Item.exports.L), 1)"},
                "ResultPath": "$.Export",
                "Next": "WithinLimit",
            },
            "WithinLimit": {
                "Type": "Choice",
                "Choices": [
                    {
                        "Variable": "$.Export.Index",
                        "NumericGreaterThan": EXPORTS_PER_RUN,
                        "Next": "ExportLimit",
                    }
                ],
                "Default": "Names",
            },
            "ExportLimit": {
                "Type": "Fail",
                "Error": "ExportLimit",
                "Cause": f"a run has at most {EXPORTS_PER_RUN} exports (job names <run>-X1 to -X9)",
            },
            "Names": {
                "Type": "Pass",
                "Parameters": {
                    "Job.$": fmt("{}-X{}", "$.Run", "$.Export.Index"),
                    "Index.$": "$.Export.Index",
                    "Checkpoint.$": "$.Registry.Item.checkpoint_uri.S",
                    "OutParent.$": fmt(exports_base + "{}/", "$.RunId"),
                },
                "ResultPath": "$.Export",
                "Next": "CreateExportJob",
            },
            "CreateExportJob": task(
                CREATE,
                request,
                ResultPath=None,
                Catch=[{"ErrorEquals": ["States.ALL"], "Next": "RecordNotCreated", "ResultPath": "$.Error"}],
                Next="Record",
            ),
            **not_created,
            "Record": task(
                UPDATE_ITEM,
                {
                    "TableName": table_name,
                    "Key": key,
                    "UpdateExpression": "SET #exports = list_append(if_not_exists(#exports, :none), :export)",
                    "ExpressionAttributeNames": {"#exports": "exports"},
                    "ExpressionAttributeValues": {
                        ":none": {"L": []},
                        ":export": {
                            "L": [
                                {
                                    "M": {
                                        "job": {"S.$": "$.Export.Job"},
                                        "step": {"N.$": "States.Format('{}', $.Step)"},
                                        "out_parent": {"S.$": "$.Export.OutParent"},
                                        "reason": {"S.$": "$.Reason"},
                                        "requested": {"S.$": "$$.State.EnteredTime"},
                                    }
                                }
                            ]
                        },
                    },
                },
                ResultPath=None,
                Next="Started",
            ),
            "Started": {"Type": "Succeed", "OutputPath": "$.Export"},
        },
    }


RECORDED_HYPERPARAMETERS = "$.Recorded.Request.HyperParameters"


def recorded_export_request(request: dict[str, Any]) -> dict[str, Any]:
    """The deployed export request with the run's recorded hyperparameters (its export settings) and
    its run named in the environment (EXPORT_OF_ENV: the supervisor records a failed export)."""
    out = {k: v for k, v in request.items() if k != "HyperParameters"}
    out["HyperParameters.$"] = RECORDED_HYPERPARAMETERS
    out["Environment"] = {**request.get("Environment", {}), f"{EXPORT_OF_ENV}.$": "$.Run"}
    return out


class ExportMachine(Construct):
    """The Export state machine and its least-privilege role."""

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        recipe: Recipe,
        team: str | None,
        job_name_prefix: str,
        bucket_name: str,
        image_uri: str,
        execution_role: iam.IRole,
        key: kms.IKey,
        table: dynamodb.ITable,
        table_name: str,
        topic: sns.ITopic | None = None,
    ) -> None:
        """`topic`: where a refused export job is published (the deployment's notifications)."""
        super().__init__(scope, id)
        stack = Stack.of(self)
        request = recorded_export_request(
            export_job_request(
                recipe,
                team,
                job_name=Runtime("$.Export.Job"),
                checkpoint_uri=Runtime("$.Export.Checkpoint"),
                out_parent=Runtime("$.Export.OutParent"),
                step=STEP_ARGUMENT,
                role_arn=execution_role.role_arn,
                image_uri=image_uri,
                bucket_name=bucket_name,
                kms_key_arn=key.key_arn,
                region=stack.region,
            )
        )
        definition = export_definition(
            request,
            table_name,
            f"s3://{bucket_name}/{exports_prefix(recipe, team)}/",
            topic.topic_arn if topic is not None else None,
            export_failed_template(recipe.name, team or recipe.tags.team, f" --team {team}" if team else ""),
        )
        _, self.state_machine = logged_state_machine(
            self,
            log_group_id="Logs",
            state_machine_id="Export",
            definition=definition,
            key=key,
            retention=logs.RetentionDays.ONE_YEAR,
            timeout=Duration.minutes(30),
            description=f"export checkpoints of {job_name_prefix}* runs as Hugging Face folders",
        )
        jobs = stack.format_arn(
            service="sagemaker", resource="training-job", resource_name=f"{job_name_prefix}*"
        )
        region = Aws.REGION
        for statement in (
            iam.PolicyStatement(
                actions=["sagemaker:CreateTrainingJob", "sagemaker:AddTags"], resources=[jobs]
            ),
            iam.PolicyStatement(
                actions=["iam:PassRole"],
                resources=[execution_role.role_arn],
                conditions={"StringEquals": {"iam:PassedToService": "sagemaker.amazonaws.com"}},
            ),
            iam.PolicyStatement(
                actions=["dynamodb:GetItem", "dynamodb:UpdateItem"], resources=[table.table_arn]
            ),
            iam.PolicyStatement(actions=["kms:DescribeKey"], resources=[key.key_arn]),
            iam.PolicyStatement(
                actions=["kms:Decrypt", "kms:Encrypt", "kms:GenerateDataKey"],
                resources=[key.key_arn],
                conditions={"StringEquals": {"kms:ViaService": f"dynamodb.{region}.amazonaws.com"}},
            ),
            # A refused export is published to the deployment's topic, encrypted with the same key.
            *(
                [
                    iam.PolicyStatement(actions=["sns:Publish"], resources=[topic.topic_arn]),
                    iam.PolicyStatement(
                        actions=["kms:Decrypt", "kms:GenerateDataKey"],
                        resources=[key.key_arn],
                        conditions={"StringEquals": {"kms:ViaService": f"sns.{region}.amazonaws.com"}},
                    ),
                ]
                if topic is not None
                else []
            ),
            # The export's EBS volume is encrypted with the key: SageMaker creates a grant for it.
            iam.PolicyStatement(
                actions=["kms:CreateGrant"],
                resources=[key.key_arn],
                conditions={"Bool": {"kms:GrantIsForAWSResource": "true"}},
            ),
        ):
            self.state_machine.add_to_role_policy(statement)
        nag.acknowledge(self.state_machine.role, "AwsSolutions-IAM5:unscoped-actions", ["Resource::*"])
        nag.acknowledge(
            self.state_machine.role,
            "AwsSolutions-IAM5:training-jobs",
            [nag.arn_finding(self, "sagemaker", f"training-job/{job_name_prefix}*")],
        )

    def allow_start(self, machine: sfn.StateMachine) -> None:
        """Let `machine` (the run supervisor's JobEnded) start exports."""
        machine.add_to_role_policy(
            iam.PolicyStatement(
                actions=["states:StartExecution"], resources=[self.state_machine.state_machine_arn]
            )
        )


def export_on_complete_state(export_machine_arn: str) -> dict[str, Any]:
    """JobEnded's one state for `export.on_complete`: start an export of the completed run and go on
    (fire and forget: the run is recorded completed whatever the export does)."""
    return {
        "Type": "Task",
        "Resource": START_EXECUTION,
        "Parameters": {
            "StateMachineArn": export_machine_arn,
            "Input": {
                "Run.$": "$.Numbers.Run",
                "RunId.$": "$.Registry.Item.run_id.S",
                "Step": 0,
                "Reason": "on_complete",
            },
        },
        "ResultPath": None,
        "Retry": retriers(START_EXECUTION),
        "Catch": [{"ErrorEquals": ["States.ALL"], "ResultPath": "$.ExportError", "Next": "Notify"}],
    }
