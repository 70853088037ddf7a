"""What one short job measured, read from its log: the trainer's metric lines, its checkpoint line and
its failure line (trainstack.protocol). Pure: lines in, a Measurement out.

Steady state only. The first `warmup` steps are left out (the compile of every block, the allocator
growing to its working set, the data reader filling its queue), and so is any later leading step still
slower than WARMUP_FACTOR x the median of the second half of the job: a compile that took longer than
planned must not read as a slow layout. The final step is left out too (its metric line is followed
by the blocking final save, which the checkpoint figure measures on its own).

Clock: wall time (the metric line's `step_time_s`), except on CPU hardware shared with other
processes, where `clock="cpu"` takes the rank's CPU time per step (`cpu_time_s`): there the wall time
measures the neighbours (on the project's 2 shared cores the same layout's median step moved by 1.8x
between two runs minutes apart), the CPU time the layout. Tokens/s follow the same clock.

Spread: half the distance between the 10th and 90th percentile of the window's per-step figures
(robust to one outlier step, which a standard deviation over ten samples is not). A candidate's
tokens/s is the window's median.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

from trainstack.protocol import exit_codes
from trainstack.protocol.metrics import parse_checkpoint_saved, parse_line

WARMUP_STEPS_COMPILED = 5  # torch.compile's first steps: the compile, then recompiles of guards
WARMUP_STEPS_EAGER = 2  # the allocator and the data queue
WARMUP_FACTOR = 1.5  # a leading step this much slower than the steady median is still warm-up
MIN_WINDOW = 8  # fewer steady steps than this and a spread means nothing
WINDOW_SECONDS = 60.0  # the window aims at this much steady training, within [MIN_WINDOW, MAX_WINDOW]
MAX_WINDOW = 40


@dataclass(frozen=True)
class StepPlan:
    warmup: int
    window: int

    @property
    def max_steps(self) -> int:
        return self.warmup + self.window + 1  # + the final step, whose line precedes the final save


def steps_for(planned_step_s: float, compiled: bool) -> StepPlan:
    """How many steps a candidate's job runs: warm-up (more with compile) and a window long enough for
    a spread (MIN_WINDOW steps) and about WINDOW_SECONDS of training, at most MAX_WINDOW steps."""
    warmup = WARMUP_STEPS_COMPILED if compiled else WARMUP_STEPS_EAGER
    wanted = math.ceil(WINDOW_SECONDS / max(planned_step_s, 1e-9))
    return StepPlan(warmup, min(MAX_WINDOW, max(MIN_WINDOW, wanted)))


@dataclass(frozen=True)
class Straggler:
    rank: int
    host: int
    skew: float  # the slowest rank's compute over the median rank's, minus 1 (worst step of the window)


@dataclass(frozen=True)
class Measurement:
    status: str  # ok | oom | failed
    reason: str = ""  # why not ok (the failure line), or notes
    warmup: int = 0  # steps left out at the start
    steps: int = 0  # steps in the window
    tokens_per_s: float = 0.0  # per GPU, median over the window
    tokens_per_s_spread: float = 0.0  # half the 10-90 percentile range
    step_time_s: float = 0.0  # median
    step_time_spread: float = 0.0
    peak_mem_gib: float = 0.0  # allocated
    peak_reserved_gib: float | None = None  # reserved (None: an image that does not print it)
    data_wait_s: float | None = None  # mean per step
    checkpoint_save_s: float | None = None  # the final save, whole
    straggler: Straggler | None = None
    losses: tuple[tuple[int, float], ...] = field(default=())  # (step, loss) over the window
    clock: str = "wall"  # what step_time_s and tokens_per_s are measured in: wall | cpu (see above)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def mean_loss(self) -> float | None:
        return statistics.fmean(v for _, v in self.losses) if self.losses else None

    def to_dict(self) -> dict:
        if not self.ok:
            return {"status": self.status, "reason": self.reason}
        d = {
            "tokens_per_s": round(self.tokens_per_s, 3),
            "tokens_per_s_spread": round(self.tokens_per_s_spread, 3),
            "step_time_s": round(self.step_time_s, 6),
            "step_time_spread_s": round(self.step_time_spread, 6),
            "peak_mem_gib": round(self.peak_mem_gib, 4),
            "peak_reserved_gib": None if self.peak_reserved_gib is None else round(self.peak_reserved_gib, 4),
            "data_wait_s": None if self.data_wait_s is None else round(self.data_wait_s, 6),
            "checkpoint_save_s": self.checkpoint_save_s,
            "straggler": None if self.straggler is None else vars(self.straggler),
            "clock": self.clock,
            "warmup_steps": self.warmup,
            "window_steps": self.steps,
            "loss_first": round(self.losses[0][1], 5),
            "loss_last": round(self.losses[-1][1], 5),
            "loss_mean": round(self.mean_loss or 0.0, 5),
        }
        return d


def spread(values: list[float]) -> float:
    """Half the 10th-90th percentile range (0 for fewer than two values)."""
    if len(values) < 2:
        return 0.0
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    return (deciles[-1] - deciles[0]) / 2.0


def failure_status(failure_reason: str | None, lines: Iterable[str] = ()) -> str | None:
    """`oom` when the trainer's failure line says it ran out of GPU memory (exit code OUT_OF_MEMORY in
    the job's FailureReason, or its `error: out of GPU memory` line in the log), else None."""
    if exit_codes.exit_code_of(failure_reason) == exit_codes.OUT_OF_MEMORY:
        return "oom"
    marker = f"error: {exit_codes.OOM_MESSAGE}"
    if any(line.lstrip().startswith(marker) for line in lines):
        return "oom"
    return None


