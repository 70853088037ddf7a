"""The run plan of every base recipe: jobs, job limit, checkpoint size, save (staging + upload), restore,
the Young/Daly interval, SIGTERM, failures; and the one-line refusal of an interval shorter than a save."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainstack.cli.main import app
from trainstack.planner import plan
from trainstack.planner.run_plan import (
    CHECKPOINT_BYTES_PER_PARAM,
    EXIT_MARGIN_S,
    GIB,
    MAX_RUNTIME_HOURS,
    NODE_MTBF_HOURS,
    S3_ACHIEVED_FRACTION,
    S3_TARGET_BYTES_PER_S_PER_RANK,
    SIGTERM_GRACE_S,
    STAGING_BYTES_PER_S_PER_GPU,
)
from trainstack.recipes.loader import resolve

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]
BASE = [
    "1b-bf16",
    "3b-bf16",
    "7b-bf16",
    "8b-fp8",
    "14b-fp8",
    "30b-fp8",
    "64b-fp8",
    "8b-fp8-128k",
    "30b-fp8-128k",
    "64b-fp8-128k",
]
runner = CliRunner()


@pytest.mark.parametrize("name", BASE)
def test_run_figures_of_every_base_recipe(name):
    recipe = resolve(name).recipe
    p = plan(recipe)
    run, ck = p.run, p.run.checkpoint
    nodes, params = recipe.compute.instance_count, recipe.model.total_params
    step = p.throughput.step_time_s

    assert run.hours == pytest.approx(recipe.training.steps * step / 3600)
    assert run.max_runtime_source == "plan"
    assert run.max_runtime_hours <= MAX_RUNTIME_HOURS
    # the default limit covers the slow end of the planner's range, so an optimistic plan is not cut short
    slow_hours = (
        run.hours * p.throughput.tokens_per_sec_per_gpu / p.throughput.tokens_per_sec_per_gpu_range[0]
    )
    assert run.max_runtime_hours >= min(MAX_RUNTIME_HOURS, slow_hours + run.startup_hours_per_job)
    assert run.jobs == max(1, math.ceil(run.hours / run.max_runtime_hours))

    # one copy of FP32 master weights and AdamW moments, written once across the nodes (DCP dedups HSDP)
    assert ck.gib_per_node == pytest.approx(params * CHECKPOINT_BYTES_PER_PARAM / nodes / GIB)
    fsdp = recipe.parallelism.shard_group * recipe.parallelism.cp  # FSDP shards over the CP ranks too
    stage = params * CHECKPOINT_BYTES_PER_PARAM / fsdp / STAGING_BYTES_PER_S_PER_GPU
    upload = ck.gib_per_node * GIB / (8 * S3_TARGET_BYTES_PER_S_PER_RANK * S3_ACHIEVED_FRACTION)
    assert (ck.stage_seconds, ck.upload_seconds) == pytest.approx((stage, upload))
    assert ck.save_seconds == pytest.approx(stage + upload)
    # on resume every GPU reads its own shards: a node reads 8 / (shard_group x cp) of the checkpoint
    # per replica
    assert ck.restore_gib_per_node == pytest.approx(8 * params * CHECKPOINT_BYTES_PER_PARAM / fsdp / GIB)

    # Young/Daly on the time training waits (staging), never shorter than one whole save
    cluster_mtbf_s = NODE_MTBF_HOURS * 3600 / nodes
    young_daly = math.sqrt(2 * stage * cluster_mtbf_s) / 60
    assert ck.interval_source == "young-daly"
    assert ck.interval_minutes == pytest.approx(max(young_daly, ck.save_seconds / 60))
    assert ck.work_at_risk_minutes == pytest.approx(ck.interval_minutes + ck.save_seconds / 60)
    # SIGTERM: the step in flight is dropped, or completed when only its optimizer step is left, so at
    # worst the last micro-step and the per-step work run, then a whole save; 15 s kept for the exit
    accum, micro = recipe.grad_accum_steps, p.throughput.micro_step_time_s
    assert 0 < micro <= step / accum + 1e-9
    assert ck.sigterm_seconds == pytest.approx(max(micro, step - (accum - 1) * micro) + ck.save_seconds)
    assert ck.sigterm_fits == (ck.sigterm_seconds <= SIGTERM_GRACE_S - EXIT_MARGIN_S)
    # staging pins every GPU's own shard: with HSDP each replica pins its copy
    assert ck.pinned_gib_per_node == pytest.approx(8 * stage * STAGING_BYTES_PER_S_PER_GPU / GIB)

    # interval saves hold the loop for their staging; the final save (and a SIGTERM save at each job
    # boundary, when it fits) for the whole save
    assert run.saves == math.ceil(run.hours * 60 / ck.interval_minutes) - 1
    boundary = ck.save_seconds if ck.sigterm_fits else ck.interval_minutes * 30
    assert run.save_blocking_hours == pytest.approx(
        (run.saves * ck.stage_seconds + ck.save_seconds + (run.jobs - 1) * boundary) / 3600
    )
    assert run.expected_failures == pytest.approx(nodes * run.hours / NODE_MTBF_HOURS)
    # cost counts the overheads: start-ups, restores, staging waits, expected failures
    assert p.cost.hours == pytest.approx(run.hours + run.overhead_hours)
    startups = run.jobs * run.startup_hours_per_job
    assert run.overhead_hours >= startups + run.save_blocking_hours + run.failure_hours


def test_the_run_line_says_hours_jobs_and_the_checkpoint():
    run = plan(resolve("64b-fp8").recipe).run
    line = run.summary()
    ck = run.checkpoint
    assert line.startswith(f"{run.hours:,.0f} h = {run.jobs} job")
    assert f"checkpoint {ck.gib_per_node:,.0f} GiB/node every {ck.interval_minutes:,.0f} min" in line
    assert f"{ck.save_seconds:,.0f} s to save" in line
    result = runner.invoke(app, ["plan", "64b-fp8"], env={"COLUMNS": "200"})
    assert line in result.stdout


def test_a_run_longer_than_28_days_takes_several_jobs():
    p = plan(resolve("64b-fp8", overrides=["training.steps=80000"]).recipe)
    assert p.run.hours > MAX_RUNTIME_HOURS
    assert p.run.max_runtime_hours == MAX_RUNTIME_HOURS
    assert p.run.jobs == math.ceil(p.run.hours / MAX_RUNTIME_HOURS) >= 2


def test_intervals_set_in_minutes_or_steps_are_applied():
    by_minutes = plan(
        resolve("8b-fp8", overrides=["checkpointing.interval_minutes=30"]).recipe
    ).run.checkpoint
    assert (by_minutes.interval_minutes, by_minutes.interval_source) == (30, "checkpointing.interval_minutes")
    p = plan(resolve("8b-fp8", overrides=["checkpointing.interval_steps=100"]).recipe)
    ck = p.run.checkpoint
    assert ck.interval_source == "checkpointing.interval_steps"
    assert ck.interval_minutes == pytest.approx(100 * p.throughput.step_time_s / 60)


def test_a_longer_node_mtbf_gives_a_longer_young_daly_interval():
    default = plan(resolve("30b-fp8").recipe).run.checkpoint
    sturdier = plan(
        resolve("30b-fp8", overrides=["checkpointing.node_mtbf_hours=25340"]).recipe
    ).run.checkpoint
    assert sturdier.mtbf_source == "checkpointing.node_mtbf_hours"
    assert sturdier.interval_minutes == pytest.approx(default.interval_minutes * 2, rel=1e-6)  # sqrt(4)


def test_an_interval_shorter_than_one_save_is_one_line_naming_the_file(recipes_dir):
    # a 64B model on 8 nodes: one save takes about 20 s; 0.1 min = 6 s cannot be kept
    (recipes_dir / "big.yaml").write_text(
        "name: big\n"
        "model: {layers: 72, hidden: 8192, heads: 64, kv_heads: 8, ffn: 28672, vocab: 128256}\n"
        "training: {seq_len: 8192, micro_batch: 1, global_batch: 1024, steps: 10}\n"
        "precision: {dtype: bf16}\nactivation_checkpointing: {mode: full}\n"
        "parallelism: {shard_group: 8}\ncompute: {instance_type: ml.p6-b200.48xlarge, instance_count: 8}\n"
    )
    team = recipes_dir / "teams" / "nlp" / "defaults.yaml"
    team.write_text("checkpointing: {interval_minutes: 0.1}\n")
    result = runner.invoke(app, ["plan", "big", "--team", "nlp", "--recipes-dir", str(recipes_dir)])
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output
    assert (
        "teams/nlp/defaults.yaml: checkpointing.interval_minutes: 0.1 min is shorter than one checkpoint save"
        in lines[0]
    )
    assert result.stdout == ""  # nothing half-written
    gate = runner.invoke(app, ["validate", str(team)])
    assert gate.exit_code == 2 and "checkpointing.interval_minutes" in gate.stderr


def test_a_step_longer_than_120_seconds_still_leaves_room_for_the_sigterm_save():
    # The trainer drops the step in flight at the next micro-step: only a micro-step counts, not a step
    # (64 micro-steps of about 4 s; the old rule, step + save, said it could never fit).
    p = plan(resolve("64b-fp8", overrides=["training.global_batch=4096"]).recipe)
    ck = p.run.checkpoint
    assert p.throughput.step_time_s > SIGTERM_GRACE_S
    assert p.throughput.micro_step_time_s < 10
    assert ck.sigterm_fits and ck.sigterm_seconds <= SIGTERM_GRACE_S - EXIT_MARGIN_S


def test_sigterm_fits_is_false_when_a_save_outlasts_what_the_exit_margin_leaves():
    # 64B on one node: the whole checkpoint, 712 GiB, leaves that node at 5 GB/s: about 150 s
    overrides = ["compute.instance_count=1"]
    p = plan(resolve("64b-fp8", overrides=overrides).recipe)
    ck = p.run.checkpoint
    assert ck.save_seconds > SIGTERM_GRACE_S - EXIT_MARGIN_S
    assert ck.sigterm_fits is False
    # a job boundary then costs the work since the last interval save, not a save
    long = plan(resolve("64b-fp8", overrides=[*overrides, "training.steps=80000"]).recipe).run
    assert long.jobs >= 2
    ck_long = long.checkpoint
    assert long.save_blocking_hours == pytest.approx(
        (
            long.saves * ck_long.stage_seconds
            + ck_long.save_seconds
            + (long.jobs - 1) * ck_long.interval_minutes * 30
        )
        / 3600
    )
    result = runner.invoke(
        app, ["plan", "64b-fp8", *(f"--set={o}" for o in overrides)], env={"COLUMNS": "200"}
    )
    assert "final save after SIGTERM" in result.stdout and "DOES NOT FIT SageMaker's 120 s" in result.stdout
    assert f"save, of {SIGTERM_GRACE_S - EXIT_MARGIN_S:.0f} s" in result.stdout


def test_the_exit_margin_is_importable_without_torch():
    # trainstack must not import torch; the trainer imports the margin from trainstack.planner.run_plan
    code = "import sys, trainstack.planner, trainstack.planner.run_plan; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_json_has_the_run_contract():
    d = json.loads(runner.invoke(app, ["plan", "30b-fp8", "--json"]).stdout)
    run = d["run"]
    for key in ("hours", "jobs", "max_runtime_hours", "max_runtime_source", "startup_hours_per_job"):
        assert key in run
    for key in (
        "gib_per_node", "save_seconds", "restore_seconds", "interval_minutes", "interval_source",
        "sigterm_fits", "work_at_risk_minutes",
    ):  # fmt: skip
        assert key in run["checkpoint"]
    assert run["jobs"] == math.ceil(run["hours"] / run["max_runtime_hours"])


def test_spot_lowers_the_price_by_the_stated_assumption_and_shows_interruptions():
    on_demand = plan(resolve("30b-fp8").recipe)
    spot = plan(resolve("30b-fp8", overrides=["compute.spot=true"]).recipe)
    assert spot.cost.spot and spot.cost.usd_per_instance_hour == pytest.approx(
        0.5 * on_demand.cost.usd_per_instance_hour
    )
    assert spot.run.spot_interruptions == pytest.approx(4 * spot.run.hours / (5 * 24))
    assert spot.run.expected_failures > on_demand.run.expected_failures
    assert spot.cost.hours > on_demand.cost.hours  # interruptions cost restarts and lost work
    assert any("interruptions expected" in a for a in spot.assumptions)
    assert "spot assumed at 50% of on-demand" in spot.cost.price_source


def _doc_row(doc: str, label: str) -> str:
    row = next(line for line in doc.splitlines() if line.startswith(f"| {label} |"))
    return row.split("|")[2]


def _numbers(text: str) -> list[float]:
    return [float(n.replace(",", "")) for n in re.findall(r"\d[\d,]*(?:\.\d+)?", text)]


def test_the_64b_run_table_in_the_docs_shows_the_planners_current_figures():
    doc = (ROOT / "docs" / "runs.md").read_text()
    doc = doc[doc.index("## What a 64b-fp8 run takes") :]
    p = plan(resolve("64b-fp8").recipe)
    run, ck, cost = p.run, p.run.checkpoint, p.cost

    assert _numbers(_doc_row(doc, "training"))[0] == round(run.hours)
    assert _numbers(_doc_row(doc, "training"))[2:4] == [round(h) for h in cost.hours_range]
    assert _numbers(_doc_row(doc, "job limit"))[0] == round(run.max_runtime_hours)
    assert _numbers(_doc_row(doc, "jobs planned")) == [run.jobs]
    assert _numbers(_doc_row(doc, "checkpoint"))[:3] == [
        round(ck.gib_per_node),
        round(ck.save_seconds),
        round(ck.stage_seconds),
    ]
    assert _numbers(_doc_row(doc, "restore")) == [round(ck.restore_seconds), round(ck.restore_gib_per_node)]
    assert _numbers(_doc_row(doc, "save interval"))[:2] == [round(ck.interval_minutes), ck.node_mtbf_hours]
    assert _numbers(_doc_row(doc, "unplanned jobs expected"))[0] == round(run.expected_failures, 2)
    assert _numbers(_doc_row(doc, "overheads"))[0] == round(run.overhead_hours, 1)
    usd, low, high = _numbers(_doc_row(doc, "cost"))[:3]
    assert usd == round(cost.total_usd, -2)
    assert (low, high) == tuple(round(x / 1000) for x in cost.total_usd_range)

    capped = plan(resolve("64b-fp8", overrides=["compute.max_runtime_hours=72"]).recipe)
    text = doc[doc.index("max_runtime_hours=72") :].split("\n\n")[0]
    jobs, restores, overheads, usd = _numbers(text.split("`", 1)[1])[:4]
    assert (jobs, restores) == (capped.run.jobs, capped.run.jobs - 1)
    assert overheads == round(capped.run.overhead_hours, 1)
    assert usd == round(capped.cost.total_usd, -2)
