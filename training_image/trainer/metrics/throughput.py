"""Throughput, MFU and memory for the metric line (whose format lives in trainstack.protocol.metrics).

FLOPs per token are the planner's (PaLM: 6N + 12·L·H·Q·T, trainstack.planner.flops_per_token), so
measured and planned MFU use one formula. The peak is the dense per-GPU peak for the recipe's dtype
of the GPU actually present when the catalog knows it (B200, H100, H200), else of the recipe's
instance type: on CPU or an unknown GPU, MFU is reported against the recipe's GPU (so CPU figures
are tiny, honestly). Memory is the CUDA allocator's peak on GPU; on CPU, the process's peak RSS.
Stragglers: below.
"""

from __future__ import annotations

import json
import os
import re
import resource
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainstack.protocol.container import opt_ml
from trainstack.recipes.hardware import GPU, INSTANCES
from trainstack.recipes.schema import Recipe

GIB = 1024**3


def detected_gpu(device: torch.device) -> GPU | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for instance in INSTANCES.values():
        if instance.gpu.name in name:
            return instance.gpu
    return None


def peak_tflops(recipe: Recipe, device: torch.device) -> tuple[float, str]:
    """(dense peak TFLOP/s per GPU for the recipe's dtype, which GPU that peak is for)."""
    gpu = detected_gpu(device)
    if gpu is None:
        return recipe.instance.peak_tflops(recipe.precision.dtype), f"{recipe.instance.gpu.name} (recipe)"
    return (gpu.fp8_tflops if recipe.precision.dtype == "fp8" else gpu.bf16_tflops), gpu.name


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * (1 if sys.platform != "darwin" else 1 / 1024) / (1024**2)


def peak_reserved_gib(device: torch.device) -> float:
    """The caching allocator's peak reservation (what the GPU actually gave up: an out-of-memory comes
    when this, not the allocated peak, reaches the GPU's memory); on CPU the peak RSS, as above."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / GIB
    return peak_memory_gib(device)


# --- stragglers -------------------------------------------------------------------------------------
#
# Collectives equalise wall time: every rank's step ends when the slowest rank's gradients arrive, so
# step time cannot tell which rank is slow. What differs per rank is the time its own blocks compute:
# each block's forward is timed from just after FSDP's pre-forward hook (which makes the compute
# stream wait for the block's all-gather) to just after the block returns. On CUDA with CUDA events on
# the compute stream (so the time excludes the all-gather wait and includes only the block's kernels);
# on CPU with the host clock (gloo's all-gather wait happens in that same hook, before the timer
# starts). Measured on log steps only: reading CUDA events is a host sync.

RESOURCE_CONFIG = opt_ml("input/config/resourceconfig.json")  # under $TRAINSTACK_OPT_ML in the emulator


def current_host(environ: dict[str, str] | None = None, resource_config: Path = RESOURCE_CONFIG) -> str:
    """SageMaker's name for this host (algo-N): SM_CURRENT_HOST, else resourceconfig.json, else the
    machine's host name."""
    env = os.environ if environ is None else environ
    if env.get("SM_CURRENT_HOST"):
        return env["SM_CURRENT_HOST"]
    try:
        return str(json.loads(resource_config.read_text())["current_host"])
    except (OSError, ValueError, KeyError, TypeError):
        return socket.gethostname()


def host_number(host: str) -> int:
    """N of SageMaker's algo-N (what the metric carries: metric values are numbers); 0 otherwise."""
    match = re.fullmatch(r"algo-(\d+)", host)
    return int(match.group(1)) if match else 0


class BlockComputeTimer:
    """Sum of the blocks' forward compute time over the steps it is armed for (see above)."""

    def __init__(self, blocks: list[torch.nn.Module], device: torch.device):
        self.cuda = device.type == "cuda"
        self.armed = False
        self._pairs: list[tuple[Any, Any]] = []
        self._open: list[Any] = []
        self._host_s = 0.0
        # Registered once. The hooks run eagerly around a compiled block (compile_blocks compiles the
        # block's forward, not its __call__): dynamo cannot trace the host clock or CUDA events, and a
        # traced `armed` would recompile every block on each log step.
        for block in blocks:
            block.register_forward_pre_hook(self._before)
            block.register_forward_hook(self._after)

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _before(self, module: torch.nn.Module, args: Any) -> None:
        if self.armed and torch.is_grad_enabled():  # not during a recompute without grad
            self._open.append(self._now())

    def _after(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.armed and self._open:
            start, end = self._open.pop(), self._now()
            if self.cuda:
                self._pairs.append((start, end))
            else:
                self._host_s += end - start

    def arm(self) -> None:
        self.armed, self._pairs, self._open, self._host_s = True, [], [], 0.0

    def collect(self) -> float:
        """Seconds measured since `arm` (synchronises on the last CUDA event), and disarm."""
        self.armed = False
        pairs, host_s = self._pairs, self._host_s
        self._pairs, self._open, self._host_s = [], [], 0.0
        if not self.cuda:
            return host_s
        if pairs:
            pairs[-1][1].synchronize()
        return sum(start.elapsed_time(end) for start, end in pairs) / 1000.0


@dataclass(frozen=True)
class Straggler:
    rank: int
    host: int  # algo-N's N
    compute_s: float  # that rank's measured compute time
    median_s: float
    skew: float  # compute_s / median_s - 1: 0.25 means 25% slower than the median rank


def slowest_rank(compute_s: list[float], hosts: list[int]) -> Straggler:
    """The rank with the longest measured compute time and its skew against the median (pure)."""
    rank = max(range(len(compute_s)), key=lambda r: compute_s[r])
    median = statistics.median(compute_s)
    skew = compute_s[rank] / median - 1.0 if median > 0 else 0.0
    return Straggler(rank, hosts[rank], compute_s[rank], median, skew)
