"""Recorded trainer output through the MetricDefinitions regexes: what SageMaker publishes, and what the
alarms then see against their thresholds.

SageMaker applies each MetricDefinition's regex to every log line and publishes the first capture
group as a value of that metric. `extract` does the same with the definitions exactly as the launcher
sends them (trainstack.protocol.metrics.metric_definitions), and the expected values come from splitting the
line on spaces and `=`, independently of those regexes.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from monitoring_helpers import definition, synth, tasks_of

from stacks.monitoring import Thresholds
from trainstack.planner import plan
from trainstack.protocol.metrics import FIELDS, SAVED_STEP_METRIC, format_line, metric_definitions
from trainstack.recipes.loader import resolve

pytestmark = pytest.mark.fast

RECORDED = (Path(__file__).parent / "data" / "trainer_cpu_tiny.log").read_text().splitlines()
TINY = Path(__file__).resolve().parents[1] / "trainer" / "fixtures" / "tiny.yaml"


def extract(lines: list[str]) -> dict[str, list[float]]:
    """metric name -> values, as SageMaker's MetricDefinitions would publish them."""
    out: dict[str, list[float]] = {d["Name"]: [] for d in metric_definitions()}
    for line in lines:
        for metric in metric_definitions():
            match = re.search(metric["Regex"], line)
            if match:
                out[metric["Name"]].append(float(match.group(1)))
    return out


def split_values(line: str) -> dict[str, float]:
    return {k: float(v) for k, v in (part.split("=", 1) for part in line.split())}


def test_recorded_trainer_output_yields_every_metric_for_every_metric_line():
    metric_lines = [line for line in RECORDED if line.startswith("step=")]
    assert len(metric_lines) == 40  # --max-steps 40 with log_every 1
    extracted = extract(RECORDED)
    for field in (f for f in FIELDS if not f.optional):  # the recording has no validation steps
        expected = [split_values(line)[field.key] for line in metric_lines]
        assert extracted[field.metric_name] == pytest.approx(expected), field.key


def test_log_lines_between_metric_lines_publish_only_the_saved_step_of_each_completed_checkpoint():
    other = [line for line in RECORDED if not line.startswith("step=")]
    assert any("step-000000030" in line for line in other)  # a checkpoint path that must not read as a step
    extracted = extract(other)
    completed = [re.search(r"checkpoint complete: \S*step-(\d+)", line) for line in other]
    saved = [int(m.group(1)) for m in completed if m]
    assert saved and extracted.pop(SAVED_STEP_METRIC) == saved
    assert all(values == [] for values in extracted.values())


def test_a_diverged_run_publishes_nan_rather_than_nothing():
    line = format_line(
        step=7,
        loss=float("nan"),
        lr=1e-4,
        tokens_per_sec=1.0,
        tflops_per_gpu=1.0,
        mfu=0.1,
        mem_gib=1.0,
        step_time_s=1.0,
        straggler_host=1,
        straggler_rank=0,
        straggler_compute_s=0.5,
        straggler_skew=0.0,
    )
    assert math.isnan(extract([line])["train:loss"][0])


def test_the_recorded_cpu_run_is_what_the_slow_alarm_catches():
    """The tiny recipe is planned for a p5 node; its CPU run is far below plan.

    Planned at a GPU-sized batch: at the fixture's 16 sequences each of the 8 GPUs gets 64 tokens per
    step, and the planner's fixed cost per step (20 ms, an assumption: trainstack.planner.calibration)
    puts that at about 3K tokens/s per GPU, below what the recording's single CPU rank, computing the
    whole batch, reports (about 5K). At 1,024 sequences the plan is about 49K tokens/s per GPU."""
    recipe = resolve(str(TINY), overrides=["training.global_batch=1024"]).recipe
    thresholds = Thresholds.of(recipe, plan(recipe))
    tokens = extract(RECORDED)["train:tokens_per_sec"]
    per_minute_average = sum(tokens) / len(tokens)  # the whole recording is well under one minute
    assert per_minute_average < thresholds.slow_tokens_per_sec
    # ... and the stall alarm counts datapoints of train:step: this run reported one per step.
    assert len(extract(RECORDED)["train:step"]) >= 1


