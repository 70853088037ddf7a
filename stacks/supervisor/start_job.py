"""The "start job" state machine definition (see stacks/supervisor/asl.py for the picture)."""

from __future__ import annotations

from typing import Any

from stacks.supervisor.asl import (
    ALREADY_EXISTS,
    CONDITION_FAILED,
    CREATE,
    GET_ITEM,
    JOB_NAME_PATH,
    PUT_ITEM,
    RECIPE_PATH,
    REGISTRY_ATTRIBUTES,
    RUN_PATH,
    STOP,
    UPDATE_ITEM,
    SupervisorConstants,
    fmt,
    job_name_expression,
    names,
    notify,
    task,
)
from trainstack.aws import supervisor
from trainstack.aws.request import (
    INPUT_CHANGE,
    INPUT_CREATOR,
    INPUT_HISTORY,
    INPUT_HYPERPARAMETER_OVERRIDES,
    INPUT_JOB,
    INPUT_JOB_ENVIRONMENT,
    INPUT_LIMITS,
    INPUT_MLFLOW_RUN_ID,
    INPUT_REASON,
    INPUT_REQUEST,
    INPUT_RUN_ID,
    INPUT_STEPS,
)
from trainstack.recipes.naming import DECIMAL_JOBS

START_AT = "NameScheme"
CREATE_AT = "CreateTrainingJob"
REQUEST_PATH = f"$.{INPUT_REQUEST}"
NOW = "$.Names.Now"

# The one JSONata state: CreateTrainingJob's whole request is the run's recorded one (whatever fields it
# has, so a deployment that adds or drops a field changes no running run), with this job's name and its
# own environment merged in (trainstack.aws.run_request.job_request is the same in Python).
CREATE_ARGUMENTS = (
    f"{{% $merge([$states.input.{INPUT_REQUEST}, {{'TrainingJobName': $states.input.Names.JobName, "
    f"'Environment': $merge([$states.input.{INPUT_REQUEST}.Environment, "
    f"$states.input.{INPUT_JOB_ENVIRONMENT}])}}]) %}}"
)
KEEP_INPUT_WITH_RESULT = (
    "{% $merge([$states.input, {'Created': {'TrainingJobArn': $states.result.TrainingJobArn}}]) %}"
)
KEEP_INPUT_WITH_ERROR = "{% $merge([$states.input, {'Error': $states.errorOutput}]) %}"


def start_job_definition(
    c: SupervisorConstants, *, request: dict[str, Any], hyperparameters: dict[str, str]
) -> dict[str, Any]:
    """The "start job" state machine: register the job in the run's record, create it, end.

    `request` is the deployed CreateTrainingJob request with the run's values as JSONPath (`"Key.$"`),
    its hyperparameters the deployed recipe's (`hyperparameters`, at RECIPE_PATH) with the launch's
    overrides; only a launch builds from it: the run records the result and every later job is built
    from that record."""
    return {
        "Comment": f"Start job n of a {c.team}/{c.recipe} run: record it in the run registry, create it.",
        "StartAt": START_AT,
        "States": {
            **registration_states(c, request=request, hyperparameters=hyperparameters),
            **creation_states(c),
        },
    }


def names_state(c: SupervisorConstants, *, decimal: bool) -> dict[str, Any]:
    return {
        "Type": "Pass",
        "Parameters": {
            "JobName.$": job_name_expression(RUN_PATH, f"$.{INPUT_JOB}", decimal=decimal),
            "CheckpointUri.$": fmt(c.checkpoint_base + "{}/", f"$.{INPUT_RUN_ID}"),
            "Job.$": fmt("{}", f"$.{INPUT_JOB}"),
            "Previous.$": fmt("{}", f"States.MathAdd($.{INPUT_JOB}, -1)"),
            "Steps.$": fmt("{}", f"$.{INPUT_STEPS}"),
            "KeepAlive.$": fmt("{}", "$.KeepAlivePeriodInSeconds"),
            "Overrides.$": f"States.JsonToString($.{INPUT_HYPERPARAMETER_OVERRIDES})",
            "Now.$": "$$.State.EnteredTime",
        },
        "ResultPath": "$.Names",
        "Next": "HowStarted",
    }


