"""The "job ended" state machine definition: Choice states generated from trainstack.aws.supervisor.RULES.

Read top to bottom: what ended (DescribeJob ... Current), the decision (Decide, one Rule<Id> per row),
what it needs first (FreshInstances: a suspect cluster's warm pool released), the limits that can turn
a next job into a failed run (crash loop, capacity budget, job slots, job names), the one write that
records the end and registers job n+1 (RecordNextJob) or ends the run (RecordEnd), the next job's
creation, and last the notification. Hooks for other steps of a decision go between the record and
Notify (e.g. an export when a run completes: `on_complete`).
"""

from __future__ import annotations

import re
from typing import Any

from stacks.supervisor.asl import (
    CONDITION_FAILED,
    DESCRIBE,
    GET_ITEM,
    PUBLISH,
    UPDATE_ITEM,
    UPDATE_JOB,
    SupervisorConstants,
    fmt,
    job_name_expression,
    names,
    notification_failed,
    notify,
    task,
)
from stacks.supervisor.start_job import CREATE_AT, creation_states
from trainstack.aws import supervisor
from trainstack.aws.request import (
    INPUT_JOB_ENVIRONMENT,
    INPUT_REQUEST,
    INPUT_RUN,
    PREVIOUS_JOB_END_ENV,
)
from trainstack.recipes.naming import DECIMAL_JOBS, JOB_INDEX_MAX

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
    if rule.stalled is not None:
        same = {"Variable": "$.Registry.Item.stalled.S", "StringEqualsPath": "$.Ended.Name"}
        tests.append(same if rule.stalled else {"Not": same})
    if rule.steps_done is not None:
        tests.append({"Variable": "$.Progress.Done", "BooleanEquals": rule.steps_done})
    assert tests, rule
    return tests[0] if len(tests) == 1 else {"And": tests}


# Where each placeholder of a rule's `why` is in the execution (supervisor.why_of fills the same).
WHY_VALUES = {
    supervisor.REASON: "$.Failure.Reason",
    supervisor.STEP: "$.Progress.Step",
    supervisor.STEPS: "$.Numbers.Steps",
}
WHY_PLACEHOLDER = re.compile("|".join(re.escape(p) for p in WHY_VALUES))


def _why(text: str) -> dict[str, str]:
    arguments = [WHY_VALUES[m.group(0)] for m in WHY_PLACEHOLDER.finditer(text)]
    if arguments:
        return {"Why.$": fmt(WHY_PLACEHOLDER.sub("{}", text), *arguments)}
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


def _failed(rule_id: str, template: str, *arguments: str) -> dict[str, Any]:
    """A limit that turns the decision into a failed run: its why, then the job's own."""
    return {
        "Type": "Pass",
        "Parameters": _decision(
            rule_id,
            supervisor.Outcome.FAILED,
            {"Why.$": fmt(template + "; this job ended because {}", *arguments, "$.Decision.Why")},
            **_next_text(supervisor.Outcome.FAILED),
            **{"CheckpointUri.$": "$.Decision.CheckpointUri", "Fresh.$": "$.Decision.Fresh"},
        ),
        "ResultPath": "$.Decision",
        "Next": "RecordEnd",
    }


def _wait(minutes: int) -> dict[str, Any]:
    """The capacity back-off's step: how long, and what the run will have waited in all."""
    return {
        "Type": "Pass",
        "Parameters": {
            "Minutes": minutes,
            "Seconds": minutes * 60,
            "Spent.$": f"States.MathAdd($.Numbers.CapacityMinutes, {minutes})",
            "Counted.$": "$.Numbers.Counted",  # a capacity retry takes the failed job's slot
            "When": supervisor.WAIT_TEXT.format(minutes=minutes),
        },
        "ResultPath": "$.Wait",
        "Next": "WithinCapacityBudget",
    }


