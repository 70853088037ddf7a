"""The trainer's metric line: defined once, read by the trainer, the launcher and the dashboard.

The trainer prints one line per log interval:

    step=120 loss=2.4131 lr=0.0003 tokens_per_sec=245000.0 tflops_per_gpu=1510.2 mfu=0.3356 mem_gib=151.2
        step_time_s=5.35 straggler_host=3 straggler_rank=17 straggler_compute_s=1.92 straggler_skew=0.04

(one line; on a validation step it ends with `val_loss=2.5012`, and for a blend with one
`val_loss_<source>=` per source). The straggler fields name the rank whose own compute was slowest on
the log step and how much slower than the median rank it was; see trainer.metrics.throughput for what is
timed and why (step time cannot show it: collectives make every rank wait for the slowest).
`straggler_host` is the N of SageMaker's host name algo-N (metric values are numbers), 0 off SageMaker.

SageMaker turns such lines into CloudWatch metrics through the training job's MetricDefinitions;
`metric_definitions()` generates those regexes from the same table, so a renamed or added metric
cannot drift between the trainer, the request and the dashboard. This module must stay free of
third-party imports: the training image imports it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

METRIC_PREFIX = "train:"  # SageMaker metric names shown in the console and in CloudWatch


@dataclass(frozen=True)
class MetricField:
    key: str  # as printed in the line
    kind: type  # int or float
    unit: str
    description: str
    optional: bool = False  # printed only on some log steps (validation: every validation.every_steps)

    @property
    def metric_name(self) -> str:
        return f"{METRIC_PREFIX}{self.key}"

    @property
    def regex(self) -> str:
        # Anchored on a space or line start so `loss=` never matches inside `val_loss=`, and capturing
        # only the number (nan/inf included, so a diverged run is visible rather than silent).
        number = r"[0-9]+" if self.kind is int else r"[-+]?(?:[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?|nan|inf)"
        return rf"(?:^|\s){re.escape(self.key)}=({number})(?=\s|$)"


FIELDS: tuple[MetricField, ...] = (
    MetricField("step", int, "Count", "optimizer step just completed"),
    MetricField("loss", float, "None", "mean training loss over the log interval"),
    MetricField("lr", float, "None", "learning rate at this step"),
    MetricField("tokens_per_sec", float, "Count/Second", "training tokens per second per GPU"),
    MetricField("tflops_per_gpu", float, "None", "achieved model TFLOP/s per GPU"),
    MetricField("mfu", float, "None", "model FLOPs utilization, 0..1, against the dense peak"),
    MetricField("mem_gib", float, "Gigabytes", "peak GPU memory allocated on this rank, GiB"),
    MetricField("step_time_s", float, "Seconds", "mean wall time of one optimizer step"),
    MetricField("straggler_host", int, "None", "N of algo-N, the host of the rank with the slowest compute"),
    MetricField("straggler_rank", int, "None", "the global rank with the slowest compute on the log step"),
    MetricField("straggler_compute_s", float, "Seconds", "that rank's block forward compute time, one step"),
    MetricField("straggler_skew", float, "None", "that time over the median rank's, minus 1"),
    # Printed by images from the tuning work on (trainstack.tuning measures them); optional so that lines
    # of older images still parse and format.
    MetricField(
        "mem_reserved_gib",
        float,
        "Gigabytes",
        "peak GPU memory reserved by the caching allocator on this rank, GiB (CPU: the peak RSS)",
        optional=True,
    ),
    MetricField(
        "data_wait_s",
        float,
        "Seconds",
        "mean seconds per step the training loop waited for its micro-batches",
        optional=True,
    ),
    MetricField(
        "cpu_time_s",
        float,
        "Seconds",
        "CPU seconds per step of this rank's process, every thread (on CPU: the step without the wait "
        "for other processes sharing the cores)",
        optional=True,
    ),
    MetricField(
        "val_loss",
        float,
        "None",
        "mean loss over the fixed validation batches (a blend: the mean of its sources'); validation steps",
        optional=True,
    ),
)
FIELD_BY_KEY = {f.key: f for f in FIELDS}
SOURCE_VAL_LOSS = "val_loss_"  # + a blend source's name (trainstack.recipes.schema.DataSource)


def source_fields(sources: Sequence[str]) -> tuple[MetricField, ...]:
    """One validation-loss field per blend source, named for it (recipe.data.source_names)."""
    return tuple(
        MetricField(
            f"{SOURCE_VAL_LOSS}{name}", float, "None", f"validation loss of source {name}", optional=True
        )
        for name in sources
    )


def fields(sources: Sequence[str] = ()) -> tuple[MetricField, ...]:
    """Every field a job of a recipe with these blend sources prints, in the line's order."""
    return FIELDS + source_fields(sources)


