"""EMULATOR: EventBridge rules and EventBridge Scheduler schedules without a hand, in the server process.

moto stores rules and targets but sends no service event, and never runs a schedule (its CloudFormation
does not even create AWS::Scheduler::Schedule). The run supervisor depends on both: JobEnded starts on a
`SageMaker Training Job State Change` event, the reconciler on a rate(10 minutes) schedule. In emulator
mode `install()` (called by trainstack.emulator.server.serve) adds:

- **Job events.** Every status change of a training or processing job passes through
  trainstack.emulator.events.change_job_status, the one place; a listener there turns it into the event
  SageMaker sends (EventBridge reference, "Amazon SageMaker AI events": source `aws.sagemaker`,
  detail-type `SageMaker Training Job State Change` / `SageMaker Processing Job State Change`, the job's
  Describe* answer at that moment as detail, times as epoch milliseconds) and queues it. One delivery
  thread delivers the queue in order to the targets of every enabled rule whose pattern matches (moto's
  own matcher), as EventBridge does: Step Functions StartExecution (a unique execution name), SNS Publish,
  SQS SendMessage, with the target's Input, InputPath or InputTransformer (`target_input`). SageMaker
  "may send multiple events for each state change" and EventBridge delivers at least once: the
  supervisor's decisions are idempotent, so a test may still deliver an event again by hand.
- **Schedules.** AWS::Scheduler::Schedule in a template creates the schedule in moto's Scheduler backend
  (`ScheduleResource`), where the API finds it too. A scheduler thread runs every ENABLED schedule:
  `rate(N unit)` (unit minute(s), hour(s), day(s)) every N units divided by the speed-up factor
  (`SPEEDUP`, default 10: the reconciler's 10 minutes become 1), the first time at once when it has no
  StartDate ("your schedule begins invoking the target immediately", Scheduler user guide, "Schedule
  types") and never after its EndDate; `at(yyyy-mm-ddThh:mm:ss)` once, at that time (UTC; not sped up);
  `cron(...)` is not run (said once in the log). Its target gets the schedule's Input as is (Step
  Functions StartExecution, SNS Publish, SQS SendMessage).
- **Hand control**, for a test that asks for it: `configure(env, events="manual")` (and the old
  `jobs_run=True` spelling, whose tests end jobs and deliver their events themselves) delivers nothing
  and runs no schedule until `events="auto"` again; events.deliver_job_state_change still delivers one
  job's event by hand. The speed-up: `configure(env, schedule_speedup=F)` (1 = AWS's own pace).

Nothing here reaches AWS: every client is the emulator's own endpoint (trainstack.emulator.endpoint).
"""

from __future__ import annotations

import functools
import json
import math
import queue
import re
import sys
import threading
import time
import uuid
from datetime import UTC, datetime
from typing import Any

from trainstack.emulator.endpoint import clients, env_for

TRAINING_STATE_CHANGE = "SageMaker Training Job State Change"
PROCESSING_STATE_CHANGE = "SageMaker Processing Job State Change"
EVENT_MODES = ("auto", "manual")
SPEEDUP = 10.0  # emulated schedule time runs this many times faster than AWS's (rate expressions only)
TICK_S = 1.0  # how often the scheduler thread looks at its schedules
RATE = re.compile(r"^rate\((\d+) (minute|minutes|hour|hours|day|days)\)$")
AT = re.compile(r"^at\((\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)\)$")
UNIT_SECONDS = {"minute": 60, "hour": 3600, "day": 86400}
INPUT_TRANSFORMER_VARIABLES_MAX = 100  # InputPathsMap: at most 100 variables (EventBridge API reference)

_settings: dict[str, Any] = {"events": "auto", "speedup": SPEEDUP, "endpoint": ""}
_events: queue.Queue = queue.Queue()
_said: set[str] = set()  # log lines said once (a cron schedule, an unsupported target)


