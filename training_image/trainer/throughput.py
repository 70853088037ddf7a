"""Throughput, MFU and memory for the metric line (whose format lives in trainstack.metrics).

FLOPs per token are the planner's (PaLM: 6N + 12·L·H·Q·T, trainstack.planner.flops_per_token), so
measured and planned MFU use one formula. The peak is the dense per-GPU peak for the recipe's dtype
of the GPU actually present when the catalog knows it (B200, H100, H200), else of the recipe's
instance type: on CPU or an unknown GPU, MFU is reported against the recipe's GPU (so CPU figures
are tiny, honestly). Memory is the CUDA allocator's peak on GPU; on CPU, the process's peak RSS.
"""

from __future__ import annotations

import resource
import sys

import torch

from trainstack.hardware import GPU, INSTANCES
from trainstack.recipe import Recipe

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
