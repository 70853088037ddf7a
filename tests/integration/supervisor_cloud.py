"""The run supervisor's state machines in one emulator, shared by the emulator tests of this folder
(tests/integration/conftest.py's `supervisor_cloud`): the definitions the RunSupervisor construct
deploys, built by the same functions with literal values instead of CDK tokens, a run registry table,
the notification topic (read through an SQS queue), and the stall rule.

Changes for the emulator: the 15-minute wait after a capacity failure is 1 s in `JobEnded` (its Wait
state); `JobEndedSlow` is the same machine with a SLOW_WAIT_S wait, to interrupt a decision half-way.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from supervisor_cases import Case
from test_supervisor_decisions import definitions

from stacks.supervisor.stalled import stalled_alarm_pattern
from trainstack.aws.request import execution_input
from trainstack.emulator import events as emulator_events
from trainstack.emulator.endpoint import ACCOUNT, REGION, Emulator, clients
from trainstack.recipes.loader import resolve
from trainstack.recipes.naming import JOB_INDEX_MAX

RECIPE = resolve("1b-bf16").recipe
PREFIX = "ts-platform-1b-bf16--"
TOPIC = "arn:aws:sns:us-east-1:123456789012:t"  # the ARN definitions() was built with
TABLE = "runs"
SLOW_WAIT_S = 6
__all__ = ["JOB_INDEX_MAX", "PREFIX", "RECIPE", "TABLE", "Cloud", "start_cloud"]


class Cloud:
    def __init__(self, emulator: Emulator) -> None:
        self.env = emulator.env()
        self.sfn, self.ddb, self.sagemaker, self.sns, self.sqs, self.events_client = clients(
            self.env, "stepfunctions", "dynamodb", "sagemaker", "sns", "sqs", "events"
        )

    def wait(self, arn: str, timeout_s: float = 120) -> dict:
        deadline = time.monotonic() + timeout_s
        while (described := self.sfn.describe_execution(executionArn=arn))["status"] == "RUNNING":
            assert time.monotonic() < deadline, arn
            time.sleep(0.2)
        return described

    def events(self, arn: str) -> list[dict]:
        pages = self.sfn.get_paginator("get_execution_history").paginate(executionArn=arn)
        return [e for page in pages for e in page["events"]]

    def subscribe(self) -> None:
        """The notification topic, read through the SQS queue (made again after a test deletes it)."""
        assert self.sns.create_topic(Name="t")["TopicArn"] == TOPIC
        queue_arn = self.sqs.get_queue_attributes(QueueUrl=self.queue, AttributeNames=["QueueArn"])
        self.sns.subscribe(TopicArn=TOPIC, Protocol="sqs", Endpoint=queue_arn["Attributes"]["QueueArn"])

    def messages(self) -> list[str]:
        found = []
        while batch := self.sqs.receive_message(QueueUrl=self.queue, MaxNumberOfMessages=10).get("Messages"):
            for m in batch:
                found.append(json.loads(m["Body"])["Message"])
                self.sqs.delete_message(QueueUrl=self.queue, ReceiptHandle=m["ReceiptHandle"])
        return found


def start_cloud(log_path: Path) -> Iterator[Cloud]:
    with Emulator(log_path=log_path).start(timeout_s=180) as emulator:
        c = Cloud(emulator)
        emulator_events.configure(c.env, jobs_run=True)
        c.ddb.create_table(
            TableName=TABLE,
            KeySchema=[{"AttributeName": "run", "KeyType": "HASH"}],
            AttributeDefinitions=[{"AttributeName": "run", "AttributeType": "S"}],
            BillingMode="PAY_PER_REQUEST",
        )
        c.queue = c.sqs.create_queue(QueueName="notifications")["QueueUrl"]
        c.subscribe()
        role = f"arn:aws:iam::{ACCOUNT}:role/supervisor"

        def machine(name: str, definition: dict) -> str:
            return c.sfn.create_state_machine(name=name, definition=json.dumps(definition), roleArn=role)[
                "stateMachineArn"
            ]

        ended, slow = (json.loads(json.dumps(definitions()["JobEnded"])) for _ in range(2))
        ended["States"]["WaitForCapacity"] = {"Type": "Wait", "Seconds": 1, "Next": "NextInput"}  # EMULATOR
        slow["States"]["WaitForCapacity"] = {"Type": "Wait", "Seconds": SLOW_WAIT_S, "Next": "NextInput"}
        c.start_job = machine("StartJob", definitions()["StartJob"])
        c.job_ended = machine("JobEnded", ended)
        c.job_ended_slow = machine("JobEndedSlow", slow)
        c.reconcile = machine("Reconcile", definitions()["Reconcile"])
        c.stop_stalled = machine("StopStalled", definitions()["StopStalled"])
        c.events_client.put_rule(Name="JobStalled", EventPattern=json.dumps(stalled_alarm_pattern(PREFIX)))
        c.events_client.put_targets(Rule="JobStalled", Targets=[{"Id": "stalled", "Arn": c.stop_stalled}])
        yield c


def start_launch(
    cloud: Cloud, run_id: str, keep_alive: int = 0, machine: str | None = None
) -> tuple[str, str]:
    """Start job 1 of a new run (as `trainstack launch` does); (run, execution ARN), not waited for."""
    run = f"{PREFIX}{run_id}"
    payload = execution_input(
        run, run_id, 1, RECIPE.training.steps, {}, keep_alive, change={"Who": "test", "What": "launch"}
    )
    arn = cloud.sfn.start_execution(
        stateMachineArn=machine or cloud.start_job,
        name=f"{run}-1-{uuid.uuid4().hex[:12]}",
        input=json.dumps(payload),
    )["executionArn"]
    return run, arn


def launch(cloud: Cloud, run_id: str, keep_alive: int = 0, machine: str | None = None) -> tuple[str, str]:
    run, arn = start_launch(cloud, run_id, keep_alive, machine)
    assert cloud.wait(arn)["status"] == "SUCCEEDED"
    return run, arn


def set_up(cloud: Cloud, run: str, case: Case) -> None:
    """Make the run's record what the case says (as `trainstack stop`, a resume or a late event would)."""
    values: dict[str, dict] = {
        "stop_requested": {"BOOL": case.stop_requested},
        "stalled": {"S": f"{run}-1" if case.stalled else ""},
        "capacity_wait": {"N": str(case.capacity_wait)},
        "capacity_minutes": {"N": str(case.capacity_minutes)},
        "capacity_budget": {"N": str(case.capacity_budget)},
        "crashes": {"N": str(case.crashes)},
        "run_state": {"S": case.run_state},
        "step": {"N": str(case.step_before)},
        "saved_step": {"N": str(case.saved_before)},
    }
    if case.at_job_limit:
        values["counted"] = {"N": str(RECIPE.compute.max_jobs)}
    if case.stale:
        values["current_job"] = {"S": f"{run}-2"}
    if case.last_index:
        values["job_index"] = {"N": str(JOB_INDEX_MAX)}
    update(cloud, run, values)


