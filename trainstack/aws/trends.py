"""A run's recent history for `trainstack status`: sparklines of step, tokens/s and loss, and an ETA
against the plan. Pure functions of plain values (the CloudWatch call that feeds them is in
commands/status.py), so they are tested without AWS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

BARS = "▁▂▃▄▅▆▇█"
TREND_KEYS = ("step", "tokens_per_sec", "loss")  # what status draws, in this order


def series_from_results(results: list[dict[str, Any]], ids: dict[str, str]) -> dict[str, list[tuple]]:
    """GetMetricData results -> {metric key: [(timestamp, value), ...] oldest first}, finite values only.

    `ids`: query Id -> metric key (trainstack.aws.runs.metric_queries uses the lower-cased key)."""
    out: dict[str, list[tuple]] = {}
    for result in results:
        key = ids.get(result.get("Id", ""))
        if key is None:
            continue
        pairs = [
            (_utc(t), float(v))
            for t, v in zip(result.get("Timestamps", []), result.get("Values", []), strict=False)
            if v is not None and math.isfinite(v)
        ]
        out.setdefault(key, []).extend(pairs)
    return {key: sorted(set(points)) for key, points in out.items()}


def _utc(value: Any) -> datetime:
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    return datetime.fromisoformat(str(value).replace("Z", "+00:00"))


def sparkline(values: list[float], width: int = 24) -> str:
    """The last values as bars, averaged into at most `width` buckets ('' for fewer than two)."""
    if len(values) < 2:
        return ""
    if len(values) > width:  # equal buckets, oldest first; the last bucket ends at the newest value
        size = len(values) / width
        values = [
            sum(chunk) / len(chunk)
            for i in range(width)
            if (chunk := values[int(i * size) : max(int((i + 1) * size), int(i * size) + 1)])
        ]
    low, high = min(values), max(values)
    if high == low:
        return BARS[len(BARS) // 2 - 1] * len(values)
    scale = (len(BARS) - 1) / (high - low)
    return "".join(BARS[round((v - low) * scale)] for v in values)


def trend_text(points: list[tuple], fmt: str = "{:,.4g}", width: int = 24) -> str | None:
    """`▁▂▄▆█  1,000 -> 4,200 over 35 min`, or None without at least two points."""
    if len(points) < 2:
        return None
    values = [v for _, v in points]
    minutes = (points[-1][0] - points[0][0]).total_seconds() / 60
    span = f"{minutes:.0f} min" if minutes < 120 else f"{minutes / 60:.1f} h"
    return f"{sparkline(values, width)}  {fmt.format(values[0])} -> {fmt.format(values[-1])} over {span}"


@dataclass(frozen=True)
class Eta:
    finish: datetime  # when the remaining steps end at the measured pace
    planned_finish: datetime  # when they would end had every step taken the planned step time
    behind_hours: float  # finish - planned_finish (negative: ahead of plan)

    def text(self, now: datetime) -> str:
        delta = self.behind_hours
        if abs(delta) < 1 / 60:
            how = "on plan"
        else:
            how = f"{_hours(abs(delta))} {'behind' if delta > 0 else 'ahead of'} plan"
        left = _hours(max(0.0, (self.finish - now).total_seconds() / 3600))
        return (
            f"{self.finish:%Y-%m-%d %H:%M} UTC (in {left}); "
            f"plan: {self.planned_finish:%Y-%m-%d %H:%M} UTC, {how}"
        )


def _hours(hours: float) -> str:
    if hours < 1:
        return f"{hours * 60:.0f} min"
    return f"{hours:.1f} h" if hours < 48 else f"{hours / 24:.1f} days"


def eta(
    started: datetime | None,
    steps_target: int,
    hours_remaining: float | None,
    planned_step_time_s: float,
    now: datetime,
) -> Eta | None:
    """The run's finish at its measured pace against the finish the plan gives for the same steps
    (from the job's training start; provisioning before it is not counted against the plan).
    None while the job has not started training or has ended."""
    if started is None or hours_remaining is None:
        return None
    finish = now + timedelta(hours=hours_remaining)
    planned = started + timedelta(seconds=steps_target * planned_step_time_s)
    return Eta(finish, planned, (finish - planned).total_seconds() / 3600)
