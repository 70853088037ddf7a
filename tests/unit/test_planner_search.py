"""The joint recommender: micro-batch x checkpointing x shard group x nodes, ties and their order, the
recipe's values beside the recommendation, pasteable fixes; `plan --compare`; tp/cp refused."""

from __future__ import annotations

import json
import shlex

import pytest
from typer.testing import CliRunner

from trainstack.cli.main import app
from trainstack.planner import HEADROOM, ActivationPolicy, Layout, plan, recipe_memory, recommend
from trainstack.planner.compare import compare
from trainstack.planner.memory import peak
from trainstack.planner.search import TIE, checkpointing_label, checkpointing_options, choose, cp_options
from trainstack.recipes.hardware import INSTANCES
from trainstack.recipes.loader import resolve

pytestmark = pytest.mark.fast

runner = CliRunner()


def layout(nodes=1, mb=1, group=8, tpd=100.0, hours=10.0, ckpt="none", cp=1) -> Layout:
    return Layout(
        instance_type="ml.p6-b200.48xlarge", nodes=nodes, micro_batch=mb, checkpointing=ckpt, mode=ckpt,
        every=2, policy="block", shard_group=group, cp=cp, fits=True, peak_gib=100.0,
        tokens_per_sec_per_gpu=1.0, hours=hours, tokens_per_usd=tpd,
    )  # fmt: skip


def test_the_most_tokens_per_dollar_wins_outside_the_tie_margin():
    best = layout(nodes=4, tpd=110.0)
    chosen, _ = choose([layout(nodes=1, tpd=100.0), best], deadline_hours=100, per_node=8)
    assert chosen is best  # 10% more tokens per dollar beats fewer nodes


def test_ties_go_to_fewer_nodes_then_a_group_inside_a_node_then_the_larger_micro_batch():
    within = 1 - TIE / 2  # inside the 3% margin
    fewer_nodes = layout(nodes=1, tpd=100.0 * within)
    assert choose([layout(nodes=2, tpd=100.0), fewer_nodes], 100, 8)[0] is fewer_nodes
    inside = layout(group=8, tpd=100.0 * within)
    assert choose([layout(group=16, tpd=100.0), inside], 100, 8)[0] is inside
    larger = layout(mb=4, tpd=100.0 * within)
    assert choose([layout(mb=1, tpd=100.0), larger], 100, 8)[0] is larger
    outside = layout(mb=4, tpd=100.0 * (1 - 2 * TIE))
    assert choose([layout(mb=1, tpd=100.0), outside], 100, 8)[0].micro_batch == 1


def test_layouts_that_miss_the_deadline_are_not_chosen():
    slow_cheap = layout(nodes=1, tpd=200.0, hours=50.0)
    in_time = layout(nodes=4, tpd=100.0, hours=12.0)
    assert choose([slow_cheap, in_time], deadline_hours=20, per_node=8)[0] is in_time


def test_64b_stays_at_shard_group_8_when_micro_batch_2_fits_there():
    recipe = resolve("64b-fp8").recipe
    budget = recipe.instance.gpu.usable_gib * (1 - HEADROOM)
    assert peak(recipe_memory(recipe, micro_batch=2, shard_group=8, policy=ActivationPolicy.full())) <= budget
    assert plan(recipe).recommendations.recommended.shard_group == 8
    # asked to widen to 16 across nodes (which frees memory for micro-batch 4), it still says 8 and 2
    wide = resolve("64b-fp8", overrides=["parallelism.shard_group=16", "training.micro_batch=4"]).recipe
    rec = plan(wide).recommendations
    assert (rec.recommended.shard_group, rec.recommended.micro_batch) == (8, 2)
    assert "--set parallelism.shard_group=8" in rec.set_flags


def test_the_search_is_joint_over_micro_batch_checkpointing_group_and_nodes():
    rec = recommend(resolve("30b-fp8").recipe)
    assert rec.considered > 50
    recipe = resolve(
        "30b-fp8",
        overrides=[
            "activation_checkpointing.mode=full",
            "activation_checkpointing.policy=block",
            "training.micro_batch=8",
        ],
    ).recipe
    # full checkpointing at micro-batch 8 fits, but op-level checkpointing at 1 gives more tokens per dollar:
    # the search changes two knobs at once (a one-knob-at-a-time search would not)
    rec = recommend(recipe)
    assert {c.field for c in rec.changes if not c.matches} >= {
        "training.micro_batch",
        "activation_checkpointing.mode",
    }
    assert rec.tokens_per_usd_gain > TIE


