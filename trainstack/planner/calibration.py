"""The throughput model's constants: which are fitted, which are published, which are assumptions.

Three kinds, kept apart so that nobody mistakes one for another (docs/planner.md lists them all):

- `Calibration`'s fitted fields: free constants, fitted by `bench/planner_accuracy.py --fit` on the
  FSDP2-class measurements in bench/calibration_published.yaml (torchtitan and torchao runs; Megatron's
  TP/PP-tuned runs are an upper bound, not fitted). The fit is a least-squares fit of log throughput
  with a weak prior on each constant (`PRIORS`), so that a constant no remaining case informs (in a
  leave-one-out fit) falls back to a stated value instead of wandering off.
- `Calibration`'s fixed fields: assumptions with a stated reason, not fitted (too few measurements
  inform them); each is labelled so.
- Published figures: the FP8 end-to-end gain by model size (the cap on what FP8 may gain), the best
  published B200 runs (the sanity bound), GPU memory bandwidth. Each names its source.

The leave-one-out errors of the fit (`LOO_LOG_ERROR`) are what the plan's ranges are made of.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

# --- Published hardware figures the model needs beyond trainstack.recipes.hardware -------------------------
# HBM bandwidth per GPU, bytes/s: memory-bound work (GEMM operand traffic, FP8 quantisation,
# elementwise ops, the optimizer) runs at this rate. B200 7.7 TB/s (../shared/README.md section 2, EC2
# docs); H100 SXM 3.35 TB/s and H200 4.8 TB/s (NVIDIA H100 / H200 datasheets).
HBM_BYTES_PER_S = {"B200": 7.7e12, "H100": 3.35e12, "H200": 4.8e12}

# --- Published FP8 end-to-end gains (FSDP2-class trainers), the cap on what FP8 may gain ------------
# (parameters, speed-up over BF16 of the whole step). The modelled gain depends on the GEMM shapes;
# it may not exceed what was measured at that size (interpolated in log parameters, flat outside).
FP8_GAIN_PUBLISHED = {
    "hopper": (
        # 1.8B +18%: PyTorch/IBM float8 + FSDP2 blog as quoted in ../shared/README.md section 8.
        (1.8e9, 1.18),
        # Llama 3.1 8B +28.0%: torchtitan benchmarks/llama3_h100_202412_torchtitan.md, 8,532 / 6,667.
        (8.0e9, 1.28),
        # Llama 3 70B +50% on 128 H100 (float8 compute and float8 all-gather): PyTorch dev-discuss
        # "Enabling Float8 All-Gather in FSDP2"; torchao docs: "up to 1.5x at 512 GPU / 405B".
        (70.6e9, 1.50),
    ),
    "blackwell": (
        # Llama 3 8B on 8x B200: float8 tensorwise +25.4%, MXFP8 +20.0% (torchao
        # docs/source/workflows/training.md, "Training e2e benchmarks on NVIDIA B200"); the larger.
        (8.0e9, 1.254),
        # Llama 3 70B on up to 1,856 B200: MXFP8 1.22x-1.28x (PyTorch blog "Accelerating 2K scale
        # pre-training up to 1.28x with TorchAO MXFP8 and TorchTitan on Crusoe B200 Cluster").
        (70.6e9, 1.28),
    ),
}

# --- The sanity bound: the best published B200 runs ------------------------------------------------
# No plan may make a GPU do more hardware FLOP/s (model FLOPs plus recompute, PaLM counting) than the
# best published B200 run of its precision did. Both are Megatron-Core + Transformer Engine runs of
# Llama 3 8B at 8K tokens on 8x B200 without recompute (../shared/calibration/published.yaml):
#   BF16: 21,618 tokens/s/GPU (third-party run of the NeMo 25.09 scripts) x 57.91 GFLOP = 1,252 TFLOP/s
#   FP8:  30,624 tokens/s/GPU (NeMo 25.11 performance summary, FP8 current scaling) x 57.91 = 1,773
# Other GPUs are bounded at the same fraction of their dense BF16 peak (derived, not measured).
BEST_PUBLISHED_B200_TFLOPS = {"bf16": 1252.0, "fp8": 1773.0}
BEST_PUBLISHED_SOURCE = {
    "bf16": "Megatron-Core Llama 3 8B BF16 on 8x B200, 21,618 tokens/s/GPU (third-party NeMo 25.09 run)",
    "fp8": "Megatron-Core Llama 3 8B FP8 current scaling on 8x B200, 30,624 tokens/s/GPU (NeMo 25.11)",
}
B200_BF16_PEAK_TFLOPS = 2250.0


@dataclass(frozen=True)
class Calibration:
    """Every constant of the throughput model (trainstack.planner.throughput), by name."""

    # --- fitted (bench/planner_accuracy.py --fit) ---
    # Fraction of dense peak a large GEMM reaches (BF16 and FP8 alike: torchao's float8 docs: "the gemm
    # speedup approaching 2x as M, K, N increase"), for each kind of GPU the published runs used: Meta's
    # Grand Teton H100s (500 W, HBM2e; torchtitan and torchao), WhiteFiber's H200s (rated power), and
    # torchao's "power limited" B200s (limit not stated). See `planning_efficiency` for what the
    # catalogue's instances are planned with.
    gemm_efficiency_h100_500w: float = 0.60
    gemm_efficiency_h200: float = 0.60
    gemm_efficiency_b200_power_limited: float = 0.60
    # Bytes moved through HBM per element to quantise a GEMM operand to FP8, for the two recipe families
    # measured (current/tensorwise scaling; MXFP8 block scaling). Delayed scaling is current less the
    # amax pass (3/5 of it, derived); Float8BlockScaling is taken as MXFP8 (assumption).
    fp8_quant_bytes_current: float = 5.0
    fp8_quant_bytes_mxfp8: float = 6.0
    # Flash attention's rate relative to the GEMM rate (causal, BF16, per hardware FLOP).
    attention_relative_efficiency: float = 0.7
    # Memory passes of the elementwise ops (norms, RoPE, SiLU, residuals, copies) over the bytes one block
    # saves for backward, forward and backward together, without torch.compile.
    elementwise_passes: float = 3.0
    # Communication overlapped with compute still slows it (SMs and HBM shared with NCCL kernels):
    # this fraction of the overlapped communication time is added.
    overlap_interference: float = 0.10

    # --- fixed assumptions (not fitted) ---
    # Memory passes over a GEMM's operands and output (MK + KN + MN elements) at HBM bandwidth, added to
    # its FLOP time: what makes small GEMMs (small micro-batch, small hidden) run further from peak. One
    # pass (each operand read once, the output written once, not overlapped with the math) is a
    # deliberately simple roll-off: every published FSDP2-class run is the same 8B shape, so no
    # measurement can fit it. It costs Llama 3 8B at micro-batch 2 about 10% against an ideal GEMM.
    gemm_memory_passes: float = 1.0
    # What torch.compile leaves of the elementwise time (Inductor fuses the norm, RoPE and SwiGLU
    # pointwise chains); GEMMs are unchanged. Assumption; the eager and compiled torchtitan pairs fit
    # `elementwise_passes` given it.
    compile_elementwise_factor: float = 0.4
    # NCCL bus bandwidth as a fraction of link bandwidth: NVLink one direction, and a GPU's own EFA NIC
    # (a ring spanning nodes crosses one NIC per hop). Assumption, typical of nccl-tests results.
    nvlink_efficiency: float = 0.7
    efa_efficiency: float = 0.7
    # CPU time per block per micro-step (kernel launches, autograd, FSDP hooks); a block is host-bound
    # when its GPU work is shorter. Assumption: ~100 eager kernels at ~15 us; compiled about a third.
    host_seconds_per_block_eager: float = 1.5e-3
    host_seconds_per_block_compiled: float = 0.5e-3
    # Per optimizer step: LR schedule, data batch to the GPU, loss logging sync. Assumption.
    step_fixed_seconds: float = 0.02
    # Bytes through HBM per sharded parameter per optimizer step: fused AdamW reads parameter, gradient,
    # m and v and writes parameter, m and v (7 x 4 bytes), the gradient-norm clip reads gradients (4).
    optimizer_bytes_per_param: float = 32.0
    # FP32 passes over one loss chunk's logits (cast, softmax, its recompute, gradient). Assumption from
    # the op list of training_image/trainer/models/loss.py.
    loss_logit_passes: float = 6.0
    # Causal attention computes about half of the T x T scores (flash attention skips masked tiles), and
    # its backward is 2.5x its forward (FlashAttention-2 paper's accounting).
    attention_causal_fraction: float = 0.5
    attention_backward_ratio: float = 2.5

    def rated_efficiency(self, gpu_name: str) -> float:
        """The GEMM efficiency of a GPU at rated power: the only published FSDP2-class runs at rated power
        are the H200 ones, so every GPU is taken to reach their fraction of its own peak (assumption: for
        H100 SXM, the same Hopper silicon at the same 700 W; for B200, Blackwell doing as well as Hopper).
        The fast end of every plan's range; the sanity bound caps it."""
        return self.gemm_efficiency_h200

    def measured_efficiency(self, gpu_name: str) -> float:
        """The GEMM efficiency the published runs of this GPU showed, throttled parts and all: the slow
        end of every plan's range."""
        return {"B200": self.gemm_efficiency_b200_power_limited, "H200": self.gemm_efficiency_h200}.get(
            gpu_name, self.gemm_efficiency_h100_500w
        )

    def planning_efficiency(self, gpu_name: str) -> float:
        """What a plan's central figure uses: the geometric mean of the two above (for H200 they agree).
        The published evidence brackets the GPU; the plan does not pretend to know where in between."""
        return math.sqrt(self.rated_efficiency(gpu_name) * self.measured_efficiency(gpu_name))

    def fp8_quant_bytes(self, fp8_recipe: str | None) -> float:
        if fp8_recipe in ("mxfp8", "block"):
            return self.fp8_quant_bytes_mxfp8
        if fp8_recipe == "delayed":
            return self.fp8_quant_bytes_current * 3.0 / 5.0
        return self.fp8_quant_bytes_current


