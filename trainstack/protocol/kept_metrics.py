"""Tracking records a job could not deliver, kept beside the run's checkpoints until someone delivers them.

The trainer (trainer.metrics.tracking) writes them when its MLflow tracker could not take them in time:
records pushed out of its full buffer, and what was still buffered or in flight at the job's end. The
run's next job (before its own records) and `trainstack runs --mlflow` (trainstack.aws.tracking)
deliver them, each file in the order the files were written, each file's records in step order, then
delete the file.

Exactly once without a lock: a record keeps the wall-clock time it was measured at, and an MLflow SQL
store (the tracking server's, SageMaker's managed MLflow) takes a metric it already holds with the same
key, step, timestamp and value as a no-op (SqlAlchemyStore._log_metrics). A file delivered twice (two
deliverers at once, or a delivery cut short before the delete, or a batch the tracker took just before
the job gave up on it) adds nothing the second time; its history has each point once. Tags are
last-writer-wins and idempotent the same way.

Layout: `<checkpoint location>/tracking/kept/<13-digit epoch ms>-<job>.jsonl`, one JSON object a line:
`{"step": N, "values": {...}, "wall_ms": T}` for metrics, `{"tags": {...}}` for the job's tags. A job's
own end (`end` status, `trainstack.state`) is never kept: a later job or the CLI knows the run's state
better than a job that has ended.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

KEPT_DIR = "tracking/kept"
KEPT_NAME = re.compile(r"^(\d{13})-([A-Za-z0-9._-]{1,128})\.jsonl$")
# Tags a kept file may carry: the job's own (`trainstack.job.<n>.*`, `trainstack.job.exit`), never the
# run's state, which the job that wrote them no longer decides.
JOB_TAG = re.compile(r"^trainstack\.job(\.\d+)?\.")


def kept_name(now_ms: int, job: str) -> str:
    """A kept file's name: sorts in the order the files were written; `job` (its index or name) says whose."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "-", job)[:128] or "job"
    return f"{int(now_ms):013d}-{safe}.jsonl"


def is_kept_name(name: str) -> bool:
    return KEPT_NAME.match(name) is not None


def keepable(record: tuple) -> dict[str, Any] | None:
    """A tracking record (trainer.metrics.tracking's tuples) as a kept line, or None when it is not kept."""
    kind = record[0]
    if kind == "metrics":
        _, step, values, wall_ms = record
        return {
            "step": int(step),
            "values": {k: float(v) for k, v in values.items()},
            "wall_ms": int(wall_ms),
        }
    if kind == "tags":
        tags = {k: str(v) for k, v in record[1].items() if JOB_TAG.match(k)}
        return {"tags": tags} if tags else None
    return None


def encode(lines: Iterable[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line, separators=(",", ":")).encode() + b"\n" for line in lines)


def decode(data: bytes) -> tuple[list[tuple[int, dict[str, float], int]], dict[str, str]]:
    """(metrics as (step, values, wall_ms) in step order, the job's tags). A line cut short (a write that
    did not finish) or not of this form is skipped: what it held is lost, the rest is not."""
    metrics, tags = [], {}
    for raw in data.splitlines():
        try:
            line = json.loads(raw)
            if "tags" in line:
                tags.update({str(k): str(v) for k, v in line["tags"].items()})
            else:
                values = {str(k): float(v) for k, v in line["values"].items()}
                metrics.append((int(line["step"]), values, int(line["wall_ms"])))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    metrics.sort(key=lambda m: (m[0], m[2]))  # stable: the order measured within a step
    return metrics, tags
