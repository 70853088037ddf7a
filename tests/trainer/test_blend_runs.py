"""The real trainer on a blend of two prepared datasets with validation: under torchrun on 2 ranks, then
resumed on 1 rank (the data position and the validation batches do not depend on the world size), and
resumed with changed weights (the schedule changes from the resumed position on)."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from blend_helpers import write_dataset
from trainer_helpers import REPO, TINY, metric_lines, trainer_env, trainer_ranks

from trainstack.aws.request import create_training_job_request
from trainstack.recipes.loader import resolve

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("trainer")]

SOURCES = '[{"uri": "s3://corpus/web/", "weight": 3}, {"uri": "s3://corpus/code/", "weight": 1}]'
BLEND = (
    "--set",
    f"data.sources={SOURCES}",
    "--set",
    "validation.every_steps=4",
    "--set",
    "validation.batches=1",
)
# validation.at_start: the model before its first step is evaluated too (step 0); a resume never is.
RECIPE = (
    "--recipe",
    str(TINY),
    *BLEND,
    "--set",
    "checkpointing.interval_steps=4",
    "--set",
    "validation.at_start=true",
)
GLOBAL_BATCH = 16


def read_trace(trace_dir: Path) -> dict[int, dict[int, dict]]:
    out: dict[int, dict[int, dict]] = {}
    for path in sorted(trace_dir.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            out.setdefault(int(path.stem.removeprefix("rank")), {})[record["step"]] = record
    return out


def one_process(*args: str) -> subprocess.CompletedProcess:
    """`python -m trainer` without torchrun: a world of one (as a 1-GPU job would run)."""
    return subprocess.run(
        [sys.executable, "-m", "trainer", "--device", "cpu", *args],
        cwd=REPO,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """One folder per input channel, as SageMaker mounts them: train_web/ and train_code/, each a
    prepared dataset with its validation split."""
    root = tmp_path_factory.mktemp("channels")
    for channel, first in (("train_web", 0), ("train_code", 100)):
        write_dataset(root / channel, first)
        write_dataset(root / channel / "validation", first, tokens=1000, shift=7)  # held-out windows
    return root


@pytest.fixture(scope="module")
def straight(data, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """8 steps on 2 ranks; checkpoints at 4 and 8; validation at 0 (at_start), 4 and 8."""
    root = tmp_path_factory.mktemp("blend")
    result = trainer_ranks(
        2, *RECIPE, "--data-dir", str(data), "--max-steps", "8",
        "--checkpoint-dir", str(root / "ck"), "--trace-dir", str(root / "trace"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return root, result


def validation_lines(stdout: str) -> dict[int, dict[str, float]]:
    """{step: values} of the metric lines with validation, read with the regexes the launcher sends."""
    recipe = resolve(str(TINY), overrides=[BLEND[1], BLEND[3], BLEND[5]]).recipe
    request = create_training_job_request(
        recipe,
        None,
        job_name="ts-t",
        role_arn="arn:aws:iam::123456789012:role/t",
        image_uri="i",
        bucket_name="b",
    )
    definitions = request["AlgorithmSpecification"]["MetricDefinitions"]
    out = {}
    for line in metric_lines(stdout):
        values = {d["Name"]: float(m.group(1)) for d in definitions if (m := re.search(d["Regex"], line))}
        if "train:val_loss" in values:
            out[int(values["train:step"])] = values
    return out


def test_the_blend_trains_on_both_sources_and_validates_each(straight):
    _, result = straight
    assert "blend(web=shards:" in result.stderr and "validation every 4 steps" in result.stderr
    evaluated = validation_lines(result.stdout)
    assert sorted(evaluated) == [0, 4, 8]
    for values in evaluated.values():
        per_source = values["train:val_loss_web"], values["train:val_loss_code"]
        assert values["train:val_loss"] == pytest.approx(sum(per_source) / 2, rel=1e-5)
    # it learns what it validates on, from the untrained model's loss on
    assert evaluated[8]["train:val_loss"] < evaluated[4]["train:val_loss"] < evaluated[0]["train:val_loss"]
    # The step-0 line carries the step and the validation values only: no training value exists yet.
    (first,) = [line for line in metric_lines(result.stdout) if line.startswith("step=0 ")]
    assert first.split()[1].startswith("val_loss=") and " loss=" not in first
    assert "validation every 4 steps and before the first" in result.stderr
    # Steps without validation print no val_ fields.
    assert all("val_loss" not in line for line in metric_lines(result.stdout) if line.startswith("step=5 "))


def test_resumed_on_one_rank_the_blend_continues_exactly(straight, data, tmp_path):
    root, result = straight
    run = tmp_path / "resumed"
    shutil.copytree(root / "ck", run / "ck")
    shutil.rmtree(run / "ck" / "step-000000008")
    resumed = one_process(
        *RECIPE, "--data-dir", str(data), "--max-steps", "8",
        "--checkpoint-dir", str(run / "ck"), "--trace-dir", str(run / "trace"),
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step 4, data position 64" in resumed.stderr and "RNG states start fresh" in resumed.stderr
    reference, mine = read_trace(root / "trace"), read_trace(run / "trace")
    for step in range(5, 9):
        # The same samples, so the same blend positions and sources; only reduction order differs.
        assert sorted(mine[0][step]["samples"]) == sorted(
            reference[0][step]["samples"] + reference[1][step]["samples"]
        )
        assert abs(mine[0][step]["loss"] - reference[0][step]["loss"]) < 1e-4, step
    assert sorted(validation_lines(resumed.stdout)) == [8]  # a resume does not evaluate at its start
    before, after = validation_lines(result.stdout)[8], validation_lines(resumed.stdout)[8]
    for key in ("train:val_loss", "train:val_loss_web", "train:val_loss_code"):
        assert after[key] == pytest.approx(before[key], rel=1e-4), key


def test_changed_weights_apply_from_the_resumed_position_and_are_kept_in_the_checkpoint(
    straight, data, tmp_path
):
    root, _ = straight
    shutil.copytree(root / "ck", tmp_path / "ck")
    shutil.rmtree(tmp_path / "ck" / "step-000000008")
    changed = SOURCES.replace('"weight": 3', '"weight": 1').replace('"weight": 1}]', '"weight": 3}]')
    resumed = one_process(
        "--recipe", str(TINY), "--set", f"data.sources={changed}", "--set", "checkpointing.interval_steps=4",
        "--data-dir", str(data), "--max-steps", "5", "--checkpoint-dir", str(tmp_path / "ck"),
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "data.sources weights [3.0, 1.0] -> [1.0, 3.0] from data position 64" in resumed.stderr
    assert "{'web': 48, 'code': 16}" in resumed.stderr  # what each source had given by then
    state = torch.load(io.BytesIO((tmp_path / "ck" / "step-000000005" / "rank-00000.pt").read_bytes()))
    assert json.loads(state["trainer"]["data_schedule"]) == [[0, [3.0, 1.0]], [64, [1.0, 3.0]]]