def next_job_state(*, decimal: bool) -> dict[str, Any]:
    """The decision to start job n+1, with its name (`decimal`: n+1 is at most naming.DECIMAL_JOBS)."""
    return {
        "Type": "Pass",
        "Parameters": {
            "Outcome.$": "$.Decision.Outcome",
            "Headline.$": "$.Decision.Headline",
            "Rule.$": "$.Decision.Rule",
            "State.$": "$.Decision.State",
            "Why.$": "$.Decision.Why",
            "Crashes.$": "$.Decision.Crashes",
            "CheckpointUri.$": "$.Decision.CheckpointUri",
            "WaitSeconds.$": "$.Wait.Seconds",
            "WaitMinutes.$": "$.Wait.Minutes",
            "Counted.$": "$.Wait.Counted",
            "CapacityMinutes.$": "$.Wait.Spent",
            "Index.$": "States.MathAdd($.Numbers.Job, 1)",
            "NextJob.$": job_name_expression(
                "$.Numbers.Run", "States.MathAdd($.Numbers.Job, 1)", decimal=decimal
            ),
        },
        "ResultPath": "$.Decision",
        "Next": "NextText",
    }


ON_COMPLETE = "OnComplete"  # the completed-run hook's state

# DescribeJob's output: the input, and the job's plain fields with its step and the step of its newest
# completed checkpoint (supervisor.STEP_METRIC's and SAVED_METRIC's last values in FinalMetricDataList,
# -1 when none was logged).
DESCRIBED_OUTPUT = (
    "{% ($r := $states.result; $s := $r.FinalMetricDataList[MetricName = '"
    + supervisor.STEP_METRIC
    + "'].Value; $k := $r.FinalMetricDataList[MetricName = '"
    + supervisor.SAVED_METRIC
    + "'].Value; $merge([$states.input, {'Ended': {'Name': $r.TrainingJobName, "
    "'Status': $r.TrainingJobStatus, 'Secondary': $r.SecondaryStatus, 'Environment': $r.Environment, "
    "'Step': $exists($s) ? $round($max($s)) : -1, 'Saved': $exists($k) ? $round($max($k)) : -1}}])) %}"
)
# supervisor.progress: Step (the job's, else the record's), Advanced (a checkpoint past the newest the
# run had), Done (Step reached the run's steps), Saved (the newest checkpoint step now), Kept (the
# count a crash adds to: 0 after progress), After (supervisor.crashes_after for any other NEXT_JOB rule
# but a capacity error: 0 after progress, else one more end without progress). A record written before
# `step` or `saved_step` existed counts from 0.
PROGRESS_OUTPUT = (
    "{% ($item := $states.input.Registry.Item; $job := $states.input.Ended.Step; "
    "$saved := $states.input.Ended.Saved; "
    "$before := $exists($item.step.N) ? $number($item.step.N) : 0; "
    "$kept := $exists($item.saved_step.N) ? $number($item.saved_step.N) : 0; "
    "$step := $job >= 0 ? $job : $before; "
    "$merge([$states.input, {'Progress': {'Step': $step, 'Advanced': $saved > $kept, "
    "'Done': $step >= $number($item.steps.N), 'Saved': $saved > $kept ? $saved : $kept, "
    "'Kept': $saved > $kept ? 0 : $number($item.crashes.N), "
    "'After': $saved > $kept ? 0 : $number($item.crashes.N) + 1}}])) %}"
)


def export_failure_entry(job: str, status: str, reason: str) -> dict[str, Any]:
    """One entry of the record's `export_failures` (JSONPath values)."""
    return {
        "M": {
            "job": {"S.$": job},
            "status": {"S.$": status} if status.startswith("$") else {"S": status},
            "reason": {"S.$": reason},
            "at": {"S.$": "$$.State.EnteredTime"},
        }
    }


def record_export_failure(c: SupervisorConstants, run: str, entry: dict[str, Any], then: str) -> dict:
    """Append `entry` to the run's `export_failures` (a run gone from the registry: nothing to record)."""
    return task(
        UPDATE_ITEM,
        {
            "TableName": c.table_name,
            "Key": {"run": {"S.$": run}},
            "UpdateExpression": (
                "SET #export_failures = list_append(if_not_exists(#export_failures, :none), :failure)"
            ),
            "ConditionExpression": "attribute_exists(#run)",
            "ExpressionAttributeNames": names("export_failures", "run"),
            "ExpressionAttributeValues": {":none": {"L": []}, ":failure": {"L": [entry]}},
        },
        ResultPath=None,
        Catch=[{"ErrorEquals": [CONDITION_FAILED], "Next": then, "ResultPath": None}],
        Next=then,
    )


