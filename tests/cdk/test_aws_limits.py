"""AWS's documented limits on what the project asks of AWS besides CreateTrainingJob (that one is
test_request_check.py's), which the local emulator does not enforce: the per-run CloudWatch alarms,
the state machines' definitions and state names, and the names of the executions the CLI starts.
The supervisor's state payloads and run record are measured in the emulator
(tests/integration/test_supervisor_emulator.py)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from cdk_helpers import flatten_join, resources

from stacks.monitoring import run_alarm_specs
from trainstack.aws.request_check import (
    PLACEHOLDER_ACCOUNT,
    PLACEHOLDER_REGION,
    check_against_model,
    longest_job_name,
)
from trainstack.aws.tracking import mlflow_app_name
from trainstack.planner import plan
from trainstack.recipes.loader import base_recipe_names, resolve, team_names, team_recipe_names
from trainstack.recipes.schema import TEAM_NAME_MAX

pytestmark = pytest.mark.fast

ALL = [(n, None) for n in base_recipe_names()] + [(n, t) for t in team_names() for n in team_recipe_names(t)]
# SNS topic names have at most 256 characters (SNS CreateTopic).
TOPIC = f"arn:aws:sns:{PLACEHOLDER_REGION}:{PLACEHOLDER_ACCOUNT}:" + "t" * 256
# CloudWatch, "Limits that apply to alarms based on metric math expressions": at most 10 metrics, a hard
# limit; PutMetricAlarm reference: at most 20 MetricDataQuery entries, 10 of them expressions.
ALARM_METRICS_MAX, ALARM_QUERIES_MAX, ALARM_EXPRESSIONS_MAX = 10, 20, 10
# Step Functions quotas: a definition of at most 1 MB (hard); state machine, execution and state names
# of at most 80 characters without white space, brackets, wildcards, special or control characters.
DEFINITION_MAX = 1_048_576
NAME_FORBIDDEN = re.compile(r"[\s<>{}\[\]?*\"#%\\^|~`$&,;:/\x00-\x1f\x7f-\x9f]")
ARN_MAX = 2048  # the longest ARN a CloudFormation reference can resolve to (IAM's ARN limit)


@pytest.mark.parametrize("name,team", ALL, ids=[f"{t or 'platform'}-{n}" for n, t in ALL])
def test_every_run_alarm_is_one_cloudwatch_accepts(name: str, team: str | None) -> None:
    recipe = resolve(name, team).recipe
    job = longest_job_name(recipe, team)
    hosts = range(1, recipe.compute.instance_count + 1)
    job_alarms, host_alarms = [], []
    for spec in run_alarm_specs(recipe, plan(recipe)):
        for host in hosts if spec.per_host else [None]:
            request = spec.request(job, TOPIC, host)
            assert check_against_model("cloudwatch", "PutMetricAlarm", request) == [], request["AlarmName"]
            metrics = request.get("Metrics", [])
            assert sum("MetricStat" in m for m in metrics) <= ALARM_METRICS_MAX
            assert sum("Expression" in m for m in metrics) <= ALARM_EXPRESSIONS_MAX
            assert len(metrics) <= ALARM_QUERIES_MAX
        (host_alarms if spec.per_host else job_alarms).append(spec.name)
    # The alarm manager deletes the job's alarms in one DeleteAlarms call and each host's in another.
    for names in (job_alarms, host_alarms):
        assert check_against_model("cloudwatch", "DeleteAlarms", {"AlarmNames": names}) == []


def test_the_model_check_names_cloudwatchs_own_limit() -> None:
    (finding,) = check_against_model(
        "cloudwatch",
        "PutMetricAlarm",
        {"AlarmName": "a" * 256, "EvaluationPeriods": 1, "ComparisonOperator": "GreaterThanThreshold"},
    )
    assert finding.path == "AlarmName" and "more than CloudWatch's maximum of 255" in finding.message
    (finding,) = check_against_model("cloudwatch", "DeleteAlarms", {"AlarmNames": ["a"] * 101})
    assert "101 items, more than CloudWatch's maximum of 100" in finding.message


def _rendered_bytes(value: Any) -> int:
    """A DefinitionString's size once deployed, each CloudFormation reference at its longest."""
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, dict) and "Fn::Join" in value:
        separator, parts = value["Fn::Join"]
        return sum(_rendered_bytes(p) for p in parts) + len(separator) * max(len(parts) - 1, 0)
    return ARN_MAX


