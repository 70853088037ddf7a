"""Tracking never in the way: the bounded buffer, what a job is told and tags, an unreachable tracker.

The MLflow server round trip (two jobs of one run, read back by MLflow's own client) is in
tests/integration/test_tracking_mlflow.py; TensorBoard's reader in test_tracking_tensorboard.py.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
from trainer.metrics.delivery import Delivery
from trainer.metrics.tracking import JobContext, job_tags, open_tracking, outcome_of, recipe_params
from trainer_helpers import TINY

from trainstack.errors import RecipeError, TrainstackError
from trainstack.protocol import exit_codes
from trainstack.recipes.loader import resolve

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def tiny():
    return resolve(str(TINY)).recipe


def test_put_never_waits_for_a_sender_that_hangs_and_drops_the_oldest_when_full():
    release = threading.Event()
    sent: list[list[int]] = []

    def hanging(batch):
        release.wait(10)  # a tracker that does not answer
        sent.append(batch)

    delivery = Delivery("test", hanging, capacity=5, batch=100, interval_s=0.01)
    time.sleep(0.05)
    started = time.perf_counter()
    for i in range(1000):
        delivery.put(i)
    per_put = (time.perf_counter() - started) / 1000
    assert per_put < 1e-3  # an append under a lock, not a network call (about 1 us measured)
    release.set()
    counts = delivery.close(timeout_s=5)
    delivered = [i for batch in sent for i in batch]
    assert delivered[-5:] == [995, 996, 997, 998, 999]  # the newest survive a full buffer
    assert counts.queued == 1000
    assert counts.delivered + counts.dropped + counts.undelivered == 1000
    assert counts.dropped >= 1000 - 2 * 5  # at most one buffer in flight when the sender hung


def test_a_failing_tracker_is_retried_and_what_never_arrives_is_counted_at_close():
    attempts = []

    def failing(batch):
        attempts.append(len(batch))
        raise ConnectionError("tracker down")

    delivery = Delivery("test", failing, capacity=100, batch=10, interval_s=0.01)
    for i in range(30):
        delivery.put(i)
    started = time.monotonic()
    counts = delivery.close(timeout_s=0.5)
    assert time.monotonic() - started < 2.0  # close is bounded: the job's end never waits on the tracker
    assert attempts and counts.failed_attempts >= 1
    assert counts.delivered == 0 and counts.undelivered == 30 and counts.dropped == 0


def test_with_keep_what_is_pushed_out_or_left_at_close_is_kept_not_dropped():
    release = threading.Event()
    sent: list[int] = []
    kept: list[int] = []

    def hanging(batch):
        release.wait(10)  # a tracker that does not answer in time
        sent.extend(batch)

    delivery = Delivery("test", hanging, keep=kept.extend, capacity=5, batch=100, interval_s=0.01)
    time.sleep(0.05)
    started = time.perf_counter()
    for i in range(1000):
        delivery.put(i)
    assert (time.perf_counter() - started) / 1000 < 1e-3  # still an append: keeping happens on the thread
    counts = delivery.close(timeout_s=0.2)
    release.set()  # the in-flight batch may still arrive: kept too (a second delivery of it adds nothing)
    assert counts.dropped == 0 and counts.undelivered == 0
    assert counts.kept == len(kept) and set(kept) | set(sent) == set(range(1000))
    assert set(range(1000)) - set(sent) <= set(kept)  # whatever the tracker did not take is kept


def test_records_are_delivered_once_the_tracker_recovers():
    state = {"up": False}
    got = []

    def flaky(batch):
        if not state["up"]:
            raise TimeoutError("throttled")
        got.extend(batch)

    delivery = Delivery("test", flaky, capacity=100, batch=100, interval_s=0.01)
    for i in range(10):
        delivery.put(i)
    time.sleep(0.1)
    state["up"] = True
    counts = delivery.close(timeout_s=5)
    assert got == list(range(10)) and counts.delivered == 10 and counts.undelivered == 0


def test_the_job_context_follows_the_launchers_environment(tiny):
    run = "ts-nlp-tiny-cpu--lr1"
    job = JobContext.from_environment(
        tiny,
        {
            "MLFLOW_TRACKING_URI": "http://127.0.0.1:5000",
            "TRAINSTACK_RUN": run,
            "TRAINING_JOB_NAME": f"{run}-3",
            "TRAINSTACK_TEAM": "nlp",
            "TRAINSTACK_PREVIOUS_JOB_END": "MaxRuntime",
        },
    )
    assert (job.job_index, job.experiment, job.run_name, job.run_id) == (3, "nlp/tiny-cpu", run, None)
    tags = job_tags(tiny, job)
    assert tags["trainstack.run"] == run and tags["trainstack.job"] == "3"
    assert tags["trainstack.job.2.ended"] == "MaxRuntime"  # the supervisor's reason for job 2
    assert tags["trainstack.job.3.name"] == f"{run}-3"
    # MLflow's own variables win: MLFLOW_EXPERIMENT_NAME and MLFLOW_RUN_ID as SageMaker or a user sets them
    given = JobContext.from_environment(tiny, {"MLFLOW_EXPERIMENT_NAME": "sweeps", "MLFLOW_RUN_ID": "abc"})
    assert (given.experiment, given.run_id) == ("sweeps", "abc")


def test_params_are_the_resolved_recipe_flattened(tiny):
    params = recipe_params(tiny)
    assert params["recipe.training.lr"] == "0.003"
    assert params["recipe.name"] == "tiny-cpu"  # strings as themselves, not JSON-quoted
    assert params["recipe.tracking.mlflow"] == "off"


@pytest.mark.parametrize(
    "error, stopped, status, state",
    [
        (None, False, "FINISHED", "completed"),
        (None, True, "KILLED", None),  # SIGTERM: the supervisor decides what the run does next
        (RecipeError("recipe", "training.lr", "bad"), False, "FAILED", "failed"),  # exit 2: fatal
        (RuntimeError("a collective timed out"), False, "FAILED", None),  # a crash: the next job retries
    ],
)
def test_how_a_job_ended_follows_the_supervisors_exit_code_rules(error, stopped, status, state):
    outcome = outcome_of(error, stopped)
    assert (outcome.status, outcome.run_state) == (status, state)
    if isinstance(error, TrainstackError):
        assert error.exit_code in exit_codes.FATAL


def test_only_rank_zero_tracks(tiny):
    env = {"MLFLOW_TRACKING_URI": "http://127.0.0.1:9", "TRAINSTACK_RUN": "ts-platform-tiny-cpu--x"}
    other, _ = open_tracking(tiny, 1, plan=None, data_source="synthetic", data_dir=None, environ=env)
    assert not other.on  # one MLflow run per training run, never one per rank (mlflow/mlflow#11782)


def test_an_unreachable_tracker_costs_the_loop_an_append_and_the_job_nothing(tiny, caplog):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}", "TRAINSTACK_RUN": "ts-platform-tiny-cpu--down"}
    tracking, _ = open_tracking(tiny, 0, plan=None, data_source="synthetic", data_dir=None, environ=env)
    assert tracking.on
    line = "step=1 loss=2.5 lr=0.001 tokens_per_sec=10 tflops_per_gpu=1 mfu=0.1 mem_gib=1 step_time_s=0.1"
    started = time.perf_counter()
    for step in range(1, 201):
        tracking.log_line(step, line, grad_norm=1.0)
    assert (time.perf_counter() - started) / 200 < 2e-3
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="trainer.tracking"):
        tracking.close(outcome_of(None, False), job_index=1, timeout_s=1.0)
    assert time.monotonic() - started < 3.0
    (report,) = [r.getMessage() for r in caplog.records if "records delivered" in r.getMessage()]
    assert "0 of 202 records delivered" in report and "202 undelivered at exit" in report


def test_a_tracker_never_reached_holds_the_jobs_end_two_seconds_not_the_whole_drain_time():
    def unreachable():
        raise ConnectionRefusedError("nothing listens")

    delivery = Delivery("test", lambda batch: None, prepare=unreachable, interval_s=0.01)
    delivery.put(1)
    time.sleep(0.1)  # at least one failed attempt
    started = time.monotonic()
    counts = delivery.close(timeout_s=30)
    assert time.monotonic() - started < 2.0 + 1.0 and counts.undelivered == 1
