"""`trainstack status`: step, tokens/s and loss trends as sparklines and an ETA against the plan
(trainstack.aws.trends, pure), drawn into the run panel; and the panel fits 120 columns even when piped
with long values (the demo's case). No AWS: jobs and metrics are built by hand."""

from __future__ import annotations

import io
import json
from datetime import UTC, datetime, timedelta

import pytest
from rich.console import Console
from typer.testing import CliRunner

from trainstack.aws import trends
from trainstack.aws.request import job_name
from trainstack.aws.runs import Sample, assess, job_from_description
from trainstack.cli.commands import status
from trainstack.cli.main import app
from trainstack.planner import plan
from trainstack.recipes.loader import resolve

pytestmark = pytest.mark.fast

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def test_sparkline_scales_between_min_and_max_and_buckets_long_series():
    assert trends.sparkline([1.0]) == ""
    assert trends.sparkline([0, 1, 2, 3, 4, 5, 6, 7]) == "▁▂▃▄▅▆▇█"
    assert trends.sparkline([5, 5, 5]) == "▄▄▄"
    long = trends.sparkline(list(range(100)), width=10)
    assert len(long) == 10 and long[0] == "▁" and long[-1] == "█"
    assert list(long) == sorted(long)  # a rising series stays rising after bucketing


def test_series_from_results_orders_points_and_drops_non_finite_values():
    t0 = NOW - timedelta(minutes=30)
    results = [
        {"Id": "loss", "Timestamps": [t0 + timedelta(minutes=20), t0], "Values": [2.0, 3.0]},
        {
            "Id": "tokens_per_sec",
            "Timestamps": [t0, t0 + timedelta(minutes=1)],
            "Values": [float("nan"), 9.0],
        },
        {"Id": "other", "Timestamps": [t0], "Values": [1.0]},
    ]
    series = trends.series_from_results(results, {"loss": "loss", "tokens_per_sec": "tokens_per_sec"})
    assert series == {
        "loss": [(t0, 3.0), (t0 + timedelta(minutes=20), 2.0)],
        "tokens_per_sec": [(t0 + timedelta(minutes=1), 9.0)],
    }
    text = trends.trend_text(series["loss"], "{:.4g}")
    assert text == "█▁  3 -> 2 over 20 min"
    assert trends.trend_text(series["tokens_per_sec"]) is None


def test_eta_compares_the_measured_finish_with_the_planned_one():
    started = NOW - timedelta(hours=2)
    # 1,000 steps planned at 10 s: the plan ends 2 h 46 min after the start; measured: 3 h more from now
    run_eta = trends.eta(started, 1000, 3.0, 10.0, NOW)
    assert run_eta.finish == NOW + timedelta(hours=3)
    assert run_eta.planned_finish == started + timedelta(seconds=10_000)
    assert run_eta.behind_hours == pytest.approx(5 - 10_000 / 3600)
    assert (
        run_eta.text(NOW) == "2026-11-30 15:00 UTC (in 3.0 h); plan: 2026-11-30 12:46 UTC, 2.2 h behind plan"
    )
    assert trends.eta(None, 1000, 3.0, 10.0, NOW) is None  # not training yet
    assert trends.eta(started, 1000, None, 10.0, NOW) is None  # ended


@pytest.fixture(scope="module")
def run():
    recipe = resolve("30b-fp8").recipe
    the_plan = plan(recipe)
    name = job_name(recipe, None, "r1")
    desc = {
        "TrainingJobName": name,
        "TrainingJobStatus": "InProgress",
        "SecondaryStatus": "Training",
        "CreationTime": NOW - timedelta(hours=3),
        "TrainingStartTime": NOW - timedelta(hours=2),
        "FailureReason": "x" * 300,  # a long value must wrap inside the panel, not widen it
        "CheckpointConfig": {"S3Uri": "s3://" + "b" * 60 + "/checkpoints/platform/30b-fp8/" + name},
        "ResourceConfig": {"InstanceType": recipe.compute.instance_type, "InstanceCount": 4},
        "HyperParameters": {"training.steps": "1000"},
    }
    job = job_from_description(desc)
    step_time = the_plan.throughput.step_time_s
    points = {
        "step": [(NOW - timedelta(minutes=60 - 10 * i), 20.0 * i) for i in range(6)],
        "tokens_per_sec": [(NOW - timedelta(minutes=60 - 10 * i), 5000.0 + 100 * i) for i in range(6)],
        "loss": [(NOW - timedelta(minutes=60 - 10 * i), 9.0 - i) for i in range(6)],
    }
    latest = {key: Sample(values[-1][1], values[-1][0]) for key, values in points.items()}
    latest["step_time_s"] = Sample(step_time * 1.5, NOW)
    report = assess(job, latest, recipe, the_plan, NOW)
    return recipe, the_plan, report, points


def test_the_run_panel_draws_trends_and_an_eta_against_the_plan(run):
    recipe, the_plan, report, points = run
    console = Console(width=120, record=True, file=io.StringIO())
    console.print(status._run_panel(report, recipe, None, points, the_plan))
    text = console.export_text()
    assert "step trend" in text and "▁▂▄▅▇█  0 -> 100 over 50 min" in text
    assert "loss trend" in text and "█▇▅▄▂▁  9 -> 4 over 50 min" in text
    assert "tokens/s trend" in text and "5,000 -> 5,500" in text
    expected = trends.eta(
        report.job.started, 1000, report.hours_remaining, the_plan.throughput.step_time_s, NOW
    )
    assert expected is not None and expected.behind_hours > 0  # measured 1.5 x the planned step time
    assert "ETA" in text and "behind plan" in text


def test_every_status_panel_fits_120_columns_when_piped(run, monkeypatch):
    recipe, the_plan, report, points = run
    snapshot = status.Snapshot([report], {}, [], True, {report.job.name: points})

    class Clients:
        where = "the local emulator (http://localhost:55555)"

    monkeypatch.setattr("trainstack.aws.runs.aws_clients", lambda local: Clients())
    monkeypatch.setattr("trainstack.aws.run_status.collect_status", lambda *a: snapshot)
    result = CliRunner().invoke(app, ["status", "30b-fp8"], env={"COLUMNS": None})
    assert result.exit_code == 0, result.output
    widths = [len(line) for line in result.stdout.splitlines()]
    assert max(widths) <= 120, max(widths)
    assert result.stdout.count("x" * 20) >= 10 and "".join(result.stdout.split()).count("x") >= 300  # wrapped
    as_json = CliRunner().invoke(app, ["status", "30b-fp8", "--json"])
    (shown,) = json.loads(as_json.stdout)["runs"]
    assert shown["trends"]["loss"][0] == [points["loss"][0][0].isoformat(), 9.0]
    assert shown["behind_plan_hours"] > 0 and shown["eta"] and shown["planned_finish"]
