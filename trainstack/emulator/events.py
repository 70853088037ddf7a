"""EMULATOR: training jobs that run until something ends them, and the events SageMaker sends when they do.

moto creates every training job already `Completed`, keeps no `Environment`, has no StopTrainingJob,
and publishes no `SageMaker Training Job State Change` events to EventBridge. The run supervisor
depends on all four, so in emulator mode only (`trainstack.emulator.server.serve` calls `install`):

- `configure(env, jobs_run=True)` makes new jobs stay `InProgress` / `Training`, as on AWS, until
  `end_training_job` (a max-runtime stop, a spot interruption, a failure with its reason, completion)
  or StopTrainingJob ends them. Off by default: other tests rely on moto's instant completion;
- CreateTrainingJob keeps the request's `Environment` (DescribeTrainingJob returns it on AWS);
- StopTrainingJob ends an in-progress job `Stopped` / `Stopped` at once (AWS passes through
  `Stopping`, sends SIGTERM and kills the container 120 s later);
- `deliver_job_state_change(env, job)` does what EventBridge does on AWS when a job changes state:
  it builds the event from DescribeTrainingJob and starts every Step Functions target of every enabled
  rule whose pattern matches (moto's own EventPattern matcher), with the input the target asks for.

Nothing here runs against real AWS: the client functions refuse an endpoint that is not local.
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

from trainstack.emulator.endpoint import clients, local_endpoint
from trainstack.errors import TrainstackError

ROUTE = "/_trainstack/"
JOB_STATE_CHANGE = "SageMaker Training Job State Change"
TERMINAL = ("Completed", "Failed", "Stopped")
_settings = {"jobs_run": False}


# --- Server side: patches applied inside the moto server process ---------------------------------


def _backend(account: str, region: str) -> Any:
    from moto.sagemaker.models import sagemaker_backends

    return sagemaker_backends[account][region]


def _transition(job: Any, status: str, secondary: str, message: str) -> None:
    now = datetime.now(UTC)
    for previous in job.secondary_status_transitions:
        previous.setdefault("EndTime", now)
    job.secondary_status_transitions.append({"Status": secondary, "StartTime": now, "StatusMessage": message})
    job.training_job_status, job.secondary_status = status, secondary
    job.last_modified_time = now
    if status in TERMINAL:
        job.training_end_time = now


def end_job(backend: Any, name: str, status: str, secondary: str, reason: str | None) -> dict[str, Any]:
    """End job `name` in `backend` the way SageMaker does (server side)."""
    if status not in TERMINAL:
        raise ValueError(f"status must be one of {TERMINAL}, got {status!r}")
    job = backend.training_jobs.get(name)
    if job is None:
        raise KeyError(name)
    _transition(job, status, secondary, reason or f"Training job {status.lower()}")
    if reason:
        job.failure_reason = reason
    return {"TrainingJobName": name, "TrainingJobStatus": status, "SecondaryStatus": secondary}


def install() -> None:
    """Patch moto's SageMaker responses and wrap the server's WSGI app (called by serve())."""
    from moto import server
    from moto.sagemaker.exceptions import ValidationError
    from moto.sagemaker.responses import SageMakerResponse

    create = SageMakerResponse.create_training_job

    def create_training_job(self: Any) -> Any:
        result = create(self)
        job = self.sagemaker_backend.training_jobs[self._get_param("TrainingJobName")]
        job.environment = self._get_param("Environment") or {}
        if _settings["jobs_run"]:
            now = datetime.now(UTC)
            job.training_job_status, job.secondary_status = "InProgress", "Training"
            job.training_end_time = None
            job.training_start_time = now
            job.secondary_status_transitions = [
                {"Status": "Starting", "StartTime": now, "EndTime": now, "StatusMessage": "Starting"},
                {
                    "Status": "Training",
                    "StartTime": now,
                    "StatusMessage": "Training image download completed",
                },
            ]
        return result

    def stop_training_job(self: Any) -> Any:
        from moto.core.responses import EmptyResult

        name = self._get_param("TrainingJobName")
        job = self.sagemaker_backend.training_jobs.get(name)
        if job is None:
            raise ValidationError(message=f"Requested resource not found: training job {name}")
        if job.training_job_status in TERMINAL:
            raise ValidationError(
                message="The request was rejected because the training job is in status "
                f"{job.training_job_status}."
            )
        _transition(job, "Stopped", "Stopped", "The job was stopped")
        return EmptyResult()

    SageMakerResponse.create_training_job = create_training_job
    SageMakerResponse.stop_training_job = stop_training_job

    run_simple = server.run_simple
    server.run_simple = lambda host, port, app, *a, **k: run_simple(host, port, _routes(app), *a, **k)


def _routes(app: Any) -> Any:
    """The emulator's own control endpoints under ROUTE; everything else goes to moto."""

    def wrapped(environ: dict, start_response: Any) -> Any:
        path = environ.get("PATH_INFO", "")
        if not path.startswith(ROUTE):
            return app(environ, start_response)
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
            body = json.loads(environ["wsgi.input"].read(length) or b"{}")
            from trainstack.emulator.endpoint import ACCOUNT, REGION

            if path == f"{ROUTE}config":
                _settings["jobs_run"] = bool(body.get("jobs_run", _settings["jobs_run"]))
                answer: dict[str, Any] = dict(_settings)
            elif path == f"{ROUTE}end-training-job":
                backend = _backend(body.get("account", ACCOUNT), body.get("region", REGION))
                answer = end_job(
                    backend,
                    body["name"],
                    body["status"],
                    body["secondary_status"],
                    body.get("failure_reason"),
                )
            else:
                raise KeyError(path)
            status, payload = "200 OK", answer
        except KeyError as missing:
            status, payload = "404 Not Found", {"error": f"not found: {missing}"}
        except (ValueError, TypeError) as bad:
            status, payload = "400 Bad Request", {"error": str(bad)}
        data = json.dumps(payload).encode()
        start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
        return [data]

    return wrapped


