"""The stateful stack: key, checkpoint bucket, image repository, run registry. Termination protection on.

The launcher stack reads them through exports with explicit names (`<prefix>-BucketArn`, ...), so
the stateful stack never depends on the launcher and a launcher change never touches it. Explicit
names also make the launcher's IAM resources readable, stable strings (cdk-nag findings included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aws_cdk import CfnOutput, Fn, Stack
from aws_cdk import aws_dynamodb as dynamodb
from aws_cdk import aws_ecr as ecr
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from constructs import Construct

from stacks.processing_role import ProcessingRole, image_repository_arns
from stacks.registry import RunRegistry
from stacks.storage import CheckpointBucket, EncryptionKey, ImageRepository
from trainstack.aws.deployment import Deployment


@dataclass(frozen=True)
class Exports:
    """Export names of the stateful resources, derived from the deployment's stack prefix."""

    prefix: str

    def name(self, what: str) -> str:
        return f"{self.prefix}-{what}"

    def value(self, what: str) -> str:
        return Fn.import_value(self.name(what))

    def bucket(self, scope: Construct, key: kms.IKey) -> s3.IBucket:
        return s3.Bucket.from_bucket_attributes(
            scope,
            "CheckpointBucket",
            bucket_arn=self.value("BucketArn"),
            bucket_name=self.value("BucketName"),
            encryption_key=key,
        )

    def key(self, scope: Construct) -> kms.IKey:
        return kms.Key.from_key_arn(scope, "Key", self.value("KeyArn"))

    def run_table(self, scope: Construct, key: kms.IKey) -> dynamodb.ITable:
        return dynamodb.Table.from_table_attributes(
            scope, "RunTable", table_arn=self.value("RunTableArn"), encryption_key=key
        )

    def repository(self, scope: Construct) -> ecr.IRepository:
        return ecr.Repository.from_repository_attributes(
            scope,
            "Repository",
            repository_arn=self.value("RepositoryArn"),
            repository_name=self.value("RepositoryName"),
        )


class DataStack(Stack):
    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        deployment: Deployment,
        repository_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            scope,
            id,
            termination_protection=True,
            description=f"trainstack {deployment.stack_prefix}: checkpoints, image repository, key, runs",
            **kwargs,
        )
        # Access-log delivery through a bucket policy, not the legacy LogDeliveryWrite ACL (cfn-lint W3045).
        self.node.set_context("@aws-cdk/aws-s3:serverAccessLogsUseBucketPolicy", True)
        self.exports = Exports(deployment.stack_prefix)
        self.key = EncryptionKey(
            self, "Encryption", description=f"{deployment.stack_prefix}: checkpoints, images, volumes, logs"
        ).key
        self.bucket = CheckpointBucket(self, "Checkpoints", key=self.key).bucket
        self.repository = ImageRepository(self, "Images", key=self.key, name=repository_name).repository
        self.run_table = RunRegistry(self, "Runs", key=self.key).table
        outputs: dict[str, str] = {}
        data = deployment.recipe.data
        if data.train_s3_uri and data.corpus_s3_uris:  # `trainstack data prepare` on AWS (docs/data.md)
            self.processing = ProcessingRole(
                self,
                "Processing",
                deployment=deployment,
                key=self.key,
                image_repository_arns=image_repository_arns(self, deployment, self.repository.repository_arn),
            )
            outputs["ProcessingRoleArn"] = self.processing.role.role_arn
        for what, value in {
            "KeyArn": self.key.key_arn,
            "BucketArn": self.bucket.bucket_arn,
            "BucketName": self.bucket.bucket_name,
            "RepositoryArn": self.repository.repository_arn,
            "RepositoryName": self.repository.repository_name,
            "RunTableArn": self.run_table.table_arn,
            "RunTableName": self.run_table.table_name,
            **outputs,
        }.items():
            CfnOutput(self, what, value=value, export_name=self.exports.name(what))
