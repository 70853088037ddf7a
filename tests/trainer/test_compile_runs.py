"""`training.compile: true` trains, end to end: the real trainer on gloo ranks (one process each),
blocks compiled by inductor's CPU backend (C++ kernels built with gcc), against the same run in
eager mode. Each pair is the tiny recipe for STEPS optimizer steps from the same seed and samples.

What is compared: every step's loss (the mean over every rank, full precision, from --trace-dir) within
LOSS_TOLERANCE of eager's. Measured (tiny, 10 steps, 1 rank): the largest gap 2.1e-4, while the
loss falls from 5.56 to 3.99 (0.1-0.2 per step), so a block compiled wrongly (dropped, run twice,
masked wrongly) is far outside it. The two differ at all because inductor fuses the BF16 block's ops
and rounds them in another order.

Layouts: 1 rank with the tiny recipe's `selective, every 2` (block 0 recomputes, block 1 does not:
both compiled graphs in one run) and a validation pass (a no_grad recompile); 2 ranks under FSDP with
full and with op-level checkpointing (separate code paths: the op policy runs inside the compiled
checkpoint); 2 ranks as one context-parallel group (cp 2: the K/V all-gather and its reduce-scatter
inside the compiled block, recomputed in backward for block 0). Then a tuning candidate whose
compile knob is on, through the tuning run's own job path. Compiling on 2 shared cores is slow, so
the model is the tiny one and the step counts small; one inductor cache serves the module (its
runs compile the same block graphs where shapes agree), empty at the start so the first runs compile
cold, as on a fresh machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trainer_helpers import TINY, metric_lines, trainer_ranks

from trainstack.protocol.metrics import parse_line
from trainstack.recipes.loader import resolve
from trainstack.tuning import engine
from trainstack.tuning.candidates import apply, candidates
from trainstack.tuning.local import run_job

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("trainer")]

STEPS = 10
LOSS_TOLERANCE = 2e-3
COMPILED_NOTE = "compile on (training.compile: true)"


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory) -> dict[str, str]:
    return {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp("inductor"))}


def train(tmp_path, name: str, ranks: int, compiled: bool, cache: dict, *settings: str) -> tuple[list, str]:
    """(each step's loss, the run's output) of the tiny recipe, compiled or eager."""
    args = ["--recipe", str(TINY), "--max-steps", str(STEPS), "--checkpoint-dir", str(tmp_path / name / "ck")]
    args += ["--trace-dir", str(tmp_path / name / "trace")]
    for setting in (f"training.compile={'true' if compiled else 'false'}", *settings):
        args += ["--set", setting]
    run = trainer_ranks(ranks, *args, timeout=540, env=cache)
    assert run.returncode == 0, run.stderr[-4000:]
    assert (COMPILED_NOTE in run.stderr) is compiled
    records = [
        json.loads(line) for line in (tmp_path / name / "trace" / "rank0.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return [r["loss"] for r in records], run.stdout


def assert_same_losses(eager: list[float], compiled: list[float]) -> None:
    for step, (a, b) in enumerate(zip(eager, compiled, strict=True), 1):
        assert abs(a - b) <= LOSS_TOLERANCE, (step, a, b)
    assert eager[-1] < eager[0] - 0.5  # it learned: the match is not two runs that stood still


def test_compiled_training_on_one_rank_reaches_eager_losses_with_and_without_checkpointed_blocks(
    tmp_path, inductor_cache
):
    validation = ("validation.every_steps=10", "validation.batches=1")
    eager, eager_out = train(tmp_path, "eager", 1, False, inductor_cache, *validation)
    compiled, compiled_out = train(tmp_path, "compiled", 1, True, inductor_cache, *validation)
    assert_same_losses(eager, compiled)
    val = [
        parse_line(line)["val_loss"]
        for out in (eager_out, compiled_out)
        for line in metric_lines(out)
        if "val_loss" in line
    ]
    assert len(val) == 2 and abs(val[0] - val[1]) <= LOSS_TOLERANCE, val
    # Inductor built the blocks' C++ kernels (gcc) into the module's fresh cache: the compiled run ran
    # inductor's code, not dynamo's eager fallback.
    assert any(Path(inductor_cache["TORCHINDUCTOR_CACHE_DIR"]).rglob("*.so"))
    # The block timer's hooks ran around the compiled blocks: a compute time on every line.
    assert all(parse_line(line)["straggler_compute_s"] > 0 for line in metric_lines(compiled_out))


@pytest.mark.parametrize(
    "checkpointing",
    [("activation_checkpointing.mode=full",), ("activation_checkpointing.policy=op",)],
    ids=["full", "op-level"],
)
def test_compiled_training_on_two_fsdp_ranks_reaches_eager_losses(tmp_path, inductor_cache, checkpointing):
    eager, _ = train(tmp_path, "eager", 2, False, inductor_cache, *checkpointing)
    compiled, _ = train(tmp_path, "compiled", 2, True, inductor_cache, *checkpointing)
    assert_same_losses(eager, compiled)


def test_compiled_training_with_context_parallelism_reaches_eager_losses(tmp_path, inductor_cache):
    cp2 = ("parallelism.cp=2", "parallelism.shard_group=2")
    eager, _ = train(tmp_path, "eager", 2, False, inductor_cache, *cp2)
    compiled, _ = train(tmp_path, "compiled", 2, True, inductor_cache, *cp2)
    assert_same_losses(eager, compiled)


def test_a_tuning_candidate_with_compile_on_trains(tmp_path, inductor_cache):
    """The tuning run's compile knob: from a recipe that says compile false, a candidate that turns
    it on (`--set training.compile=true`), its short job's recipe and the local job runner `tune
    --local` uses (torchrun, 2 ranks): the job trains every step and exits 0."""
    base = apply(resolve(str(TINY)).recipe, ("training.compile=false",))
    found = candidates(base, n=8, world=2, compile_choices=True)
    compiled = [c for c in found if "training.compile=true" in c.overrides]
    assert compiled, [c.overrides for c in found]
    candidate = compiled[0]
    steps = engine.step_plan(base, candidate, compiled=True, window=2)
    job = run_job(
        candidate.name,
        engine.job_recipe(base, candidate, steps),
        steps.max_steps,
        2,
        tmp_path,
        timeout_s=540,
        extra_env=inductor_cache,
    )
    log = "\n".join(job.lines)
    assert job.exit_code == 0, (job.failure_reason, log[-4000:])
    assert COMPILED_NOTE in log
    assert len(metric_lines(log)) == steps.max_steps