# --- Client side: what tests, the demo and `trainstack ... --local` call --------------------------


def _post(env: dict[str, str], what: str, body: dict[str, Any]) -> dict[str, Any]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        f"{local_endpoint(env)}{ROUTE}{what}",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        raise TrainstackError(
            f"the emulator refused {what}: {error.read().decode(errors='replace')}"
        ) from None


def configure(env: dict[str, str], *, jobs_run: bool) -> None:
    """With `jobs_run`, new training jobs stay InProgress / Training until ended (as on AWS)."""
    _post(env, "config", {"jobs_run": jobs_run})


def end_training_job(
    env: dict[str, str], name: str, status: str, secondary_status: str, failure_reason: str | None = None
) -> None:
    """End a job as SageMaker would: e.g. Stopped/MaxRuntimeExceeded, Stopped/Interrupted (spot),
    Failed/Failed with its FailureReason, Completed/Completed."""
    _post(
        env,
        "end-training-job",
        {
            "name": name,
            "status": status,
            "secondary_status": secondary_status,
            "failure_reason": failure_reason,
        },
    )


def _plain(value: Any) -> Any:
    """DescribeTrainingJob as an event carries it: datetimes as epoch milliseconds (strings)."""
    if isinstance(value, datetime):
        return str(int(value.timestamp() * 1000))
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if k != "ResponseMetadata"}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def job_state_change_event(description: dict[str, Any], region: str, account: str) -> dict[str, Any]:
    """The EventBridge event SageMaker sends for a job's current state (AWS's documented shape)."""
    detail = _plain(description)
    return {
        "version": "0",
        "id": str(uuid.uuid4()),
        "detail-type": JOB_STATE_CHANGE,
        "source": "aws.sagemaker",
        "account": account,
        "time": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "region": region,
        "resources": [detail["TrainingJobArn"]],
        "detail": detail,
    }


def _target_input(target: dict[str, Any], event: dict[str, Any]) -> str:
    if "Input" in target:
        return target["Input"]
    if "InputPath" in target:
        value: Any = event
        for part in target["InputPath"].removeprefix("$").strip(".").split("."):
            value = value[part] if part else value
        return json.dumps(value)
    if "InputTransformer" in target:
        raise TrainstackError("EMULATOR: input transformers are not delivered (no rule here uses one)")
    return json.dumps(event)


def deliver_job_state_change(env: dict[str, str], job_name: str) -> list[str]:
    """Play EventBridge for job `job_name`'s current state: start the Step Functions targets of every
    enabled rule whose pattern matches. Returns the execution ARNs started."""
    from moto.events.models import EventPattern

    from trainstack.emulator.endpoint import ACCOUNT

    sagemaker, events, sfn = clients(env, "sagemaker", "events", "stepfunctions")
    event = job_state_change_event(
        sagemaker.describe_training_job(TrainingJobName=job_name), env["AWS_REGION"], ACCOUNT
    )
    started = []
    for rule in events.list_rules()["Rules"]:
        if rule.get("State") != "ENABLED" or not rule.get("EventPattern"):
            continue
        if not EventPattern.load(rule["EventPattern"]).matches_event(event):
            continue
        for target in events.list_targets_by_rule(Rule=rule["Name"])["Targets"]:
            if ":states:" in target["Arn"]:
                # EventBridge gives each execution a unique name; moto would name every one "None".
                run = sfn.start_execution(
                    stateMachineArn=target["Arn"], name=uuid.uuid4().hex, input=_target_input(target, event)
                )
                started.append(run["executionArn"])
    return started
