"""The stall handler's definition: a job that stopped making progress is stopped, and the run goes on.

The per-run Stalled alarm (stacks/monitoring/run_alarms.py) goes to ALARM when a job in Training has
printed no step metric for `monitoring.stall_minutes` (a hung collective, a dead data loader, a stuck
save). CloudWatch sends that state change to EventBridge; a rule on this recipe's `<job>-Stalled`
alarms starts this state machine, which

    JobOfAlarm -> DescribeJob -> ReadRun -> Acts? (the run's current job, still in progress, the run
    running, no stop asked, monitoring.stop_stalled) -> MarkStalled (conditional: the record names the
    job as stalled) -> StopStalledJob

SageMaker then ends the job Stopped (the trainer saves on SIGTERM), and JobEnded's Stalled rule starts
the next job on fresh instances; a stall that repeats counts toward the crash loop. A recipe with
`monitoring.stop_stalled: false` keeps only the alarm's notification, as before.
"""

from __future__ import annotations

from typing import Any

from stacks.supervisor.asl import CONDITION_FAILED, DESCRIBE, GET_ITEM, STOP, UPDATE_ITEM, names, task

ALARM_STATE_CHANGE = "CloudWatch Alarm State Change"
STALLED_ALARM = "Stalled"  # the spec name of the alarm (stacks/monitoring/run_alarms.py), its names' end


def stalled_alarm_pattern(job_name_prefix: str) -> dict[str, Any]:
    """EventBridge pattern: a Stalled alarm of this recipe's jobs went to ALARM (`<job>-Stalled`)."""
    return {
        "source": ["aws.cloudwatch"],
        "detail-type": [ALARM_STATE_CHANGE],
        "detail": {
            "alarmName": [{"wildcard": f"{job_name_prefix}*-{STALLED_ALARM}"}],
            "state": {"value": ["ALARM"]},
        },
    }


def stalled_definition(*, table_name: str) -> dict[str, Any]:
    table = {"TableName": table_name, "Key": {"run": {"S.$": "$.Job.Environment.TRAINSTACK_RUN"}}}
    return {
        "Comment": "A job made no step progress for monitoring.stall_minutes: stop it, so its run continues.",
        "StartAt": "JobOfAlarm",
        "States": {
            # The alarm's one metric is dimensioned by the job (CloudWatch's documented event shape).
            "JobOfAlarm": {
                "Type": "Pass",
                "Parameters": {
                    "Name.$": "$.detail.configuration.metrics[0].metricStat.metric.dimensions.TrainingJobName"
                },
                "ResultPath": "$.Alarm",
                "Next": "DescribeJob",
            },
            "DescribeJob": task(
                DESCRIBE,
                {"TrainingJobName.$": "$.Alarm.Name"},
                ResultSelector={
                    "Name.$": "$.TrainingJobName",
                    "Status.$": "$.TrainingJobStatus",
                    "Environment.$": "$.Environment",
                },
                ResultPath="$.Job",
                Next="HasRun",
            ),
            "HasRun": {
                "Type": "Choice",
                "Choices": [
                    {"Variable": "$.Job.Environment.TRAINSTACK_RUN", "IsPresent": True, "Next": "ReadRun"}
                ],
                "Default": "Left",
            },
            "ReadRun": task(
                GET_ITEM, {**table, "ConsistentRead": True}, ResultPath="$.Registry", Next="Acts"
            ),
            "Acts": {
                "Type": "Choice",
                "Choices": [
                    {
                        "And": [
                            {"Variable": "$.Registry.Item.stop_stalled.BOOL", "IsPresent": True},
                            {"Variable": "$.Job.Status", "StringEquals": "InProgress"},
                        ],
                        "Next": "OptedIn",
                    }
                ],
                "Default": "Left",
            },
            "OptedIn": {
                "Type": "Choice",
                "Choices": [
                    {
                        "And": [
                            {"Variable": "$.Registry.Item.stop_stalled.BOOL", "BooleanEquals": True},
                            {"Variable": "$.Registry.Item.run_state.S", "StringEquals": "running"},
                            {"Variable": "$.Registry.Item.current_job.S", "StringEqualsPath": "$.Job.Name"},
                            {"Variable": "$.Registry.Item.stop_requested.BOOL", "BooleanEquals": False},
                        ],
                        "Next": "MarkStalled",
                    }
                ],
                "Default": "Left",
            },
            # Recorded before the stop, so the job's end is read as a stall (the Stalled rule), not as a
            # stop from elsewhere; conditional, so a stop, a resume or the job's own end meanwhile wins.
            "MarkStalled": task(
                UPDATE_ITEM,
                {
                    **table,
                    "UpdateExpression": "SET #stalled = :job, #updated = :now",
                    "ConditionExpression": (
                        "#current_job = :job AND #run_state = :running AND #stop_requested = :false"
                    ),
                    "ExpressionAttributeNames": names(
                        "stalled", "updated", "current_job", "run_state", "stop_requested"
                    ),
                    "ExpressionAttributeValues": {
                        ":job": {"S.$": "$.Job.Name"},
                        ":now": {"S.$": "$$.State.EnteredTime"},
                        ":running": {"S": "running"},
                        ":false": {"BOOL": False},
                    },
                },
                ResultPath=None,
                Catch=[{"ErrorEquals": [CONDITION_FAILED], "Next": "Left", "ResultPath": "$.Error"}],
                Next="StopStalledJob",
            ),
            "StopStalledJob": task(
                STOP, {"TrainingJobName.$": "$.Job.Name"}, ResultPath=None, Next="Stopped"
            ),
            "Stopped": {"Type": "Succeed", "Comment": "the job ends Stopped; JobEnded starts the next"},
            "Left": {"Type": "Succeed", "Comment": "not this run's current job, or the run opted out"},
        },
    }
