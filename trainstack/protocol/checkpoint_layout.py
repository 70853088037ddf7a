"""Where a run's checkpoints are and when one is complete: what the trainer writes (training_image/
trainer/checkpoint.py) and the control plane reads (`trainstack resume RUN --from-step N` checks that
step N is a complete checkpoint before it asks for it).

Under the run's prefix every checkpoint is a folder `step-NNNNNNNNN/` holding, among the DCP shards,
one `manifest-rankNNNNN.json` per rank ({"files": {name: size}}) and, written last by rank 0,
`COMPLETE.json` ({"world_size": n, ...}). A checkpoint is complete when the marker and every rank's
manifest exist and every listed file has exactly its listed size. Standard library only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

STEP_DIR = re.compile(r"^step-(\d{9})$")
MARKER = "COMPLETE.json"


def step_dir_name(step: int) -> str:
    return f"step-{step:09d}"


def manifest_name(rank: int) -> str:
    return f"manifest-rank{rank:05d}.json"


def _json(data: bytes | None) -> dict | None:
    if data is None:
        return None
    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def completeness_problem(
    read: Callable[[str], bytes | None], files: Callable[[], dict[str, int]]
) -> str | None:
    """Why one step folder is not a complete checkpoint, or None when it is. `read(name)`: a file's
    bytes (None when absent); `files()`: every file's size."""
    raw = read(MARKER)
    marker = _json(raw)
    if marker is None:
        return f"unreadable {MARKER}" if raw is not None else f"no {MARKER} (interrupted while writing)"
    try:
        world = int(marker["world_size"])
    except (KeyError, TypeError, ValueError):
        return f"unreadable {MARKER}"
    listed: dict[str, int] = {}
    for rank in range(world):
        manifest = _json(read(manifest_name(rank)))
        if manifest is None or not isinstance(manifest.get("files"), dict):
            return f"{manifest_name(rank)} is missing or unreadable (rank {rank} had not finished)"
        listed.update(manifest["files"])
    present = files()
    for name, size in listed.items():
        if name not in present:
            return f"{name} is missing"
        if present[name] != size:
            return f"{name} has {present[name]} bytes, expected {size} (truncated)"
    return None