def registration_states(
    c: SupervisorConstants, *, request: dict[str, Any], hyperparameters: dict[str, str]
) -> dict[str, Any]:
    """Names the job, then registers it as a launch, a resume or a recreation says (StartJob only: the
    supervisor's next jobs are registered by JobEnded's own conditional write)."""
    entry_values = {
        ":job": {"S.$": JOB_NAME_PATH},
        ":index": {"N.$": "$.Names.Job"},
        ":jobs": {"L": [{"S.$": JOB_NAME_PATH}]},
        ":now": {"S.$": NOW},
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
        "jobs": {"L": [{"S.$": JOB_NAME_PATH}]},
        "ended": {"M": {}},
        "checkpoint_uri": {"S.$": "$.Names.CheckpointUri"},
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
        "mlflow_run_id": {"S.$": f"$.{INPUT_MLFLOW_RUN_ID}"},  # "" when the run is not tracked
        "counted": {"N": "1"},
        "creator": {"S.$": "$$.Execution.Id"},
        "request": {"S.$": f"States.JsonToString({REQUEST_PATH})"},
        "history": {"S.$": "States.JsonToString(States.Array($.Entry))"},
        "stalled": {"S": ""},
        "stop_stalled": {"BOOL": c.stop_stalled},
        "capacity_minutes": {"N": "0"},
        "capacity_wait": {"N": "0"},
        "capacity_budget": {"N": str(c.capacity_budget_minutes)},
        "step": {"N": "0"},
        "saved_step": {"N": "0"},
        "export_failures": {"L": []},
        "created": {"S.$": NOW},
        "updated": {"S.$": NOW},
    }
    assert set(put_item) == set(REGISTRY_ATTRIBUTES)
    template = {k: v for k, v in request.items() if not k.startswith("TrainingJobName")}
    table = {"TableName": c.table_name, "Key": {"run": {"S.$": RUN_PATH}}}
    not_started = {"Next": "NotStarted", "ErrorEquals": [CONDITION_FAILED], "ResultPath": "$.Error"}
    limits = f"$.{INPUT_LIMITS}"
    resumed = [
        "saved_step",
        "run_state",
        "current_job",
        "job_index",
        "jobs",
        "stop_requested",
        "crashes",
        "counted",
        "max_jobs",
        "capacity_minutes",
        "capacity_wait",
        "capacity_budget",
        "stop_stalled",
        "stalled",
        "steps",
        "keep_alive",
        "request",
        "history",
        "why",
        "next_step",
        "creator",
        "updated",
    ]
    return {
        "NameScheme": {
            "Type": "Choice",
            "Choices": [
                {"Variable": f"$.{INPUT_JOB}", "NumericLessThanEquals": DECIMAL_JOBS, "Next": "Names"}
            ],
            "Default": "NamesPast99",
        },
        "Names": names_state(c, decimal=True),
        "NamesPast99": names_state(c, decimal=False),
        "HowStarted": {
            "Type": "Choice",
            "Choices": [
                {"Variable": f"$.{INPUT_REASON}", "StringEquals": "launch", "Next": "LoadRecipe"},
                {"Variable": f"$.{INPUT_REASON}", "StringEquals": "resume", "Next": "RegisterResume"},
                {"Variable": f"$.{INPUT_REASON}", "StringEquals": "recreate", "Next": "ClaimJob"},
            ],
            "Default": "NotStarted",
        },
        "LoadRecipe": {
            "Type": "Pass",
            "Result": {"HyperParameters": hyperparameters},
            "ResultPath": RECIPE_PATH,
            "Next": "BuildRequest",
        },
        # The deployed recipe's request with the run's values: what the run records and trains.
        "BuildRequest": {
            "Type": "Pass",
            "Parameters": template,
            "ResultPath": REQUEST_PATH,
            "Next": "LaunchEntry",
        },
        # The run's history starts with its launch (a resume sends the whole history, bounded).
        "LaunchEntry": {
            "Type": "Pass",
            "Parameters": {"at.$": NOW, "who.$": f"$.{INPUT_CHANGE}.Who", "what.$": f"$.{INPUT_CHANGE}.What"},
            "ResultPath": "$.Entry",
            "Next": "RegisterRun",
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
            Next=CREATE_AT,
        ),
        "AlreadyLaunched": {"Type": "Succeed", "Comment": "a run of this name exists (a repeated deploy)"},
        "RegisterResume": task(
            UPDATE_ITEM,
            {
                **table,
                "UpdateExpression": (
                    "SET #run_state = :running, #current_job = :job, #job_index = :index, "
                    "#jobs = list_append(#jobs, :jobs), #stop_requested = :false, #crashes = :zero, "
                    "#counted = :one, #max_jobs = :max_jobs, #capacity_minutes = :zero, "
                    "#capacity_wait = :zero, #capacity_budget = :budget, #stop_stalled = :stop_stalled, "
                    "#saved_step = :zero, "
                    "#stalled = :none, #steps = :steps, #keep_alive = :keep, #request = :request, "
                    "#history = :history, #why = :why, #next_step = :next, "
                    "#creator = :creator, #updated = :now"
                ),
                "ConditionExpression": (
                    "#job_index = :previous AND (#run_state = :stopped OR #run_state = :failed)"
                ),
                "ExpressionAttributeNames": names(*resumed),
                "ExpressionAttributeValues": {
                    **entry_values,
                    ":previous": {"N.$": "$.Names.Previous"},
                    ":running": {"S": "running"},
                    ":false": {"BOOL": False},
                    ":zero": {"N": "0"},
                    ":one": {"N": "1"},
                    ":none": {"S": ""},
                    ":max_jobs": {"N.$": fmt("{}", f"{limits}.MaxJobs")},
                    ":budget": {"N.$": fmt("{}", f"{limits}.CapacityMinutes")},
                    ":stop_stalled": {"BOOL.$": f"{limits}.StopStalled"},
                    ":steps": {"N.$": "$.Names.Steps"},
                    ":keep": {"N.$": "$.Names.KeepAlive"},
                    ":request": {"S.$": f"States.JsonToString({REQUEST_PATH})"},
                    ":history": {"S.$": f"States.JsonToString($.{INPUT_HISTORY})"},
                    ":why": {"S": "resumed"},
                    ":next": {"S.$": fmt("job {} starts", JOB_NAME_PATH)},
                    ":stopped": {"S": "stopped"},
                    ":failed": {"S": "failed"},
                },
            },
            ResultPath=None,
            Catch=[not_started],
            Next=CREATE_AT,
        ),
        # The reconciler found the run's current job registered, never created, and its creator gone.
        "ClaimJob": task(
            UPDATE_ITEM,
            {
                **table,
                "UpdateExpression": "SET #creator = :creator, #updated = :now",
                "ConditionExpression": (
                    "#current_job = :job AND #run_state = :running AND #stop_requested = :false "
                    "AND #creator = :previous"
                ),
                "ExpressionAttributeNames": names(
                    "creator", "updated", "current_job", "run_state", "stop_requested"
                ),
                "ExpressionAttributeValues": {
                    ":creator": entry_values[":creator"],
                    ":now": entry_values[":now"],
                    ":job": entry_values[":job"],
                    ":running": {"S": "running"},
                    ":false": {"BOOL": False},
                    ":previous": {"S.$": f"$.{INPUT_CREATOR}"},
                },
            },
            ResultPath=None,
            Catch=[not_started],
            Next=CREATE_AT,
        ),
        "NotStarted": {
            "Type": "Succeed",
            "Comment": "the run changed meanwhile (stopped, resumed, or this job already started)",
        },
    }