def measure(
    lines: Iterable[str],
    *,
    job_failed: bool = False,
    failure_reason: str | None = None,
    compiled: bool = False,
    warmup: int | None = None,
    final_step: int | None = None,
    clock: str = "wall",
) -> Measurement:
    """The Measurement of one job from its log lines (stdout and stderr, any order of other lines).
    `job_failed`: the job did not complete (its FailureReason in `failure_reason`). `compiled`: the
    candidate compiles (a longer warm-up); `warmup`: the steps to leave out, when the job's StepPlan
    says (overrides `compiled`). `final_step`: the job's last step (left out; default: the
    last metric line's). `clock`: "cpu" measures the step in the rank's CPU time where the lines carry
    it (CPU hardware; see above), else wall time."""
    lines = list(lines)
    oom = failure_status(failure_reason, lines)
    if oom:
        return Measurement("oom", _first_line(failure_reason) or exit_codes.OOM_MESSAGE)
    if job_failed:
        return Measurement("failed", _first_line(failure_reason) or "the job failed (no reason given)")
    metrics = [parse_line(line) for line in lines if line.lstrip().startswith("step=")]
    metrics = [m for m in metrics if "step" in m and "step_time_s" in m]
    saves = [s for s in (parse_checkpoint_saved(line) for line in lines) if s is not None]
    by_step: dict[int, dict[str, float]] = {}
    for m in metrics:  # one line per step (log_every 1); a repeated step keeps its last line
        by_step[int(m["step"])] = m
    steps = sorted(by_step)
    last = final_step if final_step is not None else (steps[-1] if steps else 0)
    steps = [s for s in steps if s < last]
    if warmup is None:
        warmup = WARMUP_STEPS_COMPILED if compiled else WARMUP_STEPS_EAGER
    candidates = [s for s in steps if s > warmup]
    key = (
        "cpu_time_s"
        if clock == "cpu" and all("cpu_time_s" in by_step[s] for s in candidates)
        else "step_time_s"
    )
    if len(candidates) >= 2:
        second_half = candidates[len(candidates) // 2 :]
        steady = statistics.median(by_step[s][key] for s in second_half)
        while candidates and by_step[candidates[0]][key] > WARMUP_FACTOR * steady:
            candidates.pop(0)
    if len(candidates) < 2:
        return Measurement(
            "failed",
            f"only {len(candidates)} steady steps in the log (need at least 2; {len(steps)} steps seen)",
        )
    window = [by_step[s] for s in candidates]
    tps = [m["tokens_per_sec"] for m in window]
    times = [m["step_time_s"] for m in window]
    used = "wall"
    if clock == "cpu" and all(m.get("cpu_time_s", 0.0) > 0 for m in window):
        used = "cpu"
        tps = [
            m["tokens_per_sec"] * m["step_time_s"] / m["cpu_time_s"] for m in window
        ]  # tokens a step / CPU s
        times = [m["cpu_time_s"] for m in window]
    worst = max(window, key=lambda m: m.get("straggler_skew", 0.0))
    straggler = (
        Straggler(int(worst["straggler_rank"]), int(worst.get("straggler_host", 0)), worst["straggler_skew"])
        if "straggler_rank" in worst and "straggler_skew" in worst
        else None
    )
    reserved = [m["mem_reserved_gib"] for m in metrics if "mem_reserved_gib" in m]
    waits = [m["data_wait_s"] for m in window if "data_wait_s" in m]
    return Measurement(
        "ok",
        warmup=candidates[0] - 1,
        steps=len(window),
        tokens_per_s=statistics.median(tps),
        tokens_per_s_spread=spread(tps),
        step_time_s=statistics.median(times),
        step_time_spread=spread(times),
        peak_mem_gib=max(m["mem_gib"] for m in metrics if "mem_gib" in m),
        peak_reserved_gib=max(reserved) if reserved else None,
        data_wait_s=statistics.fmean(waits) if waits else None,
        checkpoint_save_s=saves[-1][1] if saves else None,
        straggler=straggler,
        losses=tuple((s, by_step[s]["loss"]) for s in candidates),
        clock=used,
    )


def _first_line(text: str | None) -> str:
    return " ".join((text or "").split())[:300]


_RANKS = re.compile(r"micro_batch \d+ x (\d+) ranks x")


def ranks_of(lines: Iterable[str]) -> int | None:
    """The ranks a job trained on, from the trainer's `layout:` log line (None when it is not there)."""
    for line in lines:
        match = _RANKS.search(line)
        if match:
            return int(match.group(1))
    return None
