"""A world of fake ranks, and the one torch trap that makes fake results differ from real ones.

Facts checked on torch 2.13.0+cpu (../shared/README.md section 16; tests/trace pins both):

- The fake process group (`torch.testing._internal.distributed.fake_pg`, shipped in the torch wheel)
  answers every collective at once without moving data: one process stands for rank 0 of a world of
  any size, and FSDP2 shards as it would on that many GPUs.
- DTensor's sharding propagation (`torch/distributed/tensor/_sharding_prop.py`) asks
  `detect_fake_mode()` for a fake mode to compute output metadata in, and finds the trace's own. Its
  full-size (global-shape) fake copies then pass through the memory tracker as if they were
  allocations: the optimizer's ops on DTensor shards count the whole parameter's state, up to 4x of
  the step's peak on a small model. With the lookup answering None, propagation uses a private fake
  mode the tracker never sees, and the fake run's figures equal a real CPU run's (tests/trace).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist


@contextlib.contextmanager
def fake_world(world: int) -> Iterator[None]:
    """This process as rank 0 of `world` fake ranks; the group is destroyed on the way out."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def sharding_propagation_unfaked() -> Iterator[None]:
    """DTensor's sharding propagation in a fake mode of its own, not the trace's (module doc)."""
    import torch.distributed.tensor._sharding_prop as sharding_prop

    original = sharding_prop.detect_fake_mode
    sharding_prop.detect_fake_mode = lambda *args, **kwargs: None
    try:
        yield
    finally:
        sharding_prop.detect_fake_mode = original
