"""The emulator delivers events and runs schedules itself (trainstack.emulator.delivery): a job's state
change reaches the matching rules' targets with nobody calling anything, in the shape SageMaker documents
(EventBridge reference, "Amazon SageMaker AI events"), through the target's input transformation
(EventBridge user guide, "input transformation"); a schedule a template creates runs at its rate, sped
up by the documented factor, the first time at once (Scheduler user guide, "Schedule types"); hand
delivery only when a test asks for it."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator

import pytest

from trainstack.emulator import delivery
from trainstack.emulator import events as emulator_events
from trainstack.emulator.endpoint import ACCOUNT, REGION, Emulator

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("emulator")]
ROLE = f"arn:aws:iam::{ACCOUNT}:role/any"
RECORDER = {"StartAt": "Seen", "States": {"Seen": {"Type": "Pass", "End": True}}}
ENDED = ["Completed", "Failed", "Stopped"]


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    log = tmp_path_factory.mktemp("delivery") / "moto.log"
    with Emulator(log_path=log, jobs="hold").start(timeout_s=180) as started:
        yield started


def executions(sfn, machine: str) -> list[dict]:
    found = sfn.list_executions(stateMachineArn=machine)["executions"]
    return [sfn.describe_execution(executionArn=e["executionArn"]) for e in found]


def wait_for(condition, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)
    return value


def create_job(sagemaker, name: str) -> None:
    sagemaker.create_training_job(
        TrainingJobName=name,
        AlgorithmSpecification={"TrainingImage": "image", "TrainingInputMode": "File"},
        RoleArn=ROLE,
        OutputDataConfig={"S3OutputPath": "s3://out/"},
        ResourceConfig={"InstanceType": "ml.m5.xlarge", "InstanceCount": 1, "VolumeSizeInGB": 30},
        StoppingCondition={"MaxRuntimeInSeconds": 3600},
        Environment={"TRAINSTACK_RUN": name},
    )


def test_every_job_state_change_reaches_the_matching_targets_unasked_and_by_hand_only_when_asked(emulator):
    env = emulator.env()
    sfn, events, sagemaker, sqs = (
        emulator.client(s) for s in ("stepfunctions", "events", "sagemaker", "sqs")
    )
    machine = sfn.create_state_machine(name="Recorder", definition=json.dumps(RECORDER), roleArn=ROLE)[
        "stateMachineArn"
    ]
    prefix = f"ts-d{uuid.uuid4().hex[:6]}-"
    ended = {
        "source": ["aws.sagemaker"],
        "detail-type": [delivery.TRAINING_STATE_CHANGE],
        "detail": {"TrainingJobStatus": ENDED, "TrainingJobName": [{"prefix": prefix}]},
    }
    events.put_rule(Name="JobEnded", EventPattern=json.dumps(ended))
    transformer = {
        "InputPathsMap": {"job": "$.detail.TrainingJobName", "status": "$.detail.TrainingJobStatus"},
        "InputTemplate": (
            '{"Job": <job>, "Said": "<job> is \\"<status>\\"", "Rule": "<aws.events.rule-name>"}'
        ),
    }
    events.put_targets(
        Rule="JobEnded", Targets=[{"Id": "m", "Arn": machine, "InputTransformer": transformer}]
    )
    queue = sqs.create_queue(QueueName="every-change")["QueueUrl"]
    queue_arn = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["QueueArn"])["Attributes"][
        "QueueArn"
    ]
    every = {"source": ["aws.sagemaker"], "detail": {"TrainingJobName": [{"prefix": prefix}]}}
    events.put_rule(Name="EveryChange", EventPattern=json.dumps(every))
    events.put_targets(Rule="EveryChange", Targets=[{"Id": "q", "Arn": queue_arn}])

    job = f"{prefix}1"
    create_job(sagemaker, job)
    emulator_events.end_training_job(env, job, "Stopped", "MaxRuntimeExceeded")
    (execution,) = wait_for(lambda: executions(sfn, machine))  # nobody delivered it by hand
    assert json.loads(execution["input"]) == {"Job": job, "Said": f'{job} is "Stopped"', "Rule": "JobEnded"}

    # The whole event, as SageMaker documents its envelope; the detail is DescribeTrainingJob's answer.
    message = wait_for(lambda: sqs.receive_message(QueueUrl=queue, WaitTimeSeconds=1).get("Messages"))
    event = json.loads(message[0]["Body"])
    described = sagemaker.describe_training_job(TrainingJobName=job)
    assert (
        event["source"] == "aws.sagemaker" and event["detail-type"] == "SageMaker Training Job State Change"
    )
    assert (event["account"], event["region"], event["version"]) == (ACCOUNT, REGION, "0")
    assert event["resources"] == [described["TrainingJobArn"]]
    detail = event["detail"]
    assert (detail["TrainingJobStatus"], detail["SecondaryStatus"]) == ("Stopped", "MaxRuntimeExceeded")
    assert detail["Environment"] == {"TRAINSTACK_RUN": job}
    assert set(detail) <= set(described) | {"TrainingJobArn"}  # no field DescribeTrainingJob lacks
    assert detail["TrainingEndTime"] == str(int(described["TrainingEndTime"].timestamp() * 1000))

    # A test that delivers by hand asks for it: then nothing arrives unless it delivers.
    emulator_events.configure(env, events="manual")
    try:
        second = f"{prefix}2"
        create_job(sagemaker, second)
        emulator_events.end_training_job(env, second, "Completed", "Completed")
        time.sleep(2)
        assert len(executions(sfn, machine)) == 1
        (by_hand,) = emulator_events.deliver_job_state_change(env, second)
        assert json.loads(sfn.describe_execution(executionArn=by_hand)["input"])["Job"] == second
    finally:
        emulator_events.configure(env, events="auto")


def test_a_deployed_schedule_runs_at_its_rate_sped_up_from_the_start_and_stops_with_its_stack(emulator):
    env = emulator.env()
    sfn, cfn, scheduler = (emulator.client(s) for s in ("stepfunctions", "cloudformation", "scheduler"))
    template = {
        "Resources": {
            "Reconcile": {
                "Type": "AWS::StepFunctions::StateMachine",
                "Properties": {"DefinitionString": json.dumps(RECORDER), "RoleArn": ROLE},
            },
            "ReconcileSchedule": {
                "Type": "AWS::Scheduler::Schedule",
                "Properties": {
                    "ScheduleExpression": "rate(1 minute)",
                    "FlexibleTimeWindow": {"Mode": "OFF"},
                    "State": "ENABLED",
                    "Target": {"Arn": {"Ref": "Reconcile"}, "RoleArn": ROLE, "Input": '{"from": "schedule"}'},
                },
            },
        }
    }
    settings = emulator_events.configure(env, schedule_speedup=30)  # 60 s / 30: every 2 s
    assert settings["schedule_speedup"] == 30 and settings["events"] == "auto"
    try:
        started = time.monotonic()
        cfn.create_stack(StackName="Sched", TemplateBody=json.dumps(template))
        resources = cfn.list_stack_resources(StackName="Sched")["StackResourceSummaries"]
        ids = {r["LogicalResourceId"]: r["PhysicalResourceId"] for r in resources}
        machine = ids["Reconcile"] if ids["Reconcile"].startswith("arn:") else None
        machine = machine or next(
            m["stateMachineArn"]
            for m in sfn.list_state_machines()["stateMachines"]
            if "Reconcile" in m["name"]
        )
        # The API sees what the template created.
        schedule = scheduler.get_schedule(Name=ids["ReconcileSchedule"])
        assert schedule["ScheduleExpression"] == "rate(1 minute)" and schedule["Target"]["Arn"] == machine
        first = wait_for(lambda: executions(sfn, machine), timeout_s=10)  # no StartDate: at once
        assert time.monotonic() - started < 6
        assert json.loads(first[0]["input"]) == {"from": "schedule"}
        # then once every 60 s / 30 = 2 s on average (the scheduler looks once a second, and a loaded machine
        # delays some starts; next_due's own test pins the cadence exactly)
        runs = wait_for(lambda: [] if len(found := executions(sfn, machine)) < 5 else found, timeout_s=30)
        starts = sorted(e["startDate"].timestamp() for e in runs)
        mean_gap = (starts[-1] - starts[0]) / (len(starts) - 1)
        assert 1.5 <= mean_gap <= 3.5, starts
        cfn.delete_stack(StackName="Sched")
        with pytest.raises(scheduler.exceptions.ResourceNotFoundException):
            scheduler.get_schedule(Name=ids["ReconcileSchedule"])  # the schedule went with its stack
    finally:
        emulator_events.configure(env, schedule_speedup=delivery.SPEEDUP)


# --- pure parts ---------------------------------------------------------------------------------


def test_rate_expressions_and_when_a_schedule_is_next_due():
    assert delivery.rate_seconds("rate(10 minutes)") == 600
    assert delivery.rate_seconds("rate(1 hour)") == 3600 and delivery.rate_seconds("rate(2 days)") == 172800
    assert (
        delivery.rate_seconds("rate(0 minutes)") is None
        and delivery.rate_seconds("cron(0 * * * ? *)") is None
    )
    schedule = {"ScheduleExpression": "rate(10 minutes)", "State": "ENABLED", "CreationDate": 1000.0}
    assert delivery.next_due(schedule, None, 1000.0, 10) == 1000.0  # at once
    assert delivery.next_due(schedule, 1000.0, 1001.0, 10) == 1060.0  # 600 s / 10
    assert delivery.next_due(schedule, 1000.0, 1001.0, 1) == 1600.0  # AWS's own pace
    assert delivery.next_due({**schedule, "EndDate": 1030.0}, 1000.0, 1001.0, 10) is None
    assert delivery.next_due({**schedule, "StartDate": 5000.0}, None, 1001.0, 10) == 5000.0
    assert delivery.next_due({**schedule, "State": "DISABLED"}, None, 1001.0, 10) is None
    once = {"ScheduleExpression": "at(2030-01-02T03:04:05)", "State": "ENABLED"}
    assert (
        delivery.next_due(once, None, 0.0, 10) == 1893553445.0
        and delivery.next_due(once, 1.0, 2.0, 10) is None
    )


def test_input_transformer_placeholders_quoted_or_not_and_input_path():
    event = {"time": "2026-12-02T20:00:00Z", "detail": {"Name": "j-1", "Count": 3, "Tags": [{"k": "v"}]}}
    rule = {"Name": "R", "Arn": "arn:aws:events:us-east-1:123456789012:rule/R"}
    json_template = {
        "InputPathsMap": {"name": "$.detail.Name", "count": "$.detail.Count", "tag": "$.detail.Tags[0]"},
        "InputTemplate": (
            '{"n": <name>, "c": <count>, "t": <tag>, "s": "<name> x<count>", "r": <aws.events.rule-arn>}'
        ),
    }
    assert json.loads(delivery.target_input({"InputTransformer": json_template}, event, rule)) == {
        "n": "j-1", "c": 3, "t": {"k": "v"}, "s": "j-1 x3", "r": rule["Arn"],
    }  # fmt: skip
    text = {"InputPathsMap": {"name": "$.detail.Name"}, "InputTemplate": "job <name> ended"}
    assert delivery.target_input({"InputTransformer": text}, event, rule) == "job j-1 ended"
    assert json.loads(delivery.target_input({"InputPath": "$.detail.Tags"}, event, rule)) == [{"k": "v"}]
    assert delivery.target_input({"Input": '{"a": 1}'}, event, rule) == '{"a": 1}'
    assert json.loads(delivery.target_input({}, event, rule)) == event
    with pytest.raises(ValueError, match="at most 100"):
        too_many = {f"v{i}": "$.detail.Name" for i in range(101)}
        delivery.target_input(
            {"InputTransformer": {"InputPathsMap": too_many, "InputTemplate": "x"}}, event, rule
        )


def test_a_max_runtime_cap_shortens_a_jobs_limit_only_while_set(monkeypatch):
    from trainstack.emulator import jobs

    monkeypatch.setattr(jobs.SETTINGS, "max_runtime_cap_s", None)
    assert jobs._capped_runtime(3600) == 3600 and jobs._capped_runtime(None) is None
    monkeypatch.setattr(jobs.SETTINGS, "max_runtime_cap_s", 45.0)
    assert (
        jobs._capped_runtime(3600) == 45.0
        and jobs._capped_runtime(30) == 30
        and jobs._capped_runtime(None) == 45
    )
    with pytest.raises(ValueError, match="1..86400"):
        emulator_events.apply_config({"max_runtime_cap_seconds": 0})
