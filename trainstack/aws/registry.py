"""Runs as the run registry records them, and what `trainstack runs`, `stop` and `resume` compute from them.

The registry is a DynamoDB table per deployment (stack `<prefix>-Data`, output `RunTableName`), one item
per run, written by the supervisor's state machines (stacks/supervisor/asl.py lists the attributes).
Reading and the two writes the CLI makes (asking a run to stop; recording a stop the supervisor will
not see) are thin functions over a boto3 client; turning items, job descriptions and metrics into a
run's progress and cost is pure.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from trainstack.aws.runs import TERMINAL_STATES, Job
from trainstack.aws.supervisor import RECONCILE_MINUTES, RULE_BY_ID
from trainstack.protocol import exit_codes
from trainstack.recipes.naming import RunName, index_of_job, parse_run_name

RUN_TABLE_OUTPUT = "RunTableName"
DATA_STACK_SUFFIX = "-Data"


class NotRunning(Exception):
    """A conditional write found the run in another state."""


# --- Items -> runs (pure) -------------------------------------------------------------------------


def _plain(value: dict[str, Any]) -> Any:
    """A DynamoDB attribute value as a plain Python value."""
    ((kind, raw),) = value.items()
    if kind == "S":
        return raw
    if kind == "N":
        number = float(raw)
        return int(number) if number.is_integer() else number
    if kind == "BOOL":
        return bool(raw)
    if kind == "L":
        return [_plain(v) for v in raw]
    if kind == "M":
        return {k: _plain(v) for k, v in raw.items()}
    if kind == "NULL":
        return None
    raise ValueError(f"unexpected DynamoDB attribute type {kind}")


@dataclass(frozen=True)
class JobRecord:
    name: str
    index: int
    status: str  # as the registry recorded its end, or "InProgress" until then
    secondary_status: str = ""
    rule: str = ""  # the supervisor's rule for its end (trainstack.aws.supervisor.RULES), once decided


@dataclass(frozen=True)
class Change:
    """One entry of a run's history: its launch, or a deliberate change (resume --set, --from-step)."""

    at: str
    who: str
    what: str


@dataclass(frozen=True)
class Run:
    run: str
    run_id: str
    recipe: str
    team: str
    state: str
    current_job: str
    job_index: int
    jobs: tuple[JobRecord, ...]
    checkpoint_uri: str
    steps: int
    tokens_per_step: int
    usd_per_hour: float
    overrides: dict[str, str]
    keep_alive: int
    stop_requested: bool
    why: str
    next_step: str
    recipe_hash: str
    max_jobs: int
    creator: str
    created: datetime
    updated: datetime
    crashes: int = 0  # jobs in a row that ended without progress (supervisor.MAX_CONSECUTIVE_CRASHES)
    counted: int = 1  # jobs since launch or resume that spent a slot of max_jobs
    request: dict[str, Any] = field(default_factory=dict)  # the run's CreateTrainingJob request
    history: tuple[Change, ...] = ()
    stalled: str = ""  # the job the supervisor stopped because it stalled
    capacity_minutes: int = 0  # waited for capacity since launch or resume
    capacity_wait: int = 0  # the last capacity wait, minutes (0: the last end was not a shortage)
    capacity_budget: int = 0  # compute.capacity_wait_hours, minutes
    # Every export of the run, oldest first: {job, step (0: the newest), out_parent, reason, requested}
    # (the Export state machine appends them: stacks/export.py).
    exports: tuple[dict[str, Any], ...] = ()
    mlflow_run_id: str = ""  # the MLflow run launch created (trainstack.aws.tracking), "" when none
    step: int = 0  # the step the newest ended job reported (its final train:step), 0 before any
    saved_step: int = 0  # the newest checkpoint step a job reported (train:saved_step) since launch or resume
    # exports that failed, oldest first: {job, status, reason, at} (stacks/supervisor/job_ended.py)
    export_failures: tuple[dict[str, Any], ...] = ()

    @property
    def name(self) -> RunName | None:
        return parse_run_name(self.run)


