"""A tuning run's short jobs on SageMaker: one CreateTrainingJob per candidate, waited for, and its log.

Names: a tuning run is named like a run (`ts-<team>-<recipe>--<tuning id>`), and its candidates'
jobs like a run's jobs (`<run>-1`, `<run>-2`, ...), so the name always fits SageMaker's 63 characters
and the execution role, the alarms and the EventBridge rules that cover a recipe's jobs by their
prefix cover these too. Each candidate checkpoints under its own prefix (`<tuning id>-c<N>`): a fresh
run, never a resume of another layout's state. Every job asks for the same warm pool (same instance
type and count, KeepAlivePeriodInSeconds), so each next job starts on the instances the last one
released: P6 capacity is scarce, and a new provisioning per candidate would cost more than the job.

The log: SageMaker writes a job's stdout and stderr to CloudWatch Logs, group /aws/sagemaker/
TrainingJobs, one stream per host named `<job name>/algo-N-<epoch>` (developer guide, "Monitor and
analyze training jobs using Amazon CloudWatch metrics"); the metric lines are read from there, with
the reader `trainstack logs` uses (trainstack.aws.runs). The emulator's jobs (trainstack.emulator.jobs)
write their logs to the same group and streams.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainstack.aws import request as requests
from trainstack.recipes import naming
from trainstack.recipes.schema import Recipe

TERMINAL = ("Completed", "Failed", "Stopped")
TUNING_TAG = "trainstack:tuning"  # the tuning run a short job belongs to
START_UP_ALLOWANCE_S = 3600  # MaxRuntime of a short job: its planned steps x 3, plus this for start-up
MAX_STEPS_ENV = "TRAINSTACK_MAX_STEPS"  # trainer/__main__.py: --max-steps from the environment


def job_names(recipe: Recipe, team: str | None, tuning_id: str, count: int) -> list[str]:
    run = naming.run_name(recipe, team, tuning_id)
    return [naming.job_of_run(run, i + 1) for i in range(count)]


def tuning_job_request(
    job_recipe: Recipe,
    team: str | None,
    *,
    job_name: str,
    tuning_id: str,
    candidate: str,
    max_steps: int,
    planned_seconds: float,
    role_arn: str,
    image_uri: str,
    bucket_name: str,
    kms_key_arn: str | None,
    region: str | None,
) -> dict[str, Any]:
    """The CreateTrainingJob request of one candidate's short job (trainstack.aws.request builds the rest)."""
    body = requests.create_training_job_request(
        job_recipe,
        team,
        job_name=job_name,
        checkpoint_uri=requests.checkpoint_uri(bucket_name, job_recipe, team, f"{tuning_id}-{candidate}"),
        role_arn=role_arn,
        image_uri=image_uri,
        bucket_name=bucket_name,
        kms_key_arn=kms_key_arn,
        keep_alive_seconds=requests.WARM_POOL_SECONDS,
        region=region,
    )
    body["Environment"][MAX_STEPS_ENV] = str(max_steps)
    body["StoppingCondition"] = {"MaxRuntimeInSeconds": int(3 * planned_seconds) + START_UP_ALLOWANCE_S}
    body["Tags"].append({"Key": TUNING_TAG, "Value": naming.run_name(job_recipe, team, tuning_id)})
    body["RetryStrategy"] = {"MaximumRetryAttempts": 1}  # a measurement is worth one try, not a run's retries
    return body


@dataclass(frozen=True)
class SageMakerJob:
    name: str
    status: str  # Completed | Failed | Stopped
    failure_reason: str
    lines: tuple[str, ...]
    billable_seconds: float
    image: str  # the image the job ran (its digest where the URI carries one)
    environment: dict[str, str]  # as DescribeTrainingJob returns it (the emulator adds its stand-in note)


def run_training_job(
    sagemaker: Any,
    logs: Any,
    body: dict[str, Any],
    *,
    poll_s: float = 15.0,
    timeout_s: float | None = None,
    echo: Callable[[str], None] = lambda line: None,
    sleep: Callable[[float], None] = time.sleep,
) -> SageMakerJob:
    """Create the job, wait until it ends (echoing each status change), read its log."""
    name = body["TrainingJobName"]
    sagemaker.create_training_job(**body)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    said = None
    while True:
        job = sagemaker.describe_training_job(TrainingJobName=name)
        state = f"{job['TrainingJobStatus']} ({job.get('SecondaryStatus', '')})"
        if state != said:
            echo(f"     {name}: {state}")
            said = state
        if job["TrainingJobStatus"] in TERMINAL:
            break
        if deadline is not None and time.monotonic() > deadline:
            sagemaker.stop_training_job(TrainingJobName=name)
            deadline = None  # wait for Stopped
        sleep(poll_s)
    return SageMakerJob(
        name,
        job["TrainingJobStatus"],
        job.get("FailureReason", ""),
        tuple(job_log(logs, name)),
        _billed_seconds(job),
        job.get("AlgorithmSpecification", {}).get("TrainingImage", ""),
        dict(job.get("Environment") or {}),
    )


def job_log(logs: Any, job_name: str) -> list[str]:
    """Every line the job's hosts wrote (each host's stream in order, algo-1 first; none yet: [])."""
    from trainstack.aws.runs import LogCursor, log_streams, read_new_lines

    return [
        message.rstrip("\n")
        for _, _, message in read_new_lines(logs, sorted(log_streams(logs, job_name)), LogCursor())
    ]


def _billed_seconds(job: dict[str, Any]) -> float:
    """BillableTimeInSeconds, else TrainingTimeInSeconds, else the training start to end (a runtime
    that reports neither, as the emulator)."""
    for key in ("BillableTimeInSeconds", "TrainingTimeInSeconds"):
        if job.get(key):
            return float(job[key])
    start, end = job.get("TrainingStartTime"), job.get("TrainingEndTime")
    return (end - start).total_seconds() if start and end else 0.0
