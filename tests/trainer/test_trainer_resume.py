"""Resuming a run through its doors (trainer.checkpoint.resume, trainer.runtime.capacity): a changed recipe's
safe keys take effect and are logged, unsafe ones are refused in one line; TRAINSTACK_RESUME_STEP=N loads
checkpoint N with its data position and removes the later ones (markers first); every host writes the fatal
marker; a training plan's capacity block ends in a save and exit 0.

One first job (20 steps, checkpoints at 10 and 20) runs once, in this process as a world of one; each
test resumes a copy of its checkpoints, also in this process. Only the two-host test starts processes.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import torch
from trainer.__main__ import main
from trainer.checkpoint.manager import MARKER, CheckpointManager, TrainerState, complete_steps
from trainer.checkpoint.resume import RESUME_STEP_ENV, ResumePlan, abandon_after, recipe_changes, refusal
from trainer.optim import build_optimizer, build_scheduler, follow_schedule, lr_factor
from trainer.runtime.capacity import EXPIRY_ENV, RECLAIM_BEFORE_END_S, capacity_deadline, watch_capacity
from trainer.runtime.stopping import StopRequest
from trainer.storage import open_storage
from trainer_helpers import REPO, TINY, free_port, trainer_env

from trainstack.planner import plan
from trainstack.protocol.exit_codes import FATAL_MARKER, write_failure_file
from trainstack.recipes.loader import resolve

pytestmark = pytest.mark.fast

GLOBAL_BATCH = 16  # tiny.yaml


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    def metric(self, step: int) -> dict[str, float]:
        line = next(line for line in self.stdout.splitlines() if line.startswith(f"step={step} "))
        return {k: float(v) for k, v in (pair.split("=") for pair in line.split())}


def train(*args: str, env: dict[str, str] | None = None) -> Result:
    """`python -m trainer --recipe tiny.yaml --device cpu ARGS` in this process, as a world of one."""
    world = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    world.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    out, err = io.StringIO(), io.StringIO()
    previous, threads = signal.getsignal(signal.SIGTERM), torch.get_num_threads()
    torch.set_num_threads(1)  # as trainer_env's OMP_NUM_THREADS=1: the CI machine has 2 shared cores
    try:
        with (
            mock.patch.dict(os.environ, {**world, **(env or {})}),
            redirect_stdout(out),
            redirect_stderr(err),
        ):
            code = main(["--recipe", str(TINY), "--device", "cpu", "--sync-checkpoints", *args])
    finally:
        for handler in logging.root.handlers[:]:  # the trainer's handler writes to `err`
            logging.root.removeHandler(handler)
        signal.signal(signal.SIGTERM, previous)
        torch.set_num_threads(threads)
    return Result(code, out.getvalue(), err.getvalue())


def trace(directory: Path) -> dict[int, dict]:
    lines = (directory / "rank0.jsonl").read_text().splitlines()
    return {row["step"]: row for row in map(json.loads, lines)}


def listing(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def first_job(tmp_path_factory):
    """The run's first job: 20 steps; checkpoints at 10 and 20 recording tiny.yaml; its trace."""
    root = tmp_path_factory.mktemp("first_job")
    result = train(
        "--max-steps", "20", "--checkpoint-dir", str(root / "ck"), "--trace-dir", str(root / "trace")
    )
    assert result.code == 0, result.stderr[-3000:]
    assert complete_steps(open_storage(root / "ck")) == [20, 10]
    return root


@pytest.fixture
def checkpoints(first_job, tmp_path) -> Path:
    """A copy of the first job's checkpoints for one test to resume (and damage)."""
    return Path(shutil.copytree(first_job / "ck", tmp_path / "ck"))


# --- changes on resume -----------------------------------------------------------------------------


def test_a_changed_lr_and_schedule_take_effect_from_the_resumed_step_and_are_logged(checkpoints):
    """`resume --set training.lr=...`: the trainer used the checkpoint's lr and base lrs (restored with
    the optimizer and scheduler) and said nothing. Now the new schedule drives step 21 on."""
    changed = ["training.lr=1e-3", "training.warmup_steps=25", "training.steps=80", "training.grad_clip=0.5"]
    result = train(
        "--max-steps", "22", "--checkpoint-dir", str(checkpoints), *(f"--set={c}" for c in changed)
    )  # fmt: skip
    assert result.code == 0, result.stderr[-3000:]
    new = resolve(str(TINY), overrides=changed).recipe.training
    for step in (21, 22):
        assert result.metric(step)["lr"] == pytest.approx(1e-3 * lr_factor(step, new), rel=1e-5)
    logged = [line for line in result.stderr.splitlines() if "recipe changed on resume" in line]
    assert [line.split("step 21: ")[1] for line in logged] == [
        "training.grad_clip: 1.0 -> 0.5",
        "training.lr: 0.003 -> 0.001",
        "training.steps: 60 -> 80",
        "training.warmup_steps: 5 -> 25",
    ]


