"""The restart cost: planned (trainstack.planner.restart: one job's end to the next job's first step, in
parts with ranges; its billed part priced per restart and counted in the run's hours) and measured
(trainstack.aws.restarts: DescribeTrainingJob's times and transitions and the first metric line, shown
by `trainstack status`). No AWS: descriptions are built as DescribeTrainingJob documents them."""

from __future__ import annotations

import io
import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from botocore.exceptions import ClientError
from rich.console import Console
from typer.testing import CliRunner

from trainstack.aws.restarts import measure_restart, previous_job_name
from trainstack.aws.runs import Sample, assess, job_from_description
from trainstack.cli.commands import status
from trainstack.cli.main import app
from trainstack.planner import plan
from trainstack.planner.restart import COMPILE_S, DECISION_S, PROVISIONING_S, plan_restart
from trainstack.planner.run_plan import HOUR_S
from trainstack.recipes.loader import resolve

pytestmark = pytest.mark.fast

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
RUN = "ts-platform-30b-fp8--main"


def test_a_restart_is_its_parts_and_only_what_follows_training_start_time_is_billed():
    """DescribeTrainingJob: "You are billed for the time interval between [TrainingStartTime] and the
    value of TrainingEndTime": the decision and the provisioning (Starting) are not billed."""
    restart = plan_restart(restore_seconds=150.0, compiled=True)
    names = [p.name for p in restart.parts]
    assert names == ["decision", "provisioning", "image", "trainer start", "load", "compile"]
    assert [p.name for p in restart.parts if not p.billed] == ["decision", "provisioning"]
    load = next(p for p in restart.parts if p.name == "load")
    assert load.seconds == (75.0, 150.0, 300.0)  # the plan's restore, at 2x / 0.5x the assumed S3 rate
    assert all(p.source for p in restart.parts)
    assert all(low <= planned <= high for p in restart.parts for low, planned, high in [p.seconds])
    assert restart.seconds == pytest.approx(sum(p.seconds[1] for p in restart.parts))
    assert restart.billed_seconds == pytest.approx(restart.seconds - DECISION_S[1] - PROVISIONING_S[1])
    assert restart.first_job_billed_seconds == pytest.approx(restart.billed_seconds - 150.0)
    low, high = restart.seconds_range
    assert low < restart.seconds < high
    uncompiled = plan_restart(restore_seconds=150.0, compiled=False)
    assert restart.seconds - uncompiled.seconds == pytest.approx(COMPILE_S[1])


def test_the_run_plan_prices_each_restart_and_counts_its_billed_part_in_the_run():
    p = plan(resolve("64b-fp8", overrides=["compute.max_runtime_hours=72"]).recipe)
    run, cost = p.run, p.cost
    restart = run.restart
    assert restart.parts[4].seconds[1] == pytest.approx(run.checkpoint.restore_seconds)
    assert cost.usd_per_restart == pytest.approx(cost.usd_per_hour * restart.billed_seconds / HOUR_S)
    low, high = cost.usd_per_restart_range
    assert low < cost.usd_per_restart < high
    # every job starts up (billed part); every job after the first restores too
    assert run.startup_hours_per_job == pytest.approx(restart.first_job_billed_seconds / HOUR_S)
    boundaries = (
        run.jobs * run.startup_hours_per_job + (run.jobs - 1) * run.checkpoint.restore_seconds / HOUR_S
    )
    assert run.overhead_hours == pytest.approx(boundaries + run.save_blocking_hours + run.failure_hours)
    assert run.restarts == pytest.approx(run.jobs - 1 + run.expected_failures)
    assert run.restart_wall_hours == pytest.approx(run.restarts * restart.seconds / HOUR_S)

    shown = CliRunner().invoke(
        app, ["plan", "64b-fp8", "--set", "compute.max_runtime_hours=72"], env={"COLUMNS": "200"}
    )
    assert shown.exit_code == 0
    assert f"{restart.seconds / 60:,.0f} min ({restart.seconds_range[0] / 60:,.0f}-" in shown.stdout
    assert f"{cost.usd_per_restart:,.0f} USD" in shown.stdout and "per restart" in shown.stdout
    as_json = json.loads(CliRunner().invoke(app, ["plan", "64b-fp8", "--json"]).stdout)
    assert {"seconds", "seconds_range", "billed_seconds", "parts"} <= set(as_json["run"]["restart"])
    assert as_json["run"]["restart"]["parts"][1]["source"].startswith("estimate:")
    assert as_json["cost"]["usd_per_restart"] > 0


def _description(index: int, created: datetime, transitions: list[tuple[str, int, int | None]], **extra):
    """A DescribeTrainingJob response of job `index` of RUN; transitions as (Status, minutes after
    `created` it started, minutes it ended)."""
    return {
        "TrainingJobName": f"{RUN}-{index}",
        "TrainingJobStatus": "InProgress",
        "SecondaryStatus": transitions[-1][0],
        "CreationTime": created,
        "Environment": {"TRAINSTACK_RUN": RUN, "TRAINSTACK_CHECKPOINT_URI": "s3://b/checkpoints/"},
        "ResourceConfig": {"InstanceType": "ml.p6-b200.48xlarge", "InstanceCount": 4},
        "SecondaryStatusTransitions": [
            {
                "Status": status,
                "StartTime": created + timedelta(minutes=start),
                **({"EndTime": created + timedelta(minutes=end)} if end is not None else {}),
                "StatusMessage": "Launching requested ML instances" if status == "Starting" else "",
            }
            for status, start, end in transitions
        ],
        **extra,
    }


