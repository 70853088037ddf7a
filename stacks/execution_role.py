"""The SageMaker execution role: this recipe's bucket prefixes, key, image, logs and metrics only.

Only SageMaker training jobs of this recipe and team may assume it (aws:SourceArn on the job-name prefix,
aws:SourceAccount; SageMaker developer guide, cross-service confused deputy prevention for training jobs).
In VPC mode it may create and delete network interfaces only in this deployment's subnets, security group
and VPC (`allow_network_interfaces`). docs/security.md has the whole picture.
"""

from __future__ import annotations

import jsii
from aws_cdk import ArnFormat, Stack
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from constructs import Construct, IValidation

from stacks import nag
from stacks.network import TrainingNetwork
from stacks.roles import service_role
from trainstack.aws.deployment import Deployment
from trainstack.aws.export_job import exports_prefix
from trainstack.aws.request import output_prefix
from trainstack.recipes import naming

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
        jobs = stack.format_arn(
            service="sagemaker",
            resource="training-job",
            resource_name=f"{naming.job_name_prefix(recipe, team)}*",
        )
        self.role = service_role(
            self,
            "Role",
            "sagemaker.amazonaws.com",
            f"SageMaker training jobs of {deployment.stack_prefix}",
            source_arn=jobs,
            account=stack.account,
        )
        # The run's checkpoints, SageMaker's output, and the Hugging Face folders exports write.
        prefixes = [
            naming.checkpoint_prefix(recipe, team),
            output_prefix(recipe, team),
            exports_prefix(recipe, team),
        ]
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
                # The checkpoint bucket's SSE-KMS (reading, writing) and the job's encrypted output.
                iam.PolicyStatement(
                    actions=["kms:Decrypt", "kms:Encrypt", "kms:GenerateDataKey", "kms:DescribeKey"],
                    resources=[key.key_arn],
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
        if not recipe.instance.has_instance_store:
            # An EBS volume encrypted with the key (trainstack.aws.request sends VolumeKmsKeyId only for types
            # without local NVMe): EBS creates a grant for the attached volume. kms:GrantIsForAWSResource
            # applies to CreateGrant, ListGrants and RevokeGrant only (KMS developer guide, grants).
            policy.add_statements(
                iam.PolicyStatement(
                    actions=["kms:CreateGrant"],
                    resources=[key.key_arn],
                    conditions={"Bool": {"kms:GrantIsForAWSResource": "true"}},
                )
            )
        self._data_statements(recipe.data.uris)
        if recipe.model.init_from and recipe.model.init_from.startswith("s3://"):  # the base model
            self._data_statements((recipe.model.init_from,), "AwsSolutions-IAM5:base-model")
        self._granted_network: TrainingNetwork | None = None
        if vpc:
            # Read-only calls without resource-level permissions (Service Authorization Reference, EC2).
            # DeleteNetworkInterfacePermission names a permission ID, not an interface, so it too can only be
            # granted on "*".
            policy.add_statements(
                iam.PolicyStatement(
                    actions=[
                        "ec2:DescribeNetworkInterfaces",
                        "ec2:DescribeVpcs",
                        "ec2:DescribeDhcpOptions",
                        "ec2:DescribeSubnets",
                        "ec2:DescribeSecurityGroups",
                        "ec2:DeleteNetworkInterfacePermission",
                    ],
                    resources=["*"],
                )
            )
            # The scoped interface statements come with the network (allow_network_interfaces, called by
            # the launcher once it has built it); synthesis fails if it never is.
            self.node.add_validation(_NetworkGranted(self))
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

    def allow_network_interfaces(self, network: TrainingNetwork) -> None:
        """SageMaker's network interfaces for the job, in `network`'s subnets, group and VPC only.

        Condition keys per resource (Service Authorization Reference, EC2): CreateNetworkInterface checks
        the interface (no VPC key), the subnet and the security group, so it gets this deployment's subnet
        and group ARNs; the interface actions that support ec2:Vpc are limited to this VPC.
        """
        if self._granted_network is network:
            return
        if self._granted_network is not None:
            raise ValueError("an execution role serves one training network")
        self._granted_network = network
        stack = Stack.of(self)
        interfaces = stack.format_arn(service="ec2", resource="network-interface", resource_name="*")
        self.policy.add_statements(
            iam.PolicyStatement(
                actions=["ec2:CreateNetworkInterface"],
                resources=[interfaces, *network.subnet_arns, network.security_group_arn],
            ),
            iam.PolicyStatement(
                actions=["ec2:CreateNetworkInterfacePermission", "ec2:DeleteNetworkInterface"],
                resources=[interfaces],
                conditions={"ArnEquals": {"ec2:Vpc": network.vpc_arn}},
            ),
        )
        nag.acknowledge(
            self,
            "AwsSolutions-IAM5:training-network-interfaces",
            [nag.arn_finding(self, "ec2", "network-interface/*")],
        )

    def _data_statements(
        self, uris: tuple[str, ...], finding: str = "AwsSolutions-IAM5:training-data"
    ) -> None:
        """Read-only on each prefix the job reads: data.train_s3_uri or every source of a blend
        (data.sources); a base model (model.init_from)."""
        findings = []
        for uri in uris:
            bucket_name, _, prefix = uri.removeprefix("s3://").partition("/")
            prefix = prefix.rstrip("/")
            objects = f"arn:aws:s3:::{bucket_name}/{prefix + '/' if prefix else ''}*"
            findings.append(f"Resource::{objects}")
            self.policy.add_statements(
                iam.PolicyStatement(actions=["s3:GetObject"], resources=[objects]),
                iam.PolicyStatement(
                    actions=["s3:ListBucket"],
                    resources=[f"arn:aws:s3:::{bucket_name}"],
                    conditions={"StringLike": {"s3:prefix": [f"{prefix}*" if prefix else "*"]}},
                ),
            )
        if findings:
            nag.acknowledge(self, finding, findings)


@jsii.implements(IValidation)
class _NetworkGranted:
    def __init__(self, role: ExecutionRole) -> None:
        self._role = role

    def validate(self) -> list[str]:
        if self._role._granted_network is None:
            return ["VPC mode: the stack has no TrainingNetwork, so jobs could not create network interfaces"]
        return []
