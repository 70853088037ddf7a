"""Fixtures: small recipe trees in temporary directories, so gitops tests do not depend on the
project's own recipes (which the planner engineer tunes) and stay fast to plan."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

# Llama-3.2-1B-shaped decoder on one P6-B200 node: small enough to plan in milliseconds.
BASE_SMALL = """\
name: {name}
description: gitops test recipe
model: {{layers: 16, hidden: 2048, heads: 32, kv_heads: 8, ffn: 8192, vocab: 128256, tied_embeddings: true}}
training: {{seq_len: 4096, micro_batch: {micro_batch}, global_batch: 256, steps: {steps}}}
precision: {{dtype: bf16}}
activation_checkpointing: {{mode: none}}
parallelism: {{shard_group: 8}}
compute: {{instance_type: ml.p6-b200.48xlarge, instance_count: {nodes}}}
"""


def base_recipe(name: str, *, micro_batch: int = 4, steps: int = 2000, nodes: int = 1) -> str:
    return BASE_SMALL.format(name=name, micro_batch=micro_batch, steps=steps, nodes=nodes)


def write_tree(root: Path, files: dict[str, str]) -> Path:
    """Write {relative path: text} under root; returns root / 'recipes'."""
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "recipes"


def git(root: Path, *args: str) -> str:
    return subprocess.run(
        [
            "git",
            "-c",
            "user.name=trainstack-test",
            "-c",
            "user.email=test@example.com",
            "-c",
            "commit.gpgsign=false",
            "-c",
            "init.defaultBranch=main",
            *args,
        ],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
    ).stdout


class Helpers:
    base_recipe = staticmethod(base_recipe)
    write_tree = staticmethod(write_tree)
    git = staticmethod(git)


@pytest.fixture
def h() -> type[Helpers]:
    """The helpers above (test modules here are not a package, so they reach them as a fixture)."""
    return Helpers
