"""The reconciler's definition: on a schedule, drive every run whose supervision was interrupted.

Events are delivered at least once, but not always: EventBridge gives up after its retries, a JobEnded
execution can fail half-way (throttled past its retries, a timeout), a StartJob execution can die
between registering a job and creating it. Each leaves a record that says what should happen and did
not. Every RECONCILE_MINUTES an EventBridge Scheduler schedule starts this state machine, which reads
the run registry (only runs not completed) and, for each run:

- running, its current job ended, no decision recorded (a lost event, JobEnded failed):
  start JobEnded for that job, as the event would have;
- running, its current job registered but never created, and the execution registering it no longer
  running: start StartJob to create it (`recreate`, claimed by a conditional write on `creator`);
- not running (stopped or failed), its current job still training (a stop that raced the creation):
  stop the job, which no one would otherwise watch.

Everything else is left alone. Each action is idempotent through the registry's conditional writes and
SageMaker's unique job names, so a pass that overlaps an in-flight decision changes nothing twice.
"""

from __future__ import annotations

from typing import Any

from stacks.supervisor.asl import (
    DESCRIBE_EXECUTION,
    GET_ITEM,
    LIST_JOBS,
    SCAN,
    START_EXECUTION,
    STOP,
    task,
)
from trainstack.aws.request import (
    INPUT_CHANGE,
    INPUT_CREATOR,
    INPUT_HYPERPARAMETER_OVERRIDES,
    INPUT_JOB,
    INPUT_JOB_ENVIRONMENT,
    INPUT_KEEP_ALIVE,
    INPUT_REASON,
    INPUT_REQUEST,
    INPUT_RUN,
    INPUT_RUN_ID,
    INPUT_STEPS,
)

ENDED = ("Completed", "Failed", "Stopped")
EVENT_SOURCE = "trainstack.reconciler"

# ListTrainingJobs names no missing job an error (DescribeTrainingJob would, under a name Step Functions
# also gives throttling): NameContains the job's name, then the exact name picked out in JSONata, page
# after page. NameContains is a substring filter ("A string in the training job name", SageMaker API
# reference), so `<run>-1` also finds `<run>-10` ... and every job of a run whose id extends this one's
# (`x` and `x-1`); a page holds at most LIST_PAGE_MAX of them, and the exact name may be on any page.
LIST_PAGE_MAX = 100  # ListTrainingJobs MaxResults: 1-100 (botocore's model pins it: test_aws_limits.py)
FIND_JOB_ARGUMENTS = (
    "{% $merge([{'NameContains': $states.input.Job, 'MaxResults': "
    + str(LIST_PAGE_MAX)
    + "}, $exists($states.input.Token) ? {'NextToken': $states.input.Token} : {}]) %}"
)
FIND_JOB_OUTPUT = (
    "{% ($found := $states.result.TrainingJobSummaries[TrainingJobName = $states.input.Job]"
    ".TrainingJobStatus; $token := $states.result.NextToken; "
    "$merge([$states.input, "
    "$exists($found) ? {'Status': $found[0]} : $exists($token) ? {'Status': 'More', 'Token': $token} "
    ": {'Status': 'NotCreated'}])) %}"
)


def reconcile_definition(*, table_name: str, start_job_arn: str, job_ended_arn: str) -> dict[str, Any]:
    scan = {
        "TableName": table_name,
        "ConsistentRead": True,
        # Completed runs need nothing; a stopped or failed run may still have a job to stop.
        "FilterExpression": "#state <> :completed",
        "ProjectionExpression": "#run, #run_id, #state, #current, #index, #creator",
        "ExpressionAttributeNames": {
            "#run": "run",
            "#run_id": "run_id",
            "#state": "run_state",
            "#current": "current_job",
            "#index": "job_index",
            "#creator": "creator",
        },
        "ExpressionAttributeValues": {":completed": {"S": "completed"}},
    }
    each_run = {
        "Type": "Map",
        "ItemsPath": "$.Page.Items",
        "MaxConcurrency": 4,
        "ItemSelector": {
            "Run.$": "$$.Map.Item.Value.run.S",
            "RunId.$": "$$.Map.Item.Value.run_id.S",
            "State.$": "$$.Map.Item.Value.run_state.S",
            "Job.$": "$$.Map.Item.Value.current_job.S",
            "Index.$": "$$.Map.Item.Value.job_index.N",
            "Creator.$": "$$.Map.Item.Value.creator.S",
        },
        "ItemProcessor": {
            "ProcessorConfig": {"Mode": "INLINE"},
            "StartAt": "FindJob",
            "States": run_states(table_name, start_job_arn=start_job_arn, job_ended_arn=job_ended_arn),
        },
        "ResultPath": "$.Reconciled",
        "Next": "MorePages",
    }
    return {
        "Comment": "Drive every run whose job ended undecided, whose next job was never created, or whose "
        "job trains unwatched.",
        "StartAt": "FirstPage",
        "States": {
            "FirstPage": task(SCAN, scan, ResultPath="$.Page", Next="EachRun"),
            "EachRun": each_run,
            "MorePages": {
                "Type": "Choice",
                "Choices": [{"Variable": "$.Page.LastEvaluatedKey", "IsPresent": True, "Next": "NextPage"}],
                "Default": "Done",
            },
            # A page is at most 1 MB of items read (DynamoDB Scan): loops once per page, so bounded by
            # the table's size, not by time.
            "NextPage": task(
                SCAN,
                {**scan, "ExclusiveStartKey.$": "$.Page.LastEvaluatedKey"},
                ResultPath="$.Page",
                Next="EachRun",
            ),
            "Done": {"Type": "Succeed", "OutputPath": "$.Reconciled"},
        },
    }


