"""The panels `trainstack status` draws: one per run (state, progress, throughput and MFU against the
plan, trends, ETA, cost, checkpoints) and one per launcher execution still waiting for its job."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from trainstack.cli.commands.plan_options import duration

if TYPE_CHECKING:
    from rich.console import RenderableType

    from trainstack.aws.runs import Execution, RunReport


def _pending_panel(execution: Execution) -> RenderableType:
    from rich.panel import Panel

    now = datetime.now(UTC)
    ago = duration(max(0.0, (now - execution.started).total_seconds()) / 3600)
    if execution.status == "RUNNING":
        text = (
            f"launcher execution RUNNING since {execution.started:%Y-%m-%d %H:%M} UTC ({ago} ago); "
            "no training job yet (creating it, or retrying on insufficient capacity)"
        )
    else:
        text = (
            f"launcher execution {execution.status} at "
            f"{(execution.stopped or execution.started):%Y-%m-%d %H:%M} UTC without creating the "
            "training job (see the execution history in the Step Functions console)"
        )
    return Panel(
        text,
        title=execution.name,
        title_align="left",
        border_style="yellow" if execution.status == "RUNNING" else "red",
    )


def _state_style(status: str) -> str:
    return {"Completed": "green", "Failed": "bold red", "Stopped": "yellow", "Stopping": "yellow"}.get(
        status, "cyan"
    )


def _run_panel(
    report: RunReport,
    recipe: Any,
    execution: Execution | None = None,
    trends: dict[str, list] | None = None,
    plan: Any = None,
    restart: Any = None,
) -> RenderableType:
    from rich.panel import Panel
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    from trainstack.aws.runs import TERMINAL_STATES

    job = report.job
    now = datetime.now(UTC)
    table = Table.grid(padding=(0, 2))
    table.add_column(style="dim", no_wrap=True)
    table.add_column(overflow="fold")  # long S3 URIs wrap rather than lose their end
    state = f"[{_state_style(job.status)}]{job.status}[/] / {job.secondary_status or '-'}"
    if job.failure_reason:
        state += f"\n[red]{job.failure_reason}[/red]"
    table.add_row("state", state)
    if job.stand_in:  # the local emulator trained a scaled-down stand-in of the recipe
        table.add_row("emulator", f"[yellow]{job.stand_in}[/yellow]")
    started = job.started or job.created
    table.add_row(
        "started",
        f"{started:%Y-%m-%d %H:%M} UTC ({duration(max(0.0, (now - started).total_seconds()) / 3600)} ago)",
    )
    bar = Table.grid(padding=(0, 1))
    bar.add_column(width=40)
    bar.add_column()
    if report.step is not None:
        step_text = f"{report.step:,}"
    else:  # an ended job will not report one (in the emulator, nothing ever trains)
        step_text = "no step metric" if job.status in TERMINAL_STATES else "no step reported yet"
    bar.add_row(
        ProgressBar(total=1.0, completed=report.progress, width=40),
        f"{step_text} / {report.steps_target:,} steps ({report.progress:.1%})",
    )
    table.add_row("progress", bar)
    if report.tokens_per_sec is None:
        table.add_row("tokens/s per GPU", f"no metric yet (plan {report.planned_tokens_per_sec:,.0f})")
    else:
        verdict = (
            f"[bold red]SLOW[/]: below {recipe.monitoring.slow_fraction:g} x plan "
            f"= {report.slow_threshold:,.0f}"
            if report.slow
            else "[green]on plan[/]"
        )
        table.add_row(
            "tokens/s per GPU",
            f"{report.tokens_per_sec:,.0f} vs plan {report.planned_tokens_per_sec:,.0f} "
            f"({report.throughput_ratio:.0%} of plan)  {verdict}",
        )
    mfu = f"{report.mfu:.1%}" if report.mfu is not None else "-"
    table.add_row("MFU", f"{mfu} vs plan {report.planned_mfu:.1%}")
    if report.mem_gib is not None:
        table.add_row("peak memory", f"{report.mem_gib:,.1f} GiB vs plan {report.planned_peak_gib:,.1f} GiB")
    if report.loss is not None:
        table.add_row("loss", f"{report.loss:.4g}")
    if report.val_loss is not None:
        table.add_row("val_loss", f"{report.val_loss:.4g}")
    from trainstack.aws.trends import TREND_KEYS, trend_text

    labels = {"step": "step trend", "tokens_per_sec": "tokens/s trend", "loss": "loss trend"}
    formats = {"step": "{:,.0f}", "tokens_per_sec": "{:,.0f}", "loss": "{:.4g}"}
    for key in TREND_KEYS:
        text = trend_text((trends or {}).get(key, []), formats[key])
        if text is not None:
            table.add_row(labels[key], text)
    run_eta = _eta(report, plan, now)
    if run_eta is not None:
        table.add_row("ETA", run_eta.text(now))
    remaining = f", {duration(report.hours_remaining)} to go" if report.hours_remaining is not None else ""
    table.add_row(
        "cost",
        f"${report.cost_so_far_usd:,.0f} so far, ${report.cost_projected_usd:,.0f} projected "
        f"at ${report.usd_per_hour:,.0f}/h{remaining}",
    )
    table.add_row("checkpoints", job.checkpoint_uri or "-")
    if restart is not None:  # trainstack.aws.restarts: measured, beside the plan's estimate
        planned = plan.run.restart.seconds if plan is not None and plan.run.restart is not None else None
        table.add_row("restart", restart.text(report.usd_per_hour, planned))
    if execution is not None:
        table.add_row("launcher", f"execution {execution.status}")
    if report.metrics_at is not None:
        table.add_row("metrics as of", f"{report.metrics_at:%H:%M:%S} UTC")
    return Panel(
        table,
        title=job.name,
        title_align="left",
        border_style="red" if report.slow or job.status == "Failed" else "blue",
    )


def _eta(report: RunReport, plan: Any, now: datetime) -> Any:
    from trainstack.aws.run_status import run_eta

    return run_eta(report, plan, now)
