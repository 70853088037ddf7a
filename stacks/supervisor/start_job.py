"""The "start job" state machine definition (see stacks/supervisor/asl.py for the picture)."""

from __future__ import annotations

from typing import Any

from stacks.supervisor.asl import (
    ALREADY_EXISTS,
    CHECKPOINT_URI_PATH,
    CONDITION_FAILED,
    CREATE,
    JOB_NAME_PATH,
    KEEP_ALIVE_PATH,
    PUT_ITEM,
    RECIPE_PATH,
    REGISTRY_ATTRIBUTES,
    RUN_PATH,
    UPDATE_ITEM,
    SupervisorConstants,
    fmt,
    names,
    notify,
    task,
)
from trainstack.aws import supervisor
from trainstack.aws.request import (
    INPUT_HYPERPARAMETER_OVERRIDES,
    INPUT_JOB,
    INPUT_LAST_JOB,
    INPUT_MLFLOW_RUN_ID,
    INPUT_REASON,
    INPUT_RUN_ID,
    INPUT_STEPS,
)

# --- StartJob ---------------------------------------------------------------------------------------


START_AT = "LoadRecipe"


def start_job_definition(
    c: SupervisorConstants, *, request: dict[str, Any], hyperparameters: dict[str, str]
) -> dict[str, Any]:
    """The "start job" state machine: register the job in the run's record, create it, end."""
    return {
        "Comment": f"Start job n of a {c.team}/{c.recipe} run: record it in the run registry, create it.",
        "StartAt": START_AT,
        "States": start_job_states(c, request=request, hyperparameters=hyperparameters),
    }


