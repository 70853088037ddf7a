"""Pure pieces of monitoring: EventBridge patterns and dashboard SEARCH queries, tested without synthesis."""

from __future__ import annotations

from typing import Any

from aws_cdk import aws_events as events

from trainstack.aws.runs import NAMESPACE

JOB_STATE_CHANGE = "SageMaker Training Job State Change"
NOTIFY_STATES = ("Failed", "Stopped", "Completed")  # Completed is information; the others need a person


def quoted(identifier: str) -> str:
    """SEARCH needs double quotes around names with characters other than letters and digits."""
    return f'"{identifier}"'


def search_expression(
    metric: str, dimension: str, prefix: str, stat: str = "Average", period_s: int = 60
) -> str:
    """A dashboard SEARCH over this recipe's jobs: one line per job (or per host).

    `Host=<prefix>` unquoted is a partial match: CloudWatch splits the prefix and the dimension values
    into tokens at non-alphanumeric characters and matches the prefix's tokens appearing consecutively,
    so `ts-platform-30b-fp8` finds `ts-platform-30b-fp8--7eca0ce4-r1/algo-1` but not `ts-nlp-30b-fp8--...`.
    Separators are not tokens, so the `--` that ends the job-name prefix cannot make this exact:
    `ts-nlp-8b-fp8` also finds `ts-nlp-8b-fp8-128k--...` (SEARCH has no string-prefix operator).
    (Quoted, it would be an exact match of the whole value and find nothing.)
    """
    terms = prefix.rstrip("-")  # the tokens; a trailing separator adds nothing to match
    return (
        f"SEARCH('{{{quoted(NAMESPACE)},{dimension}}} MetricName={quoted(metric)} "
        f"{dimension}={terms}', '{stat}', {period_s})"
    )


def this_recipe(prefix: str) -> dict[str, Any]:
    """EventBridge `detail` conditions selecting this recipe's jobs: their names start with `prefix`.

    The job-name prefix (`ts-<team>-<recipe>--`) is exact, so `8b-fp8`'s rule does not match the jobs
    of `8b-fp8-128k` (`ts-<team>-8b-fp8-128k--...`) nor the same recipe's jobs of another team.
    """
    return {"TrainingJobName": [{"prefix": prefix}]}


def as_event_pattern(pattern: dict[str, Any]) -> events.EventPattern:
    """The CDK form of a pattern kept as a plain dict (the dict is what tests match real events against)."""
    return events.EventPattern(
        source=pattern["source"], detail_type=pattern["detail-type"], detail=pattern["detail"]
    )


def job_state_pattern(prefix: str) -> dict[str, Any]:
    """EventBridge pattern (CloudFormation form) for this recipe's jobs failing, stopping or completing."""
    return {
        "source": ["aws.sagemaker"],
        "detail-type": [JOB_STATE_CHANGE],
        "detail": {**this_recipe(prefix), "TrainingJobStatus": list(NOTIFY_STATES)},
    }


def run_state_pattern(prefix: str) -> dict[str, Any]:
    """Job state changes that create (Training) or delete (ended) a run's alarms."""
    return {
        "source": ["aws.sagemaker"],
        "detail-type": [JOB_STATE_CHANGE],
        "detail": {**this_recipe(prefix), "TrainingJobStatus": ["InProgress", *NOTIFY_STATES]},
    }
