"""The supervisor's state machines, run by the local emulator's Step Functions interpreter, against a
real (emulated) run registry, SageMaker and SNS: every case of supervisor_cases.py gets the decision
the pure function gives, the registry and the next job follow it, the notification says it, and the
history events of each kind of execution are counted.

The definitions are the ones the RunSupervisor construct deploys, built by the same functions with
literal values instead of CDK tokens (the deployed stack runs in test_emulator_deploy.py). One change
for the emulator: the 15-minute wait after a capacity failure is 1 s (its Wait state's SecondsPath).
"""

from __future__ import annotations

import json
import time
import uuid

import pytest
from supervisor_cases import CASES, Case
from test_supervisor_decisions import HISTORY_LIMIT, definitions, history_bound

from trainstack.aws.registry import read_run
from trainstack.aws.request import execution_input
from trainstack.aws.supervisor import RUN_STATE, EndedJob, Outcome, RunRecord, next_action
from trainstack.emulator import events as emulator_events
from trainstack.emulator.endpoint import ACCOUNT, REGION, Emulator, clients
from trainstack.recipes.loader import resolve
from trainstack.recipes.naming import JOB_INDEX_MAX

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("supervisor-emulator")]
RECIPE = resolve("1b-bf16").recipe
PREFIX = "ts-platform-1b-bf16--"


class Cloud:
    def __init__(self, emulator: Emulator) -> None:
        self.env = emulator.env()
        self.sfn, self.ddb, self.sagemaker, self.sns, self.sqs = clients(
            self.env, "stepfunctions", "dynamodb", "sagemaker", "sns", "sqs"
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

    def messages(self) -> list[str]:
        found = []
        while batch := self.sqs.receive_message(QueueUrl=self.queue, MaxNumberOfMessages=10).get("Messages"):
            for m in batch:
                found.append(json.loads(m["Body"])["Message"])
                self.sqs.delete_message(QueueUrl=self.queue, ReceiptHandle=m["ReceiptHandle"])
        return found


@pytest.fixture(scope="module")
def cloud(tmp_path_factory):
    with Emulator(log_path=tmp_path_factory.mktemp("moto") / "moto.log").start(timeout_s=180) as emulator:
        c = Cloud(emulator)
        emulator_events.configure(c.env, jobs_run=True)
        c.ddb.create_table(
            TableName="runs",
            KeySchema=[{"AttributeName": "run", "KeyType": "HASH"}],
            AttributeDefinitions=[{"AttributeName": "run", "AttributeType": "S"}],
            BillingMode="PAY_PER_REQUEST",
        )
        topic = c.sns.create_topic(Name="t")["TopicArn"]
        assert topic == "arn:aws:sns:us-east-1:123456789012:t"  # the ARN definitions() was built with
        c.queue = c.sqs.create_queue(QueueName="notifications")["QueueUrl"]
        queue_arn = c.sqs.get_queue_attributes(QueueUrl=c.queue, AttributeNames=["QueueArn"])["Attributes"]
        c.sns.subscribe(TopicArn=topic, Protocol="sqs", Endpoint=queue_arn["QueueArn"])
        ended = json.loads(json.dumps(definitions()["JobEnded"]))
        ended["States"]["WaitForCapacity"] = {"Type": "Wait", "Seconds": 1, "Next": "NextInput"}  # EMULATOR
        role = f"arn:aws:iam::{ACCOUNT}:role/supervisor"
        c.start_job = c.sfn.create_state_machine(
            name="StartJob", definition=json.dumps(definitions()["StartJob"]), roleArn=role
        )["stateMachineArn"]
        c.job_ended = c.sfn.create_state_machine(name="JobEnded", definition=json.dumps(ended), roleArn=role)[
            "stateMachineArn"
        ]
        yield c


def launch(cloud: Cloud, run_id: str) -> tuple[str, str]:
    run = f"{PREFIX}{run_id}"
    payload = execution_input(
        run, run_id, 1, RECIPE.training.steps, {}, 0, change={"Who": "test", "What": "launch"}
    )
    arn = cloud.sfn.start_execution(
        stateMachineArn=cloud.start_job, name=f"{run}-1-{uuid.uuid4().hex[:12]}", input=json.dumps(payload)
    )["executionArn"]
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
    }
    if case.at_job_limit:
        values["counted"] = {"N": str(RECIPE.compute.max_jobs)}
    if case.stale:
        values["current_job"] = {"S": f"{run}-2"}
    if case.last_index:
        values["job_index"] = {"N": str(JOB_INDEX_MAX)}
    cloud.ddb.update_item(
        TableName="runs",
        Key={"run": {"S": run}},
        UpdateExpression="SET " + ", ".join(f"#{k} = :{k}" for k in values),
        ExpressionAttributeNames={f"#{k}": k for k in values},
        ExpressionAttributeValues={f":{k}": v for k, v in values.items()},
    )