def _time(text: str) -> datetime:
    value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def _history(raw: Any) -> list[dict[str, str]]:
    if not raw:
        return []
    entries = json.loads(raw) if isinstance(raw, str) else raw
    return [e for e in entries if isinstance(e, dict)]


HISTORY_MAX = 50  # entries a record keeps: the launch and the newest changes (the item stays small)
WHO_MAX, WHAT_MAX = 256, 512  # characters of an entry's fields


def history_with(run: Run, at: str, who: str, what: str) -> list[dict[str, str]]:
    """The run's history with one more change, as a resume records it: the launch kept, then the
    newest, at most HISTORY_MAX entries of bounded size (a registry item holds at most 400 KB)."""
    entries = [{"at": h.at, "who": h.who, "what": h.what} for h in run.history]
    entries.append({"at": at, "who": who[:WHO_MAX], "what": what[:WHAT_MAX]})
    if len(entries) > HISTORY_MAX:
        entries = entries[:1] + entries[-(HISTORY_MAX - 1) :]
    return entries


def run_from_item(item: dict[str, Any]) -> Run:
    """A `Run` from a registry item as DynamoDB returns it (typed attribute values)."""
    a = {k: _plain(v) for k, v in item.items()}
    ended = a.get("ended", {})
    jobs = tuple(
        JobRecord(
            name,
            index,
            ended.get(name, {}).get("job_status", "InProgress"),
            ended.get(name, {}).get("secondary_status", ""),
            ended.get(name, {}).get("rule", ""),
        )
        for index, name in ((index_of_job(n) or 0, n) for n in a.get("jobs", []))
    )
    return Run(
        run=a["run"],
        run_id=a["run_id"],
        recipe=a["recipe"],
        team=a["team"],
        state=a["run_state"],
        current_job=a["current_job"],
        job_index=int(a["job_index"]),
        jobs=jobs,
        checkpoint_uri=a["checkpoint_uri"],
        steps=int(a["steps"]),
        tokens_per_step=int(a["tokens_per_step"]),
        usd_per_hour=float(a["usd_per_hour"]),
        overrides=json.loads(a.get("overrides") or "{}"),
        keep_alive=int(a.get("keep_alive", 0)),
        stop_requested=bool(a.get("stop_requested", False)),
        why=a.get("why", ""),
        next_step=a.get("next_step", ""),
        recipe_hash=a.get("recipe_hash", ""),
        max_jobs=int(a.get("max_jobs", 1)),
        creator=a.get("creator", ""),
        created=_time(a["created"]),
        updated=_time(a["updated"]),
        crashes=int(a.get("crashes", 0)),
        counted=int(a.get("counted", 1)),
        request=json.loads(a.get("request") or "{}"),
        history=tuple(
            Change(h.get("at", ""), h.get("who", ""), h.get("what", "")) for h in _history(a.get("history"))
        ),
        stalled=a.get("stalled", ""),
        capacity_minutes=int(a.get("capacity_minutes", 0)),
        capacity_wait=int(a.get("capacity_wait", 0)),
        capacity_budget=int(a.get("capacity_budget", 0)),
        exports=tuple(a.get("exports", [])),
        mlflow_run_id=a.get("mlflow_run_id", ""),
        step=int(a.get("step", 0)),
        saved_step=int(a.get("saved_step", 0)),
        export_failures=tuple(a.get("export_failures", [])),
    )


def attribute_bytes(value: dict[str, Any]) -> int:
    """A DynamoDB attribute value's size by the documented rule (DynamoDB developer guide, "Item sizes
    and formats"): strings their UTF-8 length, numbers about one byte per two digits plus one, booleans
    and nulls one byte, lists and maps 3 bytes plus their elements (1 byte each) and each map key."""
    ((kind, raw),) = value.items()
    if kind == "S":
        return len(raw.encode())
    if kind == "N":
        return (len(raw.lstrip("-").replace(".", "")) + 1) // 2 + 1
    if kind in ("BOOL", "NULL"):
        return 1
    if kind == "L":
        return 3 + sum(1 + attribute_bytes(v) for v in raw)
    assert kind == "M", kind
    return 3 + sum(len(k.encode()) + 1 + attribute_bytes(v) for k, v in raw.items())


