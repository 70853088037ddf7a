"""`trainstack data prepare` and what it must not do to a dataset (issue 40 item 6): replace a dataset of
other files in --out without a word, run with no workers, or leave its `trainer.prepare` child writing
after `kill -9` beside the rerun that resumes it (which, if a writer is alive, is refused in one line)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from trainer.prepare.pipeline import main as prepare_main
from trainer.prepare.pipeline import prepare
from typer.testing import CliRunner

from trainstack.cli.main import app
from trainstack.errors import TrainstackError

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parents[2]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def documents(count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(rng.integers(5, 60)))) + f" #{seed}-{i}" for i in range(count)]


def corpus(folder: Path, files: int, docs: int, seed: int) -> Path:
    folder.mkdir(parents=True)
    for f in range(files):
        (folder / f"part{f:02d}.jsonl").write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in documents(docs, seed + f))
        )
    return folder


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    """A real BPE tokenizer.json, trained here by `tokenizers` (no hub): slow enough per file that a
    preparation of a few dozen files is still running when the tests act on it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(documents(200, 0), trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.mark.parametrize("workers", ["0", "-2"])
def test_no_workers_is_refused_in_one_line(tmp_path, workers):
    out = str(tmp_path / "o")
    result = CliRunner().invoke(
        app,
        [
            "data",
            "prepare",
            str(REPO / "README.md"),
            "--tokenizer",
            "bytes",
            "--out",
            out,
            "--workers",
            workers,
        ],
    )
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"error: --workers {workers}: expected at least 1 (default: one per core)"
    ]
    assert not (tmp_path / "o").exists()
    with pytest.raises(TrainstackError, match=r"^--workers 0: expected at least 1"):
        prepare([str(REPO / "README.md")], "bytes", str(tmp_path / "o"), workers=0)


def test_another_corpus_with_the_same_settings_is_refused_unless_overwrite(tmp_path, tokenizer_file):
    first = corpus(tmp_path / "web", 2, 40, 1)
    other = corpus(tmp_path / "code", 2, 40, 7)
    out = tmp_path / "out"
    prepare([str(first)], str(tokenizer_file), str(out), workers=1)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(TrainstackError) as refused:
        prepare([str(other)], str(tokenizer_file), str(out), workers=1)
    assert str(refused.value) == (
        f"--out {out}/: holds a dataset prepared from other files ({first}/part00.jsonl and 1 more, not "
        "among the inputs given); give another --out, or --overwrite to replace it"
    )
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    # The same corpus resumes as before (nothing to do), and a corpus that grew keeps what was done.
    assert prepare([str(first)], str(tokenizer_file), str(out), workers=1)["documents"] > 0
    manifest = prepare([str(other)], str(tokenizer_file), str(out), workers=1, overwrite=True)
    assert sorted(s["uri"] for s in manifest["sources"]) == [str(p) for p in sorted(other.iterdir())]
    shards = {p.name.split("-")[0] for p in (out / "shards").iterdir()}
    assert shards == {"part00", "part01"} and not any(str(first) in m for m in _markers(out))


def _markers(out: Path) -> list[str]:
    return [p.read_text() for p in (out / "_prepare" / "done").glob("*.json")]


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")  # a zombie has ended: only its exit status is left to collect


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG and /proc are Linux's")
def test_kill_9_of_data_prepare_ends_its_trainer_prepare_child(tmp_path, tokenizer_file):
    inputs = corpus(tmp_path / "in", 80, 300, 100)  # seconds of work left when the parent is killed
    out = tmp_path / "out"
    cli = Path(sys.executable).parent / "trainstack"
    parent = subprocess.Popen(
        [str(cli), "data", "prepare", str(inputs), "--tokenizer", str(tokenizer_file), "--out", str(out),
         "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    done = out / "_prepare" / "done"
    deadline = time.monotonic() + 120
    while not (done.is_dir() and list(done.glob("*.json"))):
        assert parent.poll() is None and time.monotonic() < deadline, "prepare ended before it was killed"
        time.sleep(0.02)
    (child,) = _children(parent.pid)
    assert "trainer.prepare" in Path(f"/proc/{child}/cmdline").read_text()
    parent.send_signal(signal.SIGKILL)
    assert parent.wait(timeout=30) == -signal.SIGKILL
    deadline = time.monotonic() + 3  # SIGKILL from the kernel at the parent's death: well within this
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _alive(child)
    if alive:
        os.kill(child, signal.SIGKILL)  # leave no orphan behind a failing test
    assert not alive, "trainer.prepare outlived the `trainstack data prepare` that started it"
    finished = len(list(done.glob("*.json")))
    time.sleep(1)
    assert len(list(done.glob("*.json"))) == finished < 80  # nothing writes after the kill


@pytest.mark.slow
def test_a_rerun_beside_a_live_writer_is_refused_in_one_line(tmp_path, tokenizer_file, capsys):
    inputs = corpus(tmp_path / "in", 40, 300, 200)
    out = tmp_path / "out"
    args = [str(inputs), "--tokenizer", str(tokenizer_file), "--out", str(out), "--workers", "1"]
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'training_image'}:{REPO}"}
    writer = subprocess.Popen(
        [sys.executable, "-m", "trainer.prepare", *args],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        done = out / "_prepare" / "done"
        deadline = time.monotonic() + 120
        while not (done.is_dir() and list(done.glob("*.json"))):
            assert writer.poll() is None and time.monotonic() < deadline, "the writer ended too soon"
            time.sleep(0.02)
        capsys.readouterr()
        assert prepare_main(args) == 2
        errors = capsys.readouterr().err.strip().splitlines()
        assert errors == [
            f"error: --out {out}: another data preparation (pid {writer.pid}) is writing it on this "
            "machine; wait for it to end or stop it, then rerun to resume"
        ]
        assert writer.poll() is None  # the refusal touched nothing of the writer's
    finally:
        assert writer.wait(timeout=120) == 0
    assert prepare_main(args) == 0  # once it has ended, a rerun resumes (nothing left to do)
