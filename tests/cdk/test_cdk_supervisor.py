"""The run supervisor as synthesized: who may assume its roles, what they may do, that every task of
every state machine (the alarm manager's inside its Map included) retries transient errors, and the
alarms that say when supervision failed."""

from __future__ import annotations

import json

import pytest
from cdk_helpers import flatten_join, resources, state_machine_definition

from stacks.retries import TRANSIENT_ERRORS, integration_of

pytestmark = [pytest.mark.fast, pytest.mark.xdist_group("cdk-synth")]
LAUNCHER = "Trainstack-platform-30b-fp8-Launcher"


def statements(template: dict, role_prefix: str) -> list[dict]:
    return [
        statement
        for key, policy in resources(template, "AWS::IAM::Policy").items()
        if key.startswith(role_prefix)
        for statement in policy["Properties"]["PolicyDocument"]["Statement"]
    ]


def as_list(value):
    return value if isinstance(value, list) else [value]


def test_every_role_a_service_assumes_here_is_limited_to_this_account(all_templates: dict) -> None:
    checked = 0
    for name, template in all_templates.items():
        if not name.endswith("-Launcher"):
            continue
        for key, role in resources(template, "AWS::IAM::Role").items():
            for statement in role["Properties"]["AssumeRolePolicyDocument"]["Statement"]:
                services = as_list(statement.get("Principal", {}).get("Service", []))
                if set(services) & {"states.amazonaws.com", "events.amazonaws.com"}:
                    assert statement["Condition"] == {
                        "StringEquals": {"aws:SourceAccount": {"Ref": "AWS::AccountId"}}
                    }, (name, key)
                    checked += 1
    assert checked >= 5 * len([n for n in all_templates if n.endswith("-Launcher")])


def test_kms_describe_key_is_granted_without_the_grant_only_condition(all_templates: dict) -> None:
    """kms:GrantIsForAWSResource exists only on grant operations, so DescribeKey under it never applied."""
    for role in ("SupervisorStartJobRole", "SupervisorJobEndedRole"):
        found = statements(all_templates[LAUNCHER], role)
        (describe,) = [s for s in found if "kms:DescribeKey" in as_list(s["Action"])]
        assert as_list(describe["Action"]) == ["kms:DescribeKey"] and "Condition" not in describe
        # ml.p6-b200.48xlarge trains on local NVMe: no volume key is sent, so no grant is needed.
        assert not [s for s in found if "kms:CreateGrant" in as_list(s["Action"])]
        (data_keys,) = [s for s in found if "kms:GenerateDataKey" in as_list(s["Action"])]
        services = data_keys["Condition"]["StringEquals"]["kms:ViaService"]
        assert [flatten_join(v).split(".")[0] for v in services] == ["dynamodb", "sns"]


def test_the_supervisor_may_write_only_its_registry_and_publish_only_to_its_topic(
    all_templates: dict,
) -> None:
    template = all_templates[LAUNCHER]
    for role in ("SupervisorStartJobRole", "SupervisorJobEndedRole"):
        found = statements(template, role)
        dynamo = {a for s in found for a in as_list(s["Action"]) if a.startswith("dynamodb:")}
        assert dynamo == {"dynamodb:PutItem", "dynamodb:UpdateItem", "dynamodb:GetItem"}
        for s in found:
            if any(a.startswith(("dynamodb:", "sns:")) for a in as_list(s["Action"])):
                (resource,) = as_list(s["Resource"])
                text = json.dumps(resource)
                assert "RunTableArn" in text or "MonitoringNotificationsTopic" in text, s
        passed = [s for s in found if "iam:PassRole" in as_list(s["Action"])]
        assert passed and all(
            s["Condition"] == {"StringEquals": {"iam:PassedToService": "sagemaker.amazonaws.com"}}
            for s in passed
        )


def tasks_of(states: dict) -> list[tuple[str, dict]]:
    found = []
    for name, state in states.items():
        if state["Type"] == "Task":
            found.append((name, state))
        for branch in state.get("Branches", []):
            found += tasks_of(branch["States"])
        if "ItemProcessor" in state:
            found += tasks_of(state["ItemProcessor"]["States"])
    return found