def job_ended(cloud: Cloud, job: str) -> tuple[dict, str]:
    """Start JobEnded with the event SageMaker sends for the job's current state; its decision."""
    described = cloud.sagemaker.describe_training_job(TrainingJobName=job)
    event = emulator_events.job_state_change_event(described, REGION, ACCOUNT)
    arn = cloud.sfn.start_execution(
        stateMachineArn=cloud.job_ended, name=uuid.uuid4().hex, input=json.dumps(event)
    )["executionArn"]
    done = cloud.wait(arn)
    assert done["status"] == "SUCCEEDED", done
    return json.loads(done["output"]), arn


@pytest.mark.parametrize("index,case", list(enumerate(CASES)), ids=[c.id for c in CASES])
def test_the_state_machine_decides_every_case_as_the_pure_function_does(
    cloud, index: int, case: Case
) -> None:
    run, _ = launch(cloud, f"case-{index}")
    job = f"{run}-1"
    set_up(cloud, run, case)
    before = read_run(cloud.ddb, "runs", run)
    emulator_events.end_training_job(cloud.env, job, case.status, case.secondary, case.reason)
    cloud.messages()  # only this case's notification below
    decision, _ = job_ended(cloud, job)

    record = RunRecord(
        run,
        before.state,
        before.current_job,
        before.job_index,
        before.counted,
        before.max_jobs,
        before.stop_requested,
        before.crashes,
        before.stalled,
        before.capacity_minutes,
        before.capacity_wait,
        before.capacity_budget,
    )
    expected = next_action(record, EndedJob(job, case.status, case.secondary, case.reason))
    assert (decision["Outcome"], decision["Rule"]) == (expected.outcome.value, expected.rule)
    assert (decision["Outcome"], decision["Rule"]) == (case.outcome, case.rule)
    assert decision["Why"] == expected.why and decision["Next"] == expected.next_step

    after = read_run(cloud.ddb, "runs", run)
    notes = cloud.messages()
    if expected.outcome is Outcome.IGNORED:
        assert (after.state, after.current_job) == (before.state, before.current_job) and notes == []
        return
    assert after.state == RUN_STATE[expected.outcome]
    assert after.why == expected.why and after.next_step == expected.next_step
    assert {j.name: j.status for j in after.jobs}[job] == case.status
    (note,) = notes
    assert f"trainstack run {run} " in note and f"job {job} ended {case.status} ({case.secondary})" in note
    assert f"Next: {expected.next_step}." in note and f"Checkpoints: {before.checkpoint_uri}." in note
    if expected.outcome is Outcome.NEXT_JOB:
        nxt = cloud.sagemaker.describe_training_job(TrainingJobName=f"{run}-2")
        assert nxt["TrainingJobStatus"] == "InProgress"
        first = cloud.sagemaker.describe_training_job(TrainingJobName=job)
        assert (
            nxt["Environment"]["TRAINSTACK_CHECKPOINT_URI"]
            == first["Environment"]["TRAINSTACK_CHECKPOINT_URI"]
        )
        assert nxt["Environment"]["TRAINSTACK_RUN"] == run
        assert after.current_job == f"{run}-2" and after.job_index == 2
        assert after.crashes == expected.crashes  # counted by a crash, reset by any other end
        assert (after.counted, after.capacity_minutes, after.capacity_wait) == (
            expected.counted,
            expected.capacity_minutes,
            expected.wait_minutes,
        )
        # Built from the run's recorded request, whatever is deployed: the same request, its own name.
        sent = {k: v for k, v in nxt.items() if k in before.request}
        assert sent["HyperParameters"] == before.request["HyperParameters"]
        assert sent["ResourceConfig"]["InstanceCount"] == before.request["ResourceConfig"]["InstanceCount"]


def test_a_repeated_event_starts_no_second_job(cloud) -> None:
    run, _ = launch(cloud, "repeat")
    emulator_events.end_training_job(cloud.env, f"{run}-1", "Stopped", "MaxRuntimeExceeded")
    first, _ = job_ended(cloud, f"{run}-1")
    again, _ = job_ended(cloud, f"{run}-1")  # EventBridge delivers at least once
    assert (first["Outcome"], again["Outcome"]) == ("next_job", "ignored")
    assert [j.name for j in read_run(cloud.ddb, "runs", run).jobs] == [f"{run}-1", f"{run}-2"]


