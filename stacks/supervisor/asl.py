"""What both run supervisor definitions share: resources, paths, the registry's attributes, helpers.

The definitions themselves (start_job.py, job_ended.py) are plain dicts of Amazon States Language.

No CDK here: the constructs in stacks/supervisor/__init__.py pass CDK tokens (table name, bucket, ARNs) as
strings, tests pass literal values. Both executions are short and end; none waits on a job:

StartJob (started by `trainstack launch` / `resume`, the launch-on-deploy rule, and the reconciler):
    Names -> HowStarted? launch:   BuildRequest (the deployed recipe's request) -> RegisterRun (new item,
                                   the request recorded; exists -> AlreadyLaunched)
                         resume:   RegisterResume (run stopped or failed, at that job index; the request
                                   the CLI changed, and the change in the run's history)
                         recreate: ClaimJob (the run's current job was registered and never created)
      -> CreateTrainingJob (JSONata: the run's recorded request + the job's name and own environment;
         capacity and transient retries) ResourceInUse -> CheckStop; else NotCreated -> RecordNotCreated
         -> NotifyNotCreated -> Fail
      -> CheckStop (a stop asked meanwhile stops the job just created) -> Created

JobEnded (started by the rule on `SageMaker Training Job State Change`, this recipe's jobs,
Completed | Failed | Stopped, and by the reconciler for an end whose event was lost):
    DescribeJob -> HasReason? -> ReadFailure | NoReason -> Supervised? -> ReadRun -> Registered? -> Numbers
      -> Progress (the job's step against the previous job's and the run's steps)
      -> Current? (the run's newest job, the run running; else Ignored)
      -> Decide (one Choice rule per row of trainstack.aws.supervisor.RULES, in order) -> Rule<Id> (Pass)
      -> FreshInstances? (Crashed, Stalled, InternalError: ReleaseWarmPool) -> Limits?
         next job: WithinCrashLimit -> capacity: Backoff -> WithinCapacityBudget | else WithinJobLimit
                   -> WithinJobNames -> NextJob -> RecordNextJob (the end, the decision and job n+1 in one
                   conditional write) -> Wait? -> NextInput -> CreateTrainingJob ... -> Created -> Notify
         ended:    RecordEnd -> Notify
      Notify (after everything, with a Catch: a failed publish ends the execution failed, the run's
      next job already started) -> Decided
Every path ends in a Succeed whose output is the decision ({Outcome, Rule, Why, Next, ...}).

The run registry (a DynamoDB table, stacks/registry.py) holds one item per run; attribute names are
REGISTRY_ATTRIBUTES. Expressions name every attribute through ExpressionAttributeNames (`#state`...),
so none can collide with DynamoDB's reserved words.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from stacks.retries import retriers
from trainstack.aws import supervisor
from trainstack.aws.request import (
    INPUT_HYPERPARAMETER_OVERRIDES,
    INPUT_KEEP_ALIVE,
    INPUT_RUN,
    run_limits,
)
from trainstack.recipes import naming
from trainstack.recipes.schema import Recipe

CREATE = "arn:aws:states:::aws-sdk:sagemaker:createTrainingJob"
DESCRIBE = "arn:aws:states:::aws-sdk:sagemaker:describeTrainingJob"
GET_ITEM = "arn:aws:states:::dynamodb:getItem"
PUT_ITEM = "arn:aws:states:::dynamodb:putItem"
UPDATE_ITEM = "arn:aws:states:::dynamodb:updateItem"
PUBLISH = "arn:aws:states:::sns:publish"
STOP = "arn:aws:states:::aws-sdk:sagemaker:stopTrainingJob"
UPDATE_JOB = "arn:aws:states:::aws-sdk:sagemaker:updateTrainingJob"
LIST_JOBS = "arn:aws:states:::aws-sdk:sagemaker:listTrainingJobs"
SCAN = "arn:aws:states:::aws-sdk:dynamodb:scan"
START_EXECUTION = "arn:aws:states:::states:startExecution"
DESCRIBE_EXECUTION = "arn:aws:states:::aws-sdk:sfn:describeExecution"
CONDITION_FAILED = "DynamoDB.ConditionalCheckFailedException"
ALREADY_EXISTS = "SageMaker.ResourceInUseException"

# Where values live inside an execution (JSONPath).
RECIPE_PATH = "$.Recipe"
HYPERPARAMETERS_EXPRESSION = (
    f"States.JsonMerge({RECIPE_PATH}.HyperParameters, $.{INPUT_HYPERPARAMETER_OVERRIDES}, false)"
)
JOB_NAME_PATH = "$.Names.JobName"
CHECKPOINT_URI_PATH = "$.Names.CheckpointUri"
RUN_PATH = f"$.{INPUT_RUN}"
KEEP_ALIVE_PATH = f"$.{INPUT_KEEP_ALIVE}"

# The registry item's attributes (DynamoDB type in brackets).
REGISTRY_ATTRIBUTES = {
    "run": "S",  # partition key: the run's name, ts-<team>-<recipe>--<run id>
    "run_id": "S",
    "recipe": "S",
    "team": "S",
    "run_state": "S",  # running | stopped | completed | failed
    "current_job": "S",  # the newest job's name
    "job_index": "N",  # its index
    "jobs": "L",  # every job's name, in order
    "ended": "M",  # job name -> {job_status, secondary_status} once the job's end is decided
    "checkpoint_uri": "S",
    "steps": "N",
    "tokens_per_step": "N",
    "usd_per_hour": "N",  # the cluster's price per hour as planned
    "overrides": "S",  # the launch's HyperParameterOverrides as JSON
    "keep_alive": "N",
    "stop_requested": "BOOL",
    "crashes": "N",  # jobs in a row that ended without progress (trainstack.aws.supervisor); 0 on resume
    "why": "S",  # why the newest job ended (or was started), in words
    "next_step": "S",  # what happens next, in words
    "recipe_hash": "S",  # the deployed recipe's hash when the run was launched
    "max_jobs": "N",  # compute.max_jobs of the run's recipe
    "counted": "N",  # jobs since launch or resume that spent a slot of max_jobs (capacity retries do not)
    "mlflow_run_id": "S",  # the MLflow run `trainstack launch` created ("" if none; trainstack.aws.tracking)
    "creator": "S",  # the execution that registered the newest job (and creates it): `stop` may end it
    "request": "S",  # the run's CreateTrainingJob request, JSON, without TrainingJobName (every job's)
    "history": "S",  # JSON [{at, who, what}]: the launch and the deliberate changes (the newest kept)
    "stalled": "S",  # the job the supervisor stopped because it made no progress ("" for none)
    "stop_stalled": "BOOL",  # monitoring.stop_stalled of the run's recipe
    "capacity_minutes": "N",  # minutes waited for capacity since launch or resume
    "capacity_wait": "N",  # the last capacity wait in minutes (0 once a job ends another way)
    "capacity_budget": "N",  # compute.capacity_wait_hours of the run's recipe, in minutes
    "step": "N",  # the step the newest ended job reported (FinalMetricDataList train:step), 0 before any
    # the newest checkpoint step a job reported (train:saved_step) since launch or resume: a crash resets
    # the crash count only past it (trainstack.aws.supervisor.progress)
    "saved_step": "N",
    # exports that failed: [{job, status, reason, at}] (an export job's end, or an on-complete export that
    # could not start); the Export machine appends `exports` (stacks/export.py), created on first use.
    "export_failures": "L",
    "created": "S",
    "updated": "S",
}
NAMES = {f"#{a}": a for a in REGISTRY_ATTRIBUTES}


CDK_TOKEN = re.compile(r"\$\{Token\[[A-Za-z0-9_.\-]+\]\}")


def literal(text: str) -> str:
    """`text` as a literal inside an intrinsic function's string.

    The language escapes quotes, braces and backslashes there with a backslash; the emulator's
    interpreter does not undo those escapes, so texts that reach a template have none to escape.
    """
    # A CDK token (`${Token[...]}`, a bucket name, an ARN) resolves to a value without such characters.
    bad = sorted({c for c in CDK_TOKEN.sub("", text) if c in "'{}\\"})
    if bad:
        raise ValueError(f"intrinsic string literal may not contain {bad}: {text!r}")
    return text


def fmt(template: str, *arguments: str) -> str:
    """`States.Format('...', args)` where `{}` in `template` marks each argument."""
    parts = template.split("{}")
    assert len(parts) == len(arguments) + 1, (template, arguments)
    return f"States.Format('{'{}'.join(literal(p) for p in parts)}', {', '.join(arguments)})"


def job_name_expression(run_path: str, index_expression: str, *, decimal: bool) -> str:
    """The intrinsic that names the run's job of that index, `<run>-<naming.job_suffix(index)>`.

    `decimal`: the index is at most naming.DECIMAL_JOBS, and its suffix is the number. Past it, the
    suffix is looked up in naming.JOB_SUFFIXES (Step Functions has no base-36 arithmetic); the lookup is
    slower to interpret, so the definitions choose it only past job 99 (the two must agree: tested)."""
    if decimal:
        return fmt("{}-{}", run_path, index_expression)
    suffixes = f"States.StringSplit('{literal(naming.JOB_SUFFIXES)}', ',')"
    return fmt("{}-{}", run_path, f"States.ArrayGetItem({suffixes}, States.MathAdd({index_expression}, -1))")


def names(*attributes: str) -> dict[str, str]:
    unknown = set(attributes) - set(REGISTRY_ATTRIBUTES)
    assert not unknown, unknown
    return {f"#{a}": a for a in attributes}


def task(resource: str, parameters: dict[str, Any], *, capacity: bool = False, **fields: Any) -> dict:
    return {
        "Type": "Task",
        "Resource": resource,
        "Parameters": parameters,
        "Retry": retriers(resource, capacity=capacity),
        **fields,
    }


@dataclass(frozen=True)
class SupervisorConstants:
    """Everything a definition needs that is fixed when the stack is deployed."""

    recipe: str
    team: str
    team_option: str  # " --team <team>" when the deployment names its team, else ""
    table_name: str
    topic_arn: str
    checkpoint_base: str  # s3://<bucket>/checkpoints/<team>/<recipe>/
    tokens_per_step: int
    usd_per_hour: float
    recipe_hash: str
    max_jobs: int
    capacity_budget_minutes: int = 72 * 60
    stop_stalled: bool = True


def constants_for(
    recipe: Recipe, team: str | None, plan: Any, *, table_name: str, topic_arn: str, bucket_name: str
) -> SupervisorConstants:
    """The constants of a deployment of `recipe` for `team` (CDK tokens or literal values)."""
    return SupervisorConstants(
        recipe=recipe.name,
        team=team or recipe.tags.team,
        team_option=f" --team {team}" if team else "",
        table_name=table_name,
        topic_arn=topic_arn,
        checkpoint_base=f"s3://{bucket_name}/{naming.checkpoint_prefix(recipe, team)}/",
        tokens_per_step=recipe.tokens_per_step,
        usd_per_hour=float(plan.cost.usd_per_hour),
        recipe_hash=naming.recipe_hash(recipe),
        max_jobs=(limits := run_limits(recipe))["MaxJobs"],
        capacity_budget_minutes=limits["CapacityMinutes"],
        stop_stalled=limits["StopStalled"],
    )


def notify(c: SupervisorConstants, *, run: str, job: str, status: str, secondary: str, failed: str) -> dict:
    """Publish the decision: the run, the job, why it ended, what happens next, the run's checkpoints.

    Never on the path of a run's next job: every definition publishes after its writes and its
    CreateTrainingJob, and a publish that still fails (topic gone, key disabled) goes to `failed`, which
    ends the execution failed so that the ExecutionFailed alarm tells a person (on its own topic too)."""
    template, fields = supervisor.message_template(c.recipe, c.team, c.team_option)
    values = {
        "run": run,
        "job": job,
        "status": status,
        "secondary": secondary,
        "why": "$.Decision.Why",
        "next": "$.Decision.Next",
        "checkpoint_uri": "$.Decision.CheckpointUri",
    }
    return task(
        PUBLISH,
        {
            "TopicArn": c.topic_arn,
            "Subject.$": fmt(supervisor.SUBJECT, run, "$.Decision.Headline"),
            "Message.$": fmt(template, *(values[f] for f in fields)),
        },
        ResultPath=None,
        Catch=[{"ErrorEquals": ["States.ALL"], "Next": failed, "ResultPath": "$.NotifyError"}],
    )


def notification_failed(after: str) -> dict:
    """The Fail state a failed publish leads to: what the decision did already happened."""
    return {
        "Type": "Fail",
        "Error": "NotificationFailed",
        "Comment": f"the decision was recorded and carried out ({after}); only its notification failed",
        "CausePath": "$.NotifyError.Cause",
    }
