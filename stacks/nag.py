"""cdk-nag: the one reviewed place for every acknowledged finding, each with its reason.

cdk-nag v3 runs as a CDK policy-validation plugin: `enable(app)` adds AwsSolutionsChecks, and any
unacknowledged finding fails `app.synth()` (so `cdk synth` / `cdk deploy` exit non-zero).
Constructs call `acknowledge(construct, KEY, finding=...)`; the reason is looked up here, so a new
acknowledgment is a reviewed edit to this file. Other areas add their own entries below.
"""

from __future__ import annotations

from collections.abc import Iterable

from aws_cdk import Acknowledgment, App, Stack, Token, Validations
from constructs import IConstruct

# key -> reason. A key is a rule id, optionally `:qualifier` when one rule is acknowledged for
# different reasons in different places.
REASONS: dict[str, str] = {
    "AwsSolutions-S1": (
        "This is the server-access-log bucket of the checkpoint bucket; logging it into itself "
        "would loop, and S3 delivers access logs only to SSE-S3 buckets."
    ),
    "AwsSolutions-EC23:endpoint-ingress": (
        "VPC mode: the endpoints' only ingress is HTTPS from the training nodes' security group (a "
        "reference cdk-nag cannot evaluate, so the rule errors); nothing is open to 0.0.0.0/0."
    ),
    "AwsSolutions-IAM5:training-jobs": (
        "Training job names exist only at run time; the resource is narrowed to this recipe's "
        "job-name prefix (training-job/ts-<team>-<recipe>--*, which no other recipe's or team's jobs "
        "start with), never all jobs."
    ),
    "AwsSolutions-IAM5:checkpoint-prefix": (
        "The execution role reads and writes objects under this team/recipe's own prefixes of the "
        "checkpoint bucket only; object keys below the prefix are per run and unknown in advance."
    ),
    "AwsSolutions-IAM5:training-data": (
        "Read-only (s3:GetObject) on the recipe's data prefixes (data.train_s3_uri, or each of "
        "data.sources): the token shards below them "
        "are many and named by the data pipeline, not known when the stack is deployed."
    ),
    "AwsSolutions-IAM5:base-model": (
        "Read-only (s3:GetObject) on the recipe's model.init_from prefix: the Hugging Face folder the run "
        "starts from holds safetensors files the publisher named (model-0000i-of-0000N), not known when "
        "the stack is deployed."
    ),
    "AwsSolutions-IAM5:training-logs": (
        "SageMaker writes to the /aws/sagemaker/TrainingJobs log group with one stream per job and "
        "host, named at run time."
    ),
    "AwsSolutions-IAM5:training-network-interfaces": (
        "VPC mode: SageMaker creates the job's network interfaces at run time, so their IDs are unknown; "
        "creating one is also limited to this deployment's subnets and security group, and attaching or "
        "deleting one to interfaces in this deployment's VPC (ec2:Vpc)."
    ),
    "AwsSolutions-IAM5:unscoped-actions": (
        "These actions do not support resource-level permissions (ecr:GetAuthorizationToken, "
        "cloudwatch:PutMetricData (limited by a namespace condition), ec2:Describe*/ENI calls SageMaker "
        "makes in VPC mode, and the X-Ray and CloudWatch Logs delivery calls of Step Functions); IAM "
        'requires Resource "*" for them. Every action is listed explicitly; none is a wildcard.'
    ),
    # Data preparation (stacks/processing_role.py).
    "AwsSolutions-IAM5:processing-data": (
        "`trainstack data prepare` jobs read the objects under the recipe's raw-corpus prefixes "
        "(data.corpus_s3_uris) and read and write under its token-shard prefix (data.train_s3_uri; no "
        "delete): the files there are many, named by the corpus and by the preparation, unknown at deploy."
    ),
    "AwsSolutions-IAM5:processing-logs": (
        "SageMaker writes to the /aws/sagemaker/ProcessingJobs log group with one stream per job and "
        "instance, named at run time."
    ),
    "AwsSolutions-IAM5:supervisor-executions": (
        "The run reconciler reads the status of the supervisor's own executions (states:DescribeExecution "
        "on execution:<StartJob or JobEnded name>:*) to tell a job still being created from one whose "
        "creator died; execution names are made per attempt at run time."
    ),
    # Monitoring (stacks/monitoring.py).
    "AwsSolutions-IAM5:run-alarms": (
        "The alarm manager puts and deletes the alarms of each run, named <job>-<alarm> after a training "
        "job that exists only at run time; the resource is narrowed to this recipe's job-name prefix "
        "(alarm:ts-<team>-<recipe>--*, which no other recipe's or team's alarms start with), never "
        "all alarms."
    ),
    # Experiment tracking (stacks/tracking.py): the team's MLflow App and its artifact store.
    "AwsSolutions-S1:mlflow-access-logs": (
        "This is the server-access-log bucket of the team's MLflow artifact bucket; logging it into itself "
        "would loop, and S3 delivers access logs only to SSE-S3 buckets."
    ),
    "AwsSolutions-IAM5:mlflow-artifacts": (
        "The MLflow App's role reads and writes objects under the artifacts/ prefix of the team's own MLflow "
        "bucket only; MLflow names the objects below it per experiment and run at run time."
    ),
    # GitOps pipeline (stacks/pipeline.py): the artifact store, and what CDK Pipelines generates.
    "AwsSolutions-S1:pipeline-access-logs": (
        "This is the server-access-log bucket of the pipeline's artifact bucket; logging it into itself "
        "would loop, and S3 delivers access logs only to SSE-S3 buckets."
    ),
    "AwsSolutions-IAM5:pipeline-artifacts": (
        "CDK Pipelines grants its pipeline, source, synth and self-mutation roles the S3 action families "
        "(GetObject*, GetBucket*, List*, DeleteObject*, Abort*) and KMS families (GenerateDataKey*, "
        "ReEncrypt*) on this pipeline's own artifact bucket and key only; object keys are per execution."
    ),
    "AwsSolutions-IAM5:pipeline-build-logs": (
        "Each CodeBuild project of the pipeline writes only its own log group /aws/codebuild/<project> and "
        "report groups <project>-*; log streams and reports are named per build."
    ),
    "AwsSolutions-IAM5:github-bootstrap-roles": (
        "The GitHub Actions deploy role may only assume CDK bootstrap roles (names cdk-*, and the "
        "aws-cdk:bootstrap-role tag must be deploy, file-/image-publishing or lookup), in this account or a "
        "team's account named in its defaults.yaml (deploy.account) that was bootstrapped with --trust."
    ),
    "AwsSolutions-IAM5:pipeline-self-mutation": (
        "The self-mutation step assumes only the CDK bootstrap roles (sts:AssumeRole on role/* in this "
        "account, conditioned on the aws-cdk:bootstrap-role tag being deploy, file- or image-publishing) "
        "and calls cloudformation:DescribeStacks and s3:ListBucket, which it needs across stacks and asset "
        "buckets it cannot name in advance."
    ),
}


