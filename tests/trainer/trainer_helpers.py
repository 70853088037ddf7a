"""Helpers for the trainer's CPU tests: real torchrun + gloo runs of a tiny recipe."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
TINY = FIXTURES / "tiny.yaml"


def trainer_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # One thread per rank: the CI machine has 2 cores shared by every test worker.
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
    env.update(extra or {})
    return env


def torchrun(
    nproc: int, *trainer_args: str, timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node N -m trainer ...` on CPU; stdout and stderr captured."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "trainer",
        "--device",
        "cpu",
        *trainer_args,
    ]
    return subprocess.run(
        command, cwd=REPO, env=trainer_env(env), capture_output=True, text=True, timeout=timeout
    )


def metric_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("step=")]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(
    checkpoint_dirs: tuple[Path, Path],
    *trainer_args: str,
    timeout: float = 240,
    node_env: tuple[dict[str, str], dict[str, str]] | None = None,
) -> list[str]:
    """Two torchrun 'nodes' of one rank each on this machine, each with its own checkpoint directory
    (as a node-local directory would be) and optionally its own environment. Returns each node's
    combined output."""
    port = str(free_port())
    processes = []
    for node, directory in enumerate(checkpoint_dirs):
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--node-rank={node}",
            "--nproc-per-node=1",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            "-m",
            "trainer",
            "--device",
            "cpu",
            "--checkpoint-dir",
            str(directory),
            *trainer_args,
        ]
        processes.append(
            subprocess.Popen(
                command,
                cwd=REPO,
                env=trainer_env(node_env[node] if node_env else None),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=timeout)[0] for p in processes]
    for p, out in zip(processes, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]
        # Node 0's agent hosts the exit barrier's store and must leave last (STORE_HOST_EXIT_DELAY_S).
        assert "Error waiting on exit barrier" not in out, out[-3000:]
    return outputs


_FORKED = None


def trainer_ranks(
    nproc: int, *trainer_args: str, timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python -m trainer ...` on `nproc` gloo ranks, each rank a process of its own with the environment
    torchrun gives its workers (RANK, WORLD_SIZE, MASTER_*), forked from a server that imported the
    trainer once (fault_harness.Forked): the same multi-process trainer as under torchrun, without
    paying a torch import per process. `torchrun` above runs the launcher itself, for what depends on
    it. stdout and stderr both hold every rank's output, rank 0's first; the exit status is the first
    non-zero one of the ranks, as torchrun's."""
    import tempfile

    from fault_harness import Forked

    global _FORKED
    if _FORKED is None:
        _FORKED = Forked()
    argv = ["--device", "cpu", *trainer_args]
    extra = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    with tempfile.TemporaryDirectory(prefix="trainer-ranks-") as logs:
        job = _FORKED.start(argv, extra, Path(logs) / "log", world=nproc, always_ranked=True)
        codes = job.wait(timeout=timeout)
        output = "".join(job.log(rank) for rank in range(nproc))
    code = next((c for c in codes if c != 0), 0)
    return subprocess.CompletedProcess(["trainer", *argv], code, output, output)