def start_job_states(
    c: SupervisorConstants,
    *,
    request: dict[str, Any],
    hyperparameters: dict[str, str],
    output_path: str | None = None,
) -> dict[str, Any]:
    """The states that start a job, from START_AT; the input is trainstack.aws.request.execution_input
    (plus `Steps`). JobEnded embeds them for the run's next job, with `output_path` on its ends."""
    ends = {"OutputPath": output_path} if output_path else {}
    now = "$.Names.Now"
    entry_values = {
        ":job": {"S.$": JOB_NAME_PATH},
        ":index": {"N.$": "$.Names.Job"},
        ":jobs": {"L": [{"S.$": JOB_NAME_PATH}]},
        ":now": {"S.$": now},
        ":previous": {"N.$": "$.Names.Previous"},
        ":running": {"S": "running"},
        ":creator": {"S.$": "$$.Execution.Id"},
    }
    put_item = {
        "run": {"S.$": RUN_PATH},
        "run_id": {"S.$": f"$.{INPUT_RUN_ID}"},
        "recipe": {"S": c.recipe},
        "team": {"S": c.team},
        "run_state": {"S": "running"},
        "current_job": {"S.$": JOB_NAME_PATH},
        "job_index": {"N.$": "$.Names.Job"},
        "last_job": {"N.$": "$.Names.LastJob"},
        "jobs": {"L": [{"S.$": JOB_NAME_PATH}]},
        "ended": {"M": {}},
        "checkpoint_uri": {"S.$": CHECKPOINT_URI_PATH},
        "steps": {"N.$": "$.Names.Steps"},
        "tokens_per_step": {"N": str(c.tokens_per_step)},
        "usd_per_hour": {"N": f"{c.usd_per_hour:.4f}"},
        "overrides": {"S.$": "$.Names.Overrides"},
        "keep_alive": {"N.$": "$.Names.KeepAlive"},
        "stop_requested": {"BOOL": False},
        "crashes": {"N": "0"},
        "why": {"S": "launched"},
        "next_step": {"S.$": fmt("job {} starts", JOB_NAME_PATH)},
        "recipe_hash": {"S": c.recipe_hash},
        "max_jobs": {"N": str(c.max_jobs)},
        "creator": {"S.$": "$$.Execution.Id"},
        "mlflow_run_id": {"S.$": f"$.{INPUT_MLFLOW_RUN_ID}"},
        "created": {"S.$": now},
        "updated": {"S.$": now},
    }
    assert set(put_item) == set(REGISTRY_ATTRIBUTES)
    table = {"TableName": c.table_name, "Key": {"run": {"S.$": RUN_PATH}}}
    not_started = {"Next": "NotStarted", "ErrorEquals": [CONDITION_FAILED], "ResultPath": "$.Error"}
    states: dict[str, Any] = {
        "LoadRecipe": {
            "Type": "Pass",
            "Result": {"HyperParameters": hyperparameters},
            "ResultPath": RECIPE_PATH,
            "Next": "Names",
        },
        "Names": {
            "Type": "Pass",
            "Parameters": {
                "JobName.$": fmt("{}-{}", RUN_PATH, f"$.{INPUT_JOB}"),
                "CheckpointUri.$": fmt(c.checkpoint_base + "{}/", f"$.{INPUT_RUN_ID}"),
                "Job.$": fmt("{}", f"$.{INPUT_JOB}"),
                "Previous.$": fmt("{}", f"States.MathAdd($.{INPUT_JOB}, -1)"),
                "LastJob.$": fmt("{}", f"$.{INPUT_LAST_JOB}"),
                "Steps.$": fmt("{}", f"$.{INPUT_STEPS}"),
                "KeepAlive.$": fmt("{}", KEEP_ALIVE_PATH),
                "Overrides.$": f"States.JsonToString($.{INPUT_HYPERPARAMETER_OVERRIDES})",
                "Now.$": "$$.State.EnteredTime",
            },
            "ResultPath": "$.Names",
            "Next": "HowStarted",
        },
        "HowStarted": {
            "Type": "Choice",
            "Choices": [
                {"Variable": f"$.{INPUT_REASON}", "StringEquals": "launch", "Next": "RegisterRun"},
                {"Variable": f"$.{INPUT_REASON}", "StringEquals": "resume", "Next": "RegisterResume"},
            ],
            "Default": "RegisterNextJob",
        },
        "RegisterRun": task(
            PUT_ITEM,
            {
                "TableName": c.table_name,
                "Item": put_item,
                "ConditionExpression": "attribute_not_exists(#run)",
                "ExpressionAttributeNames": names("run"),
            },
            ResultPath=None,
            Catch=[{**not_started, "Next": "AlreadyLaunched"}],
            Next="CreateTrainingJob",
        ),
        "AlreadyLaunched": {
            "Type": "Succeed",
            "Comment": "a run of this name exists (a repeated deploy)",
            **ends,
        },
        "RegisterResume": task(
            UPDATE_ITEM,
            {
                **table,
                "UpdateExpression": (
                    "SET #run_state = :running, #current_job = :job, #job_index = :index, "
                    "#last_job = :last, #jobs = list_append(#jobs, :jobs), #stop_requested = :false, "
                    "#crashes = :zero, #overrides = :overrides, #keep_alive = :keep, #why = :why, "
                    "#next_step = :next, #creator = :creator, #updated = :now"
                ),
                "ConditionExpression": (
                    "#job_index = :previous AND (#run_state = :stopped OR #run_state = :failed)"
                ),
                "ExpressionAttributeNames": names(
                    "run_state",
                    "current_job",
                    "job_index",
                    "last_job",
                    "jobs",
                    "stop_requested",
                    "crashes",
                    "overrides",
                    "keep_alive",
                    "why",
                    "next_step",
                    "creator",
                    "updated",
                ),
                "ExpressionAttributeValues": {
                    **entry_values,
                    ":last": {"N.$": "$.Names.LastJob"},
                    ":false": {"BOOL": False},
                    ":zero": {"N": "0"},
                    ":overrides": {"S.$": "$.Names.Overrides"},
                    ":keep": {"N.$": "$.Names.KeepAlive"},
                    ":why": {"S": "resumed"},
                    ":next": {"S.$": fmt("job {} starts", JOB_NAME_PATH)},
                    ":stopped": {"S": "stopped"},
                    ":failed": {"S": "failed"},
                },
            },
            ResultPath=None,
            Catch=[not_started],
            Next="CreateTrainingJob",
        ),
        "RegisterNextJob": task(
            UPDATE_ITEM,
            {
                **table,
                "UpdateExpression": (
                    "SET #current_job = :job, #job_index = :index, #jobs = list_append(#jobs, :jobs), "
                    "#creator = :creator, #updated = :now"
                ),
                "ConditionExpression": (
                    "#job_index = :previous AND #run_state = :running AND #stop_requested = :false"
                ),
                "ExpressionAttributeNames": names(
                    "current_job", "job_index", "jobs", "creator", "updated", "run_state", "stop_requested"
                ),
                "ExpressionAttributeValues": {**entry_values, ":false": {"BOOL": False}},
            },
            ResultPath=None,
            Catch=[not_started],
            Next="CreateTrainingJob",
        ),
        "NotStarted": {
            "Type": "Succeed",
            "Comment": "the run changed meanwhile (stopped, resumed, or this job already started)",
            **ends,
        },
        "CreateTrainingJob": task(
            CREATE,
            request,
            capacity=True,
            ResultSelector={"TrainingJobArn.$": "$.TrainingJobArn"},
            ResultPath="$.Created",
            Catch=[
                {"ErrorEquals": [ALREADY_EXISTS], "Next": "JobExists", "ResultPath": "$.Error"},
                {"ErrorEquals": ["States.ALL"], "Next": "NotCreated", "ResultPath": "$.Error"},
            ],
            Next="Started",
        ),
        "JobExists": {
            "Type": "Succeed",
            "Comment": "a job of this name exists: another execution made it",
            **ends,
        },
        "Started": {"Type": "Succeed", **ends},
        "NotCreated": {
            "Type": "Pass",
            "Parameters": {
                "Outcome": supervisor.Outcome.FAILED.value,
                "Headline": supervisor.OUTCOME_WORDS[supervisor.Outcome.FAILED],
                "Rule": "NotCreated",
                "State": "failed",
                "Why.$": fmt("SageMaker did not create the job: {}", "$.Error.Cause"),
                "Next.$": fmt(supervisor.NEXT[supervisor.Outcome.FAILED].replace("{run}", "{}"), RUN_PATH),
                "CheckpointUri.$": CHECKPOINT_URI_PATH,
            },
            "ResultPath": "$.Decision",
            "Next": "RecordNotCreated",
        },
        "RecordNotCreated": task(
            UPDATE_ITEM,
            {
                **table,
                "UpdateExpression": (
                    "SET #run_state = :failed, #why = :why, #next_step = :next, #updated = :now, "
                    "#ended.#job = :entry"
                ),
                "ConditionExpression": "#current_job = :job",
                "ExpressionAttributeNames": {
                    **names("run_state", "why", "next_step", "updated", "ended", "current_job"),
                    "#job.$": JOB_NAME_PATH,
                },
                "ExpressionAttributeValues": {
                    ":failed": {"S": "failed"},
                    ":why": {"S.$": "$.Decision.Why"},
                    ":next": {"S.$": "$.Decision.Next"},
                    ":now": {"S.$": now},
                    ":job": {"S.$": JOB_NAME_PATH},
                    ":entry": {
                        "M": {"job_status": {"S": "NotCreated"}, "secondary_status": {"S": "NotCreated"}}
                    },
                },
            },
            ResultPath=None,
            Catch=[{"ErrorEquals": [CONDITION_FAILED], "Next": "NotifyNotCreated", "ResultPath": None}],
            Next="NotifyNotCreated",
        ),
        "NotifyNotCreated": {
            **notify(c, run=RUN_PATH, job=JOB_NAME_PATH, status="'NotCreated'", secondary="'-'"),
            "Next": "JobNotCreated",
        },
        "JobNotCreated": {"Type": "Fail", "Error": "JobNotCreated", "CausePath": "$.Decision.Why"},
    }
    return states
