"""trainer.distributed.context_parallel's pure parts, in one process: the load-balanced chunk
layout, the split of a batch, the causal mask over gathered positions, the layout's refusals, and the
Transformer Engine wiring (against stand-ins with TE's names: TE cannot run here). The multi-rank
behaviour is in test_trainer_context_parallel.py."""

from __future__ import annotations

import pytest
import torch
from test_trainer_model import fake_transformer_engine
from trainer.config import resolve_layout
from trainer.distributed import context_parallel
from trainer.distributed.context_parallel import ContextParallel, apply_context_parallel, chunk_positions
from trainer.models.model import _te_backend, build_model
from trainer_helpers import TINY

from trainstack.errors import RecipeError
from trainstack.recipes.loader import resolve

pytestmark = pytest.mark.fast


def test_rank_i_holds_chunks_i_and_2cp_minus_1_minus_i():
    # seq 16, cp 2: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert chunk_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert chunk_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    for cp in (1, 2, 4):
        every = torch.cat([chunk_positions(32, cp, r) for r in range(cp)])
        assert sorted(every.tolist()) == list(range(32))  # a partition of the sequence


def test_every_rank_gets_the_same_causal_work():
    """Keys each rank's queries see under the causal mask: equal for every rank (the load balance)."""
    for cp in (2, 4):
        work = {r: int((chunk_positions(64, cp, r) + 1).sum()) for r in range(cp)}
        assert len(set(work.values())) == 1, work


def test_split_keeps_this_ranks_tokens_of_the_same_samples():
    tokens = torch.arange(2 * 16).view(2, 16)
    local = ContextParallel(2, 1, 16).split(tokens)
    assert local.tolist() == [list(range(4, 12)), list(range(20, 28))]
    assert ContextParallel(1, 0, 16).split(tokens) is tokens


def test_the_mask_lets_a_query_see_exactly_the_keys_at_or_before_its_position():
    cp = ContextParallel(2, 0, 8)  # rank 0: positions 0, 1, 6, 7; gathered keys 0 1 6 7 | 2 3 4 5
    mask = cp.causal_mask(torch.float32, torch.device("cpu"))
    assert cp.gathered_positions().tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    seen = (mask == 0).tolist()
    assert seen[0] == [True, False, False, False, False, False, False, False]  # position 0
    assert seen[2] == [True, True, True, False, True, True, True, True]  # position 6
    assert mask.dtype == torch.float32 and torch.isinf(mask).any()
    assert cp.causal_mask(torch.float32, torch.device("cpu")) is mask  # one, shared by every block


def test_a_sequence_not_divisible_into_2cp_chunks_is_refused():
    with pytest.raises(ValueError, match="not divisible by 2 x cp = 8"):
        chunk_positions(12, 4, 0)


def test_layout_reads_cp_ranks_as_one_data_parallel_rank():
    recipe = resolve(str(TINY), overrides=["parallelism.shard_group=4", "parallelism.cp=2"]).recipe
    layout = resolve_layout(recipe, 4, "tiny.yaml")
    assert (layout.cp, layout.data_ranks, layout.shard, layout.grad_accum) == (2, 2, 2, 4)
    with pytest.raises(RecipeError, match="parallelism.cp"):
        resolve_layout(recipe, 3, "tiny.yaml")


def test_transformer_engine_attention_is_given_the_cp_group_ranks_stream_and_ring(monkeypatch):
    """TE's documented `DotProductAttention.set_context_parallel_group(cp_group, cp_global_ranks,
    cp_stream, cp_comm_type)`, once per block; RoPE reads this rank's global positions."""
    calls: list = []
    te = fake_transformer_engine(calls)
    te.DotProductAttention.set_context_parallel_group = lambda self, *args, **kwargs: calls.append(
        ("set_context_parallel_group", args, kwargs)
    )
    streams = []
    monkeypatch.setattr(
        context_parallel.torch.cuda, "Stream", lambda: streams.append(object()) or streams[-1]
    )
    shape = resolve(str(TINY)).recipe.model
    model = build_model(shape, 32, _te_backend(te, apply_rotary_pos_emb=None), loss_chunk_tokens=24)
    group = object()  # stands in for the CP process group
    cp = ContextParallel(2, 1, 32, group, (2, 3))
    apply_context_parallel(model, cp, torch.device("cpu"))
    wired = [c for c in calls if c[0] == "set_context_parallel_group"]
    assert len(wired) == shape.layers and len(streams) == 1
    for _, args, kwargs in wired:
        assert args == (group, [2, 3], streams[0]) and kwargs == {"cp_comm_type": "p2p"}
    assert model.rope_positions.tolist() == chunk_positions(32, 2, 1).tolist()