def test_recommendations_stand_beside_the_recipe_values_and_mark_matches():
    rec = plan(
        resolve("64b-fp8", overrides=["training.micro_batch=4", "parallelism.shard_group=16"]).recipe
    ).recommendations
    rows = {c.field: c for c in rec.changes}
    assert rows["compute.instance_count"].matches and rows["activation_checkpointing.mode"].matches
    assert (rows["parallelism.shard_group"].recipe, rows["parallelism.shard_group"].recommended) == (
        "16",
        "8",
    )
    assert not rows["parallelism.shard_group"].matches


def test_the_printed_fix_pastes_into_a_plan_that_matches():
    result = runner.invoke(
        app,
        [
            "plan",
            "30b-fp8",
            "--set",
            "activation_checkpointing.mode=full",
            "--set",
            "activation_checkpointing.policy=block",
        ],
    )
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("trainstack plan 30b-fp8"))
    command = []
    for line in lines[start:]:
        command.append(line.strip().rstrip("\\").strip())
        if not line.rstrip().endswith("\\"):
            break
    words = shlex.split(" ".join(command))
    assert words[:3] == ["trainstack", "plan", "30b-fp8"] and "--set" in words
    again = runner.invoke(app, words[1:])
    assert again.exit_code == 0, again.output
    assert "the recipe already matches the recommendation" in again.stdout


def test_node_counts_respect_the_team_cap():
    recipe = resolve("64b-fp8", overrides=["budget.max_instance_count=8"]).recipe
    assert recommend(recipe).recommended.nodes <= 8
    capped = resolve("30b-fp8", overrides=["budget.max_instance_count=4"]).recipe
    # the team cap bounds the search: even a tight deadline cannot pull in more nodes than allowed
    assert recommend(capped, deadline_hours=1.0).recommended.nodes <= 4


def test_a_recipe_that_does_not_fit_is_fixed_on_its_own_nodes():
    recipe = resolve(
        "30b-fp8",
        overrides=[
            "activation_checkpointing.mode=none",
            "activation_checkpointing.policy=block",
            "training.micro_batch=4",
        ],
    ).recipe
    p = plan(recipe)
    assert not p.fits
    assert p.recommendations.recommended.nodes == 4
    assert p.memory.fix.startswith("--set ")


