"""The dashboard: actual against plan, per host and per job, on one page."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from aws_cdk import Duration
from aws_cdk import aws_cloudwatch as cw
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from stacks.monitoring.patterns import search_expression
from stacks.monitoring.run_alarms import AlarmSpec
from trainstack.aws.runs import HOST_DIMENSION, JOB_DIMENSION
from trainstack.protocol.metrics import FIELD_BY_KEY, SAVED_STEP_METRIC, source_fields
from trainstack.recipes.naming import job_name_prefix
from trainstack.recipes.schema import Recipe

if TYPE_CHECKING:
    from trainstack.planner import Plan


class Dashboard(Construct):
    """Actual against plan, per host and per job, on one page."""

    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        recipe: Recipe,
        team: str | None,
        plan: Plan,
        state_machines: Mapping[str, sfn.IStateMachine],
        alarms: Sequence[cw.AlarmBase],
        run_alarm_specs: Sequence[AlarmSpec] = (),
    ) -> None:
        super().__init__(scope, id)
        prefix = job_name_prefix(recipe, team)
        team_name = team or recipe.tags.team
        mon = recipe.monitoring
        gpus = recipe.instance.gpus
        planned_tflops = plan.throughput.model_tflops_per_gpu

        def search(label: str, metric: str, dimension: str, stat: str = "Average") -> cw.MathExpression:
            return cw.MathExpression(
                expression=search_expression(metric, dimension, prefix, stat),
                using_metrics={},
                label=label,
                period=Duration.minutes(1),
            )

        def line(label: str, value: float, color: str = cw.Color.GREEN) -> cw.HorizontalAnnotation:
            return cw.HorizontalAnnotation(value=value, label=label, color=color)

        def host_graph(
            title: str, metric: str, unit_note: str, annotations: Sequence[cw.HorizontalAnnotation] = ()
        ) -> cw.GraphWidget:
            return cw.GraphWidget(
                title=f"{title} per host ({unit_note})",
                left=[search(title, metric, HOST_DIMENSION)],
                left_annotations=list(annotations),
                width=8,
                height=6,
            )

        def trainer_graph(
            key: str,
            title: str,
            annotations: Sequence[cw.HorizontalAnnotation] = (),
            stat: str = "Average",
            width: int = 8,
        ) -> cw.GraphWidget:
            return cw.GraphWidget(
                title=f"{title} ({FIELD_BY_KEY[key].metric_name})",
                left=[search(title, FIELD_BY_KEY[key].metric_name, JOB_DIMENSION, stat)],
                left_annotations=list(annotations),
                width=width,
                height=6,
            )

        header = (
            f"# trainstack {team_name}/{recipe.name}\n"
            f"{recipe.model.total_params / 1e9:.1f}B parameters, {recipe.precision.dtype}"
            f"{f' ({recipe.precision.fp8_recipe})' if recipe.precision.fp8_recipe else ''}, "
            f"{recipe.compute.instance_count} x {recipe.compute.instance_type} ({recipe.world_size} GPUs), "
            f"{recipe.training.steps:,} steps. Runs `{prefix}<run id>`, each trained by jobs "
            f"`<run>-1`, `<run>-2`, ... that resume from the run's checkpoints; one line per job below "
            f"(`trainstack runs {recipe.name}{f' --team {team}' if team else ''}` lists the runs).\n\n"
            f"Plan: {plan.throughput.tokens_per_sec_per_gpu:,.0f} tokens/s per GPU, "
            f"MFU {plan.throughput.mfu:.1%}, "
            f"step {plan.throughput.step_time_s:.2f} s, peak memory {plan.memory.peak_gib:.0f} of "
            f"{plan.memory.usable_gib:.0f} GiB per GPU. "
            "Green lines are the plan; red lines are alarm thresholds.\n\n"
            f"{_validation_note(recipe, plan)}"
            f"Each run gets its own alarms while it trains, named `<job>-<alarm>`: "
            f"{', '.join(a.name for a in run_alarm_specs)}."
        )
        self.widgets: list[list[cw.IWidget]] = [
            [
                cw.TextWidget(markdown=header, width=16, height=4),
                cw.AlarmStatusWidget(alarms=list(alarms), title="Alarms", width=8, height=4),
            ],
            [
                trainer_graph(
                    "tokens_per_sec",
                    "Tokens/s per GPU",
                    [
                        line("plan", plan.throughput.tokens_per_sec_per_gpu),
                        line(
                            f"slow (< {mon.slow_fraction:g} x plan)",
                            mon.slow_fraction * plan.throughput.tokens_per_sec_per_gpu,
                            cw.Color.RED,
                        ),
                    ],
                ),
                trainer_graph("mfu", "MFU", [line("plan", plan.throughput.mfu)]),
                trainer_graph("tflops_per_gpu", "TFLOP/s per GPU", [line("plan", planned_tflops)]),
            ],
            [
                # Validation beside training: the same fixed batches each evaluation (a blend: per source).
                cw.GraphWidget(
                    title=f"Loss: training and validation ({FIELD_BY_KEY['loss'].metric_name}, "
                    f"{FIELD_BY_KEY['val_loss'].metric_name})",
                    left=[
                        search("Loss", FIELD_BY_KEY["loss"].metric_name, JOB_DIMENSION),
                        search("Validation loss", FIELD_BY_KEY["val_loss"].metric_name, JOB_DIMENSION),
                        *[
                            search(f.description, f.metric_name, JOB_DIMENSION)
                            for f in source_fields(recipe.data.source_names)
                        ],
                    ],
                    width=8,
                    height=6,
                ),
                trainer_graph("step_time_s", "Step time s", [line("plan", plan.throughput.step_time_s)]),
                trainer_graph(
                    "mem_gib",
                    "Peak GPU memory GiB",
                    [
                        line("plan", plan.memory.peak_gib),
                        line("usable", plan.memory.usable_gib, cw.Color.RED),
                    ],
                    stat="Maximum",
                ),
            ],
            [
                cw.GraphWidget(  # the newest checkpoint beside the step: what a restart would keep
                    title=f"Step ({FIELD_BY_KEY['step'].metric_name}) and saved step ({SAVED_STEP_METRIC})",
                    left=[
                        search("Step", FIELD_BY_KEY["step"].metric_name, JOB_DIMENSION, "Maximum"),
                        search("Saved step", SAVED_STEP_METRIC, JOB_DIMENSION, "Maximum"),
                    ],
                    left_annotations=[line("target", recipe.training.steps)],
                    width=8,
                    height=6,
                ),
                trainer_graph("lr", "Learning rate"),
                host_graph(
                    "GPU utilization",
                    "GPUUtilization",
                    f"0..{100 * gpus}%",
                    [
                        line(
                            f"idle (< {mon.gpu_idle_util_pct:g}% per GPU)",
                            mon.gpu_idle_util_pct * gpus,
                            cw.Color.RED,
                        ),
                    ],
                ),
            ],
            [
                # The slowest rank's own compute against the median's (collectives equalise wall time), and
                # where it is: a host that stays named here is the bad GPU or link.
                trainer_graph(
                    "straggler_skew",
                    "Straggler skew",
                    [line(f"alarm (> {mon.straggler_skew:g})", mon.straggler_skew, cw.Color.RED)],
                    stat="Maximum",
                    width=6,
                ),
                trainer_graph("straggler_host", "Straggler host (N of algo-N)", stat="Maximum", width=6),
                trainer_graph("straggler_rank", "Straggler rank", stat="Maximum", width=6),
                trainer_graph("straggler_compute_s", "Straggler block compute s", width=6),
            ],
            [
                # What the tuning runs measure, watched on the long run too: reserved memory is what an OOM
                # is decided on; a data wait above zero means the loader, not the GPUs, sets the pace.
                trainer_graph(
                    "mem_reserved_gib",
                    "Peak reserved GPU memory GiB",
                    [line("usable", plan.memory.usable_gib, cw.Color.RED)],
                    stat="Maximum",
                ),
                trainer_graph("data_wait_s", "Data wait s per step"),
                trainer_graph("cpu_time_s", "Host CPU s per step"),
            ],
            [
                host_graph(
                    "GPU memory utilization",
                    "GPUMemoryUtilization",
                    f"0..{100 * gpus}%",
                    [
                        line(
                            "planned peak", 100 * gpus * plan.memory.peak_gib / recipe.instance.gpu.usable_gib
                        ),
                        line(
                            f"near OOM (> {mon.gpu_mem_high_pct:g}%)",
                            mon.gpu_mem_high_pct * gpus,
                            cw.Color.RED,
                        ),
                    ],
                ),
                host_graph("CPU utilization", "CPUUtilization", "0..100% per core, summed"),
                host_graph("Memory utilization", "MemoryUtilization", "0..100%"),
            ],
            [
                host_graph(
                    "Disk utilization",
                    "DiskUtilization",
                    "0..100%",
                    [
                        line(f"nearly full (> {mon.disk_high_pct:g}%)", mon.disk_high_pct, cw.Color.RED),
                    ],
                ),
                cw.GraphWidget(
                    title="Run supervisor executions (jobs started, job ends decided)",
                    width=16,
                    height=6,
                    left=[
                        metric
                        for label, machine in state_machines.items()
                        for metric in (
                            machine.metric_started(statistic="Sum", label=f"{label} started"),
                            machine.metric_failed(statistic="Sum", label=f"{label} failed"),
                            machine.metric_timed_out(statistic="Sum", label=f"{label} timed out"),
                        )
                    ],
                ),
            ],
        ]
        self.dashboard = cw.Dashboard(
            self, "Dashboard", widgets=self.widgets, default_interval=Duration.hours(6)
        )


def _validation_note(recipe: Recipe, plan: Plan) -> str:
    """The header's line on validation: when it runs, what it costs, and its alarm (or that it is off)."""
    if plan.validation is None:
        return (
            "No validation (the recipe has no `validation` section): the loss graph shows training only.\n\n"
        )
    v = plan.validation
    return (
        f"Validation {v.summary()} (plan); the ValLossRising alarm fires when it rises "
        f"{recipe.validation.alarm_rises} evaluations in a row.\n\n"
    )
