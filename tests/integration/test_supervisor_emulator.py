"""The supervisor's state machines, run by the local emulator's Step Functions interpreter, against a
real (emulated) run registry, SageMaker and SNS: every case of supervisor_cases.py gets the decision
the pure function gives, the registry and the next job follow it, the notification says it, and the
history events of each kind of execution are counted.

The definitions are the ones the RunSupervisor construct deploys, built by the same functions with
literal values instead of CDK tokens (supervisor_cloud.py; the deployed stack runs in
test_emulator_deploy.py). The faults a run meets are driven through the same machines in
test_run_faults_emulator.py.
"""

from __future__ import annotations

import pytest
from supervisor_cases import CASES, Case
from supervisor_cloud import JOB_INDEX_MAX, job_ended, launch, set_up
from test_supervisor_decisions import HISTORY_LIMIT, definitions, history_bound

from trainstack.aws.registry import read_run
from trainstack.aws.supervisor import RUN_STATE, EndedJob, Outcome, RunRecord, next_action, progress
from trainstack.emulator import events as emulator_events

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("supervisor-emulator")]


@pytest.fixture(scope="module")
def cloud(supervisor_cloud):
    return supervisor_cloud


@pytest.fixture(scope="module")
def decided(cloud) -> dict[str, tuple]:
    """Every case of the table, each its own run: launched, its record made what the case says, its job
    ended, its end decided by JobEnded. (One at a time: concurrent executions were slower here.)"""
    found = {}
    for index, case in enumerate(CASES):
        run, _ = launch(cloud, f"case-{index}")
        set_up(cloud, run, case)
        before = read_run(cloud.ddb, "runs", run)
        emulator_events.end_training_job(
            cloud.env,
            f"{run}-1",
            *(case.status, case.secondary, case.reason),
            final_step=case.final_step,
            saved_step=case.saved_step,
        )
        cloud.messages()
        decision, _ = job_ended(cloud, f"{run}-1")
        found[case.id] = (run, before, decision, read_run(cloud.ddb, "runs", run), cloud.messages())
    return found


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_the_state_machine_decides_every_case_as_the_pure_function_does(cloud, decided, case: Case) -> None:
    run, before, decision, after, notes = decided[case.id]
    job = f"{run}-1"

    record = RunRecord(
        run,
        before.state,
        before.current_job,
        before.job_index,
        before.counted,
        before.max_jobs,
        before.stop_requested,
        before.crashes,
        before.stalled,
        before.capacity_minutes,
        before.capacity_wait,
        before.capacity_budget,
        steps=before.steps,
        step=before.step,
        saved_step=before.saved_step,
    )
    ended = EndedJob(job, case.status, case.secondary, case.reason, case.final_step, case.saved_step)
    expected = next_action(record, ended)
    assert (decision["Outcome"], decision["Rule"]) == (expected.outcome.value, expected.rule)
    assert (decision["Outcome"], decision["Rule"]) == (case.outcome, case.rule)
    assert decision["Why"] == expected.why and decision["Next"] == expected.next_step

    if expected.outcome is Outcome.IGNORED:
        assert (after.state, after.current_job) == (before.state, before.current_job) and notes == []
        return
    assert after.state == RUN_STATE[expected.outcome]
    assert after.why == expected.why and after.next_step == expected.next_step
    assert {j.name: j.status for j in after.jobs}[job] == case.status
    assert after.step == (case.final_step if case.final_step is not None else before.step)
    assert after.saved_step == progress(record, ended).saved_step
    (note,) = notes
    assert f"trainstack run {run} " in note and f"job {job} ended {case.status} ({case.secondary})" in note
    assert f"Next: {expected.next_step}." in note and f"Checkpoints: {before.checkpoint_uri}." in note
    if expected.outcome is Outcome.NEXT_JOB:
        nxt = cloud.sagemaker.describe_training_job(TrainingJobName=f"{run}-2")
        assert nxt["TrainingJobStatus"] == "InProgress"
        first = cloud.sagemaker.describe_training_job(TrainingJobName=job)
        assert (
            nxt["Environment"]["TRAINSTACK_CHECKPOINT_URI"]
            == first["Environment"]["TRAINSTACK_CHECKPOINT_URI"]
        )
        assert nxt["Environment"]["TRAINSTACK_RUN"] == run
        assert after.current_job == f"{run}-2" and after.job_index == 2
        assert after.crashes == expected.crashes  # counted by a crash, reset only by a job that trained
        assert case.crashes_after is None or after.crashes == case.crashes_after
        assert (after.counted, after.capacity_minutes, after.capacity_wait) == (
            expected.counted,
            expected.capacity_minutes,
            expected.wait_minutes,
        )
        # Built from the run's recorded request, whatever is deployed: the same request, its own name.
        sent = {k: v for k, v in nxt.items() if k in before.request}
        assert sent["HyperParameters"] == before.request["HyperParameters"]
        assert sent["ResourceConfig"]["InstanceCount"] == before.request["ResourceConfig"]["InstanceCount"]