def _state_names(definition: dict[str, Any]) -> list[str]:
    names = []
    for name, state in definition.get("States", {}).items():
        names.append(name)
        for nested in [state.get("ItemProcessor"), state.get("Iterator"), *state.get("Branches", [])]:
            if nested:
                names += _state_names(nested)
    return names


def test_every_state_machine_fits_step_functions_limits(all_templates: dict[str, dict]) -> None:
    machines = {
        f"{stack}/{key}": machine
        for stack, template in all_templates.items()
        for key, machine in resources(template, "AWS::StepFunctions::StateMachine").items()
    }
    assert any("SupervisorJobEnded" in key for key in machines)
    largest = 0
    for key, machine in machines.items():
        body = machine["Properties"]["DefinitionString"]
        size = _rendered_bytes(body)
        largest = max(largest, size)
        assert size <= DEFINITION_MAX, key
        for state in _state_names(json.loads(flatten_join(body))):
            assert len(state) <= 80 and not NAME_FORBIDDEN.search(state), (key, state)
    assert largest < DEFINITION_MAX / 4  # room to grow: the JobEnded machine embeds the whole request


@pytest.mark.parametrize("name,team", ALL, ids=[f"{t or 'platform'}-{n}" for n, t in ALL])
def test_the_executions_the_cli_starts_have_names_step_functions_accepts(name: str, team: str | None) -> None:
    """`launch` and `resume` name each StartJob execution after the job it creates and the attempt
    (naming.execution_name): a failed attempt's name, kept 90 days, blocks no later one."""
    from trainstack.recipes import naming

    execution = naming.execution_name(
        longest_job_name(resolve(name, team).recipe, team), "z" * naming.ATTEMPT_TOKEN_LEN
    )
    machine = f"arn:aws:states:{PLACEHOLDER_REGION}:{PLACEHOLDER_ACCOUNT}:stateMachine:StartJob"
    params = {"stateMachineArn": machine, "name": execution}
    assert check_against_model("stepfunctions", "StartExecution", params) == []
    assert not NAME_FORBIDDEN.search(execution)


