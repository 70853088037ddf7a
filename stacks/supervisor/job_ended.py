"""The "job ended" state machine definition: Choice states generated from trainstack.aws.supervisor.RULES."""

from __future__ import annotations

from typing import Any

from stacks.supervisor.asl import (
    CONDITION_FAILED,
    DESCRIBE,
    GET_ITEM,
    UPDATE_ITEM,
    SupervisorConstants,
    fmt,
    names,
    notify,
    task,
)
from stacks.supervisor.start_job import START_AT, start_job_states
from trainstack.aws import supervisor
from trainstack.aws.request import (
    INPUT_HYPERPARAMETER_OVERRIDES,
    INPUT_JOB,
    INPUT_KEEP_ALIVE,
    INPUT_LAST_JOB,
    INPUT_PREVIOUS_JOB_END,
    INPUT_REASON,
    INPUT_RUN,
    INPUT_RUN_ID,
    INPUT_STEPS,
)

# --- JobEnded ---------------------------------------------------------------------------------------


def _any_of(path: str, values: tuple[str, ...]) -> dict[str, Any]:
    tests = [{"Variable": path, "StringEquals": v} for v in values]
    return tests[0] if len(tests) == 1 else {"Or": tests}


def rule_condition(rule: supervisor.Rule) -> dict[str, Any]:
    """The Choice condition that holds exactly when `rule.matches` does."""
    tests = []
    if rule.status:
        tests.append(_any_of("$.Ended.Status", rule.status))
    if rule.secondary:
        tests.append(_any_of("$.Ended.Secondary", rule.secondary))
    if rule.reason_pattern is not None:
        tests.append({"Variable": "$.Failure.Reason", "StringMatches": rule.reason_pattern})
    if rule.stop_requested is not None:
        tests.append(
            {"Variable": "$.Registry.Item.stop_requested.BOOL", "BooleanEquals": rule.stop_requested}
        )
    assert tests, rule
    return tests[0] if len(tests) == 1 else {"And": tests}


def _why(text: str) -> dict[str, str]:
    if supervisor.REASON in text:
        return {"Why.$": fmt(text.replace(supervisor.REASON, "{}"), "$.Failure.Reason")}
    return {"Why": text}


def _next_text(outcome: supervisor.Outcome) -> dict[str, str]:
    text = supervisor.NEXT[outcome]
    if "{run}" in text:
        return {"Next.$": fmt(text.replace("{run}", "{}"), "$.Numbers.Run")}
    return {"Next": text}


def _decision(rule_id: str, outcome: supervisor.Outcome, why: dict[str, str], **extra: Any) -> dict:
    return {
        "Outcome": outcome.value,
        "Headline": supervisor.OUTCOME_WORDS.get(outcome, outcome.value),
        "Rule": rule_id,
        "State": supervisor.RUN_STATE.get(outcome, "unchanged"),
        **why,
        **extra,
    }