def _say(line: str, once: str | None = None) -> None:
    if once is not None:
        if once in _said:
            return
        _said.add(once)
    print(f"emulator: {line}", file=sys.stderr, flush=True)


# --- The events SageMaker sends ---------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """A Describe* value as an event carries it: datetimes as epoch milliseconds (strings)."""
    if isinstance(value, datetime):
        return str(int(value.timestamp() * 1000))
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if k != "ResponseMetadata"}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


@functools.cache
def _output_members(operation: str) -> frozenset[str]:
    """The members of botocore's output shape for SageMaker's `operation` (its model, read once)."""
    import botocore.session

    shape = botocore.session.get_session().get_service_model("sagemaker").operation_model(operation)
    return frozenset(shape.output_shape.members)


def _described(job: Any, operation: str) -> dict[str, Any]:
    """The job's Describe* answer now, as the API would give it: moto's response object, cut to the members
    of botocore's output shape for `operation` (moto's object also holds its own bookkeeping)."""
    members = _output_members(operation)
    found = dict(job.response_object)
    if "Arn" in found:
        found.setdefault("ProcessingJobArn", found["Arn"])
    return {k: v for k, v in found.items() if k in members and v is not None}


def state_change_event(detail_type: str, description: dict[str, Any], arn: str) -> dict[str, Any]:
    """The EventBridge event SageMaker sends for a job's current state (its documented envelope)."""
    _, _, _, region, account, _ = arn.split(":", 5)
    return {
        "version": "0",
        "id": str(uuid.uuid4()),
        "detail-type": detail_type,
        "source": "aws.sagemaker",
        "account": account,
        "time": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "region": region,
        "resources": [arn],
        "detail": _plain(description),
    }


def job_changed(job: Any) -> None:
    """events.change_job_status's listener (server side): the job's event, built now, queued for delivery."""
    if _settings["events"] != "auto":
        return
    if hasattr(job, "processing_job_status"):
        description = _described(job, "DescribeProcessingJob")
        event = state_change_event(PROCESSING_STATE_CHANGE, description, description["ProcessingJobArn"])
    else:
        description = _described(job, "DescribeTrainingJob")
        event = state_change_event(TRAINING_STATE_CHANGE, description, description["TrainingJobArn"])
    _events.put(event)


# --- Targets: what EventBridge and Scheduler send them ------------------------------------------------


def _path(document: Any, path: str) -> Any:
    """A JSONPath of dot notation and array indices (`$.detail.Tags[0]`), as EventBridge supports them;
    None when absent."""
    value = document
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path.removeprefix("$")):
        if part.startswith("["):
            index = int(part[1:-1])
            value = value[index] if isinstance(value, list) and index < len(value) else None
        else:
            value = value.get(part) if isinstance(value, dict) else None
        if value is None:
            return None
    return value


def _inside_string(template: str, position: int) -> bool:
    """Whether `position` of a JSON template is inside a string literal (a quoted placeholder)."""
    inside, escaped = False, False
    for char in template[:position]:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':
            inside = not inside
    return inside


def transformed(transformer: dict[str, Any], event: dict[str, Any], rule: dict[str, Any]) -> str:
    """An InputTransformer's output (EventBridge user guide, "Amazon EventBridge input transformation"):
    each <variable> of InputTemplate replaced by its InputPathsMap value or a predefined variable. In a
    JSON template (one that starts with `{` or `[`) a placeholder outside quotes becomes the JSON value
    (a string quoted) and one inside quotes the bare text; in a plain-text template, the bare text."""
    paths = transformer.get("InputPathsMap") or {}
    if len(paths) > INPUT_TRANSFORMER_VARIABLES_MAX:
        raise ValueError(
            f"InputPathsMap has {len(paths)} variables, at most {INPUT_TRANSFORMER_VARIABLES_MAX}"
        )
    values = {name: _path(event, path) for name, path in paths.items()}
    values.update(
        {
            "aws.events.rule-arn": rule.get("Arn", ""),
            "aws.events.rule-name": rule.get("Name", ""),
            "aws.events.event.ingestion-time": event.get("time", ""),
            "aws.events.event": event,
            "aws.events.event.json": event,
        }
    )
    template = transformer["InputTemplate"]
    is_json = template.lstrip()[:1] in ("{", "[")

    def replace(match: re.Match) -> str:
        name = match.group(1)
        if name not in values:
            return match.group(0)
        value = values[name]
        if is_json and not _inside_string(template, match.start()):
            return json.dumps(value)
        text = value if isinstance(value, str) else json.dumps(value)
        return json.dumps(text)[1:-1] if is_json else text

    return re.sub(r"<([A-Za-z0-9_.\-]+)>", replace, template)


