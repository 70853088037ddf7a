"""How the token shards reach the nodes: SageMaker's input mode, chosen from their size.

SageMaker's guidance (developer guide, "Setting up training jobs to access datasets", best practices
for choosing the data source and input mode):
- File mode "for small datasets ... (for example, less than 50-100 GB)": the channel is copied to every
  node before training starts (about 5 minutes for 50 GB in 100 MB shards), and the instance's storage
  must hold all of it;
- FastFile mode "for larger datasets with larger files (more than 50 MB per file)": S3 objects are
  streamed on read through a POSIX view, training starts without waiting, nothing has to fit on the
  disk; "it works best when data is read sequentially";
- FSx for Lustre when a dataset "is too large for file mode, has many small files that you can't
  serialize easily, or uses a random read access pattern": the job must run in a VPC (VpcConfig), and
  the file system is created and linked to the S3 prefix outside the job.

The trainer reads each dataset sequentially (trainer.data.loader: a sample is a contiguous slice of a shard,
samples taken in shard order; a blend reads each of its sources in order) from large shards, and
little of it: a node reads its tokens/s x at most 4 bytes per token (`plan` prints the figure; a few
MB/s for the fastest recipe). So: File up to FILE_MODE_MAX_GB (the low end of the documented range),
where the copy is a few minutes per job; FastFile above it, or when the size is not known (it never has
to fit the volume and never delays the start). FSx for Lustre stays the documented option for
corpora FastFile cannot serve (many small files, random reads): not provisioned by trainstack
(`-c vpc=true` gives the VPC it needs).

The size comes from the recipe (`data.size_gb`, or `size_gb` of each of `data.sources`: the figure the
dataset's manifest gives), not from S3 at launch: the request is built when the stack is synthesized (the
launcher's state machine carries it, and every job of a run sends the same one), where no AWS is
reachable, and `trainstack launch --dry-run` shows exactly what the state machine sends.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainstack.recipes.schema import TRAIN_CHANNEL, Recipe

FILE_MODE_MAX_GB = 50.0  # "less than 50-100 GB" (SageMaker developer guide); the low end
# "it takes about 5 minutes if a [50 GB] dataset is chunked into 100 MB shards" (same page): 10 GB/min.
FILE_MODE_GB_PER_MINUTE = 10.0
# At most this share of a node's storage is given to a File-mode copy (the rest: logs, the output model,
# the trainer's own files).
FILE_MODE_VOLUME_SHARE = 0.5
BYTES_PER_TOKEN = 4  # at most: uint32 token ids (uint16 below a 65,536 vocabulary; trainer.data.loader)


@dataclass(frozen=True)
class InputPlan:
    mode: str  # "File" | "FastFile"; "" when the recipe reads no data (synthetic tokens)
    reason: str  # one line: why this mode
    channels: tuple[tuple[str, str], ...] = ()  # (channel name, S3 prefix), in the recipe's order
    size_gb: float | None = None  # all channels together, when the recipe gives every size
    download_minutes: float = 0.0  # File mode: the copy before each job's first step (estimate)
    read_mb_per_s_per_node: float | None = None  # what training reads, at the planned tokens/s

    def summary(self) -> str:
        if not self.mode:
            return self.reason
        channels = f"{len(self.channels)} channel" + ("s" if len(self.channels) != 1 else "")
        rate = (
            f"; training reads {self.read_mb_per_s_per_node:,.1f} MB/s per node"
            if self.read_mb_per_s_per_node is not None
            else ""
        )
        return f"{self.mode} ({channels}): {self.reason}{rate}"


def _channels(recipe: Recipe) -> tuple[tuple[str, str], ...]:
    data = recipe.data
    if data.sources:
        return tuple((s.channel, s.uri) for s in data.sources)
    return ((TRAIN_CHANNEL, data.train_s3_uri),) if data.train_s3_uri else ()


def _size_gb(recipe: Recipe) -> float | None:
    data = recipe.data
    if data.sources:
        sizes = [s.size_gb for s in data.sources]
        return None if any(size is None for size in sizes) else float(sum(sizes))
    return data.size_gb


def storage_gb(recipe: Recipe) -> float:
    """Where a File-mode copy lands: the instance's local NVMe, else the EBS volume (ResourceConfig)."""
    instance = recipe.instance
    return float(instance.instance_store_gb if instance.has_instance_store else recipe.compute.volume_size_gb)


def input_plan(recipe: Recipe, tokens_per_sec_per_gpu: float | None = None) -> InputPlan:
    """The input mode of the recipe's data channels, and why; with the planned tokens/s per GPU, also
    the rate a node reads at (every node reads its own samples of the whole dataset)."""
    channels = _channels(recipe)
    if not channels:
        return InputPlan("", "no data channel: the trainer reads synthetic tokens (data.train_s3_uri unset)")
    size = _size_gb(recipe)
    room = FILE_MODE_VOLUME_SHARE * storage_gb(recipe)
    chosen = recipe.data.input_mode
    if chosen != "auto":
        mode, reason = chosen, f"data.input_mode is {chosen}"
    elif size is None:
        what = "data.sources.*.size_gb" if recipe.data.sources else "data.size_gb"
        mode = "FastFile"
        reason = (
            f"size unknown ({what} unset): streamed from S3 on read, so it never has to fit the volume "
            "nor delays the start"
        )
    elif size <= FILE_MODE_MAX_GB and size <= room:
        mode = "File"
        reason = (
            f"{size:,.1f} GB <= {FILE_MODE_MAX_GB:.0f} GB: copied to every node before training (SageMaker's "
            "advice for datasets under 50-100 GB)"
        )
    else:
        mode = "FastFile"
        limit = (
            f"over {FILE_MODE_MAX_GB:.0f} GB"
            if size > FILE_MODE_MAX_GB
            else f"over half the node's {storage_gb(recipe):,.0f} GB"
        )
        reason = (
            f"{size:,.0f} GB, {limit}: large shards read in order, streamed from S3 on read (SageMaker's "
            "advice for large files read sequentially); FSx for Lustre (VPC mode, created outside "
            "trainstack) is the documented option for corpora with small files or random reads"
        )
    minutes = (size / FILE_MODE_GB_PER_MINUTE) if (mode == "File" and size is not None) else 0.0
    if mode == "File" and size is not None:
        reason += f"; about {minutes:,.0f} min per job"
    rate = None
    if tokens_per_sec_per_gpu is not None:
        rate = tokens_per_sec_per_gpu * recipe.instance.gpus * BYTES_PER_TOKEN / 1e6
    return InputPlan(mode, reason, channels, size, minutes, rate)
