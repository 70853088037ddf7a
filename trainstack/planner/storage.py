"""What a run's checkpoints cost in S3: the kept ones while the run trains, the pruned ones until the
bucket's lifecycle removes them, and what the run leaves behind.

The trainer writes a checkpoint at every interval save, at each job boundary it can save at (SIGTERM)
and at the end, keeps the newest `checkpointing.keep` and deletes the older ones. The checkpoint bucket
is versioned, so a deleted checkpoint becomes a noncurrent version, billed like any object until the
lifecycle expires it ("Normal Amazon S3 rates apply for every version of an object stored", S3 FAQ).
The bucket's rule for `checkpoints/` (stacks/storage.py, from the constants below) expires noncurrent
versions PRUNED_NONCURRENT_DAYS after they became noncurrent; S3 "calculates the time by adding the
number of days specified in the rule to the time when the new successor version of the object is
created and rounding the resulting time to the next day midnight UTC" (S3 user guide, lifecycle
configuration elements), so a pruned checkpoint is billed for 1 to 2 days, 1.5 expected; "You are not
charged for storage time associated with an object that has expired" (S3 user guide, expiring objects)
even where removal lags. Before this rule the bucket kept 3 noncurrent versions *per key*; checkpoint
keys are unique per step, so nothing expired and a run left every checkpoint it ever wrote.

Pure arithmetic over the plan's checkpoint size, save count and run hours (docs/planner.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainstack.planner.run_plan import GIB, RunPlan

TIB = 1024 * GIB
# The checkpoint bucket's lifecycle (stacks/storage.py builds its rules from these, and
# tests/cdk/test_checkpoint_lifecycle.py checks what the synthesized rules do):
CHECKPOINT_PREFIX = "checkpoints/"  # every run's checkpoints (trainstack.recipes.naming.checkpoint_prefix)
PRUNED_NONCURRENT_DAYS = 1  # the least S3 allows ("a non-zero positive integer", NoncurrentVersionExpiration)
INCOMPLETE_CHECKPOINT_UPLOAD_DAYS = 1  # a killed save's multipart uploads; a whole save takes minutes
OTHER_NONCURRENT_DAYS = 30  # model output and anything else: an overwritten or deleted file stays 30 days
OTHER_INCOMPLETE_UPLOAD_DAYS = 7
# Rounding to the next midnight UTC adds 0 to 1 day to every lifecycle action.
PRUNED_DAYS_RANGE = (float(PRUNED_NONCURRENT_DAYS), PRUNED_NONCURRENT_DAYS + 1.0)
PRUNED_DAYS_EXPECTED = PRUNED_NONCURRENT_DAYS + 0.5
# S3 Standard, us-east-1, first 50 TB a month (0.022 the next 450 TB, 0.021 above): aws.amazon.com/s3/pricing,
# as transcribed 2022-07 (the newest copy of the figures found; the 2026-09 capture of the page did not
# render its price cells). S3 bills GB as 2^30 bytes: the S3 FAQ's worked example divides byte-hours by
# 2^30 and the month's hours. Other regions and S3 Intelligent-Tiering differ; checkpoints are read again
# within days, so Standard is the class they are written in.
S3_USD_PER_GIB_MONTH = 0.023
S3_PRICE_SOURCE = (
    "S3 Standard us-east-1, first 50 TB: aws.amazon.com/s3/pricing as transcribed 2022-07 (the newest "
    "copy found; 0.022 above 50 TB, 0.021 above 500 TB)"
)
S3_PRICE_DATE = "2022-07"
HOURS_PER_MONTH = 730.0  # 365 x 24 / 12, the month AWS's calculators use


@dataclass(frozen=True)
class StoragePlan:
    checkpoint_tib: float  # one checkpoint, every node's files (FP32 master weights and AdamW m, v)
    written: int  # checkpoints the run writes: interval saves, saves at job boundaries, the final save
    kept: int  # the newest `checkpointing.keep` (fewer if the run writes fewer)
    pruned: int  # written - kept: deleted by the trainer, then removed by the bucket's lifecycle
    pruned_days: tuple[float, float]  # how long a pruned checkpoint stays billed (the lifecycle's range)
    tib_months: float  # over the run: the kept ones while it trains, every pruned one until removed
    tib_months_range: tuple[float, float]
    usd: float  # tib_months at the S3 price: part of the run's cost (CostPlan.storage_usd)
    usd_range: tuple[float, float]
    left_tib: float  # what the run leaves behind: its kept checkpoints
    left_usd_per_month: float
    # Every checkpoint it writes: what a bucket that never removes pruned ones would keep (the old rule).
    written_tib: float
    usd_per_gib_month: float = S3_USD_PER_GIB_MONTH
    price_source: str = S3_PRICE_SOURCE
    price_date: str = S3_PRICE_DATE


def checkpoints_written(run: RunPlan) -> int:
    """Interval saves, a SIGTERM save at each job boundary that fits one, and the final save."""
    boundaries = run.jobs - 1 if run.checkpoint.sigterm_fits else 0
    return run.saves + boundaries + 1


def _tib_hours(written: int, keep: int, hours: float, pruned_days: float, checkpoint_tib: float) -> float:
    """TiB-hours: saves evenly spaced over `hours`, the i-th leaving min(i, keep) checkpoints kept until
    the next; each pruned one billed `pruned_days` more."""
    gap = hours / written
    kept_checkpoint_hours = gap * sum(range(1, min(written - 1, keep) + 1))
    if written > keep:
        kept_checkpoint_hours += gap * keep * (written - keep - 1)
    pruned = max(0, written - keep)
    return checkpoint_tib * (kept_checkpoint_hours + pruned * pruned_days * 24.0)


def plan_storage(
    run: RunPlan, nodes: int, keep: int, hours: float, hours_range: tuple[float, float], time_based: bool
) -> StoragePlan:
    """The run's checkpoint storage over `hours` of wall time (its instance hours per node), with the
    range from `hours_range` and the lifecycle's 1-2 days. `time_based`: saves come every so many minutes
    (so a slower run writes more of them), not every so many steps."""
    checkpoint_tib = run.checkpoint.gib_per_node * nodes * GIB / TIB
    written = checkpoints_written(run)
    kept = min(written, keep)

    def tib_months(run_hours: float, pruned_days: float) -> float:
        count = max(1, math.ceil(written * run_hours / hours)) if time_based and hours > 0 else written
        return _tib_hours(count, keep, run_hours, pruned_days, checkpoint_tib) / HOURS_PER_MONTH

    expected = tib_months(hours, PRUNED_DAYS_EXPECTED)
    low, high = (
        tib_months(hours_range[0], PRUNED_DAYS_RANGE[0]),
        tib_months(hours_range[1], PRUNED_DAYS_RANGE[1]),
    )
    price = S3_USD_PER_GIB_MONTH * 1024
    return StoragePlan(
        checkpoint_tib=checkpoint_tib,
        written=written,
        kept=kept,
        pruned=written - kept,
        pruned_days=PRUNED_DAYS_RANGE,
        tib_months=expected,
        tib_months_range=(low, high),
        usd=expected * price,
        usd_range=(low * price, high * price),
        left_tib=kept * checkpoint_tib,
        left_usd_per_month=kept * checkpoint_tib * price,
        written_tib=written * checkpoint_tib,
    )