def notify_export_failure(c: SupervisorConstants, run: str, what: str, then: str) -> dict:
    template = supervisor.export_failed_template(c.recipe, c.team, c.team_option)
    return task(
        PUBLISH,
        {
            "TopicArn": c.topic_arn,
            "Subject.$": fmt(supervisor.EXPORT_SUBJECT, run),
            "Message.$": fmt(template, run, what, run),
        },
        ResultPath=None,
        Catch=[{"ErrorEquals": ["States.ALL"], "Next": "NotificationFailed", "ResultPath": "$.NotifyError"}],
        Next=then,
    )


def export_end_states(c: SupervisorConstants) -> dict[str, Any]:
    """An export job of a run ended (its environment names the run): a failure is recorded in the run's
    `export_failures` and notified; the run itself is not changed."""
    run = f"$.Ended.Environment.{supervisor.EXPORT_OF_ENV}"
    what = supervisor.EXPORT_JOB_FAILED.replace("{job}", "{}").replace("{status}", "{}")
    return {
        "ExportEnded": {
            "Type": "Choice",
            "Choices": [{"Variable": "$.Ended.Status", "StringEquals": "Failed", "Next": "ExportFailed"}],
            "Default": "ExportFine",
        },
        "ExportFailed": {
            "Type": "Pass",
            "Parameters": {
                **_decision(
                    "ExportFailed",
                    supervisor.Outcome.IGNORED,
                    {
                        "Why.$": fmt(
                            what.replace("{reason}", "{}"),
                            "$.Ended.Name",
                            "$.Ended.Status",
                            "$.Failure.Reason",
                        )
                    },
                    Next="trainstack export tries again; the run is unchanged",
                ),
            },
            "ResultPath": "$.Decision",
            "Next": "RecordExportFailed",
        },
        "RecordExportFailed": record_export_failure(
            c, run, export_failure_entry("$.Ended.Name", "$.Ended.Status", "$.Failure.Reason"), "NotifyExport"
        ),
        "NotifyExport": notify_export_failure(c, run, "$.Decision.Why", "Decided"),
        "ExportFine": {
            "Type": "Pass",
            "Parameters": _decision(
                "ExportEnded",
                supervisor.Outcome.IGNORED,
                {"Why": "an export job of the run ended without failing"},
                Next=supervisor.NEXT[supervisor.Outcome.IGNORED],
            ),
            "ResultPath": "$.Decision",
            "Next": "Decided",
        },
    }


def on_complete_states(c: SupervisorConstants, on_complete: dict[str, Any]) -> dict[str, Any]:
    """After a completed run is recorded: the on-complete export when the run's own recorded request
    asks for it (`export.on_complete` among its hyperparameters: what the run was launched or resumed
    with, never what is deployed now), then the notification. An export that cannot start is recorded
    in the run's `export_failures` and said in the notification."""
    wanted = f"$states.input.Recorded.Request.HyperParameters.`{supervisor.EXPORT_ON_COMPLETE_KEY}` = 'true'"
    not_started = supervisor.EXPORT_NOT_STARTED.replace("{cause}", "{}")
    return {
        "Ended": {
            "Type": "Choice",
            "Choices": [
                {
                    "Variable": "$.Decision.Outcome",
                    "StringEquals": supervisor.Outcome.COMPLETED.value,
                    "Next": "RecordedExport",
                }
            ],
            "Default": "Notify",
        },
        "RecordedExport": {
            "Type": "Pass",
            "Parameters": {"Request.$": "States.StringToJson($.Registry.Item.request.S)"},
            "ResultPath": "$.Recorded",
            "Next": "ExportWanted",
        },
        "ExportWanted": {
            "Type": "Choice",
            "QueryLanguage": "JSONata",
            "Choices": [{"Condition": "{% " + wanted + " %}", "Next": ON_COMPLETE}],
            "Default": "Notify",
        },
        ON_COMPLETE: {
            **on_complete,
            "Catch": [
                {"ErrorEquals": ["States.ALL"], "ResultPath": "$.ExportError", "Next": "ExportNotStarted"}
            ],
            "Next": "Notify",
        },
        "ExportNotStarted": {
            "Type": "Pass",
            "Parameters": {
                "Outcome.$": "$.Decision.Outcome",
                "Headline.$": "$.Decision.Headline",
                "Rule.$": "$.Decision.Rule",
                "State.$": "$.Decision.State",
                "Why.$": "$.Decision.Why",
                "Next.$": fmt("{}; " + not_started, "$.Decision.Next", "$.ExportError.Cause"),
                "CheckpointUri.$": "$.Decision.CheckpointUri",
            },
            "ResultPath": "$.Decision",
            "Next": "RecordExportNotStarted",
        },
        "RecordExportNotStarted": record_export_failure(
            c,
            "$.Numbers.Run",
            export_failure_entry("$.Ended.Name", "NotStarted", "$.ExportError.Cause"),
            "Notify",
        ),
    }


