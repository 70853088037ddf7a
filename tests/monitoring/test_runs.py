"""trainstack.aws.runs: which jobs belong to a recipe, and how a run compares to its plan (no AWS)."""

from __future__ import annotations

import io
from datetime import UTC, datetime, timedelta

import pytest

from trainstack.aws.request import job_name
from trainstack.aws.runs import (
    Job,
    Sample,
    assess,
    is_recipe_job,
    job_from_description,
    latest_from_results,
    metric_queries,
)
from trainstack.planner import plan
from trainstack.protocol.metrics import FIELDS
from trainstack.recipes.loader import resolve
from trainstack.recipes.naming import job_name_prefix, recipe_hash

pytestmark = pytest.mark.fast

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


@pytest.fixture(scope="module")
def recipe():
    return resolve("30b-fp8").recipe


@pytest.fixture(scope="module")
def the_plan(recipe):
    return plan(recipe)


def test_jobs_named_by_the_request_builder_belong_to_their_recipe(recipe):
    name = job_name(recipe, None, "r261130")
    assert is_recipe_job(name, job_name_prefix(recipe, None))
    assert not is_recipe_job(name, job_name_prefix(recipe, "nlp"))


def test_a_recipe_whose_name_extends_another_is_not_its_run(recipe):
    longer = recipe.model_copy(update={"name": f"{recipe.name}-128k"})
    other = job_name(longer, None, "x1")
    prefix = job_name_prefix(recipe, None)
    assert other.startswith(f"ts-{recipe.tags.team}-{recipe.name}-")  # the names overlap as strings ...
    assert not is_recipe_job(other, prefix)  # ... but not the job-name prefix
    assert is_recipe_job(other, job_name_prefix(longer, None))


def describe(recipe, **changes):
    name = job_name(recipe, None, "r1")
    base = {
        "TrainingJobName": name,
        "TrainingJobStatus": "InProgress",
        "SecondaryStatus": "Training",
        "CreationTime": NOW - timedelta(hours=3),
        "TrainingStartTime": NOW - timedelta(hours=2),
        "CheckpointConfig": {
            "S3Uri": f"s3://bucket/checkpoints/platform/{recipe.name}/{name}",
            "LocalPath": "/opt/ml/checkpoints",
        },
        "ResourceConfig": {
            "InstanceType": recipe.compute.instance_type,
            "InstanceCount": recipe.compute.instance_count,
        },
        "HyperParameters": {"training.steps": "2000", "name": f'"{recipe.name}"'},
    }
    base.update(changes)
    return base


def test_job_from_description_reads_the_launched_steps_and_checkpoint(recipe):
    job = job_from_description(describe(recipe))
    assert job.steps_target == 2000  # a short tuning run: --max-steps, not the recipe's steps
    assert job.checkpoint_uri.endswith(job.name)
    assert job.running and job.instance_count == recipe.compute.instance_count
    assert job.elapsed_hours(NOW) == pytest.approx(2.0)


def test_the_checkpoint_uri_is_the_runs_prefix_from_the_jobs_environment(recipe):
    uri = "s3://bucket/checkpoints/platform/30b-fp8/main/"
    job = job_from_description(
        describe(recipe, CheckpointConfig=None, Environment={"TRAINSTACK_CHECKPOINT_URI": uri})
    )
    assert job.checkpoint_uri == uri


class _Unsorted:
    """SageMaker as the emulator answers ListTrainingJobs: oldest first, whatever SortOrder says."""

    def __init__(self, names_oldest_first: list[str]) -> None:
        self.names = names_oldest_first

    def get_paginator(self, operation: str):
        assert operation == "list_training_jobs"
        return self

    def paginate(self, **kwargs):
        summaries = [
            {"TrainingJobName": n, "CreationTime": NOW - timedelta(hours=len(self.names) - i)}
            for i, n in enumerate(self.names)
        ]
        yield {"TrainingJobSummaries": summaries[:2]}
        yield {"TrainingJobSummaries": summaries[2:]}

    def describe_training_job(self, TrainingJobName: str):  # noqa: N803 (boto3's spelling)
        i = self.names.index(TrainingJobName)
        return {
            "TrainingJobName": TrainingJobName,
            "CreationTime": NOW - timedelta(hours=len(self.names) - i),
        }


def test_find_jobs_sorts_every_matching_job_before_it_cuts(recipe):
    """`status --runs 1` and `logs` show the newest job even where ListTrainingJobs ignores SortOrder."""
    from trainstack.aws.runs import find_jobs

    run = job_name(recipe, None, "r1")
    names = [f"{run}-{i}" for i in range(1, 6)]
    assert [j.name for j in find_jobs(_Unsorted(names), job_name_prefix(recipe, None), limit=1)] == [
        names[-1]
    ]
    assert [j.name for j in find_jobs(_Unsorted(names), job_name_prefix(recipe, None), limit=3)] == names[
        :1:-1
    ]


