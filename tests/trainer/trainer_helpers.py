"""Helpers for the trainer's CPU tests: real torchrun + gloo runs of a tiny recipe."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
TINY = FIXTURES / "tiny.yaml"


def trainer_env() -> dict[str, str]:
    env = dict(os.environ)
    # One thread per rank: the CI machine has 2 cores shared by every test worker.
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
    return env


def torchrun(nproc: int, *trainer_args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node N -m trainer ...` on CPU; stdout and stderr captured."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "trainer", "--device", "cpu", *trainer_args]
    return subprocess.run(command, cwd=REPO, env=trainer_env(), capture_output=True, text=True,
                          timeout=timeout)


def metric_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("step=")]