def item_bytes(item: dict[str, Any]) -> int:
    """A registry item's size: every attribute's name and value (at most 400 KB a DynamoDB item)."""
    return sum(len(name.encode()) + attribute_bytes(value) for name, value in item.items())


ITEM_MAX = 400 * 1024


# --- Progress and cost (pure) ---------------------------------------------------------------------


@dataclass(frozen=True)
class RunView:
    """A run with what SageMaker and CloudWatch add: live job states, progress, cost so far."""

    run: Run
    jobs: tuple[JobRecord, ...]  # statuses as SageMaker reports them where it could be asked
    step: int | None
    cost_usd: float
    unsupervised: bool  # marked running, but its newest job has ended and no decision was recorded
    notes: tuple[str, ...] = field(default_factory=tuple)
    waiting: bool = False  # its next job is registered and not created yet (a capacity wait, a creation)
    deployed_hash: str | None = None  # the recipe hash deployed now, when known

    @property
    def tokens(self) -> int | None:
        return None if self.step is None else self.step * self.run.tokens_per_step

    @property
    def deployment_changed(self) -> bool:
        """The deployed recipe is not the one the run was launched with (the run keeps its own)."""
        return bool(
            self.deployed_hash and self.run.recipe_hash and self.deployed_hash != self.run.recipe_hash
        )

    def as_dict(self) -> dict[str, Any]:
        r = self.run
        return {
            "run": r.run,
            "run_id": r.run_id,
            "recipe": r.recipe,
            "team": r.team,
            "state": r.state,
            "why": r.why,
            "next": r.next_step,
            "stop_requested": r.stop_requested,
            "crashes_in_a_row": r.crashes,
            "jobs": [
                {
                    "name": j.name,
                    "index": j.index,
                    "status": j.status,
                    "secondary_status": j.secondary_status,
                    "rule": j.rule,
                }
                for j in self.jobs
            ],
            "current_job": r.current_job,
            "jobs_counted": r.counted,
            "job_limit": r.max_jobs,
            "capacity_minutes": r.capacity_minutes,
            "capacity_budget_minutes": r.capacity_budget,
            "step": self.step,
            "steps": r.steps,
            "tokens": self.tokens,
            "tokens_target": r.steps * r.tokens_per_step,
            "cost_usd": round(self.cost_usd, 2),
            "usd_per_hour": r.usd_per_hour,
            "checkpoint_uri": r.checkpoint_uri,
            "created": r.created.isoformat(),
            "updated": r.updated.isoformat(),
            "unsupervised": self.unsupervised,
            "waiting": self.waiting,
            "recipe_hash": r.recipe_hash,
            "deployed_recipe_hash": self.deployed_hash,
            "deployment_changed": self.deployment_changed,
            "history": [{"at": h.at, "who": h.who, "what": h.what} for h in r.history],
            "notes": list(self.notes),
            "exports": list(r.exports),
            "export_failures": list(r.export_failures),
            "step_reported": r.step,
            "mlflow_run_id": r.mlflow_run_id,
        }