def update(cloud: Cloud, run: str, values: dict[str, dict]) -> None:
    """Set attributes of the run's record (as another writer would)."""
    cloud.ddb.update_item(
        TableName=TABLE,
        Key={"run": {"S": run}},
        UpdateExpression="SET " + ", ".join(f"#{k} = :{k}" for k in values),
        ExpressionAttributeNames={f"#{k}": k for k in values},
        ExpressionAttributeValues={f":{k}": v for k, v in values.items()},
    )


def start_job_ended(cloud: Cloud, job: str, machine: str | None = None) -> str:
    """Start JobEnded with the event SageMaker sends for the job's current state (not waited for)."""
    described = cloud.sagemaker.describe_training_job(TrainingJobName=job)
    event = emulator_events.job_state_change_event(described, REGION, ACCOUNT)
    return cloud.sfn.start_execution(
        stateMachineArn=machine or cloud.job_ended, name=uuid.uuid4().hex, input=json.dumps(event)
    )["executionArn"]


def job_ended(cloud: Cloud, job: str) -> tuple[dict, str]:
    """Start JobEnded for the job's current state; its decision."""
    arn = start_job_ended(cloud, job)
    done = cloud.wait(arn)
    assert done["status"] == "SUCCEEDED", done
    return json.loads(done["output"]), arn


def reconcile(cloud: Cloud) -> tuple[list[dict], list[str]]:
    """One pass of the reconciler, as its schedule starts it; (what it did per run, the executions it
    started, waited for)."""
    arn = cloud.sfn.start_execution(stateMachineArn=cloud.reconcile, name=uuid.uuid4().hex, input="{}")[
        "executionArn"
    ]
    done = cloud.wait(arn)
    assert done["status"] == "SUCCEEDED", done
    actions = json.loads(done["output"])
    started = [
        json.loads(e["taskSucceededEventDetails"]["output"])["ExecutionArn"]
        for e in cloud.events(arn)
        if e["type"] == "TaskSucceeded" and "ExecutionArn" in e["taskSucceededEventDetails"].get("output", "")
    ]
    for execution in started:
        cloud.wait(execution)
    return actions, started
