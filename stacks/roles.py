"""Roles that one AWS service assumes, and only for this account (and, where the resource is known,
only for those resources): the confused-deputy guard the IAM user guide recommends for service
principals."""

from __future__ import annotations

from aws_cdk import Aws
from aws_cdk import aws_iam as iam
from constructs import Construct


def service_role(
    scope: Construct,
    id: str,
    service: str,
    description: str,
    *,
    source_arn: str | None = None,
    account: str = Aws.ACCOUNT_ID,
) -> iam.Role:
    """A role only `service` acting for `account` may assume (aws:SourceAccount), and with `source_arn`
    only for the resources it matches (aws:SourceArn, ArnLike). Without one: an aws:SourceArn naming the
    resource that assumes the role would make the role and that resource depend on each other."""
    conditions: dict[str, dict[str, str]] = {"StringEquals": {"aws:SourceAccount": account}}
    if source_arn is not None:
        conditions["ArnLike"] = {"aws:SourceArn": source_arn}
    return iam.Role(
        scope,
        id,
        description=description,
        assumed_by=iam.ServicePrincipal(service, conditions=conditions),
    )
