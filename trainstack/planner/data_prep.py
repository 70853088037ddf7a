"""How many CPU instances a `trainstack data prepare` Processing job takes, for how long, at what cost.

Pure arithmetic on the input's size and file count (no I/O), shown before anything is started. Every
figure is a range (low, mid, high), and only as good as three constants:

- TOKENS_PER_BYTE: tokens per byte of input file, by format. Assumed, not measured on a real corpus:
  English web text with a 32K-128K BPE vocabulary runs about 4 to 5 characters per token (0.2-0.25
  tokens per byte of plain text); JSONL adds keys, escapes and metadata; Parquet is compressed (about
  3x on text). The manifest of a first preparation gives the real figure for a corpus.
- TOKENS_PER_VCPU_S: tokenization rate of one worker per vCPU, from bench/data_prepare.py (measured on
  a 2-core sandbox with a byte-level BPE tokenizer trained there, docs/benchmarks.md "Data
  preparation"), discounted to 0.6 of a core per vCPU (two hyperthreads share a core). Real tokenizers
  with larger vocabularies and other text run at other rates.
- CHAT_TOKENS_PER_PROCESS_S: conversations (`--format chat`) run one process per instance (no worker
  pool yet): rendering through the chat template and tokenizing with offsets, measured at 100-120K
  tokens/s for 650-token conversations on this project's 2 shared cores (docs/sft.md), as (0.5, 1, 1.5)
  x 110K. So a chat job takes small instances (ml.c5.xlarge) and scales by instance count, which
  ShardedByS3Key can only do over several input files.
- Instance prices: EC2 on-demand rates (us-east-1) times 1.2, the usual SageMaker premium; SageMaker
  Processing prices were not looked up. Override with `--usd-per-instance-hour`.

Each instance also pays a start (provisioning and pulling the training image: START_MINUTES) and the
download of its share of the inputs (File mode copies them before the container starts:
DOWNLOAD_GBPS per instance, assumed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainstack.units import data_size

# Tokens per byte of input file, (low, mid, high), by input format.
TOKENS_PER_BYTE = {
    "text": (0.18, 0.23, 0.27),
    "jsonl": (0.15, 0.20, 0.25),
    "parquet": (0.40, 0.60, 0.80),
    "gzip": (0.45, 0.60, 0.80),  # .jsonl.gz / .txt.gz: about 3x compression of text
}
# One worker per vCPU: bench/data_prepare.py's tokens/s per core on the sandbox, x 0.6 per vCPU.
MEASURED_TOKENS_PER_CORE_S = 3.6e5
TOKENS_PER_VCPU_S = tuple(MEASURED_TOKENS_PER_CORE_S * 0.6 * f for f in (0.5, 1.0, 1.5))
CHAT_TOKENS_PER_PROCESS_S = tuple(1.1e5 * f for f in (0.5, 1.0, 1.5))
START_MINUTES = (6.0, 10.0, 15.0)
DOWNLOAD_GBPS = (0.5, 1.0, 2.0)  # GB/s of S3 -> instance volume in File mode
MAX_INSTANCES = 100  # CreateProcessingJob ClusterConfig.InstanceCount: 1-100 (botocore's model)
MAX_VOLUME_GB = 16384  # ClusterConfig.VolumeSizeInGB: 1-16384 (botocore's model)
TARGET_HOURS = 2.0  # a preparation should take an afternoon, not a week
SAGEMAKER_PREMIUM = 1.2


@dataclass(frozen=True)
class ProcessingInstance:
    name: str
    vcpus: int
    memory_gib: int
    usd_per_hour: float
    price_source: str


def _priced(ec2_usd: float, ec2_name: str) -> tuple[float, str]:
    return (
        round(ec2_usd * SAGEMAKER_PREMIUM, 2),
        f"EC2 {ec2_name} on-demand us-east-1 {ec2_usd} USD/h x {SAGEMAKER_PREMIUM} "
        "(SageMaker premium; unverified)",
    )


PROCESSING_INSTANCES = {
    i.name: i
    for i in (
        ProcessingInstance("ml.c5.18xlarge", 72, 144, *_priced(3.06, "c5.18xlarge")),
        ProcessingInstance("ml.c5.9xlarge", 36, 72, *_priced(1.53, "c5.9xlarge")),
        ProcessingInstance("ml.m5.24xlarge", 96, 384, *_priced(4.608, "m5.24xlarge")),
        ProcessingInstance("ml.c6i.32xlarge", 128, 256, *_priced(5.44, "c6i.32xlarge")),
        ProcessingInstance("ml.c5.xlarge", 4, 8, *_priced(0.17, "c5.xlarge")),
    )
}
DEFAULT_INSTANCE = "ml.c5.18xlarge"
CHAT_INSTANCE = "ml.c5.xlarge"  # one process per instance: its other vCPUs serve S3 and the OS


@dataclass(frozen=True)
class PreparePlan:
    instance: ProcessingInstance
    instance_count: int
    volume_gb: int
    input_bytes: int
    files: int
    tokens: tuple[float, float, float]
    hours: tuple[float, float, float]
    usd: tuple[float, float, float]
    max_runtime_s: int  # the job's StoppingCondition: twice the high estimate, within SageMaker's 9 days
    workers: int = 0  # processes per instance (0: one per vCPU, the text path's pool)

    def describe(self) -> str:
        lo, mid, hi = self.hours
        return (
            f"{self.instance_count} x {self.instance.name} ({self.workers or self.instance.vcpus} "
            f"worker{'s' if (self.workers or self.instance.vcpus) != 1 else ''} each), "
            f"{self.volume_gb} GB volume each; {self.files} files, {data_size(self.input_bytes)} in; "
            f"about {_count(self.tokens[1])} tokens ({_count(self.tokens[0])}-{_count(self.tokens[2])}); "
            f"{mid:.1f} h ({lo:.1f}-{hi:.1f}); {self.usd[1]:,.0f} USD "
            f"({self.usd[0]:,.0f}-{self.usd[2]:,.0f}) at "
            f"{self.instance.usd_per_hour} USD/instance-hour ({self.instance.price_source})"
        )


def _count(tokens: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if tokens >= size:
            return f"{tokens / size:.1f}{unit}"
    return f"{tokens:.0f}"


def format_of(name: str) -> str:
    lowered = name.lower()
    if lowered.endswith(".gz"):
        return "gzip"
    if lowered.endswith(".parquet"):
        return "parquet"
    if lowered.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    return "text"


def plan_prepare(
    bytes_by_format: dict[str, int],
    files: int,
    *,
    instance_type: str | None = None,
    instance_count: int | None = None,
    usd_per_instance_hour: float | None = None,
    target_hours: float = TARGET_HOURS,
    chat: bool = False,
) -> PreparePlan:
    """The Processing job for inputs of these sizes (bytes per format of `format_of`); `chat`:
    conversations, one process per instance (CHAT_TOKENS_PER_PROCESS_S)."""
    instance = PROCESSING_INSTANCES[instance_type or (CHAT_INSTANCE if chat else DEFAULT_INSTANCE)]
    if usd_per_instance_hour is not None:
        instance = ProcessingInstance(
            instance.name, instance.vcpus, instance.memory_gib, usd_per_instance_hour, "given"
        )
    total = sum(bytes_by_format.values())
    tokens = tuple(
        sum(size * TOKENS_PER_BYTE[fmt][k] for fmt, size in bytes_by_format.items()) for k in range(3)
    )
    rate = list(CHAT_TOKENS_PER_PROCESS_S) if chat else [r * instance.vcpus for r in TOKENS_PER_VCPU_S]
    if instance_count is None:
        one_instance_h = tokens[1] / rate[1] / 3600
        instance_count = math.ceil(one_instance_h / target_hours)
        # Each instance takes whole files (ShardedByS3Key), and its share must fit one volume.
        instance_count = max(instance_count, math.ceil(total * 1.2 / 1e9 / (MAX_VOLUME_GB - 20)))
        instance_count = max(1, min(instance_count, MAX_INSTANCES, max(files, 1)))
    share = total / instance_count
    volume = min(MAX_VOLUME_GB, math.ceil(share * 1.2 / 1e9) + 20)  # the share, 20% slack, scratch
    # Fast, mid, slow: the high rate with the low token count is the fast end.
    hours = tuple(
        START_MINUTES[k] / 60
        + share / (DOWNLOAD_GBPS[2 - k] * 1e9) / 3600
        + tokens[k] / instance_count / rate[2 - k] / 3600
        for k in range(3)
    )
    usd = tuple(h * instance_count * instance.usd_per_hour for h in hours)
    runtime = min(9 * 24 * 3600, max(3600, math.ceil(hours[2] * 2 * 3600)))
    workers = 1 if chat else 0
    return PreparePlan(instance, instance_count, volume, total, files, tokens, hours, usd, runtime, workers)


def plan_for_tokens(tokens: float, fmt: str = "jsonl", file_gb: float = 1.0, **kwargs) -> PreparePlan:
    """The preparation of a corpus that yields `tokens` tokens (its size by the mid tokens-per-byte),
    in files of `file_gb` GB: the projection for a recipe's token budget."""
    size = int(tokens / TOKENS_PER_BYTE[fmt][1])
    return plan_prepare({fmt: size}, max(1, math.ceil(size / (file_gb * 1e9))), **kwargs)
