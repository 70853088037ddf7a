"""The alarm manager, run by the local emulator's Step Functions interpreter on SageMaker state-change
events: a job reaching Training gets every alarm (metric, dimension, threshold, SNS action) for itself
and each host; the job's end deletes them; a job still Starting gets none.

The definition is the one synthesized into the template; only CloudFormation references are replaced
(partition, the topic's ARN, created in the emulator).
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from pathlib import Path

import pytest
from monitoring_helpers import definition, synth, topic_ref

from stacks.monitoring import run_alarm_specs
from trainstack.aws.request import job_name
from trainstack.emulator.endpoint import Emulator

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("monitoring-emulator")]
SAMPLE = json.loads((Path(__file__).parent / "data" / "sagemaker_training_job_state_change.json").read_text())


def event(name: str, status: str, secondary: str) -> dict:
    e = copy.deepcopy(SAMPLE)
    e["detail"].update(TrainingJobName=name, TrainingJobStatus=status, SecondaryStatus=secondary)
    return e


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    s = synth("30b-fp8")
    # A generous start timeout: CI machines are shared and moto's first import is slow under load.
    emu = Emulator(log_path=tmp_path_factory.mktemp("moto") / "moto.log").start(timeout_s=180)
    try:
        topic = emu.client("sns").create_topic(Name="trainstack-notifications")["TopicArn"]
        asl = definition(s, {topic_ref(s)["Ref"]: topic})
        machine = emu.client("stepfunctions").create_state_machine(
            name="alarm-manager",
            definition=json.dumps(asl),
            roleArn="arn:aws:iam::123456789012:role/alarm-manager",
        )["stateMachineArn"]
        yield s, emu, topic, machine
    finally:
        emu.stop()


def run(emu: Emulator, machine: str, payload: dict) -> dict:
    sfn = emu.client("stepfunctions")
    arn = sfn.start_execution(stateMachineArn=machine, name=uuid.uuid4().hex, input=json.dumps(payload))[
        "executionArn"
    ]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        described = sfn.describe_execution(executionArn=arn)
        if described["status"] != "RUNNING":
            return described
        time.sleep(0.2)
    raise AssertionError("alarm manager execution did not finish within 120 s")


def alarms_of(emu: Emulator, job: str) -> dict[str, dict]:
    found = emu.client("cloudwatch").describe_alarms(AlarmNamePrefix=job)["MetricAlarms"]
    return {a["AlarmName"]: a for a in found}


def test_run_alarms_exist_for_the_job_and_each_host_once_it_trains(setup):
    s, emu, topic, machine = setup
    job = job_name(s.recipe, None, "e2e1")
    done = run(emu, machine, event(job, "InProgress", "Training"))
    assert done["status"] == "SUCCEEDED", done
    alarms = alarms_of(emu, job)
    expected = {}
    for spec in run_alarm_specs(s.recipe, s.plan):
        hosts = range(1, s.recipe.compute.instance_count + 1) if spec.per_host else [None]
        for host in hosts:
            request = spec.request(job, topic, host)
            expected[request["AlarmName"]] = request
    assert set(alarms) == set(expected)
    for name, request in expected.items():
        alarm = alarms[name]
        if "Metrics" in request:  # metric math: the alarm the state machine put is the pure request
            assert alarm["Metrics"] == request["Metrics"], name
            keys: tuple[str, ...] = ("EvaluationPeriods", "Threshold", "ComparisonOperator", "AlarmActions")
            assert all(alarm[k] == request[k] for k in keys), name
            continue
        for key in (
            "Namespace",
            "MetricName",
            "Dimensions",
            "Statistic",
            "Period",
            "EvaluationPeriods",
            "Threshold",
            "ComparisonOperator",
            "TreatMissingData",
            "AlarmActions",
            "OKActions",
        ):
            assert alarm[key] == request[key], (name, key)
    # e.g. the slow alarm of this job, against the plan
    slow = alarms[f"{job}-Slow"]
    assert slow["MetricName"] == "train:tokens_per_sec"
    assert slow["Threshold"] == pytest.approx(
        s.recipe.monitoring.slow_fraction * s.plan.throughput.tokens_per_sec_per_gpu
    )
    assert slow["AlarmActions"] == [topic]


def test_run_alarms_are_deleted_when_the_job_ends(setup):
    s, emu, topic, machine = setup
    job = job_name(s.recipe, None, "e2e2")
    assert run(emu, machine, event(job, "InProgress", "Training"))["status"] == "SUCCEEDED"
    assert alarms_of(emu, job)
    done = run(emu, machine, event(job, "Failed", "Failed"))
    assert done["status"] == "SUCCEEDED", done
    assert alarms_of(emu, job) == {}


def test_a_job_that_never_trained_gets_no_alarms_and_its_end_is_harmless(setup):
    s, emu, topic, machine = setup
    job = job_name(s.recipe, None, "e2e3")
    assert run(emu, machine, event(job, "InProgress", "Starting"))["status"] == "SUCCEEDED"
    assert alarms_of(emu, job) == {}
    assert run(emu, machine, event(job, "Stopped", "Stopped"))["status"] == "SUCCEEDED"
