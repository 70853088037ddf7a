"""Which errors every Step Functions task retries, by the names Step Functions gives them. Defined once.

Step Functions names a failed task's error after the integration that ran it:

- AWS SDK integrations (`arn:aws:states:::aws-sdk:<service>:<action>`): `<Service>.<ErrorCode>` in
  PascalCase, always with an `Exception` suffix, even where the service's own code lacks one
  (`S3.BucketAlreadyExistsException` for S3's `BucketAlreadyExists`; Step Functions developer guide,
  "Learning to use AWS service SDK integrations in Step Functions"). Errors a service's model does not
  declare for the action (throttling and server faults, for most) reach state machines as the
  service's base exception, `<Service>.<Service>Exception` (e.g. `SageMaker.SageMakerException`, as
  retried by public state machines on the sagemaker SDK integration), so both forms are listed.
- Optimized integrations: `DynamoDB.<ErrorCode>` as DynamoDB returns it (`DynamoDB.RequestLimitExceeded`,
  `DynamoDB.InternalServerError`; `DynamoDB.AmazonDynamoDBException` for a failure without a service
  error), `SNS.<ErrorCode>Exception` (`SNS.ThrottledException`). The emulator's interpreter (moto's
  copy of LocalStack's, built against recorded AWS responses) names them the same way.

Throttling and server-side faults are retried with bounded exponential backoff everywhere. SageMaker's
`ResourceLimitExceeded` at CreateTrainingJob (the account's instances of that type are all in use) is a
capacity wait, retried far longer (CAPACITY_RETRY). No retrier names `States.Timeout`: no task here sets
`TimeoutSeconds`, so it could never fire.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SDK_GUIDE = "https://docs.aws.amazon.com/step-functions/latest/dg/supported-services-awssdk.html"


@dataclass(frozen=True)
class Backoff:
    interval_seconds: int
    backoff_rate: float
    max_attempts: int
    max_delay_seconds: int | None = None

    def retrier(self, errors: tuple[str, ...]) -> dict[str, Any]:
        retrier: dict[str, Any] = {
            "ErrorEquals": list(errors),
            "IntervalSeconds": self.interval_seconds,
            "BackoffRate": self.backoff_rate,
            "MaxAttempts": self.max_attempts,
            "JitterStrategy": "FULL",  # many executions throttled at once should not retry in step
        }
        if self.max_delay_seconds is not None:
            retrier["MaxDelaySeconds"] = self.max_delay_seconds
        return retrier

    def worst_case_seconds(self) -> float:
        """The longest the retries can wait in total (jitter only shortens waits)."""
        total, delay = 0.0, float(self.interval_seconds)
        for _ in range(self.max_attempts):
            total += min(delay, self.max_delay_seconds or delay)
            delay *= self.backoff_rate
        return total


TRANSIENT = Backoff(interval_seconds=2, backoff_rate=2.0, max_attempts=6, max_delay_seconds=60)
# About a day of waiting for instances to free up: 5 min, then x1.5 up to 2 h between tries.
CAPACITY_RETRY = Backoff(interval_seconds=300, backoff_rate=1.5, max_attempts=16, max_delay_seconds=7200)

# Transient errors per integration: the `Resource` ARN's integration (without the action) -> names.
TRANSIENT_ERRORS: dict[str, tuple[str, ...]] = {
    "aws-sdk:sagemaker": (
        "SageMaker.ThrottlingException",
        "SageMaker.InternalFailureException",
        "SageMaker.ServiceUnavailableException",
        "SageMaker.SageMakerException",
        "SageMaker.SdkClientException",
    ),
    "aws-sdk:cloudwatch": (
        "CloudWatch.ThrottlingException",  # CloudWatch's code is `Throttling`
        "CloudWatch.InternalServiceErrorException",  # code `InternalServiceError`
        "CloudWatch.ServiceUnavailableException",
        "CloudWatch.CloudWatchException",
        "CloudWatch.SdkClientException",
    ),
    "dynamodb": (
        "DynamoDB.ProvisionedThroughputExceededException",
        "DynamoDB.ThrottlingException",
        "DynamoDB.RequestLimitExceeded",
        "DynamoDB.InternalServerError",
        "DynamoDB.TransactionConflictException",
        "DynamoDB.AmazonDynamoDBException",
    ),
    # The reconciler: DynamoDB Scan through the SDK integration (service name `DynamoDb` there), and
    # Step Functions itself (optimized startExecution: `StepFunctions.<Code>Exception`; the SDK
    # integration's describeExecution: `Sfn.<Code>Exception`).
    "aws-sdk:dynamodb": (
        "DynamoDb.ProvisionedThroughputExceededException",
        "DynamoDb.ThrottlingException",
        "DynamoDb.RequestLimitExceededException",
        "DynamoDb.InternalServerErrorException",
        "DynamoDb.DynamoDbException",
        "DynamoDb.SdkClientException",
    ),
    # (also the Export machine started after a run completes, stacks/export.py: StartExecution's
    # documented ExecutionLimitExceeded)
    "states": (
        "StepFunctions.ThrottlingException",
        "StepFunctions.ServiceUnavailableException",
        "StepFunctions.InternalServerErrorException",
        "StepFunctions.ExecutionLimitExceededException",
        "StepFunctions.AWSStepFunctionsException",
        "StepFunctions.SdkClientException",
    ),
    "aws-sdk:sfn": (
        "Sfn.ThrottlingException",
        "Sfn.ServiceUnavailableException",
        "Sfn.SfnException",
        "Sfn.SdkClientException",
    ),
    "sns": (
        "SNS.ThrottledException",  # SNS's code is `Throttled`
        "SNS.InternalErrorException",
        "SNS.KMSThrottlingException",
        "SNS.AmazonSNSException",
        "SNS.SdkClientException",
    ),
}
# Capacity, not a fault: the account's quota of the instance type is in use (CreateTrainingJob).
CAPACITY_ERRORS = ("SageMaker.ResourceLimitExceededException",)


def integration_of(resource: str) -> str:
    """`arn:aws:states:::aws-sdk:sagemaker:createTrainingJob` -> `aws-sdk:sagemaker`;
    `arn:aws:states:::dynamodb:updateItem` -> `dynamodb`."""
    service = resource.split(":::", 1)[1]
    parts = service.split(":")
    return ":".join(parts[:2]) if parts[0] == "aws-sdk" else parts[0]


def retriers(resource: str, *, capacity: bool = False) -> list[dict[str, Any]]:
    """The Retry field for a task calling `resource`: transient errors, and (CreateTrainingJob) capacity."""
    found = [TRANSIENT.retrier(TRANSIENT_ERRORS[integration_of(resource)])]
    if capacity:
        found.append(CAPACITY_RETRY.retrier(CAPACITY_ERRORS))
    return found