def target_input(target: dict[str, Any], event: dict[str, Any], rule: dict[str, Any]) -> str:
    """What a rule's target receives for `event`: its constant Input, the part InputPath selects, the
    InputTransformer's output, or (none of them) the whole event."""
    if "Input" in target:
        return target["Input"]
    if "InputPath" in target:
        return json.dumps(_path(event, target["InputPath"]))
    if "InputTransformer" in target:
        return transformed(target["InputTransformer"], event, rule)
    return json.dumps(event)


def _send(env: dict[str, str], arn: str, payload: str, what: str) -> str | None:
    """Invoke target `arn` with `payload`; the execution ARN for a Step Functions target."""
    if ":states:" in arn:
        (sfn,) = clients(env, "stepfunctions")
        # EventBridge and Scheduler give each execution a unique name; moto would name every one "None".
        return sfn.start_execution(stateMachineArn=arn, name=uuid.uuid4().hex, input=payload)["executionArn"]
    if ":sns:" in arn:
        (sns,) = clients(env, "sns")
        sns.publish(TopicArn=arn, Message=payload)
    elif ":sqs:" in arn:
        (sqs,) = clients(env, "sqs")
        url = sqs.get_queue_url(QueueName=arn.rsplit(":", 1)[1])["QueueUrl"]
        sqs.send_message(QueueUrl=url, MessageBody=payload)
    else:
        _say(f"{what}: target {arn} is not invoked in the emulator (Step Functions, SNS, SQS are)", once=arn)
    return None


def deliver(env: dict[str, str], event: dict[str, Any]) -> list[str]:
    """Do what EventBridge does with `event` on the default bus: invoke the targets of every enabled rule
    whose pattern matches (moto's matcher). Returns the Step Functions executions started."""
    from moto.events.models import EventPattern

    (events,) = clients(env, "events")
    started = []
    rules = [r for page in events.get_paginator("list_rules").paginate() for r in page["Rules"]]
    for rule in rules:
        if rule.get("State") != "ENABLED" or not rule.get("EventPattern"):
            continue
        if not EventPattern.load(rule["EventPattern"]).matches_event(event):
            continue
        pages = events.get_paginator("list_targets_by_rule").paginate(Rule=rule["Name"])
        for target in (t for page in pages for t in page["Targets"]):
            execution = _send(env, target["Arn"], target_input(target, event, rule), f"rule {rule['Name']}")
            if execution is not None:
                started.append(execution)
    return started


def _deliver_forever() -> None:
    while True:
        event = _events.get()
        try:
            deliver(env_for(_settings["endpoint"]), event)
        except Exception as error:  # one failed delivery never stops the next (EventBridge retries; so do we)
            _say(f"delivering {event['detail-type']} of {event['resources'][0]} failed: {error!r}")


# --- EventBridge Scheduler ------------------------------------------------------------------------------


def rate_seconds(expression: str) -> float | None:
    """The period of `rate(N unit)` in seconds at AWS's pace; None for any other expression."""
    match = RATE.match(expression.strip())
    if match is None:
        return None
    value, unit = int(match.group(1)), match.group(2).rstrip("s")
    if value < 1:
        return None
    return float(value * UNIT_SECONDS[unit])


def _epoch(value: Any) -> float | None:
    if value is None or value == "":
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, datetime):
        return value.timestamp()
    return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()


