"""EMULATOR: training jobs that really run, the test-only modes that end them by hand, and their events.

moto creates every training job already `Completed`, keeps no `Environment` (nor the request's
MetricDefinitions), has no StopTrainingJob, and publishes no `SageMaker Training Job State Change` events
to EventBridge. The run supervisor depends on all of them, so in emulator mode only
(`trainstack.emulator.server.serve` calls `install`):

- jobs run for real by default (`jobs="train"`): CreateTrainingJob and CreateProcessingJob start the job's
  container as local processes (trainstack.emulator.jobs: the container contract, statuses, logs,
  metrics, stops, max runtime), so jobs a deployed state machine creates train with nobody's help;
- test-only modes, set only where a test asks for them (`configure(env, jobs=...)`, or
  `Emulator(jobs=...)`): "hold" keeps new jobs `InProgress` / `Training`, running nothing, until
  `end_training_job` (a max-runtime stop, a spot interruption, a failure with its reason, completion)
  or StopTrainingJob ends them (`jobs_run=True` is the old spelling); "complete" is moto's own: every
  job `Completed` at once, nothing run;
- every status change of a job goes through `change_job_status`, the one place (listeners:
  `on_status_change`);
- CreateTrainingJob keeps the request's `Environment` (DescribeTrainingJob returns it on AWS) and its
  MetricDefinitions;
- StopTrainingJob moves an in-progress job to `Stopping`; a running job's container then gets SIGTERM and
  the job is `Stopped` once it has exited (SIGKILL 120 s later); a held job is `Stopped` / `Stopped`
  `stopping_seconds` later (default 1 s), as AWS does ("SageMaker changes the status of the job to
  Stopping. After SageMaker stops the job, it sets the status to Stopped": StopTrainingJob, API reference);
- warm pools (SageMaker developer guide, "Managed warm pools"): a job created with
  `ResourceConfig.KeepAlivePeriodInSeconds` > 0 (and no managed spot) keeps its cluster `Available`
  once it ends; the next job with the same role, instance type, count and network is placed on it
  (the pool becomes `Reused`, `ReusedByJob` names the job); UpdateTrainingJob with
  KeepAlivePeriodInSeconds 0 ends it (`Terminated`). moto has neither warm pools nor UpdateTrainingJob;
- Step Functions JSONata expressions (moto evaluates them in a JVM it does not ship) are evaluated by
  `jsonata-python`, a port of the JSONata reference implementation, and states that call Step
  Functions itself (startExecution, describeExecution) get the member names AWS uses;
- `deliver_job_state_change(env, job)` does what EventBridge does on AWS when a job changes state:
  it builds the event from DescribeTrainingJob and starts every Step Functions target of every enabled
  rule whose pattern matches (moto's own EventPattern matcher), with the input the target asks for;
  `deliver_alarm_state_change(env, alarm, job)` does the same for a CloudWatch alarm going to ALARM
  (moto evaluates no alarm), with the event shape CloudWatch documents.

Nothing here runs against real AWS: the client functions refuse an endpoint that is not local.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from trainstack.emulator.endpoint import TRAINSTACK_ROUTE, clients, local_endpoint
from trainstack.errors import TrainstackError

ROUTE = TRAINSTACK_ROUTE
JOB_STATE_CHANGE = "SageMaker Training Job State Change"
TERMINAL = ("Completed", "Failed", "Stopped")
JOB_MODES = ("train", "hold", "complete")  # run for real | InProgress until ended | Completed at once
_settings: dict[str, Any] = {"jobs": "train", "stopping_seconds": 1.0}
# Called with the job (moto's FakeTrainingJob or FakeProcessingJob) after every status change.
STATUS_LISTENERS: list[Callable[[Any], None]] = []
WARM_POOL_MATCH = ("RoleArn", "InstanceType", "InstanceCount", "VpcConfig")


# --- Server side: patches applied inside the moto server process ---------------------------------


def _backend(account: str, region: str) -> Any:
    from moto.sagemaker.models import sagemaker_backends

    return sagemaker_backends[account][region]


def on_status_change(listener: Callable[[Any], None]) -> None:
    """Call `listener(job)` after every status change of every job (in the server process)."""
    STATUS_LISTENERS.append(listener)


def change_job_status(job: Any, status: str, secondary: str | None, message: str) -> None:
    """THE one place where a job's status changes in the emulator (server side): every transition of a
    training job (the runner's Starting -> Downloading -> Training -> Uploading -> Completed / Failed /
    Stopped, StopTrainingJob's Stopping, a test's end_training_job) and of a processing job passes here,
    and then every `on_status_change` listener is called with the job (event delivery hooks in here).

    Training job: TrainingJobStatus `status`, SecondaryStatus `secondary` appended to
    SecondaryStatusTransitions with `message` (the previous transition gets its EndTime); at a terminal
    status TrainingEndTime is set and a warm pool in use becomes Available. Processing job:
    ProcessingJobStatus `status` (`secondary` unused), ExitMessage `message` at the end (none when empty).
    """
    now = datetime.now(UTC)
    if hasattr(job, "processing_job_status"):
        job.processing_job_status = status
        job.last_modified_time = now
        if status in TERMINAL:
            job.processing_end_time = now
            job.exit_message = message or None  # the containers' /opt/ml/output/message, if any
    else:
        for previous in job.secondary_status_transitions:
            previous.setdefault("EndTime", now)
        job.secondary_status_transitions.append(
            {"Status": secondary, "StartTime": now, "StatusMessage": message}
        )
        job.training_job_status, job.secondary_status = status, secondary
        job.last_modified_time = now
        if status in TERMINAL:
            job.training_end_time = now
            pool = getattr(job, "warm_pool_status", None)
            if pool is not None and pool.get("Status") == "InUse":
                pool["Status"] = "Available"
    for listener in list(STATUS_LISTENERS):
        try:
            listener(job)
        except Exception:  # a listener's fault never stops a job's life
            import traceback

            traceback.print_exc()


_transition = change_job_status  # the old name


STEP_METRIC = "train:step"  # trainstack.aws.supervisor.STEP_METRIC (the emulator imports no aws code)
SAVED_METRIC = "train:saved_step"  # trainstack.aws.supervisor.SAVED_METRIC
TRAINED = "trained"  # end_job's final_step: the job's own training.steps when it ended Completed


def end_job(
    backend: Any,
    name: str,
    status: str,
    secondary: str,
    reason: str | None,
    final_step: Any = TRAINED,
    saved_step: Any = TRAINED,
) -> dict[str, Any]:
    """End job `name` in `backend` the way SageMaker does (server side). `final_step`: the last
    `train:step` the trainer logged, in FinalMetricDataList as SageMaker parses it (None: none logged;
    TRAINED: a Completed job logged its hyperparameter `training.steps`, the trainer's last step);
    `saved_step`: likewise the last `train:saved_step`, its newest completed checkpoint (TRAINED: a
    Completed job saved its last step)."""
    if status not in TERMINAL:
        raise ValueError(f"status must be one of {TERMINAL}, got {status!r}")
    job = backend.training_jobs.get(name)
    if job is None:
        raise KeyError(name)
    from trainstack.emulator import jobs

    runner = jobs.running_job(name)
    if runner is not None:
        runner.kill()  # its processes go; the status is the one asked for here
    if reason:
        job.failure_reason = reason
    steps = (job.hyper_parameters or {}).get("training.steps")
    trained = int(steps) if status == "Completed" and steps and steps.isdigit() else None
    final_step = trained if final_step == TRAINED else final_step
    saved_step = trained if saved_step == TRAINED else saved_step
    reported = {STEP_METRIC: final_step, SAVED_METRIC: saved_step}
    metrics = [m for m in (job.final_metric_data_list or []) if m.get("MetricName") not in reported]
    for metric, value in reported.items():
        if value is not None:
            metrics.append({"MetricName": metric, "Value": float(value), "Timestamp": datetime.now(UTC)})
    job.final_metric_data_list = metrics
    change_job_status(job, status, secondary, reason or f"Training job {status.lower()}")
    return {"TrainingJobName": name, "TrainingJobStatus": status, "SecondaryStatus": secondary}


def _keep_alive(job: Any) -> int:
    return int((job.resource_config or {}).get("KeepAlivePeriodInSeconds") or 0)


def _pool_key(job: Any) -> tuple:
    resources = job.resource_config or {}
    return (
        job.role_arn,
        resources.get("InstanceType"),
        resources.get("InstanceCount"),
        json.dumps(getattr(job, "vpc_config", None), sort_keys=True),
    )


def _place_on_warm_pool(backend: Any, job: Any) -> None:
    """A new job with a warm pool asked for: placed on a matching Available pool if there is one."""
    if not _keep_alive(job) or getattr(job, "enable_managed_spot_training", False):
        return
    for other in backend.training_jobs.values():
        pool = getattr(other, "warm_pool_status", None)
        if other is not job and pool and pool["Status"] == "Available" and _pool_key(other) == _pool_key(job):
            pool.update(Status="Reused", ReusedByJob=job.training_job_name)
            break
    job.warm_pool_status = {"Status": "InUse"}


def _use_python_jsonata() -> None:
    import jsonata
    import moto.stepfunctions.parser.asl.jsonata.jsonata as moto_jsonata

    # The interpreter composes `($states := {...}; <expression>)` and evaluates it without input.
    moto_jsonata._eval_jsonata = lambda expression: jsonata.Jsonata(expression).evaluate(None)


def _pascal_step_functions_calls() -> None:
    """moto's interpreter passes Step Functions' own API the PascalCase members states use
    (`StateMachineArn`, `Input`), and botocore's stepfunctions client wants them camelCase; answers come
    back camelCase where a state reads PascalCase (`ExecutionArn`, `Status`). Both integrations, the
    optimized startExecution and the aws-sdk describeExecution, are translated here, as AWS does."""
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service import (
        state_task_service_aws_sdk,
        state_task_service_sfn,
    )

    def plain(value: Any) -> Any:
        return value.isoformat() if isinstance(value, datetime) else value

    for cls in (
        state_task_service_sfn.StateTaskServiceSfn,
        state_task_service_aws_sdk.StateTaskServiceAwsSdk,
    ):
        original = cls._eval_service_task

        def translated(
            self: Any,
            env: Any,
            resource_runtime_part: Any,
            normalised_parameters: dict,
            state_credentials: Any,
            _original: Any = original,
        ) -> Any:
            service = getattr(self, "_get_boto_service_name", lambda: "")()
            if service not in ("stepfunctions", "sfn"):
                return _original(self, env, resource_runtime_part, normalised_parameters, state_credentials)
            camel = {k[:1].lower() + k[1:]: v for k, v in normalised_parameters.items()}
            normalised_parameters.clear()
            normalised_parameters.update(camel)
            result = _original(self, env, resource_runtime_part, normalised_parameters, state_credentials)
            env.stack[-1] = {k[:1].upper() + k[1:]: plain(v) for k, v in env.stack[-1].items()}
            return result

        cls._eval_service_task = translated


def _atomic_dynamodb_writes() -> None:
    """DynamoDB evaluates a write's ConditionExpression atomically with the write ("Condition
    expressions", DynamoDB developer guide): of concurrent conditional writes to one item, exactly one
    succeeds. moto checks, then writes, in whichever server thread serves the request, so two concurrent
    UpdateItems could both pass their condition (seen: two resumes of one run both registered). One
    lock around every write makes each check-and-write one step, as on AWS."""
    import functools
    import threading

    from moto.dynamodb.models import DynamoDBBackend

    lock = threading.RLock()
    for name in ("put_item", "update_item", "delete_item", "transact_write_items"):
        original = getattr(DynamoDBBackend, name)

        @functools.wraps(original)
        def atomic(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            with lock:
                return _original(self, *args, **kwargs)

        setattr(DynamoDBBackend, name, atomic)


def _request(response: Any) -> dict[str, Any]:
    """The whole request a SageMaker (JSON protocol) handler is answering."""
    body = response.body
    return json.loads(body.decode() if isinstance(body, bytes) else body or "{}")


def install() -> None:
    """Patch moto's SageMaker responses and wrap the server's WSGI app (called by serve())."""
    import threading

    from moto import server
    from moto.core.responses import ActionResult, EmptyResult
    from moto.sagemaker.exceptions import ValidationError
    from moto.sagemaker.responses import SageMakerResponse

    _use_python_jsonata()
    _pascal_step_functions_calls()
    _atomic_dynamodb_writes()
    from trainstack.emulator import jobs

    create = SageMakerResponse.create_training_job
    create_processing = SageMakerResponse.create_processing_job

    def create_training_job(self: Any) -> Any:
        result = create(self)
        job = self.sagemaker_backend.training_jobs[self._get_param("TrainingJobName")]
        job.environment = self._get_param("Environment") or {}
        # moto replaces the request's MetricDefinitions and FinalMetricDataList with made-up ones
        algorithm = self._get_param("AlgorithmSpecification") or {}
        job.algorithm_specification["MetricDefinitions"] = algorithm.get("MetricDefinitions") or []
        job.final_metric_data_list = []
        if _settings["jobs"] == "train":
            now = datetime.now(UTC)
            job.training_job_status, job.secondary_status = "InProgress", "Starting"
            job.training_end_time = job.training_start_time = None
            job.secondary_status_transitions = [
                {
                    "Status": "Starting",
                    "StartTime": now,
                    "StatusMessage": "Preparing the instances for training",
                }
            ]
            _place_on_warm_pool(self.sagemaker_backend, job)
            jobs.start_training_job(job, _request(self), change_job_status)
        elif _settings["jobs"] == "hold":
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
            _place_on_warm_pool(self.sagemaker_backend, job)
        return result

    def job_of(self: Any) -> Any:
        name = self._get_param("TrainingJobName")
        job = self.sagemaker_backend.training_jobs.get(name)
        if job is None:
            raise ValidationError(message=f"Requested resource not found: training job {name}")
        return job

    def stop_training_job(self: Any) -> Any:
        job = job_of(self)
        if job.training_job_status in TERMINAL:
            raise ValidationError(
                message="The request was rejected because the training job is in status "
                f"{job.training_job_status}."
            )
        runner = jobs.running_job(job.training_job_name)
        if runner is not None:
            if job.training_job_status != "Stopping":
                change_job_status(job, "Stopping", "Stopping", "Stopping the training job")
            runner.stop("Stopped")  # SIGTERM to its nodes; Stopped once they have exited
        elif job.training_job_status != "Stopping":
            _transition(job, "Stopping", "Stopping", "Stopping the training job")

            def stopped() -> None:
                if job.training_job_status == "Stopping":
                    _transition(job, "Stopped", "Stopped", "The job was stopped")

            timer = threading.Timer(float(_settings["stopping_seconds"]), stopped)
            timer.daemon = True
            timer.start()
        return EmptyResult()

    def update_training_job(self: Any) -> Any:
        job = job_of(self)
        keep = (self._get_param("ResourceConfig") or {}).get("KeepAlivePeriodInSeconds")
        if keep is not None:
            job.resource_config = {**(job.resource_config or {}), "KeepAlivePeriodInSeconds": int(keep)}
            pool = getattr(job, "warm_pool_status", None)
            if pool is not None and int(keep) == 0 and pool["Status"] in ("Available", "InUse"):
                pool["Status"] = "Terminated"
        return ActionResult({"TrainingJobArn": job.arn})

    def create_processing_job(self: Any) -> Any:
        result = create_processing(self)
        job = self.sagemaker_backend.processing_jobs[self._get_param("ProcessingJobName")]
        # moto keeps neither; DescribeProcessingJob returns both on AWS
        job.environment = self._get_param("Environment") or {}
        job.processing_resources = self._get_param("ProcessingResources") or {}
        if _settings["jobs"] == "train":
            job.processing_job_status = "InProgress"
            job.processing_end_time = None
            jobs.start_processing_job(job, _request(self), change_job_status)
        elif _settings["jobs"] == "hold":
            job.processing_job_status, job.processing_end_time = "InProgress", None
        return result

    def stop_processing_job(self: Any) -> Any:
        name = self._get_param("ProcessingJobName")
        job = self.sagemaker_backend.processing_jobs.get(name)
        if job is None:
            raise ValidationError(message=f"Requested resource not found: processing job {name}")
        if job.processing_job_status in TERMINAL:
            raise ValidationError(
                message="The request was rejected because the processing job is in status "
                f"{job.processing_job_status}."
            )
        runner = jobs.running_job(name)
        change_job_status(job, "Stopping", None, "Stopping the processing job")
        if runner is not None:
            runner.stop("Stopped")
        else:
            change_job_status(job, "Stopped", None, "The job was stopped")
        return EmptyResult()

    SageMakerResponse.create_training_job = create_training_job
    SageMakerResponse.create_processing_job = create_processing_job
    SageMakerResponse.stop_processing_job = stop_processing_job
    SageMakerResponse.stop_training_job = stop_training_job
    SageMakerResponse.update_training_job = update_training_job

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

            if path == f"{ROUTE}ping":  # endpoint.answers: cheap whatever the backends hold
                answer: dict[str, Any] = {"ok": True}
            elif path == f"{ROUTE}config":
                answer = apply_config(body)
            elif path == f"{ROUTE}end-training-job":
                backend = _backend(body.get("account", ACCOUNT), body.get("region", REGION))
                answer = end_job(
                    backend,
                    body["name"],
                    body["status"],
                    body["secondary_status"],
                    body.get("failure_reason"),
                    body.get("final_step", TRAINED),
                    body.get("saved_step", TRAINED),
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


def configure(
    env: dict[str, str],
    *,
    jobs: str | None = None,
    jobs_run: bool | None = None,
    stopping_seconds: float | None = None,
    ranks_per_node: int | None = None,
    kill_after_seconds: float | None = None,
    mlflow_url: str | None = None,
    events: str | None = None,
    schedule_speedup: float | None = None,
    max_runtime_cap_seconds: float | None = None,
    no_max_runtime_cap: bool = False,
    fault_inject: str | None = None,
) -> dict[str, Any]:
    """How the emulator treats new jobs. `jobs`: "train" (the default: they run, trainstack.emulator.jobs),
    or, for a test that asks for it, "hold" (InProgress until ended by hand; `jobs_run=True` is the old
    spelling) or "complete" (Completed at once, nothing run). `stopping_seconds`: how long a held job stays
    Stopping after StopTrainingJob; `ranks_per_node`: CPU ranks per node of a running job;
    `kill_after_seconds`: SIGTERM -> SIGKILL (120 as on SageMaker); `mlflow_url`: the MLflow server jobs
    track to. `events`: "auto" (the default: the server delivers every job-state event and runs every
    schedule itself, trainstack.emulator.delivery) or, for a test that asks, "manual" (nothing delivered,
    no schedule run; `jobs_run=True` implies it); `schedule_speedup`: how many times faster than AWS rate
    schedules run (default delivery.SPEEDUP); `max_runtime_cap_seconds`: training jobs created from now on
    stop with MaxRuntimeExceeded after at most this many seconds (a demo's short max runtime; a recipe's
    is at least an hour), `no_max_runtime_cap=True` removes the cap; `fault_inject`: the
    TRAINSTACK_FAULT_INJECT of training jobs created from now on ("" for none; tests only: a real crash or
    divergence, trainer.runtime.faults lists them). Returns the settings now in force."""
    body: dict[str, Any] = {}
    if jobs_run is not None:
        body["jobs"] = "hold" if jobs_run else "complete"
        if jobs_run:  # the old spelling's tests end jobs and deliver their events by hand
            body["events"] = "manual"
    if jobs is not None:
        body["jobs"] = jobs
    for key, value in (
        ("stopping_seconds", stopping_seconds),
        ("ranks_per_node", ranks_per_node),
        ("kill_after_seconds", kill_after_seconds),
        ("mlflow_url", mlflow_url),
        ("events", events),
        ("schedule_speedup", schedule_speedup),
        ("max_runtime_cap_seconds", max_runtime_cap_seconds),
        ("fault_inject", fault_inject),
    ):
        if value is not None:
            body[key] = value
    if no_max_runtime_cap:
        body["max_runtime_cap_seconds"] = None
    return _post(env, "config", body)


def apply_config(body: dict[str, Any]) -> dict[str, Any]:
    """Server side of `configure`."""
    from trainstack.emulator import jobs

    if "jobs_run" in body:  # the old spelling
        body = {**body, "jobs": "hold" if body["jobs_run"] else "complete"}
    mode = body.get("jobs", _settings["jobs"])
    if mode not in JOB_MODES:
        raise ValueError(f"jobs must be one of {JOB_MODES}, got {mode!r}")
    _settings["jobs"] = mode
    _settings["stopping_seconds"] = float(body.get("stopping_seconds", _settings["stopping_seconds"]))
    if "ranks_per_node" in body:
        ranks = int(body["ranks_per_node"])
        if not 1 <= ranks <= 8:
            raise ValueError(f"ranks_per_node must be 1..8, got {ranks}")
        jobs.SETTINGS.ranks_per_node = ranks
    if "kill_after_seconds" in body:
        jobs.SETTINGS.kill_after_s = float(body["kill_after_seconds"])
    if "mlflow_url" in body:
        jobs.SETTINGS.mlflow_url = body["mlflow_url"] or None
    if "max_runtime_cap_seconds" in body:  # None: off
        cap = body["max_runtime_cap_seconds"]
        if cap is not None and not 1 <= float(cap) <= 86400:
            raise ValueError(f"max_runtime_cap_seconds must be 1..86400, got {cap}")
        jobs.SETTINGS.max_runtime_cap_s = None if cap is None else float(cap)
    if "fault_inject" in body:
        fault = str(body["fault_inject"] or "")
        if len(fault) > 200 or any(c.isspace() for c in fault):
            raise ValueError(f"fault_inject must be one fault of trainer.runtime.faults, got {fault!r}")
        jobs.SETTINGS.fault_inject = fault or None
    from trainstack.emulator import delivery

    delivered = delivery.apply_config(body)  # events auto | manual, schedule_speedup
    return {
        **_settings,
        **delivered,
        "jobs_run": _settings["jobs"] == "hold",
        "ranks_per_node": jobs.SETTINGS.ranks_per_node,
        "kill_after_seconds": jobs.SETTINGS.kill_after_s,
        "mlflow_url": jobs.SETTINGS.mlflow_url,
        "max_runtime_cap_seconds": jobs.SETTINGS.max_runtime_cap_s,
        "fault_inject": jobs.SETTINGS.fault_inject,
        "jobs_dir": str(jobs.SETTINGS.jobs_dir),
    }


def wait_for_status(
    env: dict[str, str], job: str, statuses: tuple[str, ...] = TERMINAL, timeout_s: float = 30
):
    """Wait until job `job` is in one of `statuses` (e.g. Stopped after StopTrainingJob); its description."""
    import time

    (sagemaker,) = clients(env, "sagemaker")
    deadline = time.monotonic() + timeout_s
    while (described := sagemaker.describe_training_job(TrainingJobName=job))[
        "TrainingJobStatus"
    ] not in statuses:
        if time.monotonic() > deadline:
            raise TrainstackError(f"EMULATOR: job {job} is still {described['TrainingJobStatus']}")
        time.sleep(0.1)
    return described


def end_training_job(
    env: dict[str, str],
    name: str,
    status: str,
    secondary_status: str,
    failure_reason: str | None = None,
    final_step: int | str | None = TRAINED,
    saved_step: int | str | None = TRAINED,
) -> None:
    """End a job as SageMaker would: e.g. Stopped/MaxRuntimeExceeded, Stopped/Interrupted (spot),
    Failed/Failed with its FailureReason, Completed/Completed. `final_step`: the `train:step` it
    reports in FinalMetricDataList (None: none; TRAINED: its training.steps when Completed);
    `saved_step`: its newest completed checkpoint's step, `train:saved_step` (likewise)."""
    _post(
        env,
        "end-training-job",
        {
            "name": name,
            "status": status,
            "secondary_status": secondary_status,
            "failure_reason": failure_reason,
            "final_step": final_step,
            "saved_step": saved_step,
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


def deliver_job_state_change(env: dict[str, str], job_name: str) -> list[str]:
    """Play EventBridge for job `job_name`'s current state: start the Step Functions targets of every
    enabled rule whose pattern matches. Returns the execution ARNs started."""
    from trainstack.emulator.endpoint import ACCOUNT

    (sagemaker,) = clients(env, "sagemaker")
    event = job_state_change_event(
        sagemaker.describe_training_job(TrainingJobName=job_name), env["AWS_REGION"], ACCOUNT
    )
    return deliver_event(env, event)


def alarm_state_change_event(alarm: str, job: str, metric: str, region: str, account: str) -> dict[str, Any]:
    """The EventBridge event CloudWatch sends when a single-metric alarm on a job's metric goes to
    ALARM (CloudWatch user guide, "Alarm events and EventBridge": its documented shape)."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.000+0000")
    return {
        "version": "0",
        "id": str(uuid.uuid4()),
        "detail-type": "CloudWatch Alarm State Change",
        "source": "aws.cloudwatch",
        "account": account,
        "time": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "region": region,
        "resources": [f"arn:aws:cloudwatch:{region}:{account}:alarm:{alarm}"],
        "detail": {
            "alarmName": alarm,
            "state": {"value": "ALARM", "reason": "Threshold Crossed", "timestamp": now},
            "previousState": {"value": "OK", "reason": "Threshold not crossed", "timestamp": now},
            "configuration": {
                "description": f"{job} stalled",
                "metrics": [
                    {
                        "id": str(uuid.uuid4()),
                        "metricStat": {
                            "metric": {
                                "namespace": "/aws/sagemaker/TrainingJobs",
                                "name": metric,
                                "dimensions": {"TrainingJobName": job},
                            },
                            "period": 60,
                            "stat": "SampleCount",
                        },
                        "returnData": True,
                    }
                ],
            },
        },
    }


def deliver_event(env: dict[str, str], event: dict[str, Any]) -> list[str]:
    """Play EventBridge for one event, by hand: invoke the targets of every enabled rule whose pattern
    matches, as the server's own delivery does (trainstack.emulator.delivery.deliver). Returns the Step
    Functions execution ARNs started."""
    from trainstack.emulator import delivery

    return delivery.deliver(env, event)


def deliver_alarm_state_change(env: dict[str, str], alarm: str, job: str, metric: str) -> list[str]:
    """Play CloudWatch and EventBridge for alarm `alarm` (on `metric` of job `job`) going to ALARM."""
    from trainstack.emulator.endpoint import ACCOUNT

    return deliver_event(env, alarm_state_change_event(alarm, job, metric, env["AWS_REGION"], ACCOUNT))
