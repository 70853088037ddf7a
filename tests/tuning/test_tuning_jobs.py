"""The tuning run's SageMaker jobs: the request is one SageMaker accepts (its documented limits, checked
against botocore's own service model by trainstack.aws.request_check), named and tagged as the run's
jobs, on one warm pool; the runner waits for the job and reads its log (moto in-process).

Limits pinned (SageMaker API reference, CreateTrainingJob; fetched with the search tool):
- TrainingJobName: 1-63 characters, ^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62};
- Environment: at most 100 entries (botocore's model: TrainingEnvironmentMap max 100), keys at most 512
  characters, values at most 512;
- ResourceConfig.KeepAlivePeriodInSeconds: 0-3600 (warm pools);
- StoppingCondition.MaxRuntimeInSeconds: at least 1, at most 28 days (2,419,200 s).
"""

from __future__ import annotations

import re
import time

import pytest

from trainstack.aws.request import WARM_POOL_SECONDS
from trainstack.aws.request_check import PLACEHOLDERS, check_request
from trainstack.aws.tuning_jobs import (
    MAX_STEPS_ENV,
    TUNING_TAG,
    job_log,
    job_names,
    run_training_job,
    tuning_job_request,
)
from trainstack.recipes.loader import resolve
from trainstack.recipes.schema import RECIPE_NAME_MAX, TEAM_NAME_MAX
from trainstack.tuning.candidates import candidates
from trainstack.tuning.engine import job_recipe, step_plan

pytestmark = pytest.mark.fast

JOB_NAME = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")


def requests(recipe, team, tuning_id="tune-zzzzzz", n=3):
    found = candidates(recipe, n)
    names = job_names(recipe, team, tuning_id, len(found))
    out = []
    for name, c in zip(names, found, strict=True):
        steps = step_plan(recipe, c)
        out.append(
            tuning_job_request(
                job_recipe(recipe, c, steps),
                team,
                job_name=name,
                tuning_id=tuning_id,
                candidate=c.name,
                max_steps=steps.max_steps,
                planned_seconds=steps.max_steps * c.planned.step_time_s,
                region="us-west-2",
                **{k: v for k, v in PLACEHOLDERS.items() if k != "mlflow_arn"},
            )
        )
    return found, out


def test_every_candidates_request_is_one_sagemaker_accepts_at_the_longest_names():
    team = "t" * TEAM_NAME_MAX
    recipe = resolve("8b-fp8", overrides=()).recipe
    recipe = recipe.model_copy(update={"name": "r" * RECIPE_NAME_MAX})
    found, bodies = requests(recipe, team, tuning_id="tune-" + "z" * 11)  # naming.RUN_ID_MAX: 16
    assert len(bodies) == len(found) == 3
    for body in bodies:
        assert check_request(body) == [], body["TrainingJobName"]
        assert len(body["TrainingJobName"]) <= 63 and JOB_NAME.match(body["TrainingJobName"])
        assert len(body["Environment"]) <= 100
        assert all(len(k) <= 512 and len(v) <= 512 for k, v in body["Environment"].items())
        assert body["ResourceConfig"]["KeepAlivePeriodInSeconds"] == WARM_POOL_SECONDS <= 3600
        assert 1 <= body["StoppingCondition"]["MaxRuntimeInSeconds"] <= 28 * 24 * 3600


def test_the_jobs_train_the_candidates_layout_for_its_steps_on_one_warm_pool_each_from_scratch():
    recipe = resolve("30b-fp8").recipe
    found, bodies = requests(recipe, "nlp")
    pools = {(b["ResourceConfig"]["InstanceType"], b["ResourceConfig"]["InstanceCount"]) for b in bodies}
    assert pools == {(recipe.compute.instance_type, recipe.compute.instance_count)}  # one warm pool fits all
    names = [b["TrainingJobName"] for b in bodies]
    assert names == [f"ts-nlp-30b-fp8--tune-zzzzzz-{i}" for i in (1, 2, 3)]
    checkpoints = {b["Environment"]["TRAINSTACK_CHECKPOINT_URI"] for b in bodies}
    assert len(checkpoints) == 3  # a fresh run per candidate, never another layout's state
    for c, body in zip(found, bodies, strict=True):
        steps = step_plan(recipe, c)
        assert body["Environment"][MAX_STEPS_ENV] == str(steps.max_steps)
        hyper = body["HyperParameters"]
        assert hyper["training.steps"] == str(recipe.training.steps)  # the run's LR schedule, not the job's
        assert hyper["training.log_every"] == "1"
        for override in c.overrides:
            key, value = override.split("=")
            assert hyper[key].strip('"') == value.lower(), (key, hyper[key])
        assert {"Key": TUNING_TAG, "Value": "ts-nlp-30b-fp8--tune-zzzzzz"} in body["Tags"]
        assert body["RetryStrategy"] == {"MaximumRetryAttempts": 1}


def test_the_runner_waits_for_the_job_and_reads_its_log_streams():
    """moto runs no container: the job is Completed at once and wrote no log, which the measurement
    then reports as a failed candidate (not a measured one)."""
    boto3 = pytest.importorskip("boto3")
    from moto import mock_aws

    from trainstack.tuning.measure import measure

    recipe = resolve("1b-bf16").recipe
    _, bodies = requests(recipe, None, n=1)
    with mock_aws():
        sm = boto3.client("sagemaker", region_name="us-west-2")
        logs = boto3.client("logs", region_name="us-west-2")
        said = []
        job = run_training_job(sm, logs, bodies[0], poll_s=0, echo=said.append, sleep=lambda s: None)
        assert job.name == bodies[0]["TrainingJobName"] and job.status in ("Completed", "Failed", "Stopped")
        assert job.lines == ()
        assert said and bodies[0]["TrainingJobName"] in said[0]
        now = int(time.time() * 1000)  # CloudWatch refuses events older than 14 days
        logs.create_log_group(logGroupName="/aws/sagemaker/TrainingJobs")
        stream = f"{job.name}/algo-1-1700000000"
        logs.create_log_stream(logGroupName="/aws/sagemaker/TrainingJobs", logStreamName=stream)
        logs.put_log_events(
            logGroupName="/aws/sagemaker/TrainingJobs",
            logStreamName=stream,
            logEvents=[{"timestamp": now + i, "message": f"line {i}"} for i in range(3)],
        )
        assert job_log(logs, job.name) == ["line 0", "line 1", "line 2"]
    assert measure(job.lines).status == "failed"
