"""The loop's health check and its record: a non-finite loss or gradient norm, checked only when the
host reads anyway (exit 3), and the per-step trace the tests compare runs by."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed as dist

from trainstack.protocol import exit_codes

EXIT_NON_FINITE = exit_codes.NON_FINITE


class NonFiniteLoss(Exception):
    exit_code = EXIT_NON_FINITE


class NonFiniteWatch:
    """Per-step (loss, grad norm) kept on the device and checked only when the host reads anyway (log
    steps, saves): a check per step would be a host sync per step. Every rank agrees on the result."""

    def __init__(self, control: dist.ProcessGroup):
        self.control = control
        self.first_step = 1
        self.values: list[torch.Tensor] = []

    def add(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        if not self.values:
            self.first_step = step
        self.values.append(torch.stack([loss.float(), grad_norm.float()]))

    def check(self) -> None:
        if not self.values:
            return
        values = torch.stack(self.values).cpu()  # the one host sync
        bad = (~torch.isfinite(values).all(dim=1)).nonzero()
        first = torch.tensor([self.first_step + int(bad[0]) if len(bad) else 2**62], dtype=torch.int64)
        dist.all_reduce(first, op=dist.ReduceOp.MIN, group=self.control)
        self.values = []
        if int(first) < 2**62:
            index = min(int(first) - self.first_step, len(values) - 1)
            loss, norm = values[index].tolist() if index >= 0 else [math.nan, math.nan]
            raise NonFiniteLoss(
                f"non-finite loss or gradient at step {int(first)} (loss={loss}, grad_norm={norm}); "
                "stopped, nothing saved from that step on "
                "(lower training.lr or raise warmup_steps, and check the data)"
            )


class Trace:
    """Per-step loss (full precision) and sample indices, one JSON line per step per rank; for tests."""

    def __init__(self, directory: Path | None, rank: int):
        self.file = None
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            self.file = open(directory / f"rank{rank}.jsonl", "a")  # noqa: SIM115

    def write(self, step: int, loss: float, samples: list[int]) -> None:
        if self.file is not None:
            self.file.write(json.dumps({"step": step, "loss": loss, "samples": samples}) + "\n")
            self.file.flush()
