"""Models in and out, planned: loading a base model at the start of a run, exporting one at its end.

    base_load_seconds(recipe)   the first job's extra start-up with `model.init_from`
    plan_export(recipe)         the export job: CPU instance, memory, disk, hours and dollars

Both are estimates from assumed transfer rates and the rates bench/hf_export_import.py measured on a
2-core CPU sandbox (docs/benchmarks.md, "Models in and out"); the figures say so where they are shown.
Pure arithmetic; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainstack.recipes.schema import ModelShape, Recipe

GB = 1e9
# A base model is published in BF16 (Llama 3.x, Qwen2.5): 2 bytes per parameter to copy and read.
BASE_BYTES_PER_PARAM = 2
# Reading the local copy into the shards: each GPU reads only its rows (trainer.hf.conversion), from the
# node's NVMe, and every replica group reads the model once. Assumption: 2 GB/s per GPU from the page
# cache / NVMe.
LOCAL_READ_BYTES_PER_S_PER_GPU = 2e9
# The export job reads each FP32 tensor of the model from the checkpoint (4 bytes per parameter) and
# writes it in the export dtype, one process, bound by memory copies. Measured on the shared 2-core
# sandbox (bench/hf_export_import.py, load average ~13): 0.02-0.07 GB/s of BF16 output, about a sixth
# of a core; assumed 0.2 GB/s on a dedicated instance (not measured). On SageMaker the reads come from
# S3 through one
# s3torchconnector client: its 10 Gbit/s target, half of it sustained (the assumption
# trainstack.planner.run_plan makes for every rank's checkpoint reads).
EXPORT_OUTPUT_BYTES_PER_S = 0.2e9
EXPORT_S3_READ_BYTES_PER_S = 10e9 / 8 * 0.5
# Peak host memory of the export: one output file twice (its tensors, and the bytes safetensors
# serialises them into before DCP writes the file), twice the largest FP32 tensor (the tensor and DCP's
# read buffer), and the interpreter with torch. Measured peaks (bench/hf_export_import.py): 1.0, 3.1
# and 6.0 GB for 0.1, 0.4 and 0.9B models whose whole BF16 output (0.2, 0.8, 1.8 GB) fit one file.
EXPORT_FIXED_GB = 1.5
EXPORT_MEMORY_HEADROOM = 1.5  # the instance needs this much more than the estimate
MAX_SHARD_GB = 2.0  # trainer.export's default output file size
EXPORT_STARTUP_HOURS = 0.15  # provisioning and pulling the training image (assumption)


@dataclass(frozen=True)
class CpuInstance:
    instance_type: str
    vcpus: int
    memory_gib: float
    usd_per_hour: float


# SageMaker training on-demand rates, us-east-1, as commonly quoted (unverified here: AWS's price page
# was not reachable from this sandbox; read 2026-12). The export needs memory, not cores.
CPU_INSTANCES = (
    CpuInstance("ml.m5.xlarge", 4, 16, 0.23),
    CpuInstance("ml.m5.2xlarge", 8, 32, 0.461),
    CpuInstance("ml.m5.4xlarge", 16, 64, 0.922),
    CpuInstance("ml.m5.12xlarge", 48, 192, 2.765),
)
CPU_PRICE_SOURCE = "SageMaker training on-demand us-east-1 as commonly quoted (unverified, 2026-12)"


def largest_tensor_elements(m: ModelShape) -> int:
    """The largest parameter the checkpoint holds whole: the embedding (or head) or the fused fc1."""
    return max(m.vocab * m.hidden, 2 * m.ffn * m.hidden, (m.q_dim + 2 * m.kv_dim) * m.hidden)


def base_load_seconds(recipe: Recipe, s3_bytes_per_s_per_node: float) -> float:
    """Extra start-up of the run's first job with `model.init_from`: SageMaker copies the base onto
    every node (the `base` input channel, at the run's S3 rate per node), then every replica group
    reads it into its shards. 0 without a base."""
    if not recipe.model.init_from:
        return 0.0
    size = recipe.model.total_params * BASE_BYTES_PER_PARAM
    copy = size / s3_bytes_per_s_per_node
    shard = recipe.parallelism.shard_group
    read = size / shard / LOCAL_READ_BYTES_PER_S_PER_GPU  # each GPU its 1/shard of the rows, in parallel
    return copy + read


@dataclass(frozen=True)
class ExportPlan:
    instance_type: str
    memory_gib: float  # the instance's
    peak_gb: float  # the export's estimated peak host memory
    volume_gb: int  # local disk: one output file at a time, the tokenizer, the image
    bytes_read_gb: float
    bytes_written_gb: float
    hours: float  # the job, start-up included
    usd: float
    usd_per_hour: float
    source: str


def plan_export(recipe: Recipe, dtype: str | None = None, max_shard_gb: float = MAX_SHARD_GB) -> ExportPlan:
    """The smallest CPU instance that holds the export's peak memory with headroom, and what it costs.
    The peak does not grow with the model beyond its largest tensor: 2 x one output file + 2 x that
    tensor in FP32 + the interpreter (checked against bench/hf_export_import.py's measured peaks)."""
    m = recipe.model
    out_bytes = 2 if (dtype or recipe.export.dtype) == "bf16" else 4
    largest = largest_tensor_elements(m) * 4
    peak = 2 * max_shard_gb * GB + 2 * largest + EXPORT_FIXED_GB * GB
    needed_gib = peak * EXPORT_MEMORY_HEADROOM / 2**30
    instance = next((i for i in CPU_INSTANCES if i.memory_gib >= needed_gib), CPU_INSTANCES[-1])
    read, written = m.total_params * 4, m.total_params * out_bytes
    seconds = read / EXPORT_S3_READ_BYTES_PER_S + written / EXPORT_OUTPUT_BYTES_PER_S
    hours = EXPORT_STARTUP_HOURS + seconds / 3600
    volume = max(30, int(2 * max_shard_gb + 10))
    return ExportPlan(
        instance_type=instance.instance_type,
        memory_gib=instance.memory_gib,
        peak_gb=peak / GB,
        volume_gb=volume,
        bytes_read_gb=read / GB,
        bytes_written_gb=written / GB,
        hours=hours,
        usd=hours * instance.usd_per_hour,
        usd_per_hour=instance.usd_per_hour,
        source=CPU_PRICE_SOURCE,
    )