def test_compare_rows_one_per_instance_type_with_the_recommended_layout():
    result = runner.invoke(app, ["plan", "30b-fp8", "--compare", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [r["instance_type"] for r in rows][0] == "ml.p6-b200.48xlarge"  # the recipe's own first
    assert sorted(r["instance_type"] for r in rows) == sorted(INSTANCES)
    for row in rows:
        for field in (
            "instance_type",
            "nodes",
            "layout",
            "fits",
            "tokens_per_sec_per_gpu",
            "hours",
            "total_usd",
        ):
            assert field in row
        assert row["fits"] is True
        low, high = row["tokens_per_sec_per_gpu_range"]
        assert low < row["tokens_per_sec_per_gpu"] <= high
    hopper = [r for r in rows if not INSTANCES[r["instance_type"]].gpu.supports_mxfp8]
    assert hopper and all(r["fp8_recipe"] == "current" for r in hopper)  # MXFP8 needs Blackwell
    own = rows[0]
    assert own["nodes"] == 4 and own["micro_batch"] == 1  # the recipe's own recommendation
    # same deadline: every type finishes training no later than the recipe's own plan (plus the tie)
    recipe_hours = plan(resolve("30b-fp8").recipe).run.hours
    for row in rows:
        assert row["hours"] <= recipe_hours * (1 + TIE) + 5  # instance hours include a few hours of overhead


def test_compare_table_has_a_row_per_instance_type():
    result = runner.invoke(app, ["plan", "8b-fp8", "--compare"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for instance_type in INSTANCES:
        assert instance_type[:15] in result.stdout
    assert "USD per instance-hour" in result.stdout


def test_tensor_parallelism_is_refused():
    result = runner.invoke(app, ["plan", "30b-fp8", "--set", "parallelism.tp=2"])
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "parallelism.tp" in lines[0] and "does not implement" in lines[0]


# --- FP8 and the op-level policy -------------------------------------------------------------------
def test_fp8_recipes_are_never_recommended_the_op_policy_and_bf16_ones_still_are():
    # The same Llama 3 8B layout: in BF16 the op-level policy wins (the memory it frees buys a larger
    # micro-batch); in FP8 it cannot run (the schema refuses it), so the search never offers it.
    bf16 = resolve("8b-fp8", overrides=["precision.dtype=bf16", "precision.fp8_recipe=null"]).recipe
    assert recommend(bf16).recommended.checkpointing == "selective op"
    assert "selective op" not in {checkpointing_label(o) for o in checkpointing_options("fp8")}
    assert "selective op" in {checkpointing_label(o) for o in checkpointing_options("bf16")}
    for name in ("8b-fp8", "14b-fp8", "30b-fp8"):
        fp8 = resolve(name).recipe
        # deadline none: every layout that fits is a candidate, and op would have been the lightest
        rec = recommend(fp8, deadline_hours=float("inf"))
        assert rec.recommended.policy != "op", name
        assert all("--set activation_checkpointing.policy=op" != f for f in rec.set_flags), name


def test_compare_never_proposes_the_op_policy_for_an_fp8_recipe():
    rows = compare(resolve("8b-fp8").recipe)
    assert len(rows) == len(INSTANCES)
    assert all(row.checkpointing != "selective op" for row in rows if row.nodes is not None)


def test_the_fp8_advice_for_a_bf16_op_recipe_pastes_into_a_valid_recipe():
    recipe = resolve(
        "7b-bf16", overrides=["activation_checkpointing.mode=selective", "activation_checkpointing.policy=op"]
    ).recipe
    (note,) = [n for n in recommend(recipe).notes if n.startswith("precision.dtype")]
    flags = note[note.index("(") + 1 : note.index(":", note.index("("))].split()
    sets = [flags[i + 1] for i in range(0, len(flags), 2) if flags[i] == "--set"]
    assert "activation_checkpointing.policy=block" in sets
    again = resolve(
        "7b-bf16",
        overrides=["activation_checkpointing.mode=selective", "activation_checkpointing.policy=op", *sets],
    ).recipe
    assert again.precision.dtype == "fp8" and again.activation_checkpointing.policy == "block"


# --- context parallelism in the search -------------------------------------------------------------
def test_30b_at_128k_without_context_parallelism_is_fixed_by_cp_and_the_fix_fits():
    """At cp 1 a 128K sequence of the 30B model does not fit even fully checkpointed; the search
    finds the context-parallel layout (the 30b-fp8-128k recipe) and its plan fits."""
    result = runner.invoke(
        app, ["plan", "30b-fp8-128k", "--set", "parallelism.cp=1", "--set", "parallelism.shard_group=8"]
    )
    assert result.exit_code == 1, result.output  # plan's exit status for "does not fit"
    assert "DOES NOT FIT" in result.stdout and "--set parallelism.cp=2" in result.stdout
    fixed = plan(resolve("30b-fp8-128k").recipe)
    assert fixed.fits and fixed.memory.peak_gib <= fixed.memory.budget_gib
    assert fixed.recommendations.matches


def test_context_parallelism_is_searched_only_where_each_gpu_keeps_8k_tokens():
    assert cp_options(8192, 8) == (1,)
    assert cp_options(131072, 8) == (1, 2, 4, 8)
    assert cp_options(32768, 8) == (1, 2, 4)
    assert cp_options(131072, 4) == (1, 2, 4)  # inside a node of 4 GPUs


def test_ties_prefer_the_smaller_context_parallel_degree():
    within = 1 - TIE / 2
    smaller = layout(cp=2, tpd=100.0 * within)
    assert choose([layout(cp=4, tpd=100.0), smaller], 100, 8)[0] is smaller


def test_context_parallelism_shortens_the_micro_step_so_a_sigterm_save_fits():
    """64b-fp8-128k at cp 2: a 128K micro-step is longer than SageMaker's SIGTERM window leaves; at
    cp 4 each GPU computes half as many tokens and the save after SIGTERM fits."""
    cp2 = plan(resolve("64b-fp8-128k").recipe).run.checkpoint
    cp4 = plan(
        resolve("64b-fp8-128k", overrides=["parallelism.cp=4", "parallelism.shard_group=8"]).recipe
    ).run.checkpoint
    assert not cp2.sigterm_fits and cp4.sigterm_fits
    assert cp4.sigterm_seconds < cp2.sigterm_seconds


def test_the_kv_exchange_is_overlapped_with_transformer_engine_and_exposed_on_the_pytorch_path():
    from trainstack.planner.calibration import CALIBRATION
    from trainstack.planner.throughput import context_parallel_exchange_s

    m = resolve("30b-fp8-128k").recipe.model
    args = dict(
        tokens_per_sequence=131072, cp=4, bandwidth=300e9, attention_fwd_s=1.0, attention_bwd_s=2.5,
        recomputed_fraction=1.0, cal=CALIBRATION,
    )  # fmt: skip
    forward = 2 * m.kv_dim * 2 * 131072 * 3 / 4 / 300e9
    exposed = context_parallel_exchange_s(m, backend="pytorch", **args)
    assert exposed == pytest.approx(3 * forward)  # gather, the recompute's gather, the reduce-scatter
    overlapped = context_parallel_exchange_s(m, backend="transformer_engine", **args)
    assert overlapped == pytest.approx(CALIBRATION.overlap_interference * 4 * forward)  # all hidden
    assert context_parallel_exchange_s(m, backend="pytorch", **{**args, "cp": 1}) == 0.0