# The fitted fields, and the prior each is pulled toward: (value, standard deviation on the fit's scale:
# logit for the fractions below 1, log for the rest). Priors are order-of-magnitude statements, not
# measurements: a large GEMM reaches ~60% of peak; quantising costs a read of the BF16 operand, an amax
# read and the FP8 write (~5 bytes per element, MXFP8 a little more for its two scaled copies); flash
# attention runs somewhat slower than GEMMs; ~3 passes of elementwise traffic; overlap costs ~10%.
PRIORS: dict[str, tuple[float, float]] = {
    "gemm_efficiency_h100_500w": (0.60, 1.0),
    "gemm_efficiency_h200": (0.60, 1.0),
    "gemm_efficiency_b200_power_limited": (0.60, 1.0),
    "fp8_quant_bytes_current": (5.0, 1.0),
    "fp8_quant_bytes_mxfp8": (6.0, 1.0),
    "attention_relative_efficiency": (0.7, 1.0),
    "elementwise_passes": (3.0, 1.0),
    "overlap_interference": (0.10, 1.0),
}
FRACTIONS = (
    "gemm_efficiency_h100_500w",
    "gemm_efficiency_h200",
    "gemm_efficiency_b200_power_limited",
    "overlap_interference",
)
FITTED = tuple(PRIORS)
assert set(FITTED) <= {f.name for f in fields(Calibration)}

# --- The fit on record (bench/planner_accuracy.py --fit writes these figures; a test refits) --------
FIT = dict(
    gemm_efficiency_h100_500w=0.5244,
    gemm_efficiency_h200=0.7939,
    gemm_efficiency_b200_power_limited=0.2667,
    fp8_quant_bytes_current=6.994,
    fp8_quant_bytes_mxfp8=13.5,
    attention_relative_efficiency=0.4424,
    elementwise_passes=12.65,
    overlap_interference=0.03429,
)
CALIBRATION = Calibration(**FIT)
# Leave-one-out errors of that fit, ln(measured / predicted) over the fitted cases: the smallest and the
# largest. A plan's tokens/s range is [slow x e^low, fast x e^high]: slow is the plan at the efficiency
# the published runs of that GPU showed, fast at rated power (Calibration.measured_efficiency and
# rated_efficiency; the central figure sits at their geometric mean). Hours and cost invert.
LOO_LOG_ERROR: tuple[float, float] = (-0.103, 0.108)


def loo_range(slow: float, fast: float) -> tuple[float, float]:
    low, high = LOO_LOG_ERROR
    return slow * math.exp(low), fast * math.exp(high)
