"""The real trainer, run cheaply many times: in this process, or forked from a server that imported it.

Starting a Python process that imports torch costs seconds here; the fault tests run the trainer about
forty times. So:
- `run_in_process` calls `python -m trainer`'s main() in the test process as a world of one, and puts
  back what it changes (environment, SIGTERM handler, logging, torch's thread count);
- `Forked` starts trainer processes from a multiprocessing fork server that imported the trainer
  once: for what must happen in a process of its own (a kill -9, a SIGTERM) or in several (a world of
  2 or 4 ranks, each given the RANK/WORLD_SIZE/MASTER_* environment torchrun would give it).
Both run exactly `trainer.__main__.main(argv)`.
"""

from __future__ import annotations

import io
import json
import logging
import multiprocessing
import os
import signal
import socket
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Imported by the fork server once, so that no forked trainer pays for them: the trainer itself, and
# what it imports lazily (torch._dynamo on the first meta-device init alone takes seconds).
PRELOAD = [
    "fault_harness",
    "trainer.__main__",
    "trainer.train",
    "torch._dynamo",
    "numpy.random",
    "s3torchconnector.dcp",
    "s3torchconnectorclient",
]


@dataclass(frozen=True)
class Outcome:
    code: int
    log: str  # stdout and stderr together


def read_trace(trace_dir: Path) -> dict[int, dict[int, dict]]:
    """{rank: {step: record}}; a later record of a step (after a resume) replaces an earlier one."""
    out: dict[int, dict[int, dict]] = {}
    for path in sorted(trace_dir.glob("rank*.jsonl")):
        rank = int(path.stem.removeprefix("rank"))
        for line in path.read_text().splitlines():
            record = json.loads(line)
            out.setdefault(rank, {})[record["step"]] = record
    return out


def run_in_process(argv: list[str], env: dict[str, str]) -> Outcome:
    """main(argv) here, as a world of one, with `env` added to the environment for the run."""
    import torch
    from trainer.__main__ import main

    saved_env, saved_handler = dict(os.environ), signal.getsignal(signal.SIGTERM)
    root = logging.getLogger()
    saved_handlers, saved_level, saved_threads = root.handlers[:], root.level, torch.get_num_threads()
    output = io.StringIO()
    try:
        for name in TORCHRUN_VARIABLES:
            os.environ.pop(name, None)
        os.environ.update(env)
        torch.set_num_threads(1)  # as the forked ranks: the same kernels, the same sums
        with redirect_stdout(output), redirect_stderr(output):
            code = main(argv)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        signal.signal(signal.SIGTERM, saved_handler)
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
        torch.set_num_threads(saved_threads)
    return Outcome(code, output.getvalue())


def _child(argv: list[str], env: dict[str, str], log_path: str) -> None:
    """A forked trainer process: output to `log_path`, exit with main()'s code."""
    descriptor = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.environ.update(env)
    import torch
    from trainer.__main__ import main

    torch.set_num_threads(1)
    code = 1
    try:
        code = main(argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Job:
    """The processes of one trainer job (one per rank) and their logs."""

    processes: list
    logs: list[Path]

    @property
    def pid(self) -> int:
        return self.processes[0].pid

    def log(self, rank: int = 0) -> str:
        return self.logs[rank].read_text() if self.logs[rank].exists() else ""

    def wait_for(self, text: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log():
            if not all(p.is_alive() for p in self.processes) or time.monotonic() > deadline:
                raise AssertionError(f"{text!r} never appeared:\n{self.log()[-3000:]}")
            time.sleep(0.02)

    def wait(self, timeout: float = 180) -> list[int]:
        """Every rank's exit code (-9: killed by SIGKILL); all killed and an error after `timeout`."""
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(max(deadline - time.monotonic(), 0.1))
        if any(p.is_alive() for p in self.processes):
            for process in self.processes:
                process.kill()
                process.join()
            raise AssertionError(f"the trainer did not end within {timeout} s:\n{self.log()[-3000:]}")
        return [p.exitcode for p in self.processes]


class Forked:
    """Trainer processes forked from a server that has the trainer imported already."""

    def __init__(self) -> None:
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(PRELOAD)

    def start(
        self, argv: list[str], env: dict[str, str], log: Path, world: int = 1, always_ranked: bool = False
    ) -> Job:
        """`world` ranks of main(argv); a world of one runs without torchrun's variables unless
        `always_ranked` (as torchrun's one worker has them)."""
        port = str(free_port())
        processes, logs = [], []
        for rank in range(world):
            rank_env = dict(env)
            if world > 1 or always_ranked:  # what torchrun gives each worker
                rank_env.update(
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    WORLD_SIZE=str(world),
                    LOCAL_WORLD_SIZE=str(world),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=port,
                )
            path = log.with_name(f"{log.name}.rank{rank}")
            process = self.context.Process(target=_child, args=(argv, rank_env, str(path)), daemon=True)
            process.start()
            processes.append(process)
            logs.append(path)
        return Job(processes, logs)
