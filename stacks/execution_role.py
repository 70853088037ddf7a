"""The SageMaker execution role: this recipe's bucket prefixes, key, image, logs and metrics only."""

from __future__ import annotations

from aws_cdk import ArnFormat, Stack
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from constructs import Construct

from stacks import nag
from trainstack import naming
from trainstack.config import Deployment
from trainstack.request import output_prefix

TRAINING_LOG_GROUP = "/aws/sagemaker/TrainingJobs"
TRAINING_METRICS_NAMESPACE = "/aws/sagemaker/TrainingJobs"


class ExecutionRole(Construct):
    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        deployment: Deployment,
        bucket: s3.IBucket,
        bucket_arn_export: str,
        key: kms.IKey,
        vpc: bool,
    ) -> None:
        super().__init__(scope, id)
        stack = Stack.of(self)
        recipe, team = deployment.recipe, deployment.team
        self.role = iam.Role(
            self,
            "Role",
            assumed_by=iam.ServicePrincipal("sagemaker.amazonaws.com"),
            description=f"SageMaker training jobs of {deployment.stack_prefix}",
        )
        prefixes = [naming.checkpoint_prefix(recipe, team), output_prefix(recipe, team)]
        objects = [bucket.arn_for_objects(f"{p}/*") for p in prefixes]
        policy = iam.Policy(
            self,
            "Policy",
            roles=[self.role],
            statements=[
                iam.PolicyStatement(
                    actions=["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"],
                    resources=objects,
                ),
                iam.PolicyStatement(
                    actions=["s3:ListBucket"],
                    resources=[bucket.bucket_arn],
                    conditions={
                        "StringLike": {
                            "s3:prefix": [f"{p}/*" for p in prefixes] + [f"{p}/" for p in prefixes]
                        }
                    },
                ),
                iam.PolicyStatement(
                    actions=["kms:Decrypt", "kms:Encrypt", "kms:GenerateDataKey", "kms:DescribeKey"],
                    resources=[key.key_arn],
                ),
                iam.PolicyStatement(
                    actions=["kms:CreateGrant"],
                    resources=[key.key_arn],
                    conditions={"Bool": {"kms:GrantIsForAWSResource": "true"}},
                ),
                iam.PolicyStatement(
                    actions=[
                        "logs:CreateLogGroup",
                        "logs:CreateLogStream",
                        "logs:PutLogEvents",
                        "logs:DescribeLogStreams",
                    ],
                    resources=[
                        stack.format_arn(
                            service="logs",
                            resource="log-group",
                            resource_name=f"{TRAINING_LOG_GROUP}:*",
                            arn_format=ArnFormat.COLON_RESOURCE_NAME,
                        )
                    ],
                ),
                iam.PolicyStatement(
                    actions=["cloudwatch:PutMetricData"],
                    resources=["*"],
                    conditions={"StringEquals": {"cloudwatch:namespace": TRAINING_METRICS_NAMESPACE}},
                ),
            ],
        )
        self.policy = policy
        self._data_statements(recipe.data.train_s3_uri)
        if vpc:
            policy.add_statements(
                iam.PolicyStatement(
                    actions=[
                        "ec2:CreateNetworkInterface",
                        "ec2:CreateNetworkInterfacePermission",
                        "ec2:DeleteNetworkInterface",
                        "ec2:DeleteNetworkInterfacePermission",
                        "ec2:DescribeNetworkInterfaces",
                        "ec2:DescribeVpcs",
                        "ec2:DescribeDhcpOptions",
                        "ec2:DescribeSubnets",
                        "ec2:DescribeSecurityGroups",
                    ],
                    resources=["*"],
                )
            )
        nag.acknowledge(self, "AwsSolutions-IAM5:unscoped-actions", ["Resource::*"])
        nag.acknowledge(
            self,
            "AwsSolutions-IAM5:checkpoint-prefix",
            [f"Resource::{bucket_arn_export}/{p}/*" for p in prefixes],
        )
        nag.acknowledge(
            self,
            "AwsSolutions-IAM5:training-logs",
            [nag.arn_finding(self, "logs", f"log-group:{TRAINING_LOG_GROUP}:*")],
        )

    def _data_statements(self, train_s3_uri: str | None) -> None:
        if not train_s3_uri:
            return
        bucket_name, _, prefix = train_s3_uri.removeprefix("s3://").partition("/")
        prefix = prefix.rstrip("/")
        objects = f"arn:aws:s3:::{bucket_name}/{prefix + '/' if prefix else ''}*"
        nag.acknowledge(self, "AwsSolutions-IAM5:training-data", [f"Resource::{objects}"])
        self.policy.add_statements(
            iam.PolicyStatement(actions=["s3:GetObject"], resources=[objects]),
            iam.PolicyStatement(
                actions=["s3:ListBucket"],
                resources=[f"arn:aws:s3:::{bucket_name}"],
                conditions={"StringLike": {"s3:prefix": [f"{prefix}*" if prefix else "*"]}},
            ),
        )