def samples(**values):
    return {k: Sample(v, NOW - timedelta(minutes=1)) for k, v in values.items()}


def test_below_the_slow_fraction_of_plan_is_slow(recipe, the_plan):
    job = job_from_description(describe(recipe))
    planned = the_plan.throughput.tokens_per_sec_per_gpu
    fraction = recipe.monitoring.slow_fraction
    slow = assess(job, samples(step=500, tokens_per_sec=planned * (fraction - 0.05)), recipe, the_plan, NOW)
    on_plan = assess(
        job, samples(step=500, tokens_per_sec=planned * (fraction + 0.05)), recipe, the_plan, NOW
    )
    assert slow.slow is True and on_plan.slow is False
    assert slow.slow_threshold == pytest.approx(fraction * planned)
    assert slow.throughput_ratio == pytest.approx(fraction - 0.05)


def test_no_throughput_yet_is_neither_slow_nor_on_plan(recipe, the_plan):
    report = assess(job_from_description(describe(recipe)), {}, recipe, the_plan, NOW)
    assert report.slow is None and report.step is None and report.progress == 0.0


def test_the_newest_val_loss_is_reported_and_none_before_the_first_evaluation(recipe, the_plan):
    job = job_from_description(describe(recipe))
    assert assess(job, samples(step=10, loss=3.0), recipe, the_plan, NOW).val_loss is None
    assert assess(job, samples(step=0, val_loss=5.7), recipe, the_plan, NOW).val_loss == 5.7


def test_progress_and_cost_follow_steps_and_wall_time(recipe, the_plan):
    job = job_from_description(describe(recipe))
    step_time = 12.0
    report = assess(
        job, samples(step=500, step_time_s=step_time, tokens_per_sec=5000.0), recipe, the_plan, NOW
    )
    assert report.progress == pytest.approx(500 / 2000)
    rate = the_plan.cost.usd_per_hour
    assert report.cost_so_far_usd == pytest.approx(rate * 2.0)
    assert report.hours_remaining == pytest.approx(1500 * step_time / 3600)
    assert report.cost_projected_usd == pytest.approx(rate * (2.0 + 1500 * step_time / 3600))


def test_a_finished_run_costs_what_it_ran(recipe, the_plan):
    job = job_from_description(
        describe(
            recipe,
            TrainingJobStatus="Completed",
            SecondaryStatus="Completed",
            TrainingEndTime=NOW - timedelta(hours=1),
        )
    )
    report = assess(job, samples(step=2000), recipe, the_plan, NOW)
    assert report.progress == 1.0 and report.hours_remaining is None
    assert (
        report.cost_projected_usd == report.cost_so_far_usd == pytest.approx(the_plan.cost.usd_per_hour * 1.0)
    )


def test_metric_queries_ask_for_every_trainer_metric_by_job():
    queries = metric_queries("ts-platform-30b-fp8--0123abcd-x")
    names = {q["MetricStat"]["Metric"]["MetricName"] for q in queries}
    assert names == {f.metric_name for f in FIELDS}
    dims = {d["Name"] for q in queries for d in q["MetricStat"]["Metric"]["Dimensions"]}
    assert dims == {"TrainingJobName"}


def test_latest_value_wins_and_nan_is_skipped():
    results = [
        {
            "Id": "tokens_per_sec",
            "Timestamps": [NOW, NOW - timedelta(minutes=1), NOW + timedelta(minutes=1)],
            "Values": [2.0, 1.0, float("nan")],
        }
    ]
    latest = latest_from_results(results)
    assert latest["tokens_per_sec"].value == 2.0


def test_recipe_hash_is_the_segment_after_the_prefix(recipe):
    name = job_name(recipe, None, "s")
    assert name.removeprefix(job_name_prefix(recipe, None)).startswith(f"{recipe_hash(recipe)}-")
    assert Job(name=name, status="Failed", secondary_status="Failed", created=NOW).running is False


@pytest.mark.parametrize(
    ("status", "words"),
    [
        ("InProgress", "no step reported yet / 2,000 steps (0.0%)"),
        ("Completed", "no step metric / 2,000 steps"),
    ],
)
def test_status_panel_says_an_ended_job_will_not_report_a_step(recipe, the_plan, status, words):
    from rich.console import Console

    from trainstack.cli.commands.status import _run_panel

    job = job_from_description(describe(recipe, TrainingJobStatus=status))
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(_run_panel(assess(job, {}, recipe, the_plan, NOW), recipe))
    assert words in console.export_text()