def job_ended_definition(
    c: SupervisorConstants, *, on_complete: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The "job ended" state machine: read the job and its run's record, decide, record, start the next
    job when the decision says so, notify.

    No request is deployed here: the next job is the run's recorded request (NextInput).
    `on_complete`: a state (its owner's definition, stacks/export.py) run between recording a completed
    run and notifying it, as `OnComplete`; it goes on to Notify whatever it does."""
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
        ":entry": {  # the rule too: `runs` names a capacity-block end (a Completed job) as such
            "M": {
                "job_status": {"S.$": "$.Ended.Status"},
                "secondary_status": {"S.$": "$.Ended.Secondary"},
                "rule": {"S.$": "$.Decision.Rule"},
            }
        },
        ":why": {"S.$": "$.Decision.Why"},
        ":next": {"S.$": "$.Decision.Next"},
        ":now": {"S.$": "$$.State.EnteredTime"},
        ":step": {"N.$": fmt("{}", "$.Progress.Step")},
        ":saved": {"N.$": fmt("{}", "$.Progress.Saved")},
    }
    changed_meanwhile = [{"ErrorEquals": [CONDITION_FAILED], "Next": "Ignored", "ResultPath": "$.Error"}]
    checkpoint = {"CheckpointUri.$": "$.Registry.Item.checkpoint_uri.S"}
    states: dict[str, Any] = {
        # JSONata: FinalMetricDataList is absent until the trainer logged a metric, and a JSONPath
        # selector on a missing field fails. Only plain fields are kept (no datetimes: asl.py).
        "DescribeJob": {
            "Type": "Task",
            "QueryLanguage": "JSONata",
            "Resource": DESCRIBE,
            "Arguments": {"TrainingJobName": "{% $states.input.detail.TrainingJobName %}"},
            "Output": DESCRIBED_OUTPUT,
            "Retry": task(DESCRIBE, {})["Retry"],
            "Next": "HasReason",
        },
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
                {"Variable": "$.Ended.Environment.TRAINSTACK_RUN", "IsPresent": True, "Next": "ReadRun"},
                {
                    "Variable": f"$.Ended.Environment.{supervisor.EXPORT_OF_ENV}",
                    "IsPresent": True,
                    "Next": "ExportEnded",
                },
            ],
            "Default": "NotSupervised",
        },
        **export_end_states(c),
        "NotSupervised": {
            "Type": "Pass",
            "Parameters": _decision(
                "NotSupervised",
                supervisor.Outcome.IGNORED,
                {
                    "Why": "the job has no run (no TRAINSTACK_RUN, or no record of it with a recorded "
                    "request in the run registry)"
                },
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
            "Choices": [{"Variable": "$.Registry.Item.request", "IsPresent": True, "Next": "Numbers"}],
            "Default": "NotSupervised",
        },
        "Numbers": {
            "Type": "Pass",
            "Parameters": {
                "Run.$": "$.Registry.Item.run.S",
                "Job.$": "States.StringToJson($.Registry.Item.job_index.N)",
                "Counted.$": "States.StringToJson($.Registry.Item.counted.N)",
                "MaxJobs.$": "States.StringToJson($.Registry.Item.max_jobs.N)",
                "Crashes.$": "States.StringToJson($.Registry.Item.crashes.N)",
                "CapacityMinutes.$": "States.StringToJson($.Registry.Item.capacity_minutes.N)",
                "CapacityWait.$": "States.StringToJson($.Registry.Item.capacity_wait.N)",
                "CapacityBudget.$": "States.StringToJson($.Registry.Item.capacity_budget.N)",
                "Steps.$": "States.StringToJson($.Registry.Item.steps.N)",
            },
            "ResultPath": "$.Numbers",
            "Next": "Progress",
        },
        # supervisor.progress and crashes_after's reset: the job's saved step against the run's newest.
        "Progress": {
            "Type": "Pass",
            "QueryLanguage": "JSONata",
            "Output": PROGRESS_OUTPUT,
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
        extra: dict[str, Any] = {"Fresh": rule.fresh_instances, **checkpoint}
        if rule.outcome is supervisor.Outcome.NEXT_JOB:
            # supervisor.crashes_after: a capacity error keeps the count, a crash adds one to what the
            # job's progress kept (0 when it completed a checkpoint past the run's newest), any other end
            # adds one unless it made progress.
            if rule.capacity:
                crashes = "$.Numbers.Crashes"
            elif rule.crash:
                crashes = "States.MathAdd($.Progress.Kept, 1)"
            else:
                crashes = "$.Progress.After"
            parameters = _decision(
                rule.id,
                rule.outcome,
                _why(rule.why),
                Capacity=rule.capacity,
                **{"Crashes.$": crashes},
                **extra,
            )
        else:
            parameters = _decision(rule.id, rule.outcome, _why(rule.why), **_next_text(rule.outcome), **extra)
        states[f"Rule{rule.id}"] = {
            "Type": "Pass",
            "Parameters": parameters,
            "ResultPath": "$.Decision",
            "Next": "FreshInstances",
        }

    request_keep_alive = "$.Recorded.Request.ResourceConfig.KeepAlivePeriodInSeconds"
    limit_why = supervisor.JOB_LIMIT_WHY.replace("{counted}", "{}").replace("{max_jobs}", "{}")
    budget_why = supervisor.CAPACITY_BUDGET_WHY.replace("{minutes}", "{}").replace("{budget}", "{}")
    next_job = (
        supervisor.NEXT[supervisor.Outcome.NEXT_JOB].replace("{next_job}", "{}").replace("{when}", "{}")
    )
    backoff = supervisor.CAPACITY_BACKOFF_MINUTES
    states |= {
        # Crashed, Stalled, InternalError: the cluster is suspect. SageMaker would place the next job
        # on the ended job's warm pool if it has one (a matching job reuses it); releasing it first
        # means fresh instances (UpdateTrainingJob KeepAlivePeriodInSeconds=0, SageMaker API reference).
        "FreshInstances": {
            "Type": "Choice",
            "Choices": [{"Variable": "$.Decision.Fresh", "BooleanEquals": True, "Next": "ReadRequest"}],
            "Default": "Limits",
        },
        "ReadRequest": {
            "Type": "Pass",
            "Parameters": {"Request.$": "States.StringToJson($.Registry.Item.request.S)"},
            "ResultPath": "$.Recorded",
            "Next": "HasWarmPool",
        },
        "HasWarmPool": {
            "Type": "Choice",
            "Choices": [{"Variable": request_keep_alive, "IsPresent": True, "Next": "WarmPoolKept"}],
            "Default": "Limits",
        },
        "WarmPoolKept": {
            "Type": "Choice",
            "Choices": [{"Variable": request_keep_alive, "NumericGreaterThan": 0, "Next": "ReleaseWarmPool"}],
            "Default": "Limits",
        },
        "ReleaseWarmPool": task(
            UPDATE_JOB,
            {"TrainingJobName.$": "$.Ended.Name", "ResourceConfig": {"KeepAlivePeriodInSeconds": 0}},
            ResultPath=None,
            # Best effort: a pool SageMaker did not keep (or already ended) cannot be released twice.
            Catch=[{"ErrorEquals": ["States.ALL"], "Next": "Limits", "ResultPath": "$.ReleaseError"}],
            Next="Limits",
        ),
        "Limits": {
            "Type": "Choice",
            "Choices": [
                {
                    "Variable": "$.Decision.Outcome",
                    "StringEquals": supervisor.Outcome.NEXT_JOB.value,
                    "Next": "WithinCrashLimit",
                }
            ],
            "Default": "RecordEnd",
        },
        "WithinCrashLimit": {
            "Type": "Choice",
            "Choices": [
                {
                    "Variable": "$.Decision.Crashes",
                    "NumericGreaterThanEquals": supervisor.MAX_CONSECUTIVE_CRASHES,
                    "Next": supervisor.CRASH_LOOP,
                }
            ],
            "Default": "CapacityOrSlot",
        },
        supervisor.CRASH_LOOP: _failed(
            supervisor.CRASH_LOOP,
            supervisor.CRASH_LOOP_WHY.replace("{crashes}", "{}").replace("{saved}", "{}"),
            "$.Decision.Crashes",
            "$.Progress.Saved",
        ),
        "CapacityOrSlot": {
            "Type": "Choice",
            "Choices": [{"Variable": "$.Decision.Capacity", "BooleanEquals": True, "Next": "Backoff"}],
            "Default": "WithinJobLimit",
        },
        # supervisor.capacity_wait: the back-off's first step above the previous wait.
        "Backoff": {
            "Type": "Choice",
            "Choices": [
                {"Variable": "$.Numbers.CapacityWait", "NumericLessThan": minutes, "Next": f"Wait{minutes}"}
                for minutes in backoff[:-1]
            ],
            "Default": f"Wait{backoff[-1]}",
        },
        **{f"Wait{minutes}": _wait(minutes) for minutes in backoff},
        "WithinCapacityBudget": {
            "Type": "Choice",
            "Choices": [
                {
                    "Variable": "$.Wait.Spent",
                    "NumericGreaterThanPath": "$.Numbers.CapacityBudget",
                    "Next": supervisor.CAPACITY_BUDGET,
                }
            ],
            "Default": "WithinJobNames",
        },
        supervisor.CAPACITY_BUDGET: _failed(
            supervisor.CAPACITY_BUDGET, budget_why, "$.Wait.Spent", "$.Numbers.CapacityBudget"
        ),
        "WithinJobLimit": {
            "Type": "Choice",
            "Choices": [
                {
                    "Variable": "$.Numbers.Counted",
                    "NumericGreaterThanEqualsPath": "$.Numbers.MaxJobs",
                    "Next": supervisor.JOB_LIMIT,
                }
            ],
            "Default": "NoWait",
        },
        supervisor.JOB_LIMIT: _failed(
            supervisor.JOB_LIMIT, limit_why, "$.Numbers.Counted", "$.Numbers.MaxJobs"
        ),
        "NoWait": {
            "Type": "Pass",
            "Parameters": {
                "Minutes": 0,
                "Seconds": 0,
                "Spent.$": "$.Numbers.CapacityMinutes",
                "Counted.$": "States.MathAdd($.Numbers.Counted, 1)",
                "When": "",
            },
            "ResultPath": "$.Wait",
            "Next": "WithinJobNames",
        },
        "WithinJobNames": {
            "Type": "Choice",
            "Choices": [
                {
                    "Variable": "$.Numbers.Job",
                    "NumericGreaterThanEquals": JOB_INDEX_MAX,
                    "Next": supervisor.NO_JOB_NAMES,
                }
            ],
            "Default": "NameScheme",
        },
        supervisor.NO_JOB_NAMES: _failed(supervisor.NO_JOB_NAMES, supervisor.NO_JOB_NAMES_WHY),
        "NameScheme": {
            "Type": "Choice",
            "Choices": [{"Variable": "$.Numbers.Job", "NumericLessThan": DECIMAL_JOBS, "Next": "NextJob"}],
            "Default": "NextJobPast99",
        },
        "NextJob": next_job_state(decimal=True),
        "NextJobPast99": next_job_state(decimal=False),
        "NextText": {
            "Type": "Pass",
            "Parameters": {"Next.$": fmt(next_job, "$.Decision.NextJob", "$.Wait.When")},
            "ResultPath": "$.Text",
            "Next": "RecordNextJob",
        },
        # One conditional write: the job's end, the decision and the next job registered, so no
        # failure between them can leave an end recorded with no job to follow it (the reconciler
        # creates a registered job whose creation never happened).
        "RecordNextJob": task(
            UPDATE_ITEM,
            {
                **recorded,
                "ConditionExpression": (
                    "#current_job = :job AND #run_state = :running AND #stop_requested = :false"
                ),
                "UpdateExpression": (
                    "SET #ended.#job = :entry, #crashes = :crashes, #counted = :counted, "
                    "#capacity_minutes = :spent, #capacity_wait = :wait, #why = :why, #next_step = :next, "
                    "#current_job = :next_job, #job_index = :index, #jobs = list_append(#jobs, :jobs), "
                    "#stalled = :none, #creator = :creator, #step = :step, #saved_step = :saved, "
                    "#updated = :now"
                ),
                "ExpressionAttributeNames": {
                    **names(
                        "ended",
                        "crashes",
                        "counted",
                        "capacity_minutes",
                        "capacity_wait",
                        "why",
                        "next_step",
                        "current_job",
                        "job_index",
                        "jobs",
                        "stalled",
                        "creator",
                        "updated",
                        "run_state",
                        "stop_requested",
                        "step",
                        "saved_step",
                    ),
                    "#job.$": "$.Ended.Name",
                },
                "ExpressionAttributeValues": {
                    **common_values,
                    ":next": {"S.$": "$.Text.Next"},
                    ":false": {"BOOL": False},
                    ":none": {"S": ""},
                    ":crashes": {"N.$": fmt("{}", "$.Decision.Crashes")},
                    ":counted": {"N.$": fmt("{}", "$.Decision.Counted")},
                    ":spent": {"N.$": fmt("{}", "$.Decision.CapacityMinutes")},
                    ":wait": {"N.$": fmt("{}", "$.Decision.WaitMinutes")},
                    ":next_job": {"S.$": "$.Decision.NextJob"},
                    ":index": {"N.$": fmt("{}", "$.Decision.Index")},
                    ":jobs": {"L": [{"S.$": "$.Decision.NextJob"}]},
                    ":creator": {"S.$": "$$.Execution.Id"},
                },
            },
            ResultPath=None,
            Catch=changed_meanwhile,
            Next="WaitFirst",
        ),
        "WaitFirst": {
            "Type": "Choice",
            "Choices": [
                {"Variable": "$.Decision.WaitSeconds", "NumericGreaterThan": 0, "Next": "WaitForCapacity"}
            ],
            "Default": "NextInput",
        },
        "WaitForCapacity": {"Type": "Wait", "SecondsPath": "$.Decision.WaitSeconds", "Next": "NextInput"},
        # The next job starts in this execution, through the same states as StartJob's, from the run's
        # recorded request: no execution waits on another, and the registry's conditional write made a
        # repeated event harmless.
        "NextInput": {
            "Type": "Pass",
            "Parameters": {
                f"{INPUT_RUN}.$": "$.Numbers.Run",
                f"{INPUT_REQUEST}.$": "States.StringToJson($.Registry.Item.request.S)",
                # the trainer tags the run's MLflow run with why the previous job ended
                # (trainer.metrics.tracking)
                INPUT_JOB_ENVIRONMENT: {f"{PREVIOUS_JOB_END_ENV}.$": "$.Decision.Rule"},
                "Names": {"JobName.$": "$.Decision.NextJob"},
                "Decision": {
                    "Outcome.$": "$.Decision.Outcome",
                    "Headline.$": "$.Decision.Headline",
                    "Rule.$": "$.Decision.Rule",
                    "State.$": "$.Decision.State",
                    "Why.$": "$.Decision.Why",
                    "Next.$": "$.Text.Next",
                    "NextJob.$": "$.Decision.NextJob",
                    "CheckpointUri.$": "$.Decision.CheckpointUri",
                },
                "Numbers.$": "$.Numbers",
                "Ended.$": "$.Ended",
            },
            "ResultPath": "$",
            "Next": CREATE_AT,
        },
        **creation_states(c, then="Notify"),
        "RecordEnd": task(
            UPDATE_ITEM,
            {
                **recorded,
                "UpdateExpression": (
                    "SET #run_state = :state, #ended.#job = :entry, #why = :why, #next_step = :next, "
                    "#step = :step, #saved_step = :saved, #updated = :now"
                ),
                "ExpressionAttributeNames": {
                    **names(
                        *("ended", "why", "next_step", "updated", "current_job", "run_state"),
                        *("step", "saved_step"),
                    ),
                    "#job.$": "$.Ended.Name",
                },
                "ExpressionAttributeValues": {**common_values, ":state": {"S.$": "$.Decision.State"}},
            },
            ResultPath=None,
            Catch=changed_meanwhile,
            Next="Ended" if on_complete else "Notify",
        ),
        "Notify": {
            **notify(
                c,
                run="$.Numbers.Run",
                job="$.Ended.Name",
                status="$.Ended.Status",
                secondary="$.Ended.Secondary",
                failed="NotificationFailed",
            ),
            "Next": "Decided",
        },
        "NotificationFailed": notification_failed("the run's record, and its next job if any"),
        "Decided": {"Type": "Succeed", "OutputPath": "$.Decision"},
    }
    if on_complete:
        states |= on_complete_states(c, on_complete)
    return {
        "Comment": f"A job of a {c.team}/{c.recipe} run ended: decide what the run does next.",
        "StartAt": "DescribeJob",
        "States": states,
    }