def test_a_resumed_optimizer_follows_the_new_lr_and_weight_decay_and_an_unchanged_one_is_untouched():
    old = resolve(str(TINY)).recipe.training
    new = resolve(str(TINY), overrides=["training.lr=1e-3", "training.weight_decay=0.01"]).recipe.training
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizer, scheduler = build_optimizer(model, old, "cpu"), None
    scheduler = build_scheduler(optimizer, old)
    for _ in range(7):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        scheduler.step()
    saved_optim, saved_sched = optimizer.state_dict(), scheduler.state_dict()

    def resumed(training):
        optimizer = build_optimizer(model, training, "cpu")
        scheduler = build_scheduler(optimizer, training)
        optimizer.load_state_dict(saved_optim)
        scheduler.load_state_dict(saved_sched)
        return optimizer, scheduler

    optimizer, scheduler = resumed(old)
    before = [dict((k, v) for k, v in g.items() if k != "params") for g in optimizer.param_groups]
    follow_schedule(optimizer, scheduler, old, 7)
    assert [dict((k, v) for k, v in g.items() if k != "params") for g in optimizer.param_groups] == before

    optimizer, scheduler = resumed(new)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(old.lr * lr_factor(8, old))  # what a load leaves
    follow_schedule(optimizer, scheduler, new, 7)
    assert [g["lr"] for g in optimizer.param_groups] == [new.lr * lr_factor(8, new)] * 2
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.01, 0.0]
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(new.lr * lr_factor(9, new))


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("model.layers=3", "model.layers: 2 -> 3"),  # was a PyTorch traceback from DCP's load
        ("training.global_batch=32", "training.global_batch: 16 -> 32"),  # was accepted without a word
    ],
)
def test_an_unsafe_change_is_refused_in_one_fatal_line_before_anything_is_loaded(
    checkpoints, tmp_path, override, named
):
    before = listing(checkpoints)
    failure = tmp_path / "failure"
    result = train(
        "--max-steps", "22", "--checkpoint-dir", str(checkpoints), "--set", override,
        env={"TRAINSTACK_FAILURE_FILE": str(failure)},
    )  # fmt: skip
    assert result.code == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"step-000000020: the job's recipe changes {named}, which cannot change" in errors[0]
    assert failure.read_text().startswith(f"{FATAL_MARKER} exit=2: resuming from ")
    assert listing(checkpoints) == before  # nothing loaded into, nothing removed


def test_unsafe_keys_are_all_named_and_a_record_this_schema_cannot_read_is_compared_key_by_key():
    recipe = resolve(str(TINY)).recipe
    recorded = json.loads(
        resolve(str(TINY), overrides=["training.seq_len=64", "training.seed=7"]).recipe.model_dump_json()
    )
    found = recipe_changes(json.dumps(recorded), recipe)
    assert refusal(found, "x").startswith(
        "x: the job's recipe changes training.seed: 7 -> 1234 (and 1 more: training.seq_len)"
    )
    recorded["training"]["renamed_since"] = 1  # a field an older trainer wrote, unknown to this schema
    keys = [c.key for c in recipe_changes(json.dumps(recorded), recipe)]
    assert keys == ["training.renamed_since", "training.seed", "training.seq_len"]


# --- resume from a chosen step ---------------------------------------------------------------------


def test_from_step_loads_that_checkpoint_with_its_data_position_and_removes_the_later_ones(
    first_job, checkpoints, tmp_path
):
    result = train(
        "--max-steps", "12", "--checkpoint-dir", str(checkpoints), "--trace-dir", str(tmp_path / "trace"),
        env={RESUME_STEP_ENV: "10"},
    )  # fmt: skip
    assert result.code == 0, result.stderr[-3000:]
    assert f"step 10, data position {10 * GLOBAL_BATCH}" in result.stderr
    assert "removed the checkpoints after it (steps 20)" in result.stderr
    straight, resumed = trace(first_job / "trace"), trace(tmp_path / "trace")
    for step in (11, 12):  # the same losses and samples as the first job's own steps 11 and 12
        assert abs(resumed[step]["loss"] - straight[step]["loss"]) <= 1e-6, step
        assert resumed[step]["samples"] == straight[step]["samples"]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000000010", "step-000000012"]
    assert complete_steps(open_storage(checkpoints)) == [12, 10]


