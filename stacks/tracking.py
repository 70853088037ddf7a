"""Experiment tracking: a team's SageMaker MLflow App, and the execution role's access to a tracker.

`tracking.mlflow: managed` gives a team ONE MLflow App for all of its recipes, so their runs can be
compared in one place. Every recipe of a team has its own Data and Launcher stacks, so the App cannot live
in any one of them (which recipe's stack would own it, and what if that recipe is retired?): it lives in
the team's own stack, `Trainstack-<team>-Tracking` (stacks/app.py adds it once per team that uses it),
which exports the App's ARN as `Trainstack-<team>-MlflowAppArn`; each launcher of the team imports it and
depends on that stack, so `cdk deploy --all` (and every pipeline stage) deploys it first.

Why an MLflow App (`AWS::SageMaker::MlflowApp`, CDK `aws_sagemaker.CfnMlflowApp`) and not a tracking
server (`CfnMlflowTrackingServer`): the App is SageMaker's serverless managed MLflow, with no instance size
to pick and no hourly charge while nobody logs (a tracking server bills its size every hour it exists); both
take the same ARN-based client (sagemaker-mlflow) and the same `MlflowConfig`. A team that already runs a
tracking server names its ARN in `tracking.mlflow` instead.

The artifact store is a bucket of the team's tracking stack, in the same account as its checkpoint buckets:
SSE-KMS with the stack's own key (rotation on), versioned, SSL only, server access logs, retained, like
the checkpoint bucket (stacks/storage.py). The App reaches it through a role only SageMaker may assume for
this account's MLflow Apps. The App, bucket and key are retained on delete: experiment history outlives a
`cdk destroy`.
"""

from __future__ import annotations

from typing import Any

from aws_cdk import CfnOutput, Duration, RemovalPolicy, Stack
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_sagemaker as sagemaker
from constructs import Construct

from stacks import nag
from stacks.roles import service_role
from stacks.storage import EncryptionKey, add_logged_kms_bucket
from trainstack.aws.tracking import mlflow_app_name, mlflow_arn_export

ARTIFACT_PREFIX = "artifacts"
INCOMPLETE_UPLOAD_DAYS = 7
NONCURRENT_EXPIRY_DAYS = 90

# What a training job's execution role may do on its tracker: find or create the experiment and the run,
# read it back, log params/tags/metrics in batches, set its status, and register exported models. Action
# names from the Service Authorization Reference (Amazon SageMaker with MLflow, prefix sagemaker-mlflow);
# an MLflow App's API additionally needs sagemaker:CallMlflowAppApi and the plugin reads the App with
# sagemaker:DescribeMlflowApp (as AWS's own policies for MLflow App users list them). No wildcard actions.
MLFLOW_JOB_ACTIONS = (
    "sagemaker-mlflow:GetExperimentByName",
    "sagemaker-mlflow:CreateExperiment",
    "sagemaker-mlflow:SearchRuns",
    "sagemaker-mlflow:CreateRun",
    "sagemaker-mlflow:GetRun",
    "sagemaker-mlflow:UpdateRun",
    "sagemaker-mlflow:LogBatch",
    "sagemaker-mlflow:CreateRegisteredModel",
    "sagemaker-mlflow:GetRegisteredModel",
    "sagemaker-mlflow:CreateModelVersion",
)
MLFLOW_APP_ACTIONS = ("sagemaker:CallMlflowAppApi", "sagemaker:DescribeMlflowApp")


def allow_tracking(policy: iam.Policy, mlflow_arn: str, *, app: bool) -> None:
    """Add the MLflow statement for exactly the tracker `mlflow_arn` to a job's execution-role policy."""
    actions = [*MLFLOW_JOB_ACTIONS, *(MLFLOW_APP_ACTIONS if app else ())]
    policy.add_statements(iam.PolicyStatement(actions=actions, resources=[mlflow_arn]))


class TeamMlflow(Construct):
    """A team's MLflow App, its KMS-encrypted, retained artifact bucket and the role the App uses on it."""

    def __init__(self, scope: Construct, id: str, *, team: str, key: kms.IKey) -> None:
        super().__init__(scope, id)
        stack = Stack.of(self)
        self.bucket, self.access_logs = add_logged_kms_bucket(
            self,
            key=key,
            log_prefix="mlflow/",
            lifecycle_rules=[
                s3.LifecycleRule(
                    abort_incomplete_multipart_upload_after=Duration.days(INCOMPLETE_UPLOAD_DAYS),
                    noncurrent_version_expiration=Duration.days(NONCURRENT_EXPIRY_DAYS),
                )
            ],
            access_logs_acknowledgment="AwsSolutions-S1:mlflow-access-logs",
        )
        apps = stack.format_arn(service="sagemaker", resource="mlflow-app", resource_name="*")
        self.role = service_role(
            self,
            "Role",
            "sagemaker.amazonaws.com",
            f"SageMaker MLflow App of team {team}: its artifact store only",
            source_arn=apps,
            account=stack.account,
        )
        objects = self.bucket.arn_for_objects(f"{ARTIFACT_PREFIX}/*")
        policy = iam.Policy(
            self,
            "Policy",
            roles=[self.role],
            statements=[
                iam.PolicyStatement(
                    actions=["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"],
                    resources=[objects],
                ),
                iam.PolicyStatement(
                    actions=["s3:ListBucket", "s3:GetBucketLocation"], resources=[self.bucket.bucket_arn]
                ),
                iam.PolicyStatement(
                    actions=["kms:Decrypt", "kms:Encrypt", "kms:GenerateDataKey", "kms:DescribeKey"],
                    resources=[key.key_arn],
                ),
            ],
        )
        artifacts = (
            f"Resource::<{stack.get_logical_id(self.bucket.node.default_child)}.Arn>/{ARTIFACT_PREFIX}/*"
        )
        nag.acknowledge(policy, "AwsSolutions-IAM5:mlflow-artifacts", [artifacts])
        self.app = sagemaker.CfnMlflowApp(
            self,
            "App",
            name=mlflow_app_name(team),
            artifact_store_uri=f"s3://{self.bucket.bucket_name}/{ARTIFACT_PREFIX}/",
            role_arn=self.role.role_arn,
            # Exports are registered by trainstack (trainstack.aws.tracking.register_export), not copied
            # into SageMaker's Model Registry behind the team's back.
            model_registration_mode="AutoModelRegistrationDisabled",
        )
        self.app.node.add_dependency(policy)  # the App checks its artifact store access on creation
        self.app.apply_removal_policy(RemovalPolicy.RETAIN)
        self.arn = self.app.attr_arn


class TrackingStack(Stack):
    """`Trainstack-<team>-Tracking`: the team's MLflow App, shared by all of its recipes."""

    def __init__(self, scope: Construct, id: str, *, team: str, **kwargs: Any) -> None:
        super().__init__(
            scope,
            id,
            termination_protection=True,
            description=f"trainstack team {team}: the MLflow App all of its recipes' runs are tracked in",
            **kwargs,
        )
        self.node.set_context("@aws-cdk/aws-s3:serverAccessLogsUseBucketPolicy", True)
        key = EncryptionKey(self, "Encryption", description=f"trainstack team {team}: MLflow artifacts").key
        self.mlflow = TeamMlflow(self, "Mlflow", team=team, key=key)
        CfnOutput(self, "MlflowAppArn", value=self.mlflow.arn, export_name=mlflow_arn_export(team))
        CfnOutput(self, "ArtifactBucketName", value=self.mlflow.bucket.bucket_name)
