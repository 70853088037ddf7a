"""What may change in a run between two of its jobs, and what may not.

A run trains the recipe it was launched with (the run registry records it). `trainstack resume RUN --set
key=value` changes it deliberately, and the trainer compares the recipe its checkpoint was written with
against the one its job carries. Both sides classify the difference here, so the CLI refuses up front
exactly what the trainer would refuse on resume.

Safe mid-run: what changes how the remaining steps are driven or watched, not what the checkpoint's
tensors and data position mean: the optimizer's schedule and clipping, the step budget, checkpoint
cadence, the node count and layout (DCP reshards on load; the data position is counted in samples),
micro-batch and recompute (the same global batch, other accumulation), monitoring, tracking and
validation settings, the image (a trainer fix), prices and caps. Unsafe: the model's shape, the sequence
length, the global batch, the seed, the precision and the data, which would make the checkpoint's
state or data position mean something else. A key not listed is unsafe: new settings must opt in here.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from trainstack.recipes.schema import Recipe

# Dotted recipe keys (fnmatch patterns) that may change between two jobs of one run.
SAFE_MID_RUN = (
    "description",
    "training.lr",
    "training.min_lr_ratio",
    "training.warmup_steps",
    "training.weight_decay",
    "training.grad_clip",
    "training.steps",
    "training.log_every",
    "training.micro_batch",
    "training.loss_chunk_tokens",
    "training.compile",
    "activation_checkpointing.*",
    "parallelism.shard_group",
    "checkpointing.*",
    "compute.instance_count",
    "compute.volume_size_gb",  # the instances' scratch volume: no checkpoint or data state lives there
    "compute.max_runtime_hours",
    "compute.max_jobs",
    "compute.usd_per_instance_hour",
    "compute.spot",
    "compute.max_wait_hours",
    "compute.training_plan_arn",
    "compute.keep_alive_seconds",
    "compute.max_retry_attempts",
    "compute.capacity_wait_hours",
    "image.*",
    "monitoring.*",
    "tracking.*",
    "validation",  # a run without validation that gains it (the section was unset: no dotted keys)
    "validation.*",
    "export.*",
    "budget.*",
    "tags.*",
    "data.sources.*.weight",  # the blend's schedule changes from the resumed position on (trainer.data.blend)
    "data.sources.*.size_gb",  # how the shards reach the nodes, not which shards (planner.input_mode)
    "data.size_gb",
    "data.input_mode",
    "launch_on_deploy",
)


@dataclass(frozen=True)
class Change:
    key: str  # dotted recipe key
    before: Any
    after: Any

    @property
    def safe(self) -> bool:
        return is_safe(self.key)

    def __str__(self) -> str:
        return f"{self.key}: {json.dumps(self.before)} -> {json.dumps(self.after)}"


def is_safe(key: str) -> bool:
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in SAFE_MID_RUN)


def flatten(recipe: Recipe) -> dict[str, Any]:
    """The recipe as dotted keys (lists indexed: `data.sources.0.weight`), `name`/`extends` left out."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, child in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), child)
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, child in enumerate(value):
                walk(f"{prefix}.{i}", child)
        else:
            flat[prefix] = value

    walk("", recipe.model_dump(mode="json", exclude={"name", "extends"}))
    return flat


def changes(before: Recipe, after: Recipe) -> list[Change]:
    """Every dotted key whose value differs, in key order (a key present on one side only included)."""
    old, new = flatten(before), flatten(after)
    return [
        Change(key, old.get(key), new.get(key))
        for key in sorted(old.keys() | new.keys())
        if old.get(key) != new.get(key)
    ]


def unsafe(found: Iterable[Change]) -> list[Change]:
    return [change for change in found if not change.safe]