def test_the_largest_run_record_fits_one_dynamodb_item() -> None:
    """A run's record holds its request (every job is built from it), every job's name and end, and its
    history. moto accepts items of any size; DynamoDB refuses one over 400 KB (developer guide, "Service,
    account, and table quotas"). The record at its largest: the largest request any recipe here makes
    (trainstack.aws.request_check.requests_for), a run that named all JOB_INDEX_MAX jobs, a full history
    of the longest entries, SageMaker's longest FailureReason (1,024 characters) in `why`."""
    import json

    from stacks.supervisor.asl import REGISTRY_ATTRIBUTES
    from trainstack.aws.export_job import EXPORTS_PER_RUN
    from trainstack.aws.registry import HISTORY_MAX, ITEM_MAX, WHAT_MAX, WHO_MAX, item_bytes
    from trainstack.aws.request_check import longest_run_id, requests_for
    from trainstack.aws.supervisor import (
        CAPACITY_BUDGET_WHY,
        CRASH_LOOP_WHY,
        JOB_LIMIT_WHY,
        NEXT,
        RULES,
        Outcome,
    )
    from trainstack.protocol.exit_codes import FAILURE_REASON_MAX
    from trainstack.recipes import naming
    from trainstack.recipes.schema import to_hyperparameters

    largest_request, hyperparameters, longest = {}, {}, ("", None)
    for name, team in ALL:
        recipe = resolve(name, team).recipe
        for _, request in requests_for(recipe, team):
            if len(json.dumps(request)) > len(json.dumps(largest_request)):
                largest_request, hyperparameters = request, to_hyperparameters(recipe)
        run = naming.run_name(recipe, team, longest_run_id())
        longest = max(longest, (run, team), key=lambda r: len(r[0]))
    run = longest[0]
    jobs = [naming.job_of_run(run, i) for i in range(1, naming.JOB_INDEX_MAX + 1)]
    text = lambda n: {"S": "x" * n}  # noqa: E731
    entry = {"at": "2026-12-01T00:00:00.000000+00:00", "who": "w" * WHO_MAX, "what": "w" * WHAT_MAX}
    why = max(len(JOB_LIMIT_WHY), len(CAPACITY_BUDGET_WHY), len(CRASH_LOOP_WHY)) + 400 + FAILURE_REASON_MAX
    item = {
        "run": {"S": run},
        "run_id": text(naming.RUN_ID_MAX),
        "recipe": text(22),
        "team": text(16),
        "run_state": {"S": "completed"},
        "current_job": {"S": jobs[-1]},
        "job_index": {"N": str(naming.JOB_INDEX_MAX)},
        "jobs": {"L": [{"S": j} for j in jobs]},
        "ended": {
            "M": {
                j: {
                    "M": {
                        "job_status": text(10),
                        "secondary_status": {"S": "MaxWaitTimeExceeded"},
                        "rule": text(max(len(r.id) for r in RULES) + len("NoJobNames")),
                    }
                }
                for j in jobs
            }
        },
        "checkpoint_uri": text(5 + 63 + 1 + 80 + 17),
        "steps": {"N": "9" * 10},
        "tokens_per_step": {"N": "9" * 12},
        "usd_per_hour": {"N": "99999.9999"},
        "overrides": {"S": json.dumps(hyperparameters)},  # the launch's overrides: at most every key
        "keep_alive": {"N": "3600"},
        "stop_requested": {"BOOL": True},
        "crashes": {"N": "3"},
        "why": text(why),
        "next_step": text(len(NEXT[Outcome.NEXT_JOB]) + 2 * naming.JOB_NAME_MAX),
        "recipe_hash": text(naming.HASH_LEN),
        "max_jobs": {"N": "99"},
        "counted": {"N": "99"},
        "creator": text(2048),  # an execution ARN, at IAM's longest ARN
        "request": {"S": json.dumps(largest_request, separators=(",", ":"))},
        "history": {"S": json.dumps([entry] * HISTORY_MAX)},
        "stalled": {"S": jobs[-1]},
        "stop_stalled": {"BOOL": True},
        "capacity_minutes": {"N": "40320"},
        "capacity_wait": {"N": "120"},
        "capacity_budget": {"N": "40320"},
        "mlflow_run_id": text(32),  # MLflow run ids are 32 hex digits
        "step": {"N": "9" * 10},
        "saved_step": {"N": "9" * 10},
        # Every export job of the run failed (at most EXPORTS_PER_RUN), and its on-complete start too,
        # each with SageMaker's longest FailureReason.
        "export_failures": {
            "L": [
                {
                    "M": {
                        "job": {"S": jobs[-1] + "-X9"},
                        "status": text(10),
                        "reason": text(FAILURE_REASON_MAX),
                        "at": text(32),
                    }
                }
            ]
            * (EXPORTS_PER_RUN + 1)
        },
        "created": text(32),
        "updated": text(32),
    }
    assert set(item) == set(REGISTRY_ATTRIBUTES)
    size = item_bytes(item)
    print(f"largest run record {size:,} B of {ITEM_MAX:,} (request {len(item['request']['S']):,} B)")
    assert size < ITEM_MAX * 0.9


# CloudFormation references in the resources below, at their longest documented form.
ROLE_ARN_LONGEST = f"arn:aws:iam::123456789012:role/{'r' * 64}"  # IAM role names: at most 64 characters
STATE_MACHINE_ARN_LONGEST = f"arn:aws:states:us-west-2:123456789012:stateMachine:{'m' * 80}"
BUCKET_NAME_LONGEST = "b" * 63  # S3 bucket names: at most 63 characters