def view(
    run: Run, described: dict[str, Job], step: int | None, now: datetime, deployed_hash: str | None = None
) -> RunView:
    """Combine the registry's run with the jobs SageMaker described (by name) and the newest step.

    The notes never advise an action that would lose information: an end with no decision yet is the
    supervisor's (or the reconciler's) to decide, and a job waiting to be created is waiting."""
    jobs = tuple(
        JobRecord(j.name, j.index, described[j.name].status, described[j.name].secondary_status, j.rule)
        if j.name in described
        else j
        for j in run.jobs
    )
    hours = sum(described[j.name].elapsed_hours(now) for j in run.jobs if j.name in described)
    current = described.get(run.current_job)
    running = run.state == "running"
    unsupervised = running and current is not None and current.status in TERMINAL_STATES
    waiting = running and current is None
    notes: list[str] = []
    if unsupervised:
        notes.append(
            f"job {run.current_job} ended {current.status} and its decision is not recorded yet: the "
            f"supervisor decides it, or the reconciler within {RECONCILE_MINUTES} minutes if its event was "
            "lost; nothing to do"
        )
    elif waiting:
        notes.append(
            f"job {run.current_job} is registered and not created yet ({run.next_step or 'starting'}): the "
            "supervisor creates it after any capacity wait; `trainstack stop` ends the wait"
        )
    if running and run.stop_requested:
        notes.append("a stop was requested: the run stops when its current job has ended (the trainer saves)")
    viewed = RunView(run, jobs, step, hours * run.usd_per_hour, unsupervised, (), waiting, deployed_hash)
    if viewed.deployment_changed:
        notes.append(
            f"the deployed recipe ({deployed_hash}) is not the one this run was launched with "
            f"({run.recipe_hash}): the run keeps training its recorded recipe; `trainstack resume {run.run} "
            "--set key=value` changes it deliberately"
        )
    if step is not None and run.steps:
        step = min(step, run.steps)
    return RunView(run, jobs, step, viewed.cost_usd, unsupervised, tuple(notes), waiting, deployed_hash)


# --- AWS: where registries are, reading and writing runs ------------------------------------------


@dataclass(frozen=True)
class Registry:
    stack: str  # Trainstack-<team>-<recipe>-Data
    table: str


