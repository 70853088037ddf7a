"""Context parallelism (trainer.distributed.context_parallel) on 4 gloo ranks.

In FP32 (context_parallel_worker.py, the trainer's own pieces): cp 2 and cp 4, with FSDP over the
other ranks, and cp 2 under HSDP, give the losses and gradients of cp 1 within float32 tolerance over
20 steps; so do cp 4 and cp 1 at 8x a Llama 3.1 rope_scaling model's original context; and one CP
block keeps for backward exactly what trainstack.planner.trainer_memory says. End to end (the real
trainer, BF16): a cp 2 run's checkpoint resumes at cp 1 at the same data position and weights.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from trainer_helpers import REPO, TINY, metric_lines, trainer_env, trainer_ranks

from trainstack.planner import trainer_memory
from trainstack.protocol.metrics import parse_line
from trainstack.recipes.schema import ModelShape

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("trainer")]

STEPS = 20
# The worker's model (context_parallel_worker.SHAPE).
SHAPE = ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, ffn=176, vocab=256, rope_theta=10000.0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("cp") / "runs.pt"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=4",
        str(REPO / "tests" / "trainer" / "context_parallel_worker.py"),
        str(out),
        str(STEPS),
    ]
    result = subprocess.run(command, cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out)


def assert_same_training(reference: dict, other: dict, steps: int) -> None:
    """Losses within 2e-6 (float32 reduction order); gradients of every parameter within 1e-5 of its
    largest entry at the first step, 2e-4 at the last (20 AdamW steps amplify rounding differences)."""
    assert len(reference["losses"]) == len(other["losses"]) == steps
    for step, (a, b) in enumerate(zip(reference["losses"], other["losses"], strict=True), 1):
        assert abs(a - b) < 2e-6, (step, a, b)
    for a, b in zip(reference["grad_norms"], other["grad_norms"], strict=True):
        assert abs(a - b) < 1e-4 * a
    for step, tolerance in ((1, 1e-5), (steps, 2e-4)):
        for name, grad in reference["grads"][step].items():
            theirs = other["grads"][step][name]
            assert (grad - theirs).abs().max() <= tolerance * grad.abs().max(), (step, name)
    assert reference["losses"][-1] < reference["losses"][0] - 0.5  # it learned: not a trivial match


@pytest.mark.parametrize("layout", ["cp2", "cp4"])
def test_context_parallel_trains_like_cp1_over_20_steps_with_fsdp_across_the_other_ranks(runs, layout):
    assert_same_training(runs["cp1"], runs[layout], STEPS)


def test_context_parallel_under_hsdp_trains_like_cp1(runs):
    """2 replicas x (1 shard x cp 2): the first 5 of the same 20-step schedule."""
    reference, other = runs["cp1"], runs["cp2-hsdp"]
    for step, (a, b) in enumerate(zip(reference["losses"][:5], other["losses"], strict=True), 1):
        assert abs(a - b) < 2e-6, (step, a, b)
    for name, grad in reference["grads"][1].items():
        assert (grad - other["grads"][1][name]).abs().max() <= 1e-5 * grad.abs().max(), name


def test_llama31_rope_scaling_at_8x_the_original_context_is_the_same_at_cp4(runs):
    assert_same_training(runs["long-cp1"], runs["long-cp4"], 5)


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_block_keeps_exactly_what_trainer_memory_says(runs, cp):
    counted = runs[f"saved-cp{cp}"]
    tokens = counted["local_tokens"]
    for mode in ("none", "full", "op"):
        expected = trainer_memory.context_parallel_block_saved_bytes(SHAPE, mode, cp) * tokens
        assert counted[mode] == expected, (mode, counted[mode], expected)
    seq_len = 32
    assert counted["mask_bytes"] == trainer_memory.context_parallel_mask_bytes(seq_len, cp)
    # The gathered K/V are what CP adds on the uncheckpointed block: cp x the local K/V.
    assert (
        counted["none"] - trainer_memory.block_saved_bytes(SHAPE, "none") * tokens
        == 4 * SHAPE.kv_dim * (cp - 1) * tokens
    )


def trace(directory) -> dict[int, dict]:
    records = {}
    for line in (directory / "rank0.jsonl").read_text().splitlines():
        record = json.loads(line)
        records[record["step"]] = record
    return records


def test_a_run_saved_at_cp2_resumes_at_cp1_exactly(tmp_path):
    """The real trainer (BF16): cp 2 x 2 data-parallel ranks for 12 steps (checkpoint at 10), then the
    step-10 checkpoint resumed at cp 1 on the 2 data-parallel ranks. Same data position, same samples
    per step, and the first resumed step's loss (a forward of the loaded weights on the same tokens)
    equal to the cp 2 run's step 11; validation at step 12 gives the same held-out loss."""
    common = (
        "--recipe",
        str(TINY),
        "--set",
        "parallelism.shard_group=2",
        "--set",
        "validation.every_steps=12",  # at step 12 in both runs, on the same held-out samples
        "--set",
        "validation.batches=1",
    )
    cp2 = trainer_ranks(
        4,
        *common,
        "--set",
        "parallelism.cp=2",
        "--max-steps",
        "12",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        "--trace-dir",
        str(tmp_path / "cp2"),
    )
    assert cp2.returncode == 0, cp2.stderr[-3000:]
    assert "context parallel 2 (FSDP over shard x cp)" in cp2.stderr
    assert "micro_batch 2 x 2 ranks x 4 accumulation" in cp2.stderr
    shutil.rmtree(tmp_path / "ck" / "step-000000012")  # resume from step 10
    cp1 = trainer_ranks(
        2,
        *common,
        "--max-steps",
        "12",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        "--trace-dir",
        str(tmp_path / "cp1"),
    )
    assert cp1.returncode == 0, cp1.stderr[-3000:]
    assert "step 10, data position 160" in cp1.stderr
    assert "parallelism.cp" in cp1.stderr  # the change is logged as a safe one
    before, after = trace(tmp_path / "cp2"), trace(tmp_path / "cp1")
    assert sorted(after) == [11, 12]
    for step in (11, 12):
        assert after[step]["samples"] == before[step]["samples"]
    # Step 11's loss is the loaded weights' forward on the same tokens: cp 1 and cp 2 differ only in
    # how BF16 attention sums over the split (seen: equal to 1e-6).
    assert abs(after[11]["loss"] - before[11]["loss"]) < 1e-4
    assert abs(after[12]["loss"] - before[12]["loss"]) < 1e-3
    # Validation splits its samples over the CP ranks as training does: the same held-out loss.
    val = [
        parse_line(line)["val_loss"]
        for run in (cp2, cp1)
        for line in metric_lines(run.stdout)
        if "val_loss" in line
    ]
    assert len(val) == 2 and abs(val[0] - val[1]) < 1e-3, val
