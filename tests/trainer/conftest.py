"""Fixtures shared by the in-process trainer tests."""

from __future__ import annotations

import gc

import pytest
import torch.distributed as dist


@pytest.fixture
def world_of_one(tmp_path):
    """A gloo process group of this process alone, torn down after the test (as the trainer does:
    the test's sharded modules are collected first, while the group is still up)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    gc.collect()
    dist.destroy_process_group()
