"""A real fine-tuning run through the trainer's entrypoint on 2 gloo ranks (issue 38): a tiny Llama base
(`model.init_from`, transformers' weights) fine-tuned on a chat dataset prepared by `prepare_chat`
(`training.objective: sft`): it loads the base, logs how the conversations pack and how many epochs the
steps make, validates on the held-out conversations before the first step and every 4 steps, the
training loss falls over the epochs, it checkpoints, and a run stopped at step 8 and resumed takes the
same packed rows and computes the same losses as the run that went straight through; every row of the
run's positions is read exactly once."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from sft_trainer_helpers import llama_base, prepare, sft_recipe, write_recipe
from trainer_helpers import metric_lines, trainer_ranks

from trainstack.protocol.metrics import parse_line
from trainstack.recipes.schema import Validation

pytestmark = [pytest.mark.fast, pytest.mark.xdist_group("trainer")]

SEQ_LEN = 128
GLOBAL_BATCH = 8
STEPS = 12


def read_trace(trace_dir: Path) -> dict[int, dict[int, dict]]:
    """{rank: {step: record}}; a later record for a step (after a resume) replaces an earlier one."""
    out: dict[int, dict[int, dict]] = {}
    for path in sorted(trace_dir.glob("rank*.jsonl")):
        rank = int(path.stem.removeprefix("rank"))
        for line in path.read_text().splitlines():
            record = json.loads(line)
            out.setdefault(rank, {})[record["step"]] = record
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, Path, Path]:
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("sft-run")
    llama_base(transformers, root / "base", SEQ_LEN, seed=2)
    data = prepare(root, root / "base", count=48, seq_len=SEQ_LEN, validation_fraction=0.25)
    recipe = sft_recipe(
        root / "base",
        seq_len=SEQ_LEN,
        micro_batch=1,
        global_batch=GLOBAL_BATCH,
        steps=STEPS,
        lr=3e-3,
        warmup_steps=2,
        loss_chunk_tokens=48,
    )
    recipe = recipe.model_copy(update={"validation": Validation(every_steps=4, batches=1)})
    return root, write_recipe(recipe, root / "recipe.json"), data


def train(recipe: Path, data: Path, run: Path, max_steps: int) -> subprocess.CompletedProcess:
    args = ("--recipe", str(recipe), "--data-dir", str(data), "--checkpoint-dir", str(run / "ck"))
    return trainer_ranks(2, *args, "--max-steps", str(max_steps), "--trace-dir", str(run / "trace"))


@pytest.fixture(scope="module")
def straight(setup) -> tuple[Path, subprocess.CompletedProcess]:
    root, recipe, data = setup
    result = train(recipe, data, root / "straight", STEPS)
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "straight", result


def test_a_fine_tuning_run_starts_from_the_base_validates_and_its_loss_falls(setup, straight):
    root, _, _ = setup
    run, result = straight
    assert f"loaded base model {root / 'base'}" in result.stderr
    assert "fine-tuning on " in result.stderr and "conversations packed into" in result.stderr
    lines = [parse_line(line) for line in metric_lines(result.stdout)]
    training = [line for line in lines if "loss" in line]
    assert [int(line["step"]) for line in training] == list(range(1, STEPS + 1))
    validated = {int(line["step"]): line["val_loss"] for line in lines if "val_loss" in line}
    assert sorted(validated) == [0, 4, 8, 12]  # before the first step (init_from), then every 4
    losses = [line["loss"] for line in training]
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    assert (run / "ck").is_dir() and any((run / "ck").iterdir())


def test_a_stopped_fine_tuning_run_resumes_exactly(setup, straight, tmp_path):
    _, recipe, data = setup
    first = train(recipe, data, tmp_path, 8)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = train(recipe, data, tmp_path, STEPS)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"step 8, data position {8 * GLOBAL_BATCH}" in resumed.stderr
    reference, trace = read_trace(straight[0] / "trace"), read_trace(tmp_path / "trace")
    for step in range(1, STEPS + 1):
        assert abs(trace[0][step]["loss"] - reference[0][step]["loss"]) <= 1e-6, step
        for rank in (0, 1):  # every rank took the same packed rows as in the straight run
            assert trace[rank][step]["samples"] == reference[rank][step]["samples"]
    rows = sorted(s for rank in trace.values() for record in rank.values() for s in record["samples"])
    assert rows == list(range(STEPS * GLOBAL_BATCH)), "a row was repeated or skipped"


def test_the_same_chat_dataset_under_objective_pretrain_is_refused_in_one_line(setup, tmp_path):
    root, recipe, data = setup
    pretrain = json.loads(recipe.read_text())
    pretrain["training"]["objective"] = "pretrain"
    path = tmp_path / "pretrain.json"
    path.write_text(json.dumps(pretrain))
    result = train(path, data, tmp_path, 1)
    assert result.returncode == 2
    assert "loss_mask: a chat dataset (`data prepare --format chat`) under training.objective pretrain" in (
        result.stderr
    )
    shutil.rmtree(tmp_path / "ck", ignore_errors=True)


def test_sft_on_synthetic_tokens_is_refused_in_one_line(setup, tmp_path):
    _, recipe, _ = setup
    args = ("--recipe", str(recipe), "--checkpoint-dir", str(tmp_path / "ck"), "--synthetic")
    result = trainer_ranks(1, *args, "--max-steps", "1")
    assert result.returncode == 2
    assert "--synthetic: training.objective is sft, which trains on a chat dataset's targets" in result.stderr
