"""Fixtures for recipe, loader, planner and CLI tests: a throwaway recipes directory."""

from __future__ import annotations

from pathlib import Path

import pytest

SMALL = """\
model: {layers: 2, hidden: 64, heads: 4, kv_heads: 2, ffn: 128, vocab: 1000}
training: {seq_len: 32, micro_batch: 1, global_batch: 8, steps: 10}
precision: {dtype: bf16}
activation_checkpointing: {mode: none}
parallelism: {shard_group: 8}
compute: {instance_type: ml.p6-b200.48xlarge}
"""


@pytest.fixture
def small_text() -> str:
    """A valid recipe body (without `name`) small enough to plan by hand."""
    return SMALL


@pytest.fixture
def recipes_dir(tmp_path: Path) -> Path:
    """recipes/ with one valid base recipe `small` and an empty team `nlp`."""
    root = tmp_path / "recipes"
    (root / "teams" / "nlp").mkdir(parents=True)
    (root / "small.yaml").write_text("name: small\n" + SMALL)
    return root