def format_line(sources: Sequence[str] = (), **values: float) -> str:
    """The metric line for `values`, in the table's order; every field must be given except the
    optional ones (validation), and only the blend's `sources` may add per-source fields."""
    table = fields(sources)
    missing = [f.key for f in table if not f.optional and f.key not in values]
    extra = sorted(set(values) - {f.key for f in table})
    if missing or extra:
        raise ValueError(f"metric line fields: missing {missing}, unknown {extra}")
    return _joined(table, values)


def format_validation_line(step: int, sources: Sequence[str] = (), **values: float) -> str:
    """The line of an evaluation that is not on a log step, `step=0 val_loss=10.37` (validation.at_start:
    before the first step, where no training value exists yet): the step and the validation fields only.
    The same regexes read it, so val_loss's first point is at step 0."""
    table = fields(sources)
    unknown = sorted(set(values) - {f.key for f in table if f.optional})
    if unknown or not values:
        raise ValueError(f"validation line fields: unknown {unknown}" if unknown else "no validation values")
    return _joined(table, {"step": step, **values})


def _joined(table: Sequence[MetricField], values: dict[str, float]) -> str:
    parts = []
    for f in table:
        if f.key not in values:
            continue
        value = values[f.key]
        if f.kind is int:
            parts.append(f"{f.key}={int(value)}")
        elif math.isfinite(value):
            parts.append(f"{f.key}={value:.6g}")
        else:
            parts.append(f"{f.key}={'nan' if math.isnan(value) else 'inf'}")
    return " ".join(parts)


def parse_line(line: str, sources: Sequence[str] = ()) -> dict[str, float]:
    """Values SageMaker would extract from one log line (fields absent from the line are left out)."""
    out: dict[str, float] = {}
    for f in fields(sources):
        match = re.search(f.regex, line)
        if match:
            out[f.key] = f.kind(float(match.group(1)))
    return out


def metric_definitions(sources: Sequence[str] = ()) -> list[dict[str, str]]:
    """CreateTrainingJob AlgorithmSpecification.MetricDefinitions (at most 40: 16, plus one per blend
    source, at most 16 of them: trainstack.recipes.schema.MAX_SOURCES, plus the saved step)."""
    line = [{"Name": f.metric_name, "Regex": f.regex} for f in fields(sources)]
    return [*line, {"Name": SAVED_STEP_METRIC, "Regex": SAVED_STEP_REGEX}]


# The trainer's log line for a completed checkpoint save; the tuning run reads the save time from it.
_SAVED = re.compile(r"checkpoint complete: (\S+) \(([0-9]*\.?[0-9]+) s\)")
# The step of the newest checkpoint a job completed, read by SageMaker from that line (its folder is
# checkpoint_format.step_dir_name, `step-000000120`): what the next job resumes from, so what the job
# kept of its training. Not a field of the metric line: a save completes in the background, after later
# steps' lines, or after the last line of a stopped job.
SAVED_STEP_METRIC = f"{METRIC_PREFIX}saved_step"
SAVED_STEP_REGEX = r"checkpoint complete: \S*step-0*([0-9]+)/? \("


def checkpoint_saved_line(where: str, seconds: float) -> str:
    """`checkpoint complete: <where> (<seconds> s)`: what the trainer logs when a save has completed."""
    return f"checkpoint complete: {where} ({seconds:.3f} s)"


def parse_checkpoint_saved(line: str) -> tuple[str, float] | None:
    """(where, seconds) of a `checkpoint_saved_line`, or None for any other line."""
    match = _SAVED.search(line)
    return (match.group(1), float(match.group(2))) if match else None


def parse_saved_step(line: str) -> int | None:
    """The step SAVED_STEP_REGEX reads from a `checkpoint_saved_line`, or None for any other line."""
    match = re.search(SAVED_STEP_REGEX, line)
    return int(match.group(1)) if match else None


# The step an export job exported, read by SageMaker from the export's last line (`exported step 120 to
# s3://.../step-120/: ...`, trainer.export.hf_folder) into its FinalMetricDataList: `trainstack runs`
# names the folder an export of "the newest step" wrote (its parent's `step-<N>/`), not `step-N/`.
EXPORTED_STEP_METRIC = "export:step"
EXPORTED_STEP_REGEX = r"exported step ([0-9]+) to "


def export_metric_definitions() -> list[dict[str, str]]:
    """The export job's MetricDefinitions: its exported step (one of CreateTrainingJob's 40)."""
    return [{"Name": EXPORTED_STEP_METRIC, "Regex": EXPORTED_STEP_REGEX}]
