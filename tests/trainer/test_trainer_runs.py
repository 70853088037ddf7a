"""End-to-end CPU runs of the real multi-process trainer (gloo): FSDP, HSDP, exact resume, skipped
half-written checkpoints, SIGTERM, NaN, and the stack's metric regexes against the real output. The
reference run and the SIGTERM test go through torchrun (and the image's entrypoint) themselves; the
others start their ranks as torchrun would, forked from a server that imported the trainer once
(trainer_helpers.trainer_ranks), since a torch import per process costs seconds here."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from trainer.checkpoint.manager import MARKER, completeness_problem
from trainer.entrypoint import child_pids
from trainer_helpers import REPO, TINY, metric_lines, torchrun, trainer_env, trainer_ranks, two_nodes

from trainstack.aws.request import create_training_job_request
from trainstack.protocol.metrics import FIELDS, SAVED_STEP_METRIC, metric_definitions, parse_line
from trainstack.recipes.loader import resolve
from trainstack.recipes.schema import to_hyperparameters

# The fast tier trains 2 ranks and resumes exactly (the first two tests); the rest is the slow tier.
pytestmark = [pytest.mark.fast, pytest.mark.xdist_group("trainer")]

GLOBAL_BATCH = 16  # tiny.yaml


def read_trace(trace_dir: Path) -> dict[int, dict[int, dict]]:
    """{rank: {step: record}}; a later record for a step (after a resume) replaces an earlier one."""
    out: dict[int, dict[int, dict]] = {}
    for path in sorted(trace_dir.glob("rank*.jsonl")):
        rank = int(path.stem.removeprefix("rank"))
        for line in path.read_text().splitlines():
            record = json.loads(line)
            out.setdefault(rank, {})[record["step"]] = record
    return out


def all_samples(trace_dir: Path) -> list[int]:
    samples: list[int] = []
    for path in sorted(trace_dir.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            samples.extend(json.loads(line)["samples"])
    return samples


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """30 steps without interruption on 2 ranks (FSDP over 2)."""
    root = tmp_path_factory.mktemp("straight")
    result = torchrun(
        2,
        "--recipe",
        str(TINY),
        "--max-steps",
        "30",
        "--checkpoint-dir",
        str(root / "ck"),
        "--trace-dir",
        str(root / "trace"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return root, result


@pytest.fixture(scope="module")
def first_20(tmp_path_factory) -> Path:
    """The first 20 steps of the same run, stopped there (checkpoints at 10 and 20)."""
    root = tmp_path_factory.mktemp("first20")
    result = trainer_ranks(
        2,
        "--recipe",
        str(TINY),
        "--max-steps",
        "20",
        "--checkpoint-dir",
        str(root / "ck"),
        "--trace-dir",
        str(root / "trace"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def test_fsdp_loss_falls_on_the_synthetic_set(straight):
    _, result = straight
    losses = [parse_line(line)["loss"] for line in metric_lines(result.stdout)]
    assert len(losses) == 30
    assert "FSDP over 2 ranks" in result.stderr
    assert "backend pytorch" in result.stderr  # which model path ran is logged
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5, losses


def test_resume_is_exact_and_the_data_position_continues(straight, first_20, tmp_path):
    run = tmp_path / "resumed"
    shutil.copytree(first_20, run)
    result = trainer_ranks(
        2,
        "--recipe",
        str(TINY),
        "--max-steps",
        "30",
        "--checkpoint-dir",
        str(run / "ck"),
        "--trace-dir",
        str(run / "trace"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stderr and "step 20, data position 320" in result.stderr
    reference, resumed = read_trace(straight[0] / "trace"), read_trace(run / "trace")
    assert abs(resumed[0][30]["loss"] - reference[0][30]["loss"]) <= 1e-6
    for step in range(21, 31):
        assert abs(resumed[0][step]["loss"] - reference[0][step]["loss"]) <= 1e-6, step
        for rank in (0, 1):  # every rank took the same samples as in the straight run
            assert resumed[rank][step]["samples"] == reference[rank][step]["samples"]
    samples = all_samples(run / "trace")  # steps 1-20, then 21-30 after the resume
    assert sorted(samples) == list(range(30 * GLOBAL_BATCH)), "a batch was repeated or skipped"


@pytest.mark.slow
def test_truncated_checkpoint_is_skipped_for_the_previous_complete_one(straight, first_20, tmp_path):
    run = tmp_path / "truncated"
    shutil.copytree(first_20, run)
    newest = run / "ck" / "step-000000020"
    shard = next(newest.glob("*.distcp"))
    with shard.open("r+b") as f:  # killed mid-write / half-synced from S3
        f.truncate(shard.stat().st_size // 2)
    assert "truncated" in completeness_problem(newest)
    result = trainer_ranks(
        2,
        "--recipe",
        str(TINY),
        "--max-steps",
        "30",
        "--checkpoint-dir",
        str(run / "ck"),
        "--trace-dir",
        str(run / "trace"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "skipping checkpoint" in result.stderr and "step-000000020" in result.stderr
    assert "step 10, data position 160" in result.stderr
    reference, resumed = read_trace(straight[0] / "trace"), read_trace(run / "trace")
    assert abs(resumed[0][30]["loss"] - reference[0][30]["loss"]) <= 1e-6


@pytest.mark.slow
def test_checkpoint_without_marker_is_skipped(first_20, tmp_path):
    run = tmp_path / "unmarked"
    shutil.copytree(first_20, run)
    (run / "ck" / "step-000000020" / MARKER).unlink()
    result = trainer_ranks(2, "--recipe", str(TINY), "--max-steps", "21", "--checkpoint-dir", str(run / "ck"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "interrupted while writing" in result.stderr and "step 10, data position 160" in result.stderr


@pytest.mark.slow
def test_hsdp_2x2_mesh_trains_like_fsdp(straight, tmp_path):
    # shard_group 2 on 4 ranks: 2 replicas x 2-way shard; global batch and samples per step unchanged.
    result = trainer_ranks(
        4,
        "--recipe",
        str(TINY),
        "--set",
        "parallelism.shard_group=2",
        "--max-steps",
        "6",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        "--trace-dir",
        str(tmp_path / "trace"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "HSDP: 2 replicas x 2-way shard" in result.stderr
    hsdp, fsdp = read_trace(tmp_path / "trace"), read_trace(straight[0] / "trace")
    # Same samples and math; only the order of the gradient reductions differs (seen: within 1e-6).
    for step in range(1, 7):
        assert abs(hsdp[0][step]["loss"] - fsdp[0][step]["loss"]) < 1e-4, step
    assert hsdp[0][6]["loss"] < hsdp[0][1]["loss"]


@pytest.mark.slow
def test_one_process_computes_the_same_losses_as_two_ranks(straight, tmp_path):
    # Initialisation and the data each step sees do not depend on the layout: only reduction order does.
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer",
            "--recipe",
            str(TINY),
            "--device",
            "cpu",
            "--max-steps",
            "3",
            "--checkpoint-dir",
            str(tmp_path / "ck"),
            "--trace-dir",
            str(tmp_path / "trace"),
        ],
        cwd=REPO,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "FSDP over 1 ranks" in result.stderr and "8 accumulation" in result.stderr
    single, fsdp = read_trace(tmp_path / "trace"), read_trace(straight[0] / "trace")
    for step in (1, 2, 3):
        assert abs(single[0][step]["loss"] - fsdp[0][step]["loss"]) < 1e-4, step


@pytest.mark.slow
def test_every_metric_regex_matches_real_lines_and_only_the_intended_numbers(straight):
    _, result = straight
    lines = metric_lines(result.stdout)
    assert lines
    # The MetricDefinitions the launcher actually sends in CreateTrainingJob, from the one definition.
    request = create_training_job_request(
        resolve(str(TINY)).recipe,
        None,
        job_name="ts-test-tiny-1",
        role_arn="arn:aws:iam::123456789012:role/t",
        image_uri="123456789012.dkr.ecr.us-west-2.amazonaws.com/t:1",
        bucket_name="bucket-t",
    )
    definitions = request["AlgorithmSpecification"]["MetricDefinitions"]
    assert definitions == metric_definitions()
    line_definitions, (saved,) = definitions[:-1], definitions[-1:]
    assert [d["Name"] for d in line_definitions] == [f.metric_name for f in FIELDS]
    assert saved["Name"] == SAVED_STEP_METRIC
    for line in lines:
        printed = dict(token.split("=", 1) for token in line.split())
        # tiny.yaml has no validation: every field but the validation ones (optional ones that only
        # older images leave out are printed by this trainer on every log step).
        assert list(printed) == [f.key for f in FIELDS if not f.key.startswith("val_loss")]
        for field, definition in zip(FIELDS, line_definitions, strict=True):
            found = re.findall(definition["Regex"], line)
            assert found == ([printed[field.key]] if field.key in printed else []), (definition, line)
        assert not re.search(saved["Regex"], line)
    # Log lines (stderr, which SageMaker also scans) yield no value of the metric line's fields, and the
    # saved step exactly from each completed checkpoint's line (its folder's step).
    saved_steps = []
    for line in result.stderr.splitlines():
        for definition in line_definitions:
            assert not re.search(definition["Regex"], line), (definition["Name"], line)
        if found := re.findall(saved["Regex"], line):
            folder = re.search(r"checkpoint complete: \S*step-(\d+)", line)
            assert folder and found == [str(int(folder.group(1)))], line
            saved_steps.append(int(found[0]))
    assert saved_steps, "no completed checkpoint in the run's log"


@pytest.mark.slow
def test_sigterm_to_the_entrypoint_and_torchrun_exits_zero_and_resumes_exactly(straight, tmp_path):
    """SageMaker's stop, as the container may get it: SIGTERM to the entrypoint, which forwards it to the
    2 trainer ranks, and to torchrun too (a signal to the container's process tree). torchrun must not
    act on it (its agent would cut the save short and exit 1, failing the job: it did before torchrun
    was started with SIGTERM blocked). The ranks agree on the stop at a micro-step boundary, drop the
    partial step (or complete it when only its optimizer step was left), save, exit 0; a second job
    resumes and matches the uninterrupted run to 1e-6 with every sample used once."""
    resource_config = tmp_path / "resourceconfig.json"
    resource_config.write_text(json.dumps({"current_host": "algo-1", "hosts": ["algo-1"]}))
    hyperparameters = tmp_path / "hyperparameters.json"  # exactly what the launcher passes
    hyperparameters.write_text(json.dumps(to_hyperparameters(resolve(str(TINY)).recipe)))
    checkpoints, trace = tmp_path / "ck", tmp_path / "trace"
    out = (tmp_path / "out.txt").open("w")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trainer.entrypoint",
            "train",
            "--resource-config",
            str(resource_config),
            "--nproc-per-node",
            "2",
            "--",
            "--recipe",
            str(hyperparameters),
            "--device",
            "cpu",
            "--checkpoint-dir",
            str(checkpoints),
            "--trace-dir",
            str(trace),
        ],
        cwd=REPO,
        env=trainer_env(),
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 180
    while "step=13 " not in (tmp_path / "out.txt").read_text():
        assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "out.txt").read_text()
        time.sleep(0.05)
    (torchrun_pid,) = child_pids(process.pid)
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    os.kill(torchrun_pid, signal.SIGTERM)
    code = process.wait(timeout=120)
    elapsed = time.monotonic() - signalled
    log = (tmp_path / "out.txt").read_text()
    assert code == 0, log[-3000:]
    assert elapsed < 60, elapsed  # SageMaker allows 120 s; a tiny CPU model needs a few
    dropped = re.search(r"SIGTERM during step (\d+) after micro-step (\d+) of 4: the partial step is", log)
    completed = re.search(r"SIGTERM during step (\d+) after its last micro-step: the step is", log)
    assert dropped or completed, log[-3000:]
    stopped_at = int(re.search(r"SIGTERM: saved step (\d+)", log).group(1))
    if dropped:
        assert stopped_at == int(dropped.group(1)) - 1 and 1 <= int(dropped.group(2)) < 4
        assert stopped_at + 1 not in read_trace(trace)[0]  # the dropped step left no trace
    else:
        assert stopped_at == int(completed.group(1))
    assert 13 <= stopped_at < 30
    newest = checkpoints / f"step-{stopped_at:09d}"
    assert completeness_problem(newest) is None
    assert json.loads((newest / MARKER).read_text())["samples_consumed"] == stopped_at * GLOBAL_BATCH

    resumed = trainer_ranks(
        2,
        "--recipe",
        str(TINY),
        "--max-steps",
        "30",
        "--checkpoint-dir",
        str(checkpoints),
        "--trace-dir",
        str(trace),
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"step {stopped_at}, data position {stopped_at * GLOBAL_BATCH}" in resumed.stderr
    reference, run = read_trace(straight[0] / "trace"), read_trace(trace)
    for step in range(stopped_at + 1, 31):
        assert abs(run[0][step]["loss"] - reference[0][step]["loss"]) <= 1e-6, step
        for rank in (0, 1):
            assert run[rank][step]["samples"] == reference[rank][step]["samples"]
    assert sorted(all_samples(trace)) == list(range(30 * GLOBAL_BATCH)), "a batch was repeated or skipped"


@pytest.mark.slow
def test_nan_loss_exits_non_zero_and_saves_nothing_after_it(tmp_path):
    # Step 5's gradients become NaN, as a diverging run's do (a learning rate high enough to diverge on
    # purpose is past the recipe's bounds): the optimizer takes them, so the weights are NaN from there.
    result = trainer_ranks(
        2,
        "--recipe",
        str(TINY),
        "--set",
        "checkpointing.interval_steps=1",
        "--max-steps",
        "20",
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        env={"TRAINSTACK_FAULT_INJECT": "nan-gradients@5"},
    )
    assert result.returncode != 0
    message = re.search(r"error: non-finite loss or gradient at step (\d+)", result.stderr)
    assert message, result.stderr[-3000:]
    bad_step = int(message.group(1))
    saved = sorted(int(p.name.removeprefix("step-")) for p in (tmp_path / "ck").glob("step-*"))
    assert all(step < bad_step for step in saved), (saved, bad_step)
    assert all(completeness_problem(tmp_path / "ck" / f"step-{s:09d}") is None for s in saved)


@pytest.mark.slow
def test_trains_from_token_shards_written_by_make_shards(tmp_path):
    texts = []
    for i in range(6):
        path = tmp_path / f"doc{i}.txt"
        path.write_text((f"the quick brown fox jumps over the lazy dog {i}. ") * 40)
        texts.append(str(path))
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.prepare.make_shards",
            "--tokenizer",
            "bytes",
            "--shard-tokens",
            "4000",
            "--out",
            str(tmp_path / "shards"),
            *texts,
        ],
        cwd=REPO,
        env=trainer_env(),
        capture_output=True,
        text=True,
    )
    assert made.returncode == 0, made.stderr
    result = trainer_ranks(
        2,
        "--recipe",
        str(TINY),
        "--set",
        "model.vocab=257",
        "--max-steps",
        "12",
        "--data-dir",
        str(tmp_path / "shards"),
        "--checkpoint-dir",
        str(tmp_path / "ck"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "data shards:" in result.stderr
    losses = [parse_line(line)["loss"] for line in metric_lines(result.stdout)]
    assert losses[-1] < losses[0]


@pytest.mark.slow
def test_node_local_checkpoint_directories_resume_after_an_s3_style_merge(straight, tmp_path):
    """SageMaker: each node writes its own /opt/ml/checkpoints, synced to one S3 prefix and downloaded
    whole to every node on restart. Each node keeps only its own files; the merge is complete only
    with every node's files; resuming from it continues exactly."""
    nodes = (tmp_path / "node0", tmp_path / "node1")
    two_nodes(nodes, "--recipe", str(TINY), "--max-steps", "20", "--trace-dir", str(tmp_path / "trace"))
    assert {p.name for p in (nodes[1] / "step-000000020").iterdir()} == {
        "__1_0.distcp",
        "rank-00001.pt",
        "manifest-rank00001.json",
    }  # no marker on node 1
    only_node0 = tmp_path / "s3-partial"
    shutil.copytree(nodes[0], only_node0)
    assert "manifest-rank00001.json is missing" in completeness_problem(only_node0 / "step-000000020")
    s3 = tmp_path / "s3"  # what all nodes uploaded; on restart every node downloads all of it
    for node in nodes:
        shutil.copytree(node, s3, dirs_exist_ok=True)
    for node in nodes:
        shutil.copytree(s3, node, dirs_exist_ok=True)
    assert completeness_problem(nodes[0] / "step-000000020") is None
    outputs = two_nodes(
        nodes, "--recipe", str(TINY), "--max-steps", "30", "--trace-dir", str(tmp_path / "trace")
    )
    assert "step 20, data position 320" in outputs[0]
    resumed, reference = read_trace(tmp_path / "trace"), read_trace(straight[0] / "trace")
    assert abs(resumed[0][30]["loss"] - reference[0][30]["loss"]) <= 1e-6
    assert sorted(all_samples(tmp_path / "trace")) == list(range(30 * GLOBAL_BATCH))


@pytest.mark.slow
def test_checkpoints_go_straight_to_the_emulators_s3_and_resume_exactly(straight, tmp_path):
    """TRAINSTACK_CHECKPOINT_URI as the launcher sets it: both ranks write their shards straight to
    S3 (the local emulator's, through s3torchconnector), a second job resumes from S3 exactly."""
    pytest.importorskip("boto3")
    from trainstack.emulator.endpoint import Emulator

    with Emulator() as emulator:
        env, s3 = emulator.env(), emulator.client("s3")
        s3.create_bucket(Bucket="trainstack-ck")
        env |= {
            "TRAINSTACK_CHECKPOINT_URI": "s3://trainstack-ck/checkpoints/platform/tiny-cpu/run-1/",
            "TRAINSTACK_RUN": "run-1",
        }
        trace = tmp_path / "trace"
        first = trainer_ranks(
            2, "--recipe", str(TINY), "--max-steps", "20", "--trace-dir", str(trace), env=env
        )
        assert first.returncode == 0, first.stderr[-3000:]
        listed = s3.list_objects_v2(Bucket="trainstack-ck", Prefix="checkpoints/")["Contents"]
        names = {o["Key"].split("/", 4)[4] for o in listed}
        assert {"step-000000010/COMPLETE.json", "step-000000020/COMPLETE.json"} <= names
        assert {"step-000000020/manifest-rank00000.json", "step-000000020/manifest-rank00001.json"} <= names
        second = trainer_ranks(
            2, "--recipe", str(TINY), "--max-steps", "30", "--trace-dir", str(trace), env=env
        )
        assert second.returncode == 0, second.stderr[-3000:]
    uri = "s3://trainstack-ck/checkpoints/platform/tiny-cpu/run-1/"
    assert f"resumed from {uri}step-000000020" in second.stderr
    reference, resumed = read_trace(straight[0] / "trace"), read_trace(trace)
    for step in range(21, 31):
        assert abs(resumed[0][step]["loss"] - reference[0][step]["loss"]) <= 1e-6, step
    assert sorted(all_samples(trace)) == list(range(30 * GLOBAL_BATCH))


SLOW_ATTENTION = """\
# Test only: makes this node's attention 30 ms slower per call, as a throttled GPU would be.
import time
import torch.nn.functional as F

_attention = F.scaled_dot_product_attention


def _slow_attention(*args, **kwargs):
    time.sleep(0.03)
    return _attention(*args, **kwargs)


F.scaled_dot_product_attention = _slow_attention
"""


@pytest.mark.slow
def test_the_slow_node_is_named_as_straggler_though_step_times_are_equal(tmp_path):
    """Node 2 (algo-2) computes slower. Its wall step time equals node 1's (the collectives make the fast
    node wait), so the trainer compares what each rank's own blocks took to compute."""
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(SLOW_ATTENTION)
    outputs = two_nodes(
        (tmp_path / "node0", tmp_path / "node1"),
        "--recipe",
        str(TINY),
        "--max-steps",
        "4",
        node_env=({"SM_CURRENT_HOST": "algo-1"}, {"SM_CURRENT_HOST": "algo-2", "PYTHONPATH": str(slow)}),
    )
    lines = [parse_line(line) for line in metric_lines(outputs[0])]
    assert len(lines) == 4
    for values in lines:
        assert values["straggler_host"] == 2 and values["straggler_rank"] == 1, values
        # 4 micro-steps x 2 blocks x 30 ms added to a few ms of compute (more when other tests load the
        # cores); with 2 ranks the median is their mean, so the skew (a - b) / (a + b) stays below 1
        assert values["straggler_compute_s"] >= 0.24 and values["straggler_skew"] > 0.25, values