def test_every_task_of_every_state_machine_retries_transient_errors(all_templates: dict) -> None:
    template = all_templates[LAUNCHER]
    checked = 0
    for key, machine in resources(template, "AWS::StepFunctions::StateMachine").items():
        definition = json.loads(flatten_join(machine["Properties"]["DefinitionString"]))
        for name, state in tasks_of(definition["States"]):
            resource = state["Resource"].replace("${{'Ref': 'AWS::Partition'}}", "aws")
            resource = (
                resource.replace("arn:${", "arn:aws${").split("}", 1)[-1] if "${" in resource else resource
            )
            errors = {e for r in state.get("Retry", []) for e in r["ErrorEquals"]}
            assert set(TRANSIENT_ERRORS[integration_of(resource)]) <= errors, (key, name)
            assert "States.Timeout" not in errors or "TimeoutSeconds" in state, (key, name)
            checked += 1
    assert checked >= 20  # StartJob, JobEnded and the alarm manager's puts and deletes


def test_alarms_cover_both_supervisor_machines_and_undelivered_job_events(all_templates: dict) -> None:
    template = all_templates[LAUNCHER]
    alarms = {k: a["Properties"] for k, a in resources(template, "AWS::CloudWatch::Alarm").items()}
    (failed,) = [a for k, a in alarms.items() if k.startswith("MonitoringAlarmsExecutionFailed")]
    machines = {
        flatten_join(m["MetricStat"]["Metric"]["Dimensions"][0]["Value"])
        for m in failed["Metrics"]
        if "MetricStat" in m
    }
    assert len(machines) == 4 and all("Supervisor" in m for m in machines)  # start, decide, reconcile, stalls
    # Not only on the topic the supervisor publishes to: a deleted topic or a disabled deployment key
    # must not silence the alarm that reports the failed publish (a topic with its own key).
    topics = [flatten_join(a) for a in failed["AlarmActions"]]
    assert len(topics) == 2 and any("SupervisionTopic" in t for t in topics), topics
    (undelivered,) = [a for k, a in alarms.items() if k.startswith("MonitoringAlarmsJobEventsUndelivered")]
    assert undelivered["MetricName"] == "FailedInvocations" and undelivered["Namespace"] == "AWS/Events"
    assert "SupervisorJobStateChanged" in json.dumps(undelivered["Dimensions"])


def test_the_job_ended_machine_decides_with_the_rule_table(all_templates: dict) -> None:
    from trainstack.aws.supervisor import RULES

    states = state_machine_definition(all_templates[LAUNCHER], "JobEnded")["States"]
    assert [c["Next"] for c in states["Decide"]["Choices"]] == [f"Rule{r.id}" for r in RULES]
    topic = states["Notify"]["Parameters"]["TopicArn"]
    assert "MonitoringNotificationsTopic" in topic


def test_results_discarded_in_the_builder_stay_discarded_in_the_template(all_templates: dict) -> None:
    """`"ResultPath": null` keeps a task's input; a template that dropped it would replace the input with
    the task's result (as Stack.to_json_string does with nulls)."""
    start = state_machine_definition(all_templates[LAUNCHER], "StartJob")["States"]
    for name in ("RegisterRun", "RegisterResume", "ClaimJob", "NotifyNotCreated", "StopUnwanted"):
        assert "ResultPath" in start[name] and start[name]["ResultPath"] is None, name
    ended = state_machine_definition(all_templates[LAUNCHER], "JobEnded")["States"]
    for name in ("RecordNextJob", "RecordEnd", "Notify", "ReleaseWarmPool", "NotifyNotCreated"):
        assert "ResultPath" in ended[name] and ended[name]["ResultPath"] is None, name


