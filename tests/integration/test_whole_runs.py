"""Whole runs on the default emulator: every job really trains (the trainer on CPU ranks, as the
emulator runs a SageMaker training job), the emulator delivers each job's state change to the deployed
rules, and the supervisor's state machines decide what comes next. Nothing is ended or delivered by hand;
a test only chooses the world the run meets: a short max runtime, a `trainstack stop`, a trainer fault
(TRAINSTACK_FAULT_INJECT, through the emulator's test-only setting: a real divergence, a real crash).

What a real job cannot do here (a spot interruption, a capacity error, a lost event, a decision cut off
half-way) is ended by hand in test_emulator_deploy.py and test_run_faults_emulator.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from deployed_cloud import ROOT, Cloud, one_line_error, wait_until

from trainstack.aws.supervisor import CRASH_LOOP, MAX_CONSECUTIVE_CRASHES
from trainstack.emulator import events as emulator_events
from trainstack.emulator.endpoint import ACCOUNT, REGION, Emulator

# The fast tier's one whole run is the first test (max runtime -> the supervisor's next job -> completed);
# every other test here is the slow tier.
pytestmark = [pytest.mark.fast, pytest.mark.xdist_group("whole-runs")]
RECIPE = "tests/integration/fixtures/whole-run.yaml"
RECIPE_NAME = "whole-run"
DATA_STACK = f"Trainstack-platform-{RECIPE_NAME}-Data"
DATA_BUCKET = "trainstack-whole-run-data"  # the recipe's data.train_s3_uri
STEPS = 400  # the recipe's training.steps
FIRST_JOB_RUNTIME_S = 45  # job 1's max runtime: ends it mid-run (its start-up is 5-30 s on 2 cores)
RESUMED = re.compile(r"resumed from .*: step (\d+), data position \d+")


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cloud]:
    """The emulator as a user gets it (jobs train, events and schedules delivered by the emulator), the
    recipe deployed with `npx cdk deploy`, its data prepared with `trainstack data prepare`."""
    log = tmp_path_factory.mktemp("whole-runs") / "moto.log"
    with Emulator(log_path=log) as emulator:
        cloud = Cloud(emulator, tmp_path_factory.mktemp("cdk-out"))
        settings = emulator_events.configure(cloud.env)
        assert (settings["jobs"], settings["events"]) == ("train", "auto")
        cloud.cdk("bootstrap", f"aws://{ACCOUNT}/{REGION}")
        cloud.deploy(RECIPE)
        emulator.client("s3").create_bucket(Bucket=DATA_BUCKET)
        prepared = cloud.cli(
            *("data", "prepare", str(ROOT / "docs"), "--tokenizer", "bytes"),
            *("--out", f"s3://{DATA_BUCKET}/tokens/", "--local", "--validation-fraction", "0.25"),
            *("--workers", "1"),
        )
        assert prepared.returncode == 0, prepared.stdout + prepared.stderr
        yield cloud


@pytest.fixture
def fault(cloud: Cloud) -> Iterator:
    """Set a trainer fault for the jobs a test's run creates; cleared after the test."""
    yield lambda text: emulator_events.configure(cloud.env, fault_inject=text)
    emulator_events.configure(cloud.env, fault_inject="")


def jobs_of(record) -> list[tuple[str, str, str, str]]:
    return [(j.name, j.status, j.secondary_status, j.rule) for j in record.jobs]