def registries(cloudformation: Any, stack_prefix: str | None = None) -> list[Registry]:
    """The run registries deployed here: every `Trainstack-...-Data` stack with a RunTableName output,
    or only `<stack_prefix>-Data`."""
    found = []
    if stack_prefix is not None:
        try:
            stacks = cloudformation.describe_stacks(StackName=f"{stack_prefix}{DATA_STACK_SUFFIX}")["Stacks"]
        except cloudformation.exceptions.ClientError as error:
            if "does not exist" in str(error):
                return []
            raise
    else:
        stacks = [
            s
            for page in cloudformation.get_paginator("describe_stacks").paginate()
            for s in page["Stacks"]
            if s["StackName"].startswith("Trainstack-") and s["StackName"].endswith(DATA_STACK_SUFFIX)
        ]
    for stack in stacks:
        outputs = {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", [])}
        if RUN_TABLE_OUTPUT in outputs and stack.get("StackStatus") != "DELETE_COMPLETE":
            found.append(Registry(stack["StackName"], outputs[RUN_TABLE_OUTPUT]))
    return sorted(found, key=lambda r: r.stack)


def deployed_recipe_hash(cloudformation: Any, registry: Registry) -> str | None:
    """The recipe hash the registry's launcher stack deploys now (None when it cannot be read)."""
    launcher = registry.stack.removesuffix(DATA_STACK_SUFFIX) + "-Launcher"
    try:
        (stack,) = cloudformation.describe_stacks(StackName=launcher)["Stacks"]
    except cloudformation.exceptions.ClientError:  # no launcher (deleted, never deployed)
        return None
    return {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", [])}.get("RecipeHash")


def scan_runs(dynamodb: Any, table: str) -> list[Run]:
    runs = []
    for page in dynamodb.get_paginator("scan").paginate(TableName=table, ConsistentRead=True):
        runs.extend(run_from_item(item) for item in page.get("Items", []))
    return runs


def read_run(dynamodb: Any, table: str, run: str) -> Run | None:
    item = dynamodb.get_item(TableName=table, Key={"run": {"S": run}}, ConsistentRead=True).get("Item")
    return run_from_item(item) if item else None


def _now() -> str:
    return datetime.now(UTC).isoformat()


def request_stop(dynamodb: Any, table: str, run: str) -> Run:
    """Ask the supervisor to end `run` when its current job ends; raises NotRunning unless it is running."""
    try:
        item = dynamodb.update_item(
            TableName=table,
            Key={"run": {"S": run}},
            UpdateExpression="SET #stop = :true, #updated = :now",
            ConditionExpression="#state = :running",
            ExpressionAttributeNames={
                "#stop": "stop_requested",
                "#updated": "updated",
                "#state": "run_state",
            },
            ExpressionAttributeValues={
                ":true": {"BOOL": True},
                ":now": {"S": _now()},
                ":running": {"S": "running"},
            },
            ReturnValues="ALL_NEW",
        )["Attributes"]
    except dynamodb.exceptions.ConditionalCheckFailedException:
        raise NotRunning(run) from None
    return run_from_item(item)


def record_stopped(dynamodb: Any, table: str, run: Run, why: str, next_step: str) -> bool:
    """Mark `run` stopped when no job end will tell the supervisor: its newest job was never created
    (and the execution creating it was stopped, or is gone). Conditional: the run is still running at
    that job, registered by the same execution, and that job's end is not recorded, so no end the
    supervisor recorded and no newer job is overwritten. False when the run changed meanwhile."""
    try:
        dynamodb.update_item(
            TableName=table,
            Key={"run": {"S": run.run}},
            UpdateExpression="SET #state = :stopped, #why = :why, #next = :next, #updated = :now",
            ConditionExpression=(
                "#state = :running AND #current = :job AND #creator = :creator "
                "AND attribute_not_exists(#ended.#job)"
            ),
            ExpressionAttributeNames={
                "#state": "run_state",
                "#why": "why",
                "#next": "next_step",
                "#updated": "updated",
                "#current": "current_job",
                "#creator": "creator",
                "#ended": "ended",
                "#job": run.current_job,
            },
            ExpressionAttributeValues={
                ":stopped": {"S": "stopped"},
                ":running": {"S": "running"},
                ":job": {"S": run.current_job},
                ":creator": {"S": run.creator},
                ":why": {"S": why},
                ":next": {"S": next_step},
                ":now": {"S": _now()},
            },
        )
    except dynamodb.exceptions.ConditionalCheckFailedException:
        return False
    return True


# --- Resuming a run whose last job failed deterministically ---------------------------------------------
# Every job of a run trains the run's recorded request (trainstack.aws.run_request): a redeploy with a
# fixed recipe or image never reaches it. So a run whose last job failed on that recipe or in that
# image's code would fail the same way on resume, as issue 40 saw (a recipe fixed and redeployed, then
# `resume`: jobs 2 and 3 failed like job 1). Such a resume is refused before any job starts, unless it
# changes something (`--set`: the safe key, or image.uri, that is the fix). A missing resource, a
# diverged loss (resume --from-step with another lr) and no EFA (the deployment's network) are fixed
# outside the recorded recipe and resume as they are.
FAILED_ON_RECIPE = (
    "run {run} cannot be resumed as it is: its last job {job} failed on the run's recorded recipe, which "
    "every job of the run trains (a redeploy does not change it), so the next job would fail the same way "
    "({why}). Launch a new run with the fixed recipe (trainstack launch RECIPE), or, if a key that may "
    "change mid-run is the fix, resume {run} --set KEY=VALUE"
)
FAILED_IN_CODE = (
    "run {run} cannot be resumed as it is: its last job {job} failed in the code of the run's recorded "
    "image, which the next job would run again ({why}). Resume with the fixed image (trainstack resume "
    "{run} --set image.uri=<fixed image>), or launch a new run"
)
FATAL_RULE = RULE_BY_ID["Fatal"].id
REFUSED_AS_IS = {
    exit_codes.RECIPE_OR_ENVIRONMENT: FAILED_ON_RECIPE,
    exit_codes.OUT_OF_MEMORY: FAILED_ON_RECIPE,  # the layout: only a new run changes it
    exit_codes.CODE: FAILED_IN_CODE,
}


def resume_refusal(record: Run, changes: bool) -> str | None:
    """Why `resume` of `record` with no change (`changes` False) would only repeat its last failure, in
    one line; None when it may go ahead."""
    last = max(record.jobs, key=lambda j: j.index, default=None)
    if changes or record.state != "failed" or last is None or last.rule != FATAL_RULE:
        return None
    template = REFUSED_AS_IS.get(exit_codes.exit_code_of(record.why))
    if template is None:
        return None
    return template.format(run=record.run, job=last.name, why=" ".join(record.why.split()))
