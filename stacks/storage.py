"""Stateful constructs: the KMS key, the checkpoint bucket and the image repository.

Everything here is retained on delete: a `cdk destroy` never loses a checkpoint or an image.
"""

from __future__ import annotations

from collections.abc import Sequence

from aws_cdk import Duration, RemovalPolicy, Stack
from aws_cdk import aws_ecr as ecr
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from constructs import Construct

from stacks import nag
from trainstack.planner import storage as priced

ACCESS_LOG_EXPIRY_DAYS = 365
IMAGES_KEPT = 20


class EncryptionKey(Construct):
    """One customer-managed key (rotation on) for the bucket, the repository, volumes and logs."""

    def __init__(self, scope: Construct, id: str, *, description: str) -> None:
        super().__init__(scope, id)
        stack = Stack.of(self)
        self.key = kms.Key(
            self,
            "Key",
            description=description,
            enable_key_rotation=True,
            removal_policy=RemovalPolicy.RETAIN,
        )
        # CloudWatch Logs encrypts the launcher's log groups with this key; only log groups of this
        # account and region may use it. The encryption context is how CloudWatch Logs names the log group
        # to KMS (CloudWatch Logs user guide, encrypt log data with KMS), so it is the source condition
        # here. No kms:Describe*: DescribeKey never carries an encryption context, so under this condition
        # it could never be allowed anyway.
        self.key.add_to_resource_policy(
            iam.PolicyStatement(
                principals=[iam.ServicePrincipal(f"logs.{stack.region}.amazonaws.com")],
                actions=[
                    "kms:Encrypt*",
                    "kms:Decrypt*",
                    "kms:ReEncrypt*",
                    "kms:GenerateDataKey*",
                ],
                resources=["*"],  # in a key policy "*" means this key
                conditions={
                    "ArnLike": {
                        "kms:EncryptionContext:aws:logs:arn": (
                            f"arn:{stack.partition}:logs:{stack.region}:{stack.account}:log-group:*"
                        )
                    }
                },
            )
        )


def add_logged_kms_bucket(
    scope: Construct,
    *,
    key: kms.IKey,
    log_prefix: str,
    lifecycle_rules: Sequence[s3.LifecycleRule],
    access_logs_acknowledgment: str,
) -> tuple[s3.Bucket, s3.Bucket]:
    """A retained SSE-KMS bucket (versioned, SSL only, private) and the bucket its access logs go to.

    Both are created directly in `scope` as "Bucket" and "AccessLogs", so the constructs that use this
    keep their logical IDs. Returns (bucket, access_logs).
    """
    # S3 delivers server access logs only to an SSE-S3 bucket.
    access_logs = s3.Bucket(
        scope,
        "AccessLogs",
        encryption=s3.BucketEncryption.S3_MANAGED,
        block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
        enforce_ssl=True,
        versioned=True,
        object_ownership=s3.ObjectOwnership.BUCKET_OWNER_PREFERRED,
        lifecycle_rules=[
            s3.LifecycleRule(
                expiration=Duration.days(ACCESS_LOG_EXPIRY_DAYS),
                noncurrent_version_expiration=Duration.days(1),
                abort_incomplete_multipart_upload_after=Duration.days(1),
            )
        ],
        removal_policy=RemovalPolicy.RETAIN,
    )
    nag.acknowledge(access_logs, access_logs_acknowledgment)
    bucket = s3.Bucket(
        scope,
        "Bucket",
        encryption=s3.BucketEncryption.KMS,
        encryption_key=key,
        bucket_key_enabled=True,
        block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
        enforce_ssl=True,
        versioned=True,
        server_access_logs_bucket=access_logs,
        server_access_logs_prefix=log_prefix,
        lifecycle_rules=list(lifecycle_rules),
        removal_policy=RemovalPolicy.RETAIN,
    )
    return bucket, access_logs


def checkpoint_lifecycle_rules() -> list[s3.LifecycleRule]:
    """What leaves the checkpoint bucket, and when (S3 user guide: lifecycle configuration elements,
    expiring objects, lifecycle conflicts; the planner prices exactly these: trainstack.planner.storage).

    The trainer deletes pruned checkpoints; versioning turns each deleted file into a noncurrent version
    under a delete marker. Checkpoint keys are unique per step, so each has one noncurrent version: a
    `NewerNoncurrentVersions` condition ("If there are this many more recent noncurrent versions, Amazon S3
    will take the associated action") is never met for them and must not be set. So, under `checkpoints/`:
    noncurrent versions expire after PRUNED_NONCURRENT_DAYS (the least S3 allows; S3 rounds to the next
    midnight UTC, so a pruned checkpoint is gone 1-2 days after the prune), the delete markers left alone
    then are removed (`ExpiredObjectDeleteMarker`: "remove a delete marker with no noncurrent versions"),
    and a killed save's incomplete multipart uploads are aborted after a day. Elsewhere (model output) an
    overwritten or deleted file stays recoverable for OTHER_NONCURRENT_DAYS. Current versions never expire:
    a kept checkpoint or a model stays until someone deletes it. Where two rules apply, "the shorter
    expiration policy is honored" (S3 user guide, lifecycle conflicts)."""
    return [
        s3.LifecycleRule(
            id="pruned-checkpoints",
            prefix=priced.CHECKPOINT_PREFIX,
            noncurrent_version_expiration=Duration.days(priced.PRUNED_NONCURRENT_DAYS),
            expired_object_delete_marker=True,
            abort_incomplete_multipart_upload_after=Duration.days(priced.INCOMPLETE_CHECKPOINT_UPLOAD_DAYS),
        ),
        s3.LifecycleRule(
            id="noncurrent-versions",
            noncurrent_version_expiration=Duration.days(priced.OTHER_NONCURRENT_DAYS),
            expired_object_delete_marker=True,
            abort_incomplete_multipart_upload_after=Duration.days(priced.OTHER_INCOMPLETE_UPLOAD_DAYS),
        ),
    ]


class CheckpointBucket(Construct):
    """Checkpoints and model output, prefixed per team/recipe/run. SSE-KMS, versioned, SSL only."""

    def __init__(self, scope: Construct, id: str, *, key: kms.IKey) -> None:
        super().__init__(scope, id)
        self.bucket, self.access_logs = add_logged_kms_bucket(
            self,
            key=key,
            log_prefix="checkpoints/",
            lifecycle_rules=checkpoint_lifecycle_rules(),
            access_logs_acknowledgment="AwsSolutions-S1",
        )


class ImageRepository(Construct):
    """The training image repository: scan on push, immutable tags, KMS, keeps the last N images."""

    def __init__(self, scope: Construct, id: str, *, key: kms.IKey, name: str | None = None) -> None:
        super().__init__(scope, id)
        self.repository = ecr.Repository(
            self,
            "Repository",
            repository_name=name,
            image_scan_on_push=True,
            image_tag_mutability=ecr.TagMutability.IMMUTABLE,
            encryption=ecr.RepositoryEncryption.KMS,
            encryption_key=key,
            lifecycle_rules=[
                ecr.LifecycleRule(
                    max_image_count=IMAGES_KEPT, description=f"keep the last {IMAGES_KEPT} images"
                )
            ],
            removal_policy=RemovalPolicy.RETAIN,
        )
