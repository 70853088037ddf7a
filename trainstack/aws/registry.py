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
from trainstack.recipes.naming import RunName, parse_run_name

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


@dataclass(frozen=True)
class Run:
    run: str
    run_id: str
    recipe: str
    team: str
    state: str
    current_job: str
    job_index: int
    last_job: int
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
    crashes: int = (
        0  # jobs in a row that ended by a crash (trainstack.aws.supervisor.MAX_CONSECUTIVE_CRASHES)
    )
    # Every export of the run, oldest first: {job, step (0: the newest), out_parent, reason, requested}
    # (the Export state machine appends them: stacks/export.py).
    exports: tuple[dict[str, Any], ...] = ()
    mlflow_run_id: str = ""  # the MLflow run launch created (trainstack.aws.tracking), "" when none

    @property
    def name(self) -> RunName | None:
        return parse_run_name(self.run)


def _time(text: str) -> datetime:
    value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return value if value.tzinfo else value.replace(tzinfo=UTC)


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
        )
        for index, name in ((int(n.rsplit("-", 1)[1]), n) for n in a.get("jobs", []))
    )
    return Run(
        run=a["run"],
        run_id=a["run_id"],
        recipe=a["recipe"],
        team=a["team"],
        state=a["run_state"],
        current_job=a["current_job"],
        job_index=int(a["job_index"]),
        last_job=int(a["last_job"]),
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
        exports=tuple(a.get("exports", [])),
        mlflow_run_id=a.get("mlflow_run_id", ""),
    )


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

    @property
    def tokens(self) -> int | None:
        return None if self.step is None else self.step * self.run.tokens_per_step

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
                {"name": j.name, "index": j.index, "status": j.status, "secondary_status": j.secondary_status}
                for j in self.jobs
            ],
            "current_job": r.current_job,
            "job_limit": r.last_job,
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
            "exports": list(r.exports),
            "mlflow_run_id": r.mlflow_run_id,
        }


def view(run: Run, described: dict[str, Job], step: int | None, now: datetime) -> RunView:
    """Combine the registry's run with the jobs SageMaker described (by name) and the newest step."""
    jobs = tuple(
        JobRecord(j.name, j.index, described[j.name].status, described[j.name].secondary_status)
        if j.name in described
        else j
        for j in run.jobs
    )
    hours = sum(described[j.name].elapsed_hours(now) for j in run.jobs if j.name in described)
    current = described.get(run.current_job)
    unsupervised = run.state == "running" and current is not None and current.status in TERMINAL_STATES
    notes = ()
    if unsupervised:
        notes = (
            f"job {run.current_job} ended {current.status} but the supervisor recorded no decision "
            f"(still deciding, or its event was lost): `trainstack stop {run.run}` then `trainstack "
            f"resume {run.run}`",
        )
    if step is not None and run.steps:
        step = min(step, run.steps)
    return RunView(run, jobs, step, hours * run.usd_per_hour, unsupervised, notes)


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
    """Mark `run` stopped when no job end will tell the supervisor (its newest job never started or has
    already ended). False when the run changed meanwhile (another job, or no longer running)."""
    try:
        dynamodb.update_item(
            TableName=table,
            Key={"run": {"S": run.run}},
            UpdateExpression="SET #state = :stopped, #why = :why, #next = :next, #updated = :now",
            ConditionExpression="#state = :running AND #current = :job",
            ExpressionAttributeNames={
                "#state": "run_state",
                "#why": "why",
                "#next": "next_step",
                "#updated": "updated",
                "#current": "current_job",
            },
            ExpressionAttributeValues={
                ":stopped": {"S": "stopped"},
                ":running": {"S": "running"},
                ":job": {"S": run.current_job},
                ":why": {"S": why},
                ":next": {"S": next_step},
                ":now": {"S": _now()},
            },
        )
    except dynamodb.exceptions.ConditionalCheckFailedException:
        return False
    return True