def test_from_step_that_is_not_a_complete_checkpoint_is_one_line_and_removes_nothing(checkpoints):
    (checkpoints / "step-000000020" / MARKER).unlink()  # a save cut short
    before = listing(checkpoints)
    for requested in ("20", "15"):
        result = train(
            "--max-steps", "22", "--checkpoint-dir", str(checkpoints), env={RESUME_STEP_ENV: requested}
        )
        assert result.code == 2
        (error,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert error == (
            f"error: {RESUME_STEP_ENV}={requested}: step {requested} is not a complete checkpoint in "
            f"{checkpoints} (complete checkpoints: 10)"
        )
    assert listing(checkpoints) == before


def _three_checkpoints(storage_or_root):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    manager = CheckpointManager(storage_or_root, keep=5, rank=0, world=1)
    for step in (10, 20, 30):
        manager.save(model, optimizer, scheduler, TrainerState(step, step * 8, "synthetic", 1), blocking=True)
    manager.close()
    manager = CheckpointManager(storage_or_root, keep=5, rank=0, world=1)
    assert manager.discover() == 30
    return manager


def _abandon_with_a_crash_half_way(manager):
    """The job dies in the first delete, after the markers were overwritten."""
    plan_10 = ResumePlan(10, True, (20, 30), (), True)
    with mock.patch.object(type(manager.storage), "delete", side_effect=OSError("killed")):
        abandon_after(manager, plan_10)
    assert sorted(manager.storage.steps()) == [10, 20, 30]  # nothing deleted ...
    assert complete_steps(manager.storage) == [10]  # ... yet 20 and 30 are skipped on resume
    abandon_after(manager, plan_10)  # the next try (the same environment) finishes the job
    assert manager.storage.steps() == [10] and manager.complete == [10]


def test_abandoned_checkpoints_lose_their_marker_first_on_a_local_directory(world_of_one, tmp_path):
    _abandon_with_a_crash_half_way(_three_checkpoints(tmp_path / "ck"))


@pytest.mark.slow
def test_abandoned_checkpoints_lose_their_marker_first_on_the_emulators_s3(world_of_one, monkeypatch):
    pytest.importorskip("boto3")
    from trainstack.emulator.endpoint import Emulator

    with Emulator() as emulator:
        for name, value in emulator.env().items():
            monkeypatch.setenv(name, value)
        client = emulator.client("s3")
        client.create_bucket(Bucket="trainstack-resume")
        manager = _three_checkpoints(open_storage("s3://trainstack-resume/run-a/"))
        _abandon_with_a_crash_half_way(manager)
        objects = client.list_objects_v2(Bucket="trainstack-resume")["Contents"]
        assert {o["Key"].split("/")[1] for o in objects} == {"step-000000010"}


# --- every host writes the fatal marker ------------------------------------------------------------


def test_a_fatal_line_replaces_a_crash_line_and_a_crash_line_never_replaces_a_fatal_one(tmp_path):
    path = tmp_path / "failure"
    assert write_failure_file(path, 1, "save failed")
    assert write_failure_file(path, 3, "non-finite loss")
    assert not write_failure_file(path, 1, "a collective was lost")
    assert path.read_text() == f"{FATAL_MARKER} exit=3: non-finite loss\n"
    assert [p.name for p in tmp_path.iterdir()] == ["failure"]  # no temporary file left


@pytest.mark.slow
def test_every_host_writes_the_fatal_marker_not_only_rank_0s(first_job, tmp_path):
    """Two hosts (one rank each, SM_CURRENT_HOST algo-1 / algo-2, each its own failure file and node-local
    copy of the checkpoints) resume with an unsafe change. Rank 0 decides; both hosts refuse in one
    line and both failure files say trainstack-fatal (before: only rank 0's host wrote one)."""
    port = str(free_port())
    processes = []
    for node in (0, 1):
        shutil.copytree(first_job / "ck", tmp_path / f"ck{node}")
        env = trainer_env(
            {
                "SM_CURRENT_HOST": f"algo-{node + 1}",
                "TRAINSTACK_FAILURE_FILE": str(tmp_path / f"failure{node}"),
            }
        )
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
            "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "trainer",
            "--device", "cpu", "--recipe", str(TINY), "--set", "training.seq_len=64",
            "--checkpoint-dir", str(tmp_path / f"ck{node}"),
        ]  # fmt: skip
        processes.append(
            subprocess.Popen(
                command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outputs = [p.communicate(timeout=240)[0] for p in processes]
    for node, (process, output) in enumerate(zip(processes, outputs, strict=True)):
        assert process.returncode != 0, output[-3000:]
        assert len(re.findall(r"^error: resuming from .*training.seq_len: 32 -> 64", output, re.M)) == 1, (
            output
        )
        assert (tmp_path / f"failure{node}").read_text().startswith(f"{FATAL_MARKER} exit=2: resuming from")


# --- a training plan's capacity block ends -----------------------------------------------------------


def test_the_documented_capacity_block_expiry_gives_the_stop_time():
    """AWS: the job is told the block's end in SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP
    (whole epoch seconds; '0' when there is none), and the instances are terminated from 30 minutes
    before it (developer guide, "Training plans utilization for SageMaker training jobs")."""
    assert RECLAIM_BEFORE_END_S == 30 * 60
    assert capacity_deadline({}, 20.0) is None and capacity_deadline({EXPIRY_ENV: "0"}, 20.0) is None
    assert capacity_deadline({EXPIRY_ENV: "soon"}, 20.0) is None  # logged, not fatal
    end = 1_796_000_000  # 2026-11-30 ...
    deadline = capacity_deadline({EXPIRY_ENV: str(end)}, 20.0)
    assert deadline.reclaim_at == end - 1800
    assert deadline.stop_at == end - 1800 - (60 + 15)  # at least a minute for the stop, and the exit margin
    long_save = capacity_deadline({EXPIRY_ENV: str(end)}, 150.0)
    assert long_save.stop_at == end - 1800 - (2 * 150 + 15)  # the planned stop, doubled


def test_the_stop_is_requested_at_the_deadline_with_the_time_left_until_the_reclaim():
    previous = signal.getsignal(signal.SIGTERM)
    try:
        stop = StopRequest()
        now = time.time()
        end = now + 1800 + 75 + 0.2  # the stop is due in 0.2 s
        timer = watch_capacity(stop, 20.0, {EXPIRY_ENV: str(end)}, clock=time.time)
        assert not stop.requested
        timer.join(timeout=10)
        assert stop.requested and 70 < stop.seconds_left() <= 75.5
        stop.request(120.0)  # a later SIGTERM cannot move the kill further away ...
        assert stop.seconds_left() <= 75.5
        stop.request(5.0)  # ... only closer
        assert stop.seconds_left() <= 5.0
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_trainer_saves_and_exits_0_before_the_capacity_block_is_reclaimed(tmp_path):
    tiny = resolve(str(TINY)).recipe
    lead = capacity_deadline({EXPIRY_ENV: "1"}, plan(tiny).run.checkpoint.sigterm_seconds).lead_s
    # The stop falls due about 10 s from now: after the first steps even on a loaded machine (a stop
    # before step 1 saves nothing: there is no step-0 checkpoint), long before 100,000 steps.
    end = int(time.time() + RECLAIM_BEFORE_END_S + lead + 10)
    result = train(
        "--max-steps", "100000", "--checkpoint-dir", str(tmp_path / "ck"), env={EXPIRY_ENV: str(end)}
    )
    assert result.code == 0, result.stderr[-3000:]
    assert "training plan: capacity block ends" in result.stderr
    assert "until SageMaker reclaims the instances; stopping to save" in result.stderr
    # The stop saves the step it ends on, or (when a save of a recent step is complete or in flight and
    # the window is short, as on a loaded machine) leaves the run to resume from that one: either way the
    # next job's step is the newest complete checkpoint.
    found = re.search(r"SIGTERM: saved step (\d+) and stopping", result.stderr) or re.search(
        r"SIGTERM: stopping without a final save; the next job resumes from \S*step-(\d+)", result.stderr
    )
    assert found, result.stderr[-3000:]
    saved = int(found.group(1))
    assert saved < 100000 and complete_steps(open_storage(tmp_path / "ck"))[0] == saved