def enable(app: App) -> None:
    """Run AwsSolutionsChecks on every stack of `app`; unacknowledged findings fail synthesis."""
    from cdk_nag import AwsSolutionsChecks

    Validations.of(app).add_plugins(AwsSolutionsChecks(app))


def acknowledge(construct: IConstruct, key: str, findings: Iterable[str] = ()) -> None:
    """Acknowledge rule `key` (a REASONS key) on `construct`, per finding when the rule has several."""
    reason = REASONS[key]
    if not reason.strip():
        raise ValueError(f"cdk-nag acknowledgment {key} has no reason")
    rule = key.split(":", 1)[0]
    ids = [f"{rule}[{finding}]" for finding in findings] or [rule]
    Validations.of(construct).acknowledge(*(Acknowledgment(id=i, reason=reason) for i in ids))


def arn_finding(scope: IConstruct, service: str, resource: str) -> str:
    """How cdk-nag writes `stack.format_arn(service=..., resource...)` in a finding id."""
    stack = Stack.of(scope)
    region = "<AWS::Region>" if Token.is_unresolved(stack.region) else stack.region
    account = "<AWS::AccountId>" if Token.is_unresolved(stack.account) else stack.account
    return f"Resource::arn:<AWS::Partition>:{service}:{region}:{account}:{resource}"