def test_a_repeated_event_starts_no_second_job(cloud) -> None:
    run, _ = launch(cloud, "repeat")
    emulator_events.end_training_job(cloud.env, f"{run}-1", "Stopped", "MaxRuntimeExceeded")
    first, _ = job_ended(cloud, f"{run}-1")
    again, _ = job_ended(cloud, f"{run}-1")  # EventBridge delivers at least once
    assert (first["Outcome"], again["Outcome"]) == ("next_job", "ignored")
    assert [j.name for j in read_run(cloud.ddb, "runs", run).jobs] == [f"{run}-1", f"{run}-2"]


def test_history_events_per_execution_stay_far_below_the_limit(cloud, capsys) -> None:
    """Counted in the emulator: a start, a decision that starts the next job, a decision that ends the
    run. None depends on how long a job trains, so a 28-day job costs these two executions and a 90-day
    run (4 jobs at 28 days) four of each; each execution is also bounded by its definition."""
    run, start = launch(cloud, "history")
    emulator_events.end_training_job(cloud.env, f"{run}-1", "Stopped", "MaxRuntimeExceeded")
    _, next_job = job_ended(cloud, f"{run}-1")
    emulator_events.end_training_job(cloud.env, f"{run}-2", "Completed", "Completed")
    _, completed = job_ended(cloud, f"{run}-2")
    counts = {
        "start job": len(cloud.events(start)),
        "job ended, next job": len(cloud.events(next_job)),
        "job ended, run completed": len(cloud.events(completed)),
    }
    bounds = {name: history_bound(d) for name, d in definitions().items()}
    assert counts["start job"] <= bounds["StartJob"]
    assert max(counts["job ended, next job"], counts["job ended, run completed"]) <= bounds["JobEnded"]
    per_job = counts["start job"] + counts["job ended, next job"]
    job_hours = 28 * 24
    with capsys.disabled():
        print(f"\nhistory events: {counts}; per 28-day job {per_job} ({per_job / job_hours:.2f} per hour)")
    assert max(counts.values()) < HISTORY_LIMIT / 100


STATE_PAYLOAD_MAX = 262_144  # bytes of UTF-8: any state's input or output (Step Functions quotas)


def payload_sizes(events: list[dict]) -> list[int]:
    """The size of every state's (and the execution's) input and output in a history."""
    return [
        len(text.encode())
        for event in events
        for key, details in event.items()
        if key.endswith("EventDetails") and isinstance(details, dict)
        for field in ("input", "output")
        if isinstance(text := details.get(field), str)
    ]


def test_state_payloads_and_the_run_record_stay_within_what_aws_accepts(cloud, capsys) -> None:
    """The emulator accepts payloads and items of any size. Measured here on a run whose first job
    crashed with a failure reason of SageMaker's full 1,024 characters; the record is then extrapolated,
    by the growth measured per job, to a run's most jobs (naming.JOB_INDEX_MAX) and a full history
    (test_aws_limits.py bounds the same record from the definitions, for every recipe)."""
    from trainstack.aws.registry import HISTORY_MAX, ITEM_MAX, WHAT_MAX, WHO_MAX, item_bytes
    from trainstack.protocol.exit_codes import FAILURE_REASON_MAX

    run, start = launch(cloud, "limits")
    reason = ("AlgorithmError: " + "x" * FAILURE_REASON_MAX)[:FAILURE_REASON_MAX]
    emulator_events.end_training_job(cloud.env, f"{run}-1", "Failed", "Failed", reason)
    _, next_job = job_ended(cloud, f"{run}-1")
    two_jobs = item_size(cloud, run, item_bytes)
    emulator_events.end_training_job(cloud.env, f"{run}-2", "Failed", "Failed", reason)
    job_ended(cloud, f"{run}-2")
    per_job = item_size(cloud, run, item_bytes) - two_jobs
    emulator_events.end_training_job(cloud.env, f"{run}-3", "Completed", "Completed")
    _, completed = job_ended(cloud, f"{run}-3")

    payload = max(size for arn in (start, next_job, completed) for size in payload_sizes(cloud.events(arn)))
    assert payload < STATE_PAYLOAD_MAX / 4
    history = HISTORY_MAX * (WHO_MAX + WHAT_MAX + 80)
    largest = two_jobs + per_job * (JOB_INDEX_MAX - 2) + history
    assert 0 < per_job < 300 and largest < ITEM_MAX * 0.9
    with capsys.disabled():
        print(
            f"\nlargest state payload {payload:,} B (limit {STATE_PAYLOAD_MAX:,}); run record {two_jobs:,} B "
            f"with 2 jobs, {per_job} B more per job, at most {largest:,} B with {JOB_INDEX_MAX} jobs and a "
            f"full history (limit {ITEM_MAX:,})"
        )


def item_size(cloud, run: str, measure) -> int:
    item = cloud.ddb.get_item(TableName="runs", Key={"run": {"S": run}}, ConsistentRead=True)["Item"]
    return measure(item)
