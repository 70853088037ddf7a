"""The run registry: one DynamoDB item per run of this recipe and team (stacks/supervisor/asl.py lists
the attributes). Stateful, so it lives in the data stack: retained, deletion protection on, point-in-time
recovery, encrypted with the deployment's customer-managed key, billed per request (a run writes a few
items a day). The supervisor's state machines write it; `trainstack runs`, `stop` and `resume` read it.
"""

from __future__ import annotations

from aws_cdk import RemovalPolicy
from aws_cdk import aws_dynamodb as dynamodb
from aws_cdk import aws_kms as kms
from constructs import Construct

PARTITION_KEY = "run"


class RunRegistry(Construct):
    def __init__(self, scope: Construct, id: str, *, key: kms.IKey) -> None:
        super().__init__(scope, id)
        self.table = dynamodb.Table(
            self,
            "Table",
            partition_key=dynamodb.Attribute(name=PARTITION_KEY, type=dynamodb.AttributeType.STRING),
            billing_mode=dynamodb.BillingMode.PAY_PER_REQUEST,
            encryption=dynamodb.TableEncryption.CUSTOMER_MANAGED,
            encryption_key=key,
            point_in_time_recovery_specification=dynamodb.PointInTimeRecoverySpecification(
                point_in_time_recovery_enabled=True
            ),
            deletion_protection=True,
            removal_policy=RemovalPolicy.RETAIN,
        )
