"""The processing role: what a `trainstack data prepare` SageMaker Processing job of this deployment may do.

Only processing jobs named for this recipe and team may assume it (aws:SourceArn on the job-name prefix
`processing-job/ts-prep-<team>-<recipe>--*`, aws:SourceAccount; SageMaker developer guide, cross-service
confused deputy prevention). It may read the raw corpus prefixes the recipe names (`data.corpus_s3_uris`,
where the tokenizer lives too), read and write the token-shard prefix (`data.train_s3_uri`: shards,
completion markers, the settings record; no delete), pull the training image, write its own log
streams, and use the deployment's key for its EBS volumes. Nothing else: no other bucket, no
sagemaker:* calls, no iam:PassRole.
"""

from __future__ import annotations

from aws_cdk import ArnFormat, DefaultStackSynthesizer, Stack
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from constructs import Construct

from stacks import nag
from stacks.roles import service_role
from trainstack.aws.deployment import Deployment
from trainstack.aws.processing import job_name_prefix

PROCESSING_LOG_GROUP = "/aws/sagemaker/ProcessingJobs"


def _s3(uri: str) -> tuple[str, str]:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    prefix = prefix.rstrip("/")
    return bucket, f"{prefix}/" if prefix else ""


class ProcessingRole(Construct):
    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        deployment: Deployment,
        key: kms.IKey,
        image_repository_arns: list[str],
    ) -> None:
        super().__init__(scope, id)
        stack = Stack.of(self)
        recipe, team = deployment.recipe, deployment.team or deployment.recipe.tags.team
        jobs = stack.format_arn(
            service="sagemaker",
            resource="processing-job",
            resource_name=f"{job_name_prefix(team, recipe.name)}*",
        )
        self.role = service_role(
            self,
            "Role",
            "sagemaker.amazonaws.com",
            f"SageMaker Processing jobs of {deployment.stack_prefix} (trainstack data prepare)",
            source_arn=jobs,
            account=stack.account,
        )
        statements: list[iam.PolicyStatement] = []
        findings: list[str] = []
        for uri, actions in [(u, ["s3:GetObject"]) for u in recipe.data.corpus_s3_uris] + [
            (recipe.data.train_s3_uri, ["s3:GetObject", "s3:PutObject", "s3:AbortMultipartUpload"])
        ]:
            bucket, prefix = _s3(uri)
            objects = f"arn:aws:s3:::{bucket}/{prefix}*"
            findings.append(f"Resource::{objects}")
            statements.append(iam.PolicyStatement(actions=actions, resources=[objects]))
            statements.append(
                iam.PolicyStatement(
                    actions=["s3:ListBucket"],
                    resources=[f"arn:aws:s3:::{bucket}"],
                    conditions={"StringLike": {"s3:prefix": [f"{prefix}*" if prefix else "*"]}},
                )
            )
        logs = stack.format_arn(
            service="logs",
            resource="log-group",
            resource_name=f"{PROCESSING_LOG_GROUP}:*",
            arn_format=ArnFormat.COLON_RESOURCE_NAME,
        )
        statements += [
            iam.PolicyStatement(
                actions=[
                    "logs:CreateLogGroup",
                    "logs:CreateLogStream",
                    "logs:PutLogEvents",
                    "logs:DescribeLogStreams",
                ],
                resources=[logs],
            ),
            # The job's EBS volumes are encrypted with the deployment's key (VolumeKmsKeyId): EBS takes a
            # grant for each attached volume (kms:GrantIsForAWSResource; KMS developer guide, grants).
            iam.PolicyStatement(
                actions=["kms:Decrypt", "kms:Encrypt", "kms:GenerateDataKey", "kms:DescribeKey"],
                resources=[key.key_arn],
            ),
            iam.PolicyStatement(
                actions=["kms:CreateGrant"],
                resources=[key.key_arn],
                conditions={"Bool": {"kms:GrantIsForAWSResource": "true"}},
            ),
        ]
        if image_repository_arns:
            statements += [
                iam.PolicyStatement(
                    actions=[
                        "ecr:BatchGetImage",
                        "ecr:GetDownloadUrlForLayer",
                        "ecr:BatchCheckLayerAvailability",
                    ],
                    resources=image_repository_arns,
                ),
                iam.PolicyStatement(actions=["ecr:GetAuthorizationToken"], resources=["*"]),
            ]
        self.policy = iam.Policy(self, "Policy", roles=[self.role], statements=statements)
        nag.acknowledge(self, "AwsSolutions-IAM5:processing-data", findings)
        nag.acknowledge(
            self,
            "AwsSolutions-IAM5:processing-logs",
            [nag.arn_finding(self, "logs", f"log-group:{PROCESSING_LOG_GROUP}:*")],
        )
        if image_repository_arns:
            nag.acknowledge(self, "AwsSolutions-IAM5:unscoped-actions", ["Resource::*"])


def image_repository_arns(scope: Construct, deployment: Deployment, repository_arn: str) -> list[str]:
    """The ECR repository the deployment's training image is pulled from: a prebuilt image's own, this
    deployment's repository for a tag in it, else the CDK bootstrap's container-assets repository
    (where `cdk deploy` publishes the image it builds; default bootstrap qualifier)."""
    stack = Stack.of(scope)
    source = deployment.image
    if source.uri:
        registry, _, rest = source.uri.partition("/")
        parts = registry.split(".")
        if len(parts) >= 6 and parts[1] == "dkr" and parts[2] == "ecr":
            name = rest.split("@")[0].rsplit(":", 1)[0]
            return [f"arn:aws:ecr:{parts[3]}:{parts[0]}:repository/{name}"]
        return []  # not ECR: nothing to grant
    if source.repository_tag:
        return [repository_arn]
    qualifier = DefaultStackSynthesizer.DEFAULT_QUALIFIER
    return [
        stack.format_arn(
            service="ecr",
            resource="repository",
            resource_name=f"cdk-{qualifier}-container-assets-{stack.account}-{stack.region}",
        )
    ]