def test_a_run_whose_first_job_reaches_its_max_runtime_is_completed_by_the_supervisors_next_job(
    cloud: Cloud,
) -> None:
    """The fast tier's whole run. Job 1 reaches its max runtime (SIGTERM: the trainer saves and exits),
    the supervisor starts job 2 by itself when job 1's Stopped event arrives, job 2 resumes from that
    save and completes the run's steps. One checkpoint prefix throughout; the completed run is not
    stopped, resumed or launched again."""
    emulator_events.configure(cloud.env, max_runtime_cap_seconds=FIRST_JOB_RUNTIME_S)
    try:
        first, _ = cloud.launch(RECIPE, None, "--name", "long")
    finally:  # only job 1: the jobs the supervisor creates keep the recipe's max runtime
        emulator_events.configure(cloud.env, no_max_runtime_cap=True)
    run = first.rsplit("-", 1)[0]

    second = f"{run}-2"
    record = wait_until(lambda: cloud.run_record(DATA_STACK, run), lambda r: r.current_job == second, 300)
    assert jobs_of(record)[0] == (first, "Stopped", "MaxRuntimeExceeded", "MaxRuntime")
    stopped_at = int(cloud.final_metrics(first)["train:step"])
    assert 0 < stopped_at < STEPS
    assert resumed_step(cloud, second) == stopped_at  # saved on SIGTERM, resumed

    record = cloud.wait_for_run(DATA_STACK, run, ("completed", "failed", "stopped"), timeout_s=600)
    assert record.state == "completed", record.why
    assert int(cloud.final_metrics(second)["train:step"]) == STEPS == record.step
    assert [j[:2] for j in jobs_of(record)] == [(first, "Stopped"), (second, "Completed")]
    assert jobs_of(record)[1][3] == "Completed"
    uris = {
        cloud.sagemaker.describe_training_job(TrainingJobName=j)["Environment"]["TRAINSTACK_CHECKPOINT_URI"]
        for j in (first, second)
    }
    assert len(uris) == 1 and uris == {record.checkpoint_uri}
    (listed,) = [r for r in cloud.cli_json("runs", RECIPE, "--local") if r["run"] == run]
    assert listed["state"] == "completed"

    # A completed run is not stopped, resumed or launched again (its name is taken), each in one line.
    assert "is not running (completed" in one_line_error(cloud.cli("stop", run, "--local"))
    assert "is completed: only a stopped or failed run can be resumed" in one_line_error(
        cloud.cli("resume", run, "--local")
    )
    taken = one_line_error(cloud.cli("launch", RECIPE, "--local", "--name", "long"))
    assert f"a run named {run} exists (completed; launch of recipe " in taken
    assert [j.name for j in cloud.run_record(DATA_STACK, run).jobs] == [first, second]


@pytest.mark.slow
def test_a_run_stopped_by_its_user_resumes_from_the_save_of_the_stop_and_completes(cloud: Cloud) -> None:
    """A user stops job 1 once it has trained (`trainstack stop`: SageMaker passes through Stopping,
    the trainer saves), the run is stopped; `resume` starts job 2, which resumes from that save and
    completes the run's steps, on the same checkpoint prefix."""
    first, _ = cloud.launch(RECIPE, None, "--name", "stopped")
    run = first.rsplit("-", 1)[0]
    wait_until(lambda: cloud.final_metrics(first).get("train:step", 0), lambda s: s > 0, 300)
    stopped = cloud.cli_json("stop", run, "--local")
    assert stopped == {"run": run, "job": first, "execution": None}
    record = cloud.wait_for_run(DATA_STACK, run, ("stopped",), timeout_s=300)
    assert jobs_of(record)[0] == (first, "Stopped", "Stopped", "StopRequested")
    described = cloud.sagemaker.describe_training_job(TrainingJobName=first)
    # SageMaker passes through Stopping (SIGTERM: the trainer saves) before Stopped.
    statuses = [t["Status"] for t in described["SecondaryStatusTransitions"]]
    assert statuses[-1] == "Stopped" and statuses.index("Stopping") > statuses.index("Training"), statuses
    first_step = int(cloud.final_metrics(first)["train:step"])
    assert 0 < first_step < STEPS

    resumed = cloud.cli_json("resume", run, "--local")
    second = resumed["job"]
    assert second == f"{run}-2"
    record = cloud.wait_for_run(DATA_STACK, run, ("completed", "failed", "stopped"), timeout_s=600)
    assert record.state == "completed", record.why
    assert resumed_step(cloud, second) == first_step
    assert int(cloud.final_metrics(second)["train:step"]) == STEPS == record.step
    assert [j[:2] for j in jobs_of(record)] == [(first, "Stopped"), (second, "Completed")]
    uris = {
        cloud.sagemaker.describe_training_job(TrainingJobName=j)["Environment"]["TRAINSTACK_CHECKPOINT_URI"]
        for j in (first, second)
    }
    assert uris == {record.checkpoint_uri}


