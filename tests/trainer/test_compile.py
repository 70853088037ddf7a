"""torch.compile of the blocks (trainer.models.model.compile_blocks) with what surrounds a block in a
run, in one process: FSDP2's hooks, the block timer's hooks (trainer.metrics.throughput), activation
checkpointing, the context-parallel mask cache. What failed was dynamo's tracing, whatever the backend,
so dynamo runs here with its `eager` backend (the captured graphs run as captured: seconds, not a C++
build); test_compile_runs.py trains with inductor end to end, and test_trainer_model.py checks the
blocks' gradients through AOTAutograd (`aot_eager`).

`training.compile: true` used to crash every run: `Module.compile` compiles the block's `__call__`,
so dynamo traced the timer's hook and stopped at `time.perf_counter` ("Attempted to call function
marked as skipped", fatal under fullgraph)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils.checkpoint import checkpoint
from trainer.data.loader import SyntheticTokens
from trainer.distributed.context_parallel import ContextParallel, _fill_mask_cache
from trainer.distributed.parallel import build_mesh, shard_model
from trainer.metrics.throughput import BlockComputeTimer
from trainer.models.activation_checkpointing import apply_activation_checkpointing
from trainer.models.model import build_model, compile_blocks, pytorch_backend
from trainer_helpers import TINY

from trainstack.recipes.loader import resolve
from trainstack.recipes.schema import ActivationCheckpointing

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def tiny():
    return resolve(str(TINY)).recipe


def sharded(recipe, backend=None):
    """The tiny model as the trainer lays it out (one block in 2 recomputes, then compile when
    `backend` is given, then FSDP2 over a world of one), initialised from seed 0."""
    torch.manual_seed(0)
    tr = recipe.training
    model = build_model(recipe.model, tr.seq_len, pytorch_backend(), tr.loss_chunk_tokens)
    apply_activation_checkpointing(model, ActivationCheckpointing(mode="selective", every=2))
    if backend is not None:
        compile_blocks(model, backend=backend)
    shard_model(model, build_mesh("cpu", 1, 1))
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def batch(recipe, index: int) -> torch.Tensor:
    source = SyntheticTokens(recipe.model.vocab, recipe.training.seq_len, 1)
    return torch.from_numpy(np.stack([source.sample(2 * index + i) for i in range(2)]))


def test_compiled_blocks_keep_the_block_timer_eager_and_compile_once_per_kind_of_block(tiny, world_of_one):
    """Three steps, the timer armed on the first and third (as on log steps): the compiled model
    gives the eager model's losses, the timer measures the armed steps only, and dynamo compiled
    exactly two frames, a recomputing block and a plain one, shared by both blocks of a kind and
    never recompiled by the timer arming or disarming."""
    counter = CompileCounterWithBackend("eager")
    eager, compiled = sharded(tiny), sharded(tiny, backend=counter)
    timers = {
        name: BlockComputeTimer(list(m.layers), torch.device("cpu"))
        for name, m in (("e", eager), ("c", compiled))
    }
    for step in range(3):
        tokens = batch(tiny, step)
        armed = step != 1
        losses = {}
        for name, model in (("e", eager), ("c", compiled)):
            if armed:
                timers[name].arm()
            loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            losses[name] = loss.item()
            measured = timers[name].collect()
            assert (measured > 0) is armed, (name, step, measured)
        assert abs(losses["e"] - losses["c"]) < 1e-4, (step, losses)
    assert counter.frame_count == 2
    for (name, expected), got in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        assert torch.allclose(got.grad.full_tensor(), expected.grad.full_tensor(), atol=1e-5, rtol=1e-4), name


def test_a_compiled_checkpointed_region_reads_the_one_context_parallel_mask_its_block_hook_made():
    """Dynamo refuses a mutation of outside state inside an activation checkpoint ("HOP: Unsafe side
    effect"), which the mask cache's first fill was. Compiled (fullgraph) with the cache empty, the
    region still gets the right mask and leaves the cache alone; after the block's eager pre-forward
    hook has filled it, the region reads that one shared mask."""
    cp = ContextParallel(size=2, rank=1, seq_len=32)
    x = torch.randn(2, 16, 8, dtype=torch.bfloat16)

    def region(x):
        return x.float().sum() + cp.causal_mask(x.dtype, x.device).float().clamp(min=-1).sum()

    expected = region(x)  # eager: fills the cache
    cp._masks.clear()
    compiled = torch.compile(
        lambda x: checkpoint(region, x, use_reentrant=False), backend="eager", fullgraph=True
    )
    assert torch.equal(compiled(x), expected)
    assert cp._masks == {}
    _fill_mask_cache(cp, torch.nn.Identity(), (x,))
    assert torch.equal(compiled(x), expected)
    (shared,) = cp._masks.values()
    # Rank 1 holds global chunks 1 and 2 of 4 (positions 8-23): its first query, position 8, sees
    # keys 0-8 only, wherever the gather put them.
    assert shared[0].isfinite().sum() == 9