def test_the_supervisor_may_create_grants_only_for_a_volume_it_encrypts(monkeypatch, tmp_path) -> None:
    """An instance type with an EBS volume gets VolumeKmsKeyId in its request (trainstack.aws.request), and
    then the roles that create its jobs may create the grant SageMaker makes for that volume."""
    import dataclasses

    from cdk_helpers import synth, templates

    from trainstack.recipes import hardware

    ebs_only = dataclasses.replace(hardware.INSTANCES["ml.p5.48xlarge"], instance_store_disks=0)
    monkeypatch.setitem(hardware.INSTANCES, "ml.p5.48xlarge", ebs_only)
    out = synth(
        {"recipe": "7b-bf16", "set": "compute.instance_type=ml.p5.48xlarge,training.micro_batch=1"}, tmp_path
    )
    template = templates(out)["Trainstack-platform-7b-bf16-Launcher"]
    for role in ("SupervisorStartJobRole", "SupervisorJobEndedRole"):
        (grant,) = [s for s in statements(template, role) if "kms:CreateGrant" in as_list(s["Action"])]
        assert as_list(grant["Action"]) == ["kms:CreateGrant"]
        assert grant["Condition"] == {"Bool": {"kms:GrantIsForAWSResource": "true"}}


def test_the_reconciler_runs_on_a_schedule_with_least_privilege(all_templates: dict) -> None:
    """moto runs no EventBridge Scheduler: the schedule is checked here, the reconciler it starts in
    tests/integration/test_run_faults_emulator.py."""
    from trainstack.aws.supervisor import RECONCILE_MINUTES

    template = all_templates[LAUNCHER]
    (schedule,) = resources(template, "AWS::Scheduler::Schedule").values()
    props = schedule["Properties"]
    assert props["ScheduleExpression"] == f"rate({RECONCILE_MINUTES} minutes)"
    assert props["State"] == "ENABLED" and props["FlexibleTimeWindow"] == {"Mode": "OFF"}
    target = props["Target"]
    assert (
        "SupervisorReconcile" in json.dumps(target["Arn"])
        and target["RetryPolicy"]["MaximumRetryAttempts"] == 3
    )
    roles = resources(template, "AWS::IAM::Role")
    (role_key,) = [k for k in roles if json.dumps(target["RoleArn"]).find(k) >= 0]
    (trust,) = roles[role_key]["Properties"]["AssumeRolePolicyDocument"]["Statement"]
    assert trust["Principal"] == {"Service": "scheduler.amazonaws.com"}
    assert trust["Condition"] == {"StringEquals": {"aws:SourceAccount": {"Ref": "AWS::AccountId"}}}
    (start,) = statements(template, "SupervisorScheduleRole")
    assert as_list(start["Action"]) == ["states:StartExecution"] and "SupervisorReconcile" in json.dumps(
        start["Resource"]
    )
    # The reconciler itself: read the registry, list and stop this recipe's jobs, start and read
    # the supervisor's own executions; nothing else.
    actions = {a for s in statements(template, "SupervisorReconcileRole") for a in as_list(s["Action"])}
    assert actions - {"logs:CreateLogDelivery", "logs:GetLogDelivery", "logs:UpdateLogDelivery"} - {
        "logs:DeleteLogDelivery",
        "logs:ListLogDeliveries",
        "logs:PutResourcePolicy",
        "logs:DescribeResourcePolicies",
        "logs:DescribeLogGroups",
        "xray:PutTraceSegments",
        "xray:PutTelemetryRecords",
        "xray:GetSamplingRules",
        "xray:GetSamplingTargets",
    } == {
        "dynamodb:Scan",
        "dynamodb:GetItem",
        "kms:Decrypt",
        "kms:Encrypt",
        "kms:GenerateDataKey",
        "sagemaker:StopTrainingJob",
        "sagemaker:ListTrainingJobs",
        "states:StartExecution",
        "states:DescribeExecution",
    }


def test_a_stalled_alarm_of_this_recipe_starts_the_stall_handler(all_templates: dict) -> None:
    from stacks.supervisor.stalled import stalled_alarm_pattern

    template = all_templates[LAUNCHER]
    (rule,) = [
        r for k, r in resources(template, "AWS::Events::Rule").items() if k.startswith("SupervisorJobStalled")
    ]
    assert rule["Properties"]["EventPattern"] == stalled_alarm_pattern("ts-platform-30b-fp8--")
    (target,) = rule["Properties"]["Targets"]
    assert "SupervisorStopStalled" in json.dumps(target["Arn"])
    actions = {a for s in statements(template, "SupervisorStopStalledRole") for a in as_list(s["Action"])}
    assert {"sagemaker:StopTrainingJob", "dynamodb:UpdateItem"} <= actions
    assert not {a for a in actions if a.startswith("sagemaker:Create") or a == "iam:PassRole"}