@pytest.mark.parametrize(
    ("fraction_of_plan", "slow"), [(1.0, False), (0.75, False), (0.65, True), (0.2, True)]
)
def test_slow_alarm_threshold_against_lines_at_fractions_of_plan(fraction_of_plan, slow):
    s = synth("30b-fp8")
    thr = s.plan.throughput
    lines = [
        format_line(
            step=100 + i,
            loss=2.5 - 0.01 * i,
            lr=3e-4,
            tokens_per_sec=thr.tokens_per_sec_per_gpu * fraction_of_plan,
            tflops_per_gpu=thr.model_tflops_per_gpu * fraction_of_plan,
            mfu=thr.mfu * fraction_of_plan,
            mem_gib=s.plan.memory.peak_gib,
            step_time_s=thr.step_time_s / fraction_of_plan,
            straggler_host=3,
            straggler_rank=17,
            straggler_compute_s=thr.step_time_s / 3,
            straggler_skew=0.02,
        )
        for i in range(6)
    ]
    seen = extract(lines)["train:tokens_per_sec"]
    average = sum(seen) / len(seen)  # the alarm's AVG over the minute
    # The threshold the alarm manager puts on the Slow alarm, read from the synthesized definition.
    put_slow = tasks_of(definition(s))["PutSlow"]["Parameters"]
    assert put_slow["MetricName"] == "train:tokens_per_sec" and put_slow["Statistic"] == "Average"
    assert (average < put_slow["Threshold"]) is slow  # LessThanThreshold
    # the default slow_fraction is 0.7: the cases straddle it
    assert s.recipe.monitoring.slow_fraction == 0.7


def test_memory_and_mfu_lines_read_back_exactly():
    values = dict(
        step=12,
        loss=2.25,
        lr=2.5e-4,
        tokens_per_sec=6123.5,
        tflops_per_gpu=1401.25,
        mfu=0.3114,
        mem_gib=151.25,
        step_time_s=10.5,
        straggler_host=12,
        straggler_rank=95,
        straggler_compute_s=3.25,
        straggler_skew=0.375,
    )
    extracted = extract([format_line(**values)])
    for field in (f for f in FIELDS if not f.optional):
        assert extracted[field.metric_name] == [pytest.approx(values[field.key], rel=1e-5)]


def test_metric_definitions_stay_within_createtrainingjobs_limits():
    """AlgorithmSpecification.MetricDefinitions: at most 40; each Name 1-255 and Regex 1-500 characters
    (SageMaker API reference, CreateTrainingJob / MetricDefinition). botocore does not check lengths
    and the emulator accepts anything, so this is the check."""
    definitions = metric_definitions()
    assert len(definitions) <= 40
    assert all(1 <= len(d["Name"]) <= 255 and 1 <= len(d["Regex"]) <= 500 for d in definitions)
    assert len({d["Name"] for d in definitions}) == len(definitions)


def test_straggler_fields_name_the_host_as_a_number_and_never_match_inside_other_keys():
    line = format_line(
        step=5,
        loss=2.0,
        lr=1e-4,
        tokens_per_sec=10.0,
        tflops_per_gpu=1.0,
        mfu=0.1,
        mem_gib=1.0,
        step_time_s=9.75,
        straggler_host=7,
        straggler_rank=52,
        straggler_compute_s=3.5,
        straggler_skew=0.31,
    )
    extracted = extract([line])
    assert extracted["train:straggler_host"] == [7.0] and extracted["train:straggler_rank"] == [52.0]
    assert extracted["train:step"] == [5.0] and extracted["train:step_time_s"] == [9.75]
    assert extracted["train:straggler_skew"] == [pytest.approx(0.31)]