@pytest.mark.slow
def test_a_run_that_diverges_ends_with_the_trainers_reason_and_no_second_job(cloud: Cloud, fault) -> None:
    """A NaN loss is a failure the next job would repeat: the trainer says so in its failure file, and
    the supervisor ends the run on the first job with that line."""
    fault("nan-gradients@3")
    answer = cloud.cli_json("launch", RECIPE, "--local", "--wait", "--name", "diverges", "--max-steps", "20")
    record = cloud.wait_for_run(DATA_STACK, answer["run"], ("failed", "completed", "stopped"), 300)
    assert record.state == "failed" and "nan" in record.why.lower(), record.why
    assert [(j.name, j.status, j.rule) for j in record.jobs] == [(answer["job"], "Failed", "Fatal")]
    reason = cloud.sagemaker.describe_training_job(TrainingJobName=answer["job"])["FailureReason"]
    assert "trainstack-fatal" in reason and reason.split(":")[0] in record.why


@pytest.mark.slow
def test_a_crash_that_repeats_fails_the_run_and_a_resume_after_the_fix_completes_it(
    cloud: Cloud, fault
) -> None:
    """A worker killed in the middle of its save of step 20 (SIGKILL, before the checkpoint's marker) is
    a crash the supervisor retries. Each retry resumes from step 10, the newest intact checkpoint, and
    crashes at the same place: none trained past the job before it, so the count is never reset, and
    after MAX_CONSECUTIVE_CRASHES the run fails. The fault removed (a person fixed the cause), `resume`
    starts counting again and the run completes."""
    fault("kill:before-marker@20")
    answer = cloud.cli_json(
        "launch", RECIPE, "--local", "--wait", "--name", "crash-loop", "--max-steps", "30"
    )
    run = answer["run"]
    record = cloud.wait_for_run(DATA_STACK, run, ("failed", "completed", "stopped"), 600)
    assert record.state == "failed" and "in a row ended without a checkpoint past step 10" in record.why
    crashed = [("Failed", "Crashed")] * (MAX_CONSECUTIVE_CRASHES - 1) + [("Failed", CRASH_LOOP)]
    assert [(j.status, j.rule) for j in record.jobs] == crashed
    for job in record.jobs[1:]:  # the killed save of step 20 skipped for the intact one before it
        assert resumed_step(cloud, job.name, timeout_s=0) == 10

    fault("")
    resumed = cloud.cli_json("resume", run, "--local")
    assert cloud.run_record(DATA_STACK, run).crashes == 0
    record = cloud.wait_for_run(DATA_STACK, run, ("completed", "failed", "stopped"), 300)
    assert record.state == "completed", record.why
    assert record.jobs[-1].name == resumed["job"] and record.step == 30
    assert resumed_step(cloud, resumed["job"], timeout_s=0) == 10