def test_history_events_per_execution_stay_far_below_the_limit(cloud, capsys) -> None:
    """Counted in the emulator: a start, a decision that starts the next job, a decision that ends the
    run. None depends on how long a job trains, so a 28-day job costs these two executions and a 90-day
    run (4 jobs at 28 days) four of each; each execution is also bounded by its definition."""
    run, start = launch(cloud, "history")
    emulator_events.end_training_job(cloud.env, f"{run}-1", "Stopped", "MaxRuntimeExceeded")
    _, next_job = job_ended(cloud, f"{run}-1")
    emulator_events.end_training_job(cloud.env, f"{run}-2", "Completed", "Completed")
    _, completed = job_ended(cloud, f"{run}-2")
    counts = {
        "start job": len(cloud.events(start)),
        "job ended, next job": len(cloud.events(next_job)),
        "job ended, run completed": len(cloud.events(completed)),
    }
    bounds = {name: history_bound(d) for name, d in definitions().items()}
    assert counts["start job"] <= bounds["StartJob"]
    assert max(counts["job ended, next job"], counts["job ended, run completed"]) <= bounds["JobEnded"]
    per_job = counts["start job"] + counts["job ended, next job"]
    job_hours = 28 * 24
    with capsys.disabled():
        print(f"\nhistory events: {counts}; per 28-day job {per_job} ({per_job / job_hours:.2f} per hour)")
    assert max(counts.values()) < HISTORY_LIMIT / 100


STATE_PAYLOAD_MAX = 262_144  # bytes of UTF-8: any state's input or output (Step Functions quotas)


def payload_sizes(events: list[dict]) -> list[int]:
    """The size of every state's (and the execution's) input and output in a history."""
    return [
        len(text.encode())
        for event in events
        for key, details in event.items()
        if key.endswith("EventDetails") and isinstance(details, dict)
        for field in ("input", "output")
        if isinstance(text := details.get(field), str)
    ]


def test_state_payloads_and_the_run_record_stay_within_what_aws_accepts(cloud, capsys) -> None:
    """The emulator accepts payloads and items of any size. Measured here on a run whose first job
    crashed with a failure reason of SageMaker's full 1,024 characters; the record is then extrapolated,
    by the growth measured per job, to a run's most jobs (naming.JOB_INDEX_MAX) and a full history
    (test_aws_limits.py bounds the same record from the definitions, for every recipe)."""
    from trainstack.aws.registry import HISTORY_MAX, ITEM_MAX, WHAT_MAX, WHO_MAX, item_bytes
    from trainstack.protocol.exit_codes import FAILURE_REASON_MAX

    run, start = launch(cloud, "limits")
    reason = ("AlgorithmError: " + "x" * FAILURE_REASON_MAX)[:FAILURE_REASON_MAX]
    emulator_events.end_training_job(cloud.env, f"{run}-1", "Failed", "Failed", reason)
    _, next_job = job_ended(cloud, f"{run}-1")
    two_jobs = item_size(cloud, run, item_bytes)
    emulator_events.end_training_job(cloud.env, f"{run}-2", "Failed", "Failed", reason)
    job_ended(cloud, f"{run}-2")
    per_job = item_size(cloud, run, item_bytes) - two_jobs
    emulator_events.end_training_job(cloud.env, f"{run}-3", "Completed", "Completed")
    _, completed = job_ended(cloud, f"{run}-3")

    payload = max(size for arn in (start, next_job, completed) for size in payload_sizes(cloud.events(arn)))
    assert payload < STATE_PAYLOAD_MAX / 4
    history = HISTORY_MAX * (WHO_MAX + WHAT_MAX + 80)
    largest = two_jobs + per_job * (JOB_INDEX_MAX - 2) + history
    assert 0 < per_job < 300 and largest < ITEM_MAX * 0.9
    with capsys.disabled():
        print(
            f"\nlargest state payload {payload:,} B (limit {STATE_PAYLOAD_MAX:,}); run record {two_jobs:,} B "
            f"with 2 jobs, {per_job} B more per job, at most {largest:,} B with {JOB_INDEX_MAX} jobs and a "
            f"full history (limit {ITEM_MAX:,})"
        )


def item_size(cloud: Cloud, run: str, measure) -> int:
    item = cloud.ddb.get_item(TableName="runs", Key={"run": {"S": run}}, ConsistentRead=True)["Item"]
    return measure(item)
