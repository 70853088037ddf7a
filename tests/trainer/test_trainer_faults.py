"""The real trainer against the faults of a multi-week run, on both storage backends: a local directory
and the emulator's S3 through s3torchconnector.

Each fault ends in an exact resume, losses compared step by step with an uninterrupted run (and, after
a change of world size, the samples of every step too), from the newest intact checkpoint; or, where
nothing intact exists, one line and exit 2. The uninterrupted run is made once per backend (a module
fixture) and its checkpoints are copied and damaged per test. Trainer runs are in-process (a world of
one) unless the fault needs processes of their own: a kill -9, a SIGTERM, several ranks (forked from a
server that imported the trainer once: tests/trainer/fault_harness.py). Kills hit an exact phase of a
save through TRAINSTACK_FAULT_INJECT (trainer/runtime/faults.py, test-only).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fault_harness import Forked, read_trace, run_in_process
from trainer.runtime.faults import PHASES
from trainer_helpers import TINY

from trainstack.protocol.checkpoint_format import MARKER, extras_name, manifest_name, step_dir_name

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("checkpoint-faults")]

# The tiny recipe with one sample per micro-step: 8 micro-steps on 1 rank, 4 on 2, 2 on 4.
TRAIN = [
    "--recipe",
    str(TINY),
    "--device",
    "cpu",
    "--set",
    "training.micro_batch=1",
    "--set",
    "training.global_batch=8",
    "--set",
    "checkpointing.interval_steps=2",
    "--set",
    "checkpointing.keep=5",
]
REFERENCE_STEPS = 10  # checkpoints at 2, 4, 6, 8, 10
BUCKET = "trainstack-faults"
EXACT = 1e-6  # the same layout: the same arithmetic (seen: equal to the last bit)
RESHARDED = 1e-4  # another world size: the same math, gradients reduced in another order (seen: 2e-5)


@dataclass
class Backend:
    """Where a test's checkpoints live, and raw access to their bytes that bypasses the trainer."""

    name: str
    root: Path  # local: the parent of every location; s3: scratch space
    env: dict[str, str]
    s3: Any = None  # a boto3 client of the emulator

    def location(self, name: str) -> str:
        return str(self.root / name) if self.s3 is None else f"s3://{BUCKET}/{name}/"

    def _key(self, location: str, step: int, file: str = "") -> str:
        return f"{location.removeprefix(f's3://{BUCKET}/')}{step_dir_name(step)}/{file}"

    def steps(self, location: str) -> list[int]:
        if self.s3 is None:
            base = Path(location)
            return sorted(int(p.name[5:]) for p in base.glob("step-*")) if base.is_dir() else []
        prefix = location.removeprefix(f"s3://{BUCKET}/")
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix, Delimiter="/")
        found = [p["Prefix"][len(prefix) :] for page in pages for p in page.get("CommonPrefixes", [])]
        return sorted(int(p[5:14]) for p in found if p.startswith("step-"))

    def files(self, location: str, step: int) -> list[str]:
        if self.s3 is None:
            return sorted(p.name for p in (Path(location) / step_dir_name(step)).iterdir())
        listed = self.s3.list_objects_v2(Bucket=BUCKET, Prefix=self._key(location, step))
        return sorted(o["Key"].rsplit("/", 1)[1] for o in listed.get("Contents", []))

    def read(self, location: str, step: int, file: str) -> bytes:
        if self.s3 is None:
            return (Path(location) / step_dir_name(step) / file).read_bytes()
        return self.s3.get_object(Bucket=BUCKET, Key=self._key(location, step, file))["Body"].read()

    def write(self, location: str, step: int, file: str, data: bytes) -> None:
        if self.s3 is None:
            (Path(location) / step_dir_name(step) / file).write_bytes(data)
        else:
            self.s3.put_object(Bucket=BUCKET, Key=self._key(location, step, file), Body=data)

    def delete(self, location: str, step: int, file: str) -> None:
        if self.s3 is None:
            (Path(location) / step_dir_name(step) / file).unlink()
        else:
            self.s3.delete_object(Bucket=BUCKET, Key=self._key(location, step, file))

    def copy(self, source: str, target: str, steps: list[int]) -> None:
        for step in steps:
            if self.s3 is None:
                shutil.copytree(Path(source) / step_dir_name(step), Path(target) / step_dir_name(step))
                continue
            for file in self.files(source, step):
                self.s3.copy_object(
                    Bucket=BUCKET,
                    Key=self._key(target, step, file),
                    CopySource={"Bucket": BUCKET, "Key": self._key(source, step, file)},
                )

    def damage(self, location: str, step: int, file: str, how: str) -> None:
        if how == "missing":
            self.delete(location, step, file)
            return
        data = bytearray(self.read(location, step, file))
        if how == "truncated":  # a copy or an upload cut short
            data = data[: len(data) // 2]
        elif how == "garbage":  # the same size, other bytes
            data = bytearray((b ^ 0x5A) for b in data)
        elif how == "flipped":  # a few bytes in the middle
            middle = len(data) // 2
            data[middle : middle + 4] = bytes(b ^ 0xFF for b in data[middle : middle + 4])
        self.write(location, step, file, bytes(data))


@pytest.fixture(scope="module")
def emulator():
    from trainstack.emulator.endpoint import Emulator

    with Emulator() as running:
        running.client("s3").create_bucket(Bucket=BUCKET)
        yield running


@pytest.fixture(scope="module", params=["local", "s3"])
def backend(request, tmp_path_factory) -> Backend:
    root = tmp_path_factory.mktemp(f"faults-{request.param}")
    if request.param == "local":
        return Backend("local", root, {})
    running = request.getfixturevalue("emulator")
    return Backend("s3", root, running.env(), running.client("s3"))


@pytest.fixture(scope="module")
def forked() -> Forked:
    return Forked()


def train(backend: Backend, location: str, until: int, trace: Path | None = None, **env: str):
    """The trainer in this process (a world of one) up to step `until`."""
    args = [*TRAIN, "--max-steps", str(until), "--checkpoint-dir", location]
    if trace is not None:
        args += ["--trace-dir", str(trace)]
    return run_in_process(args, {**backend.env, **env})


@dataclass(frozen=True)
class Reference:
    location: str  # its checkpoints: steps 2, 4, 6, 8, 10
    losses: dict[int, float]
    samples: dict[int, list[int]]


@pytest.fixture(scope="module")
def reference(backend) -> Reference:
    """The uninterrupted run: 10 steps on one rank, a checkpoint every 2."""
    trace = backend.root / "reference-trace"
    outcome = train(backend, backend.location("reference"), REFERENCE_STEPS, trace)
    assert outcome.code == 0, outcome.log[-3000:]
    assert "a new run, starting at step 0" in outcome.log  # an empty location is a new run
    assert backend.steps(backend.location("reference")) == [2, 4, 6, 8, 10]
    records = read_trace(trace)[0]
    return Reference(
        backend.location("reference"),
        {s: r["loss"] for s, r in records.items()},
        {s: sorted(r["samples"]) for s, r in records.items()},
    )


def assert_resumed_exactly(reference: Reference, outcome, trace: Path, start: int, until: int) -> None:
    """The run resumed from step `start` and its losses of steps start+1..until equal the reference's."""
    assert outcome.code == 0, outcome.log[-3000:]
    assert f"{step_dir_name(start)}: step {start}, data position {start * 8}" in outcome.log, outcome.log[
        -3000:
    ]
    losses = {s: r["loss"] for s, r in read_trace(trace)[0].items()}
    assert sorted(losses) == list(range(start + 1, until + 1))
    for step, loss in losses.items():
        assert abs(loss - reference.losses[step]) <= EXACT, (step, loss, reference.losses[step])


def skipped(outcome) -> dict[int, str]:
    """{step: why} of every 'skipping checkpoint' line."""
    found = re.findall(r"skipping checkpoint \S*step-(\d{9}): (.*)", outcome.log)
    return {int(step): why for step, why in found}


# --- kill -9 at each phase of a save ---------------------------------------------------------------
LEFT_BY_KILL = {  # what the next job says about the folder the killed save left
    "before-shards": "no COMPLETE.json (interrupted while writing)",
    "mid-shards": "no COMPLETE.json (interrupted while writing)",
    "after-shards": "no COMPLETE.json (interrupted while writing)",
    "after-manifests": "no COMPLETE.json (interrupted while writing; manifests of ranks 0 written)",
    "before-marker": "no COMPLETE.json (interrupted while writing; manifests of ranks 0 written)",
}


@pytest.mark.parametrize("phase", PHASES)
def test_kill_9_at_each_phase_of_a_save_resumes_exactly(backend, reference, forked, phase, tmp_path):
    """A job resumed from step 4 is killed while it saves step 5 (its final save), at `phase`."""
    location = backend.location(f"kill-{phase}")
    backend.copy(reference.location, location, [4])
    args = [*TRAIN, "--max-steps", "5", "--checkpoint-dir", location]
    fault = {"TRAINSTACK_FAULT_INJECT": f"kill:{phase}@5"}
    job = forked.start(args, {**backend.env, **fault}, tmp_path / "killed")
    assert job.wait() == [-signal.SIGKILL], job.log()[-3000:]
    assert f"kill -9 at {phase} of step 5" in job.log()
    assert backend.steps(location) == [4, 5]
    if phase == "after-marker":  # the marker was written: step 5 is complete
        outcome = train(backend, location, 6, tmp_path / "trace")
        assert_resumed_exactly(reference, outcome, tmp_path / "trace", 5, 6)
    else:  # step 5 is trained again and saved over the folder the kill left
        outcome = train(backend, location, 5, tmp_path / "trace")
        assert skipped(outcome) == {5: LEFT_BY_KILL[phase]}
        assert_resumed_exactly(reference, outcome, tmp_path / "trace", 4, 5)
        assert backend.steps(location) == [4, 5] and MARKER in backend.files(location, 5)


# --- damaged files ---------------------------------------------------------------------------------
DAMAGES = {10: "missing", 8: "truncated", 6: "garbage", 4: "flipped"}  # step 2 stays intact
FILES = {
    ".metadata": ".metadata",
    "rank file": extras_name(0),
    "shard": "__0_0.distcp",
    "manifest": manifest_name(0),
    "marker": MARKER,
}
EXPECTED = {  # what the resume says about each damaged folder
    "missing": "{file} is missing",
    "truncated": "{file} has {half} bytes, expected {size} (truncated)",
    "garbage": "{file}: sha256 mismatch (its bytes changed after it was written)",
    "flipped": "{file}: sha256 mismatch (its bytes changed after it was written)",
}
MARKER_EXPECTED = {
    "missing": "no COMPLETE.json (interrupted while writing; manifests of ranks 0 written)",
    "truncated": "COMPLETE.json: not valid JSON",
    "garbage": "COMPLETE.json: not valid JSON",
    "flipped": "COMPLETE.json: not valid JSON",
}


@pytest.mark.parametrize("kind", FILES)
def test_damaged_files_are_skipped_naming_the_file_and_the_resume_is_exact(
    backend, reference, kind, tmp_path
):
    """Four checkpoints with the same file missing, truncated, overwritten with same-size garbage and
    with four bytes flipped in its middle: each skipped with the file named, the resume exact from the
    one intact checkpoint left (step 2)."""
    file, location = FILES[kind], backend.location(f"damaged-{kind.replace(' ', '-')}")
    backend.copy(reference.location, location, [2, 4, 6, 8, 10])
    sizes = {step: len(backend.read(location, step, file)) for step in DAMAGES}
    for step, how in DAMAGES.items():
        backend.damage(location, step, file, how)
    outcome = train(backend, location, 3, tmp_path / "trace")
    expected = {
        step: (MARKER_EXPECTED[how] if file == MARKER else EXPECTED[how]).format(
            file=file, half=sizes[step] // 2, size=sizes[step]
        )
        for step, how in DAMAGES.items()
    }
    assert {step: why.split(" (rank 0 had")[0] for step, why in skipped(outcome).items()} == expected
    assert_resumed_exactly(reference, outcome, tmp_path / "trace", 2, 3)


def test_a_marker_with_world_size_0_no_longer_switches_the_check_off(backend, reference, tmp_path):
    location = backend.location("world-size-0")
    backend.copy(reference.location, location, [8, 10])
    marker = json.loads(backend.read(location, 10, MARKER))
    backend.write(location, 10, MARKER, json.dumps({**marker, "world_size": 0}).encode())
    backend.damage(location, 10, "__0_0.distcp", "flipped")  # what the switched-off check let through
    outcome = train(backend, location, 9, tmp_path / "trace")
    assert skipped(outcome) == {10: "COMPLETE.json: world_size: 0 is out of range (from 1 to 65536)"}
    assert_resumed_exactly(reference, outcome, tmp_path / "trace", 8, 9)


def test_where_nothing_intact_exists_the_job_stops_with_one_line_and_exit_2(backend, reference, tmp_path):
    """Never a silent restart from step 0 over a run's checkpoints: one line naming each folder and why,
    exit 2 and the fatal marker, so the supervisor ends the run instead of starting another job."""
    location = backend.location("nothing-intact")
    backend.copy(reference.location, location, [2, 4])
    backend.damage(location, 4, "__0_0.distcp", "garbage")
    backend.delete(location, 2, MARKER)
    failure = tmp_path / "failure"
    outcome = train(backend, location, 6, TRAINSTACK_FAILURE_FILE=str(failure))
    assert outcome.code == 2, outcome.log[-3000:]
    (line,) = [line for line in outcome.log.splitlines() if line.startswith("error:")]
    assert "no intact checkpoint to resume from" in line
    assert "step-000000004: __0_0.distcp: sha256 mismatch" in line
    assert "step-000000002: no COMPLETE.json (interrupted while writing" in line
    assert failure.read_text().startswith("trainstack-fatal exit=2: ")
    assert backend.steps(location) == [2, 4]  # nothing written over them
    assert "Traceback" not in outcome.log


# --- SIGTERM ---------------------------------------------------------------------------------------
def test_sigterm_with_no_time_to_save_exits_0_and_the_next_job_resumes_exactly(
    backend, reference, forked, tmp_path
):
    """A job resumed from step 4 gets a SIGTERM that leaves no time to save (test-only fault: the
    signal counts as arriving with only the exit margin left): exit 0, nothing newer marked complete,
    and the next job resumes from the newest checkpoint exactly."""
    location = backend.location("sigterm-no-time")
    backend.copy(reference.location, location, [4])
    args = [*TRAIN, "--max-steps", "10", "--checkpoint-dir", location]
    job = forked.start(args, {**backend.env, "TRAINSTACK_FAULT_INJECT": "sigterm-no-time"}, tmp_path / "job")
    job.wait_for("step=5 ")
    os.kill(job.pid, signal.SIGTERM)
    assert job.wait() == [0], job.log()[-3000:]
    log = job.log()
    assert "no time to save step" in log and "SIGTERM: stopping without a final save" in log
    resumes = int(re.search(r"the next job resumes from \S*step-(\d{9})", log).group(1))
    assert backend.steps(location)[-1] == resumes  # nothing newer was marked (nor left)
    outcome = train(backend, location, resumes + 1, tmp_path / "trace")
    assert_resumed_exactly(reference, outcome, tmp_path / "trace", resumes, resumes + 1)


@pytest.mark.parametrize("backend", ["local"], indirect=True)  # the rule does not depend on the storage
def test_sigterm_before_the_first_step_saves_nothing_and_the_next_job_starts_as_it_did(
    backend, reference, forked, tmp_path
):
    """No step-0 checkpoint: its optimizer state would already count a step (torch initialises a fresh
    optimizer's state with a zero-gradient step), and its resume drifted by 0.017 to 0.067."""
    location = str(tmp_path / "ck")
    args = [*TRAIN, "--max-steps", "10", "--checkpoint-dir", location]
    job = forked.start(args, {"TRAINSTACK_FAULT_INJECT": "sigterm-at-start"}, tmp_path / "job")
    assert job.wait() == [0], job.log()[-3000:]
    assert "nothing to save before the first step" in job.log()
    assert not list(Path(location).glob("step-*"))
    outcome = train(backend, location, 1, tmp_path / "trace")
    assert outcome.code == 0 and "a new run, starting at step 0" in outcome.log, outcome.log[-3000:]
    (loss,) = [r["loss"] for r in read_trace(tmp_path / "trace")[0].values()]
    assert abs(loss - reference.losses[1]) <= EXACT


# --- a change of world size ------------------------------------------------------------------------
WORLD_CHANGES = {"local": 2, "s3": 4}  # 1 -> 2 -> 1 ranks on one backend, 1 -> 4 -> 1 on the other


def test_a_change_of_world_size_resumes_exactly(backend, reference, forked, tmp_path):
    """Saved by 1 rank at step 4, resumed by 2 (local) or 4 (S3) ranks, which save step 5 (the new
    ranks read rank 0's trainer state: that missing rank file once raised on S3), resumed by 1 again.
    Each step's loss matches the uninterrupted run (the gradients are reduced in another order, so
    within RESHARDED) and each step trained on exactly its samples."""
    world, location, trace = WORLD_CHANGES[backend.name], backend.location("world-sizes"), tmp_path / "trace"
    backend.copy(reference.location, location, [4])
    args = [*TRAIN, "--max-steps", "5", "--checkpoint-dir", location, "--trace-dir", str(trace)]
    job = forked.start(args, backend.env, tmp_path / "job", world=world)
    assert job.wait() == [0] * world, job.log()[-3000:]
    assert (
        "step 4, data position 32" in job.log() and f"checkpoint from 1 ranks resumed on {world}" in job.log()
    )
    assert backend.steps(location) == [4, 5]
    outcome = train(backend, location, 6, trace)
    assert outcome.code == 0, outcome.log[-3000:]
    assert f"checkpoint from {world} ranks resumed on 1" in outcome.log
    ranks = read_trace(trace)
    assert sorted(ranks) == list(range(world))
    for step in (5, 6):
        assert abs(ranks[0][step]["loss"] - reference.losses[step]) <= RESHARDED, step
        samples = sorted(s for rank in ranks.values() if step in rank for s in rank[step]["samples"])
        assert samples == reference.samples[step], step