def test_the_measured_restart_runs_from_the_previous_jobs_end_to_the_first_metric_line():
    ended = NOW - timedelta(hours=1)
    previous = job_from_description(
        _description(1, ended - timedelta(days=3), [("Starting", 0, 9), ("Training", 9, 4320)])
        | {"TrainingJobStatus": "Stopped", "TrainingEndTime": ended}
    )
    created = ended + timedelta(minutes=2)  # the supervisor's decision
    job = job_from_description(
        _description(2, created, [("Starting", 0, 8), ("Downloading", 8, 9), ("Training", 9, None)])
        | {"TrainingStartTime": created + timedelta(minutes=8)}
    )
    assert job.run == RUN and previous_job_name(job) == f"{RUN}-1" and previous_job_name(previous) is None
    first_metric = (created + timedelta(minutes=16), 10.0)  # step 10's line
    measured = measure_restart(job, previous, first_metric)
    assert measured.parts == (
        ("decision", 120.0),
        ("provisioning", 480.0),
        ("downloading", 60.0),
        ("to the first metric line", 420.0),
    )
    assert measured.seconds == 18 * 60 and measured.billed_seconds == 8 * 60 and measured.first_step == 10
    assert measure_restart(job, previous, None) is None  # no metric line yet
    first_job = measure_restart(previous, None, (ended - timedelta(days=3) + timedelta(minutes=15), 10.0))
    assert first_job.previous is None and [n for n, _ in first_job.parts] == [
        "provisioning",
        "to the first metric line",
    ]


def test_status_shows_each_jobs_measured_restart_beside_the_plan(monkeypatch):
    recipe = resolve("30b-fp8").recipe
    the_plan = plan(recipe)
    ended = NOW - timedelta(hours=1)
    created = ended + timedelta(minutes=2)
    first = _description(1, ended - timedelta(days=3), [("Starting", 0, 9), ("Training", 9, 4320)]) | {
        "TrainingJobStatus": "Stopped",
        "TrainingEndTime": ended,
    }
    second = job_from_description(
        _description(2, created, [("Starting", 0, 8), ("Training", 8, None)])
        | {"TrainingStartTime": created + timedelta(minutes=8)}
    )

    class SageMaker:  # job 1 is not among the jobs status fetched: it is described
        def describe_training_job(self, TrainingJobName):
            if TrainingJobName != first["TrainingJobName"]:
                raise ClientError({"Error": {"Code": "ValidationException"}}, "DescribeTrainingJob")
            return first

    trends = {second.name: {"step": [(created + timedelta(minutes=14), 10.0)]}}
    restarts = status.measured_restarts(SageMaker(), [second], trends)
    measured = restarts[second.name]
    assert measured.previous == first["TrainingJobName"] and measured.seconds == 16 * 60

    report = assess(second, {"step": Sample(10.0, NOW)}, recipe, the_plan, NOW)
    console = Console(width=120, record=True, file=io.StringIO())
    console.print(status._run_panel(report, recipe, None, trends[second.name], the_plan, measured))
    text = " ".join(console.export_text().split())
    usd = report.usd_per_hour * 6 * 60 / 3600
    assert f"restart 16 min from {RUN}-1's end to the first metric line (step 10): decision 2," in text
    assert f"6 min billed, {usd:,.0f} USD; plan {the_plan.run.restart.seconds / 60:.0f} min" in text

    class Clients:
        where = "the local emulator (http://localhost:55555)"

    snapshot = status.Snapshot([report], {}, [], True, trends, restarts)
    monkeypatch.setattr("trainstack.aws.runs.aws_clients", lambda local: Clients())
    monkeypatch.setattr("trainstack.aws.run_status.collect_status", lambda *a: snapshot)
    (shown,) = json.loads(CliRunner().invoke(app, ["status", "30b-fp8", "--json"]).stdout)["runs"]
    assert shown["restart"]["parts"] == {
        "decision": 120.0,
        "provisioning": 480.0,
        "to the first metric line": 360.0,
    }
    assert shown["restart"]["billed_seconds"] == 360.0


def test_the_restart_table_in_the_docs_shows_the_planners_current_64b_figures():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "runs.md").read_text()
    doc = doc[doc.index("## Restarts: planned and measured") :]
    p = plan(resolve("64b-fp8").recipe)
    for part in p.run.restart.parts:
        label = "checkpoint load" if part.name == "load" else part.name
        row = next(line for line in doc.splitlines() if line.startswith(f"| {label} |"))
        planned, low, high = (float(x) for x in re.findall(r"\d+(?:\.\d+)?", row.split("|")[2])[:3])
        expected = [s / 60 for s in (part.seconds[1], part.seconds[0], part.seconds[2])]
        assert [planned, low, high] == pytest.approx(expected, abs=0.051 if planned < 10 else 0.5), label
        assert ("| yes |" in row) == part.billed, label
    billed = f"{p.run.restart.billed_seconds / 60:.0f} of the {p.run.restart.seconds / 60:.0f} minutes"
    low, high = p.cost.usd_per_restart_range
    assert f"{billed}, {p.cost.usd_per_restart:,.0f} USD ({low:,.0f}-{high:,.0f})" in " ".join(doc.split())