def next_due(schedule: dict[str, Any], last: float | None, now: float, speedup: float) -> float | None:
    """When `schedule` (GetSchedule's fields) should next invoke its target, given its last invocation
    (None: never): a pure function of the expression, StartDate, EndDate, state and the speed-up. None: not
    (again)."""
    if schedule.get("State", "ENABLED") != "ENABLED":
        return None
    expression = schedule["ScheduleExpression"].strip()
    end = _epoch(schedule.get("EndDate"))
    period = rate_seconds(expression)
    if period is not None:
        start = _epoch(schedule.get("StartDate")) or _epoch(schedule.get("CreationDate")) or now
        nxt = start if last is None else last + period / speedup
        return None if end is not None and nxt > end else nxt
    at = AT.match(expression)
    if at is not None:
        if last is not None:
            return None
        return datetime.fromisoformat(at.group(1)).replace(tzinfo=UTC).timestamp()
    return None


def _schedules() -> list[dict[str, Any]]:
    from moto.scheduler.models import scheduler_backends

    found = []
    for regions in list(scheduler_backends.values()):
        for backend in list(regions.values()):
            for group in list(backend.schedule_groups.values()):
                for schedule in list(group.schedules.values()):
                    found.append(schedule.to_dict())
    return found


def run_due_schedules(
    env: dict[str, str], last_runs: dict[str, float], now: float, speedup: float
) -> list[str]:
    """Invoke every schedule that is due at `now`; `last_runs` (schedule ARN -> when its last invocation was
    due) is updated. Returns
    the Step Functions executions started."""
    started = []
    for schedule in _schedules():
        arn = schedule["Arn"]
        if not (rate_seconds(schedule["ScheduleExpression"]) or AT.match(schedule["ScheduleExpression"])):
            _say(f"schedule {arn}: {schedule['ScheduleExpression']} is not run in the emulator", once=arn)
            continue
        due = next_due(schedule, last_runs.get(arn), now, speedup)
        if due is None or due > now:
            continue
        # A fixed cadence from the start, as Scheduler keeps: the next is due a period after this one was
        # due, however late the scheduler got to it (but never a burst to catch up with a long pause).
        last_runs[arn] = due if now - due < TICK_S * 5 else now
        target = schedule["Target"]
        try:
            execution = _send(env, target["Arn"], target.get("Input") or "{}", f"schedule {schedule['Name']}")
        except Exception as error:  # Scheduler retries by its RetryPolicy; the next period does here
            _say(f"schedule {arn} could not invoke {target['Arn']}: {error!r}")
            continue
        if execution is not None:
            started.append(execution)
    return started


def _schedule_forever() -> None:
    last_runs: dict[str, float] = {}
    while True:
        time.sleep(TICK_S)
        if _settings["events"] != "auto":
            continue
        try:
            run_due_schedules(env_for(_settings["endpoint"]), last_runs, time.time(), _settings["speedup"])
        except Exception as error:
            _say(f"running schedules failed: {error!r}")


