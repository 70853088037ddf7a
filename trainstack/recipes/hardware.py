"""Hardware catalog: the SageMaker instance types recipes can target.

Figures and their sources are in ../shared/README.md section 2 and docs/planner.md. Peak TFLOP/s are
*dense* (the sparse marketing figures are twice these). Prices are on-demand estimates per
instance-hour: each names its source and the date it was read (`price_source`, `price_date`); a figure
we could not verify says so, and the planner prints it next to every cost. SageMaker's training
prices for these types were not published where we looked: the figures are EC2 on-demand rates, which
SageMaker's usually exceed. A team that knows its rate (negotiated, or a training plan) sets
`compute.usd_per_instance_hour` in its defaults.yaml, and plan, diff and the budget guard use that.

Local storage decides two fields of the training job's ResourceConfig (trainstack.aws.request): SageMaker
refuses `VolumeKmsKeyId` for an instance type with local NVMe storage ("You can't request a
VolumeKmsKeyId when using an instance type with local storage": the instance store is encrypted by a
hardware module on the instance), refuses a `VolumeSizeInGB` above that storage, and provisions no EBS
volume for it at all ("Available storage is fixed to the NVMe-type instance's storage capacity";
SageMaker API reference, ResourceConfig). See `volume_size_problem`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    arch: str  # "blackwell" | "hopper"
    usable_gib: float  # what the CUDA allocator can hand out per GPU
    bf16_tflops: float  # dense peak
    fp8_tflops: float  # dense peak
    supports_mxfp8: bool  # MXFP8 / NVFP4 block scaling needs SM 10.0+ (Blackwell)
    nvlink_gbps: float  # per-GPU NVLink bandwidth, GB/s


@dataclass(frozen=True)
class Instance:
    instance_type: str
    gpu: GPU
    gpus: int
    efa_gbps: float  # inter-node network, Gbit/s
    usd_per_hour: float  # one instance, on demand
    price_source: str
    price_date: str  # when the figure was read (YYYY-MM)
    # Local NVMe instance store, per instance: disks x GB each (SageMaker counts GB, 10^9 bytes); 0 disks:
    # EBS-only, where ResourceConfig.VolumeSizeInGB sizes an EBS volume and VolumeKmsKeyId encrypts it.
    instance_store_disks: int = 0
    instance_store_disk_gb: int = 0

    @property
    def instance_store_gb(self) -> int:
        """Total local NVMe storage per instance, GB; 0 for an EBS-only type."""
        return self.instance_store_disks * self.instance_store_disk_gb

    @property
    def has_instance_store(self) -> bool:
        return self.instance_store_gb > 0

    def peak_tflops(self, dtype: str) -> float:
        """Dense peak per GPU for a recipe precision ("bf16" or "fp8")."""
        return self.gpu.fp8_tflops if dtype == "fp8" else self.gpu.bf16_tflops


B200 = GPU(
    "B200",
    "blackwell",
    usable_gib=179.0,
    bf16_tflops=2250.0,
    fp8_tflops=4500.0,
    supports_mxfp8=True,
    nvlink_gbps=1800.0,
)
H100 = GPU(
    "H100",
    "hopper",
    usable_gib=79.6,
    bf16_tflops=989.0,
    fp8_tflops=1979.0,
    supports_mxfp8=False,
    nvlink_gbps=900.0,
)
H200 = GPU(
    "H200",
    "hopper",
    usable_gib=139.8,
    bf16_tflops=989.0,
    fp8_tflops=1979.0,
    supports_mxfp8=False,
    nvlink_gbps=900.0,
)

INSTANCES: dict[str, Instance] = {
    i.instance_type: i
    for i in (
        Instance(
            "ml.p6-b200.48xlarge",
            B200,
            gpus=8,
            instance_store_disks=8,  # 8 x 3.84 TB NVMe SSD (EC2 instance store table; shared notes 12)
            instance_store_disk_gb=3840,
            efa_gbps=3200.0,
            usd_per_hour=114.0,
            price_source="EC2 on-demand, about 114 USD/h: unverified third-party figure quoted in the "
            "project notes (../shared/README.md section 2); SageMaker price not found",
            price_date="2026-11",
        ),
        Instance(
            "ml.p5.48xlarge",
            H100,
            gpus=8,
            instance_store_disks=8,  # 8 x 3.84 TB NVMe SSD (EC2 instance store table; shared notes 12)
            instance_store_disk_gb=3840,
            efa_gbps=3200.0,
            usd_per_hour=55.04,
            price_source="EC2 on-demand us-east-1, 98.32 USD/h less AWS's June 2025 P5 cut of up to 45% "
            "(usage.ai, 'LLM cost optimization on AWS', updated 2026-06-30); estimate",
            price_date="2026-06",
        ),
        Instance(
            "ml.p5en.48xlarge",
            H200,
            gpus=8,
            instance_store_disks=8,  # 8 x 3.84 TB NVMe SSD (EC2 instance store table; shared notes 12)
            instance_store_disk_gb=3840,
            efa_gbps=3200.0,
            usd_per_hour=63.30,
            price_source="EC2 on-demand us-east-1 after the June 2025 P5 cut (estimate; source of the "
            "figure not recorded when it was added)",
            price_date="2026-11",
        ),
    )
}


def volume_size_problem(instance: Instance, volume_size_gb: int) -> str | None:
    """Why SageMaker would refuse `volume_size_gb` on `instance` (one line), or None.

    SageMaker API reference, ResourceConfig.VolumeSizeInGB: "You can't request a VolumeSizeInGB greater
    than the total size of the local instance storage." (EBS-only types take any size the model allows.)
    """
    if instance.has_instance_store and volume_size_gb > instance.instance_store_gb:
        return (
            f"{volume_size_gb} GB exceeds the {instance.instance_store_gb:,} GB of local NVMe storage of "
            f"{instance.instance_type} ({instance.instance_store_disks} x {instance.instance_store_disk_gb} "
            "GB), which SageMaker uses instead of an EBS volume"
        )
    return None


def get_instance(instance_type: str) -> Instance:
    """The catalog entry, or KeyError naming the supported types."""
    try:
        return INSTANCES[instance_type]
    except KeyError:
        raise KeyError(
            f"unknown instance type {instance_type!r}; supported: {', '.join(sorted(INSTANCES))}"
        ) from None