def creation_states(c: SupervisorConstants, *, then: str | None = None) -> dict[str, Any]:
    """CreateTrainingJob for `$.Names.JobName` from `$.Request`, and what follows it. The input holds
    `Run`, `Request`, `JobEnvironment` and `Names.JobName`. `then`: the state after the job exists
    (JobEnded's notification); without it, the execution ends there."""
    table = {"TableName": c.table_name, "Key": {"run": {"S.$": RUN_PATH}}}
    created = {"Type": "Pass", "Next": then} if then else {"Type": "Succeed", "OutputPath": "$.Names"}
    return {
        CREATE_AT: {
            "Type": "Task",
            "QueryLanguage": "JSONata",
            "Resource": CREATE,
            "Arguments": CREATE_ARGUMENTS,
            "Output": KEEP_INPUT_WITH_RESULT,
            "Retry": task(CREATE, {}, capacity=True)["Retry"],
            "Catch": [
                # Another execution made it (a repeated event, the reconciler): the same job, watched.
                {"ErrorEquals": [ALREADY_EXISTS], "Next": "CheckStop", "Output": KEEP_INPUT_WITH_ERROR},
                {"ErrorEquals": ["States.ALL"], "Next": "NotCreated", "Output": KEEP_INPUT_WITH_ERROR},
            ],
            "Next": "CheckStop",
        },
        # `trainstack stop` may have asked while the job was being created: the job it could not see
        # is stopped here, so no job of a stopping (or stopped) run trains unwatched.
        "CheckStop": task(
            GET_ITEM,
            {**table, "ConsistentRead": True},
            ResultSelector={
                "State.$": "$.Item.run_state.S",
                "Current.$": "$.Item.current_job.S",
                "StopRequested.$": "$.Item.stop_requested.BOOL",
            },
            ResultPath="$.Check",
            Next="StillWanted",
        ),
        "StillWanted": {
            "Type": "Choice",
            "Choices": [
                {
                    "And": [
                        {"Variable": "$.Check.State", "StringEquals": "running"},
                        {"Variable": "$.Check.Current", "StringEqualsPath": JOB_NAME_PATH},
                        {"Variable": "$.Check.StopRequested", "BooleanEquals": False},
                    ],
                    "Next": "Created",
                }
            ],
            "Default": "StopUnwanted",
        },
        "StopUnwanted": task(
            STOP,
            {"TrainingJobName.$": JOB_NAME_PATH},
            ResultPath=None,
            Catch=[{"ErrorEquals": ["States.ALL"], "Next": "Created", "ResultPath": "$.StopError"}],
            Next="Created",
        ),
        "Created": created,
        "NotCreated": {
            "Type": "Pass",
            "Parameters": {
                "Outcome": supervisor.Outcome.FAILED.value,
                "Headline": supervisor.OUTCOME_WORDS[supervisor.Outcome.FAILED],
                "Rule": "NotCreated",
                "State": "failed",
                "Why.$": fmt("SageMaker did not create the job: {}", "$.Error.Cause"),
                "Next.$": fmt(supervisor.NEXT[supervisor.Outcome.FAILED].replace("{run}", "{}"), RUN_PATH),
                "CheckpointUri.$": f"{REQUEST_PATH}.Environment.TRAINSTACK_CHECKPOINT_URI",
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
                "ConditionExpression": "#current_job = :job AND #run_state = :running",
                "ExpressionAttributeNames": {
                    **names("run_state", "why", "next_step", "updated", "ended", "current_job"),
                    "#job.$": JOB_NAME_PATH,
                },
                "ExpressionAttributeValues": {
                    ":failed": {"S": "failed"},
                    ":running": {"S": "running"},
                    ":why": {"S.$": "$.Decision.Why"},
                    ":next": {"S.$": "$.Decision.Next"},
                    ":now": {"S.$": "$$.State.EnteredTime"},
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
            **notify(
                c,
                run=RUN_PATH,
                job=JOB_NAME_PATH,
                status="'NotCreated'",
                secondary="'-'",
                failed="JobNotCreated",
            ),
            "Next": "JobNotCreated",
        },
        "JobNotCreated": {"Type": "Fail", "Error": "JobNotCreated", "CausePath": "$.Decision.Why"},
    }