def _schedule_resource() -> type:
    """AWS::Scheduler::Schedule for moto's CloudFormation: created in, updated in and deleted from moto's
    Scheduler backend, named as CloudFormation names it when the template gives no Name."""
    from moto.core.common_models import CloudFormationModel
    from moto.scheduler.models import scheduler_backends

    def create(name: str, properties: dict[str, Any], account: str, region: str) -> Any:
        backend = scheduler_backends[account][region]
        return backend.create_schedule(
            description=properties.get("Description"),
            end_date=properties.get("EndDate"),
            flexible_time_window=properties.get("FlexibleTimeWindow") or {"Mode": "OFF"},
            group_name=properties.get("GroupName") or "default",
            kms_key_arn=properties.get("KmsKeyArn"),
            name=name,
            schedule_expression=properties["ScheduleExpression"],
            schedule_expression_timezone=properties.get("ScheduleExpressionTimezone"),
            start_date=properties.get("StartDate"),
            state=properties.get("State") or "ENABLED",
            target=dict(properties["Target"]),
            action_after_completion=None,
        )

    class ScheduleResource(CloudFormationModel):
        __module__ = "moto.cloudformation.trainstack_schedule"  # moto's model registry keys by module

        def __init__(self, schedule: Any, account: str, region: str) -> None:
            self.schedule, self.account, self.region = schedule, account, region

        @property
        def physical_resource_id(self) -> str:
            return self.schedule.name

        @staticmethod
        def cloudformation_name_type() -> str:
            return "Name"

        @staticmethod
        def cloudformation_type() -> str:
            return "AWS::Scheduler::Schedule"

        @classmethod
        def has_cfn_attr(cls, attr: str) -> bool:
            return attr == "Arn"

        def get_cfn_attribute(self, attribute_name: str) -> str:
            return self.schedule.arn

        @classmethod
        def create_from_cloudformation_json(
            cls, resource_name, cloudformation_json, account_id, region_name, **kwargs
        ):
            properties = cloudformation_json.get("Properties", {})
            # A generated name is at most 64 characters (CreateSchedule's Name), as CloudFormation's is.
            name = properties.get("Name") or resource_name[:64]
            return cls(create(name, properties, account_id, region_name), account_id, region_name)

        @classmethod
        def update_from_cloudformation_json(
            cls, original_resource, new_resource_name, cloudformation_json, account_id, region_name
        ):
            cls.delete_from_cloudformation_json(
                original_resource.schedule.name, cloudformation_json, account_id, region_name
            )
            return cls.create_from_cloudformation_json(
                original_resource.schedule.name, cloudformation_json, account_id, region_name
            )

        @classmethod
        def delete_from_cloudformation_json(cls, resource_name, cloudformation_json, account_id, region_name):
            backend = scheduler_backends[account_id][region_name]
            group = (cloudformation_json.get("Properties") or {}).get("GroupName") or "default"
            try:
                backend.delete_schedule(group, resource_name)
            except Exception:  # already gone
                pass

    return ScheduleResource


# --- Configuration and installation --------------------------------------------------------------------


def apply_config(body: dict[str, Any]) -> dict[str, Any]:
    """Server side of `events.configure(events=..., schedule_speedup=...)`: the settings now in force."""
    mode = body.get("events")
    if mode is None and body.get("jobs_run") is not None:
        mode = "manual"  # the old spelling's tests end jobs and deliver their events by hand
    if mode is not None:
        if mode not in EVENT_MODES:
            raise ValueError(f"events must be one of {EVENT_MODES}, got {mode!r}")
        _settings["events"] = mode
    if "schedule_speedup" in body:
        speedup = float(body["schedule_speedup"])
        if not math.isfinite(speedup) or not 1 <= speedup <= 3600:
            raise ValueError(f"schedule_speedup must be 1..3600, got {speedup}")
        _settings["speedup"] = speedup
    return {"events": _settings["events"], "schedule_speedup": _settings["speedup"]}


def install(endpoint: str, on_status_change: Any) -> None:
    """In the server process (serve()): the job-event listener, registered with `on_status_change`
    (events.on_status_change: handed in, as events imports this module), AWS::Scheduler::Schedule in
    CloudFormation, and the delivery and scheduler threads, which talk to the server at `endpoint`."""
    from moto.cloudformation import parsing

    _settings["endpoint"] = endpoint
    on_status_change(job_changed)
    schedule_resource = _schedule_resource()
    resource_class_from_type = parsing.resource_class_from_type

    def with_schedules(resource_type: str):
        if resource_type == "AWS::Scheduler::Schedule":
            return schedule_resource
        return resource_class_from_type(resource_type)

    parsing.resource_class_from_type = with_schedules
    for loop, name in ((_deliver_forever, "eventbridge"), (_schedule_forever, "scheduler")):
        threading.Thread(target=loop, name=f"emulator-{name}", daemon=True).start()