def run_states(table_name: str, *, start_job_arn: str, job_ended_arn: str) -> dict[str, Any]:
    """One run of the scan: what SageMaker says of its current job, and the one action it needs."""
    return {
        "FindJob": {
            "Type": "Task",
            "QueryLanguage": "JSONata",
            "Resource": LIST_JOBS,
            "Arguments": FIND_JOB_ARGUMENTS,
            "Output": FIND_JOB_OUTPUT,
            "Retry": task(LIST_JOBS, {})["Retry"],
            "Next": "Found",
        },
        # Not on this page, and there are more: the next one (bounded by the account's jobs whose names
        # contain this one, LIST_PAGE_MAX a page).
        "Found": {
            "Type": "Choice",
            "Choices": [{"Variable": "$.Status", "StringEquals": "More", "Next": "FindJob"}],
            "Default": "Route",
        },
        "Route": {
            "Type": "Choice",
            "Choices": [
                {
                    "And": [
                        {"Variable": "$.State", "StringEquals": "running"},
                        {"Or": [{"Variable": "$.Status", "StringEquals": s} for s in ENDED]},
                    ],
                    "Next": "DecideEnd",
                },
                {
                    "And": [
                        {"Variable": "$.State", "StringEquals": "running"},
                        {"Variable": "$.Status", "StringEquals": "NotCreated"},
                    ],
                    "Next": "IsCreatorRunning",
                },
                {
                    "And": [
                        {"Not": {"Variable": "$.State", "StringEquals": "running"}},
                        {"Variable": "$.Status", "StringEquals": "InProgress"},
                    ],
                    "Next": "StopUnwatched",
                },
            ],
            "Default": "Fine",
        },
        "DecideEnd": task(
            START_EXECUTION,
            {
                "StateMachineArn": job_ended_arn,
                "Name.$": "States.UUID()",
                # What JobEnded reads of SageMaker's event: it describes the job itself.
                "Input": {"source": EVENT_SOURCE, "detail": {"TrainingJobName.$": "$.Job"}},
            },
            ResultSelector={"Execution.$": "$.ExecutionArn"},
            ResultPath="$.Action",
            Next="Decided",
        ),
        "Decided": {"Type": "Pass", "Parameters": {"Run.$": "$.Run", "Action": "decide"}, "End": True},
        "IsCreatorRunning": task(
            DESCRIBE_EXECUTION,
            {"ExecutionArn.$": "$.Creator"},
            ResultSelector={"Status.$": "$.Status"},
            ResultPath="$.CreatorExecution",
            # No such execution (or none recorded): nothing is creating the job.
            Catch=[{"ErrorEquals": ["States.ALL"], "Next": "ReadRun", "ResultPath": "$.CreatorError"}],
            Next="CreatorGone",
        ),
        "CreatorGone": {
            "Type": "Choice",
            "Choices": [
                {"Variable": "$.CreatorExecution.Status", "StringEquals": "RUNNING", "Next": "Fine"},
            ],
            "Default": "ReadRun",
        },
        "ReadRun": task(
            GET_ITEM,
            {"TableName": table_name, "Key": {"run": {"S.$": "$.Run"}}, "ConsistentRead": True},
            ResultSelector={"Request.$": "$.Item.request.S"},
            ResultPath="$.Record",
            Next="Recreate",
        ),
        "Recreate": task(
            START_EXECUTION,
            {
                "StateMachineArn": start_job_arn,
                "Name.$": "States.UUID()",
                "Input": {
                    f"{INPUT_RUN}.$": "$.Run",
                    f"{INPUT_RUN_ID}.$": "$.RunId",
                    f"{INPUT_JOB}.$": "States.StringToJson($.Index)",
                    INPUT_STEPS: 0,
                    INPUT_HYPERPARAMETER_OVERRIDES: {},
                    INPUT_KEEP_ALIVE: 0,
                    INPUT_REASON: "recreate",
                    f"{INPUT_REQUEST}.$": "States.StringToJson($.Record.Request)",
                    INPUT_JOB_ENVIRONMENT: {},
                    INPUT_CHANGE: {"Who": EVENT_SOURCE, "What": "recreate"},
                    f"{INPUT_CREATOR}.$": "$.Creator",
                },
            },
            ResultSelector={"Execution.$": "$.ExecutionArn"},
            ResultPath="$.Action",
            Next="Recreated",
        ),
        "Recreated": {"Type": "Pass", "Parameters": {"Run.$": "$.Run", "Action": "recreate"}, "End": True},
        "StopUnwatched": task(
            STOP,
            {"TrainingJobName.$": "$.Job"},
            ResultPath=None,
            Catch=[{"ErrorEquals": ["States.ALL"], "Next": "Fine", "ResultPath": "$.StopError"}],
            Next="Stopped",
        ),
        "Stopped": {"Type": "Pass", "Parameters": {"Run.$": "$.Run", "Action": "stop"}, "End": True},
        "Fine": {"Type": "Pass", "Parameters": {"Run.$": "$.Run", "Action": "none"}, "End": True},
    }