def job_ended_definition(
    c: SupervisorConstants,
    *,
    request: dict[str, Any],
    hyperparameters: dict[str, str],
    on_complete: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The "job ended" state machine: read the job and its run's record, decide, record, notify, and
    start the next job when the decision says so."""
    describe = {"TrainingJobName.$": "$.detail.TrainingJobName"}
    key = {"run": {"S.$": "$.Numbers.Run"}}
    recorded = {
        "TableName": c.table_name,
        "Key": key,
        "ConditionExpression": "#current_job = :job AND #run_state = :running",
    }
    common_values = {
        ":job": {"S.$": "$.Ended.Name"},
        ":running": {"S": "running"},
        ":entry": {
            "M": {"job_status": {"S.$": "$.Ended.Status"}, "secondary_status": {"S.$": "$.Ended.Secondary"}}
        },
        ":why": {"S.$": "$.Decision.Why"},
        ":next": {"S.$": "$.Decision.Next"},
        ":now": {"S.$": "$$.State.EnteredTime"},
    }
    changed_meanwhile = [{"ErrorEquals": [CONDITION_FAILED], "Next": "Ignored", "ResultPath": "$.Error"}]
    checkpoint = {"CheckpointUri.$": "$.Registry.Item.checkpoint_uri.S"}
    states: dict[str, Any] = {
        "DescribeJob": task(
            DESCRIBE,
            describe,
            ResultSelector={
                "Name.$": "$.TrainingJobName",
                "Status.$": "$.TrainingJobStatus",
                "Secondary.$": "$.SecondaryStatus",
                "Environment.$": "$.Environment",
            },
            ResultPath="$.Ended",
            Next="HasReason",
        ),
        "HasReason": {
            "Type": "Choice",
            "Choices": [{"Variable": "$.Ended.Status", "StringEquals": "Failed", "Next": "ReadFailure"}],
            "Default": "NoReason",
        },
        # A second read: FailureReason exists only on failed jobs, and a selector on a missing field fails.
        "ReadFailure": task(
            DESCRIBE,
            describe,
            ResultSelector={"Reason.$": "$.FailureReason"},
            ResultPath="$.Failure",
            Next="Supervised",
        ),
        "NoReason": {
            "Type": "Pass",
            "Result": {"Reason": ""},
            "ResultPath": "$.Failure",
            "Next": "Supervised",
        },
        "Supervised": {
            "Type": "Choice",
            "Choices": [
                {"Variable": "$.Ended.Environment.TRAINSTACK_RUN", "IsPresent": True, "Next": "ReadRun"}
            ],
            "Default": "NotSupervised",
        },
        "NotSupervised": {
            "Type": "Pass",
            "Parameters": _decision(
                "NotSupervised",
                supervisor.Outcome.IGNORED,
                {"Why": "the job has no run (no TRAINSTACK_RUN, or no record of it in the run registry)"},
                Next=supervisor.NEXT[supervisor.Outcome.IGNORED],
            ),
            "ResultPath": "$.Decision",
            "Next": "Decided",
        },
        "ReadRun": task(
            GET_ITEM,
            {
                "TableName": c.table_name,
                "Key": {"run": {"S.$": "$.Ended.Environment.TRAINSTACK_RUN"}},
                "ConsistentRead": True,
            },
            ResultPath="$.Registry",
            Next="Registered",
        ),
        "Registered": {
            "Type": "Choice",
            "Choices": [{"Variable": "$.Registry.Item", "IsPresent": True, "Next": "Numbers"}],
            "Default": "NotSupervised",
        },
        "Numbers": {
            "Type": "Pass",
            "Parameters": {
                "Run.$": "$.Registry.Item.run.S",
                "Job.$": "States.StringToJson($.Registry.Item.job_index.N)",
                "Last.$": "States.StringToJson($.Registry.Item.last_job.N)",
                "Crashes.$": "States.StringToJson($.Registry.Item.crashes.N)",
            },
            "ResultPath": "$.Numbers",
            "Next": "Current",
        },
        "Current": {
            "Type": "Choice",
            "Choices": [
                {
                    "And": [
                        {"Variable": "$.Ended.Name", "StringEqualsPath": "$.Registry.Item.current_job.S"},
                        {"Variable": "$.Registry.Item.run_state.S", "StringEquals": "running"},
                    ],
                    "Next": "Decide",
                }
            ],
            "Default": "Ignored",
        },
        "Ignored": {
            "Type": "Pass",
            "Parameters": _decision(
                "Ignored",
                supervisor.Outcome.IGNORED,
                {"Why": supervisor.IGNORED_WHY},
                Next=supervisor.NEXT[supervisor.Outcome.IGNORED],
            ),
            "ResultPath": "$.Decision",
            "Next": "Decided",
        },
        "Decide": {
            "Type": "Choice",
            "Choices": [{**rule_condition(rule), "Next": f"Rule{rule.id}"} for rule in supervisor.RULES],
            "Default": "Undecided",
        },
        "Undecided": {
            "Type": "Fail",
            "Error": "Undecided",
            "Cause": "no rule of trainstack.aws.supervisor.RULES matches the job's status",
        },
    }
    for rule in supervisor.RULES:
        if rule.outcome is supervisor.Outcome.NEXT_JOB:
            when = f" in {rule.wait_minutes} minutes" if rule.wait_minutes else ""
            crashed = rule.id == "Crashed"  # counts toward the crash loop; any other end resets it
            parameters = _decision(
                rule.id,
                rule.outcome,
                _why(rule.why),
                When=when,
                WaitSeconds=rule.wait_minutes * 60,
                **({"Crashes.$": "States.MathAdd($.Numbers.Crashes, 1)"} if crashed else {"Crashes": 0}),
                **checkpoint,
            )
            after = "WithinCrashLimit" if crashed else "WithinJobLimit"
        else:
            parameters = _decision(
                rule.id, rule.outcome, _why(rule.why), **_next_text(rule.outcome), **checkpoint
            )
            after = "RecordEnd"
        states[f"Rule{rule.id}"] = {
            "Type": "Pass",
            "Parameters": parameters,
            "ResultPath": "$.Decision",
            "Next": after,
        }

    failed = supervisor.Outcome.FAILED
    limit_why = supervisor.JOB_LIMIT_WHY.replace("{job}", "{}").replace("{last}", "{}")
    next_job = (
        supervisor.NEXT[supervisor.Outcome.NEXT_JOB].replace("{next_job}", "{}-{}").replace("{when}", "{}")
    )
    states |= {
        "WithinCrashLimit": {
            "Type": "Choice",
            "Choices": [
                {
                    "Variable": "$.Decision.Crashes",
                    "NumericGreaterThanEquals": supervisor.MAX_CONSECUTIVE_CRASHES,
                    "Next": supervisor.CRASH_LOOP,
                }
            ],
            "Default": "WithinJobLimit",
        },
        supervisor.CRASH_LOOP: {
            "Type": "Pass",
            "Parameters": _decision(
                supervisor.CRASH_LOOP,
                failed,
                {
                    "Why.$": fmt(
                        supervisor.CRASH_LOOP_WHY.replace("{crashes}", "{}") + "; this job ended because {}",
                        "$.Decision.Crashes",
                        "$.Decision.Why",
                    )
                },
                **_next_text(failed),
                **{"CheckpointUri.$": "$.Decision.CheckpointUri"},
            ),
            "ResultPath": "$.Decision",
            "Next": "RecordEnd",
        },
        "WithinJobLimit": {
            "Type": "Choice",
            "Choices": [
                {"Variable": "$.Numbers.Job", "NumericLessThanPath": "$.Numbers.Last", "Next": "NextJob"}
            ],
            "Default": "JobLimit",
        },
        "JobLimit": {
            "Type": "Pass",
            "Parameters": _decision(
                supervisor.JOB_LIMIT,
                failed,
                {
                    "Why.$": fmt(
                        limit_why + "; this job ended because {}",
                        "$.Numbers.Job",
                        "$.Numbers.Last",
                        "$.Decision.Why",
                    )
                },
                **_next_text(failed),
                **{"CheckpointUri.$": "$.Decision.CheckpointUri"},
            ),
            "ResultPath": "$.Decision",
            "Next": "RecordEnd",
        },
        "NextJob": {
            "Type": "Pass",
            "Parameters": {
                "Outcome.$": "$.Decision.Outcome",
                "Headline.$": "$.Decision.Headline",
                "Rule.$": "$.Decision.Rule",
                "State.$": "$.Decision.State",
                "Why.$": "$.Decision.Why",
                "WaitSeconds.$": "$.Decision.WaitSeconds",
                "Crashes.$": "$.Decision.Crashes",
                "CheckpointUri.$": "$.Decision.CheckpointUri",
                "Index.$": "States.MathAdd($.Numbers.Job, 1)",
                "NextJob.$": fmt("{}-{}", "$.Numbers.Run", "States.MathAdd($.Numbers.Job, 1)"),
                "Next.$": fmt(
                    next_job, "$.Numbers.Run", "States.MathAdd($.Numbers.Job, 1)", "$.Decision.When"
                ),
            },
            "ResultPath": "$.Decision",
            "Next": "RecordNextJob",
        },
        "RecordNextJob": task(
            UPDATE_ITEM,
            {
                **recorded,
                "UpdateExpression": (
                    "SET #ended.#job = :entry, #crashes = :crashes, #why = :why, #next_step = :next, "
                    "#updated = :now"
                ),
                "ExpressionAttributeNames": {
                    **names("ended", "crashes", "why", "next_step", "updated", "current_job", "run_state"),
                    "#job.$": "$.Ended.Name",
                },
                "ExpressionAttributeValues": {
                    **common_values,
                    ":crashes": {"N.$": fmt("{}", "$.Decision.Crashes")},
                },
            },
            ResultPath=None,
            Catch=changed_meanwhile,
            Next="Notify",
        ),
        "RecordEnd": task(
            UPDATE_ITEM,
            {
                **recorded,
                "UpdateExpression": (
                    "SET #run_state = :state, #ended.#job = :entry, #why = :why, #next_step = :next, "
                    "#updated = :now"
                ),
                "ExpressionAttributeNames": {
                    **names("ended", "why", "next_step", "updated", "current_job", "run_state"),
                    "#job.$": "$.Ended.Name",
                },
                "ExpressionAttributeValues": {**common_values, ":state": {"S.$": "$.Decision.State"}},
            },
            ResultPath=None,
            Catch=changed_meanwhile,
            Next="Notify",
        ),
        "Notify": {
            **notify(
                c,
                run="$.Numbers.Run",
                job="$.Ended.Name",
                status="$.Ended.Status",
                secondary="$.Ended.Secondary",
            ),
            "Next": "Continue",
        },
        "Continue": {
            "Type": "Choice",
            "Choices": [
                {
                    "Variable": "$.Decision.Outcome",
                    "StringEquals": supervisor.Outcome.NEXT_JOB.value,
                    "Next": "WaitFirst",
                }
            ],
            "Default": "Decided",
        },
        "WaitFirst": {
            "Type": "Choice",
            "Choices": [
                {"Variable": "$.Decision.WaitSeconds", "NumericGreaterThan": 0, "Next": "WaitForCapacity"}
            ],
            "Default": "NextInput",
        },
        "WaitForCapacity": {"Type": "Wait", "SecondsPath": "$.Decision.WaitSeconds", "Next": "NextInput"},
        # The next job starts in this execution, through the same states as StartJob: no execution
        # waits on another, and the registry's conditional write makes a repeated event harmless.
        "NextInput": {
            "Type": "Pass",
            "Parameters": {
                f"{INPUT_RUN}.$": "$.Numbers.Run",
                f"{INPUT_RUN_ID}.$": "$.Registry.Item.run_id.S",
                f"{INPUT_JOB}.$": "$.Decision.Index",
                f"{INPUT_LAST_JOB}.$": "$.Numbers.Last",
                f"{INPUT_HYPERPARAMETER_OVERRIDES}.$": "States.StringToJson($.Registry.Item.overrides.S)",
                f"{INPUT_KEEP_ALIVE}.$": "States.StringToJson($.Registry.Item.keep_alive.N)",
                f"{INPUT_STEPS}.$": "States.StringToJson($.Registry.Item.steps.N)",
                INPUT_REASON: "next",
                f"{INPUT_PREVIOUS_JOB_END}.$": "$.Decision.Rule",  # the trainer tags the run with it
                "Decision.$": "$.Decision",
            },
            "ResultPath": "$",
            "Next": START_AT,
        },
        **start_job_states(c, request=request, hyperparameters=hyperparameters, output_path="$.Decision"),
        "Decided": {"Type": "Succeed", "OutputPath": "$.Decision"},
    }
    if on_complete is not None:  # export.on_complete: one state after a completed run (stacks/export.py)
        completed = {"Variable": "$.Decision.Outcome", "StringEquals": supervisor.Outcome.COMPLETED.value}
        states["Continue"]["Choices"].append({**completed, "Next": "OnComplete"})
        states["OnComplete"] = {**on_complete, "Next": "Decided"}
    return {
        "Comment": f"A job of a {c.team}/{c.recipe} run ended: decide what the run does next.",
        "StartAt": "DescribeJob",
        "States": states,
    }