def test_every_reconcile_schedule_is_one_eventbridge_scheduler_accepts(
    all_templates: dict[str, dict],
) -> None:
    """The reconciler's schedules against botocore's model of CreateSchedule (a name CloudFormation
    generates: at its longest, 64 characters; the retry policy's age and attempts are ranged there)."""
    schedules = [
        (name, logical, r["Properties"])
        for name, template in all_templates.items()
        for logical, r in resources(template, "AWS::Scheduler::Schedule").items()
    ]
    assert schedules, "no reconcile schedule in the synthesized templates"
    for name, logical, properties in schedules:
        target = {**properties["Target"], "Arn": STATE_MACHINE_ARN_LONGEST, "RoleArn": ROLE_ARN_LONGEST}
        request = {**properties, "Name": "n" * 64, "Target": target}
        assert check_against_model("scheduler", "CreateSchedule", request) == [], (name, logical)


def test_every_teams_mlflow_app_is_one_sagemaker_accepts(vpc_tracking_templates: dict[str, dict]) -> None:
    """The team's MLflow App against botocore's model of CreateMlflowApp, and its name at the longest
    team name (the App's name allows letters, digits and hyphens only)."""
    apps = [
        r["Properties"]
        for template in vpc_tracking_templates.values()
        for r in resources(template, "AWS::SageMaker::MlflowApp").values()
    ]
    assert len(apps) == 1
    request = {
        **apps[0],
        "ArtifactStoreUri": f"s3://{BUCKET_NAME_LONGEST}/artifacts/",
        "RoleArn": ROLE_ARN_LONGEST,
    }
    assert check_against_model("sagemaker", "CreateMlflowApp", request) == []
    longest = {**request, "Name": mlflow_app_name("t" * TEAM_NAME_MAX)}
    assert check_against_model("sagemaker", "CreateMlflowApp", longest) == []
    assert check_against_model("sagemaker", "CreateMlflowApp", {**request, "Name": "team_1"}) != []


def test_the_reconcilers_job_lookup_is_one_list_training_jobs_accepts_page_by_page() -> None:
    """ListTrainingJobs (SageMaker API reference): MaxResults 1-100, NameContains "a string in the
    training job name" of at most 63 characters, NextToken for the next page. The reconciler asks for
    the largest page, with the longest job name, and follows NextToken (stacks/supervisor/reconcile.py)."""
    from stacks.supervisor.reconcile import FIND_JOB_ARGUMENTS, FIND_JOB_OUTPUT, LIST_PAGE_MAX

    longest = max((longest_job_name(resolve(n, t).recipe, t) for n, t in ALL), key=len)
    assert len(longest) <= 63
    page = {"NameContains": longest, "MaxResults": LIST_PAGE_MAX}
    assert check_against_model("sagemaker", "ListTrainingJobs", page) == []
    assert check_against_model("sagemaker", "ListTrainingJobs", {**page, "NextToken": "t" * 8192}) == []
    assert check_against_model("sagemaker", "ListTrainingJobs", {**page, "MaxResults": LIST_PAGE_MAX + 1})
    assert check_against_model("sagemaker", "ListTrainingJobs", {**page, "NameContains": "x" * 64})
    assert f"'MaxResults': {LIST_PAGE_MAX}" in FIND_JOB_ARGUMENTS and "'NextToken'" in FIND_JOB_ARGUMENTS
    # NameContains finds more than the job: the exact name is compared, never the first summary taken.
    assert "TrainingJobName = $states.input.Job" in FIND_JOB_OUTPUT and "NextToken" in FIND_JOB_OUTPUT


def test_the_cli_reads_its_executions_history_in_pages_step_functions_accepts() -> None:
    """`launch` and `resume` read their StartJob execution's history to learn whether its registration
    won (run_access.registration_won): GetExecutionHistory maxResults is 0-1000 (Step Functions API
    reference); the execution ARN at its longest (256 characters: an 80-character state machine and
    execution name each)."""
    from trainstack.cli.commands.run_access import HISTORY_PAGE_MAX

    request = {"executionArn": "arn:aws:states:us-west-2:123456789012:execution:" + "m" * 80 + ":" + "e" * 80}
    page = {**request, "maxResults": HISTORY_PAGE_MAX}
    assert check_against_model("stepfunctions", "GetExecutionHistory", page) == []
    assert check_against_model(
        "stepfunctions", "GetExecutionHistory", {**page, "maxResults": HISTORY_PAGE_MAX + 1}
    )