@pytest.mark.slow
def test_a_bug_costs_one_job_says_why_and_a_fixed_image_resumes_the_run(cloud: Cloud, fault) -> None:
    """Issue 40: an uncaught error (here a TypeError at step 3, as a real bug raises it) ended "exit code
    1 (no /opt/ml/output/failure)", was counted as a crash and retried twice, and nothing said why. Now the
    trainer classifies it (deterministic: code), the run fails on its first job with the cause, `runs`
    shows it, a `resume` that changes nothing is refused (the next job would run the same code), and
    `resume --set image.uri=<fixed>` sends that image with the next job, which completes the run."""
    fault("raise:TypeError@3")
    answer = cloud.cli_json("launch", RECIPE, "--local", "--wait", "--name", "code-bug", "--max-steps", "20")
    run = answer["run"]
    record = cloud.wait_for_run(DATA_STACK, run, ("failed", "completed", "stopped"), 300)
    assert record.state == "failed", record.why
    assert [(j.name, j.status, j.rule) for j in record.jobs] == [(answer["job"], "Failed", "Fatal")]
    reason = cloud.sagemaker.describe_training_job(TrainingJobName=answer["job"])["FailureReason"]
    assert reason.startswith("trainstack-fatal exit=6: deterministic code: TypeError: fault injection"), (
        reason
    )
    assert "trainer/runtime/faults.py" in reason and reason in record.why
    (listed,) = [r for r in cloud.cli_json("runs", RECIPE, "--local", "--mlflow") if r["run"] == run]
    assert "deterministic code: TypeError" in listed["why"] and "--set image.uri=" in listed["why"]
    # A recipe deployed from a file is found by the run's recorded recipe (issue 40: the demo's suggested
    # `runs ... --mlflow` said "unknown recipe 'demo-tiny'"); this one tracks nothing.
    assert listed["mlflow"] == "mlflow: not tracked (tracking.mlflow is off)"

    refused = one_line_error(cloud.cli("resume", run, "--local"))
    assert f"run {run} cannot be resumed as it is" in refused and "--set image.uri=<fixed image>" in refused
    assert [j.name for j in cloud.run_record(DATA_STACK, run).jobs] == [answer["job"]]  # nothing started

    fault("")  # the fixed trainer (the emulator runs this checkout's code whatever the image)
    fixed = f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/trainstack-fixed:2"
    resumed = cloud.cli_json("resume", run, "--local", "--set", f"image.uri={fixed}")
    described = cloud.sagemaker.describe_training_job(TrainingJobName=resumed["job"])
    assert described["AlgorithmSpecification"]["TrainingImage"] == fixed
    record = cloud.wait_for_run(DATA_STACK, run, ("completed", "failed", "stopped"), 300)
    assert record.state == "completed", record.why
    assert record.jobs[-1].name == resumed["job"] and record.step == 20


@pytest.mark.slow
def test_jobs_whose_max_runtime_ends_before_their_first_save_fail_the_run_at_the_third(cloud: Cloud) -> None:
    """Issue 40: jobs that end without progress (there: exit 0 after a capacity block's deadline, 0 steps)
    each started the next at once, up to compute.max_jobs. Here every job's max runtime ends while it is
    still starting (SIGTERM before its first step: it saves nothing and exits 0, MaxRuntimeExceeded); the
    third such job in a row fails the run with that cause, not the 20th."""
    emulator_events.configure(cloud.env, max_runtime_cap_seconds=2)
    try:
        answer = cloud.cli_json("launch", RECIPE, "--local", "--name", "no-progress")
        run = answer["run"]
        record = cloud.wait_for_run(DATA_STACK, run, ("failed", "completed", "stopped"), 600)
    finally:
        emulator_events.configure(cloud.env, no_max_runtime_cap=True)
    ended = [("Stopped", "MaxRuntime")] * (MAX_CONSECUTIVE_CRASHES - 1) + [("Stopped", CRASH_LOOP)]
    assert record.state == "failed" and [(j.status, j.rule) for j in record.jobs] == ended, record.why
    assert record.why.startswith(
        f"{MAX_CONSECUTIVE_CRASHES} jobs of the run in a row ended without a checkpoint past step 0"
    )
    assert record.why.endswith(
        "this job ended because it reached its max runtime "
        "(StoppingCondition.MaxRuntimeInSeconds) and saved on SIGTERM"
    )
    for job in record.jobs:
        described = cloud.sagemaker.describe_training_job(TrainingJobName=job.name)
        assert described["SecondaryStatus"] == "MaxRuntimeExceeded"
        saved = [m for m in described.get("FinalMetricDataList", []) if m["MetricName"] == "train:saved_step"]
        assert saved == []  # not one checkpoint: none of them made progress


def resumed_step(cloud: Cloud, job: str, timeout_s: float = 300) -> int:
    """The step the job's trainer resumed from, by its own log line (trainer.train._resume_or_start)."""
    log = wait_until(lambda: cloud.log_of(job), RESUMED.search, timeout_s)
    return int(RESUMED.search(log).group(1))
