"""Packing that keeps examples apart (issue 38): best-fit decreasing against a plain quadratic
reference of the same rule, rows whose labels and positions are each example's own, the block-diagonal
causal mask and the varlen kernels' cu_seqlens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from trainer.data.packing import (
    IGNORE_INDEX,
    collate,
    pack_best_fit_decreasing,
    pack_row,
    packing_efficiency,
)
from trainer.models.model import block_causal_mask

pytestmark = pytest.mark.fast


def best_fit_decreasing_reference(lengths: list[int], capacity: int) -> list[list[int]]:
    """The rule written the obvious way (O(n * bins)): decreasing length, ties in input order; the
    open bin with the least room that still fits, ties to the earliest opened; else a new bin."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins, rooms = [], []
    for i in order:
        fitting = [b for b in range(len(bins)) if rooms[b] >= lengths[i]]
        if fitting:
            best = min(fitting, key=lambda b: (rooms[b], b))
        else:
            best = len(bins)
            bins.append([])
            rooms.append(capacity)
        bins[best].append(i)
        rooms[best] -= lengths[i]
    return bins


@pytest.mark.parametrize("seed", range(6))
def test_best_fit_decreasing_places_every_example_as_the_plain_rule_does(seed):
    rng = np.random.default_rng(seed)
    capacity = int(rng.choice([16, 64, 100]))
    lengths = rng.integers(1, capacity + 1, size=int(rng.integers(1, 300))).tolist()
    if seed % 2:  # many short examples: many bins with equal room, so the tie rule matters
        lengths = rng.integers(1, 6, size=400).tolist()
    bins = pack_best_fit_decreasing(lengths, capacity)
    assert bins == best_fit_decreasing_reference(lengths, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))  # each exactly once, never split
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)


def test_best_fit_decreasing_fills_better_than_one_example_per_sequence():
    lengths = [60, 40, 30, 30, 20, 20, 10, 10, 10, 5, 5]
    bins = pack_best_fit_decreasing(lengths, 100)
    assert len(bins) == 3  # 240 tokens: 3 sequences of 100 is the least possible
    assert packing_efficiency(sum(lengths), len(bins), 100) == pytest.approx(0.8)
    assert packing_efficiency(0, 0, 100) == 0.0


def test_an_example_longer_than_the_sequence_is_refused_not_cut():
    with pytest.raises(ValueError, match="1..8"):
        pack_best_fit_decreasing([3, 9], 8)


def test_a_million_examples_pack_in_seconds():
    import time

    lengths = np.random.default_rng(0).integers(20, 2048, size=1_000_000)
    started = time.perf_counter()
    bins = pack_best_fit_decreasing(lengths, 4096)
    elapsed = time.perf_counter() - started
    assert sum(len(b) for b in bins) == lengths.size
    assert packing_efficiency(int(lengths.sum()), len(bins), 4096) > 0.99
    assert elapsed < 30, elapsed


def example(ids, mask):
    return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)


def test_a_packed_row_keeps_each_examples_labels_and_positions_its_own():
    a = example([11, 12, 13, 14], [0, 0, 1, 1])
    b = example([21, 22, 23], [0, 1, 1])
    row = pack_row([a, b], 10, pad_id=0)
    assert row.input_ids.tolist() == [11, 12, 13, 14, 21, 22, 23, 0, 0, 0]
    # position j learns token j + 1 of its own example where that token is a target; never across.
    x = IGNORE_INDEX
    assert row.labels.tolist() == [x, 13, 14, x, 22, 23, x, x, x, x]
    assert row.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2]
    assert row.segment_ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert row.lengths == (4, 3, 3) and row.examples == 2
    full = pack_row([a, b, example([31, 32, 33], [0, 0, 1])], 10)
    assert full.lengths == (4, 3, 3) and full.segment_ids.max() == 2  # no padding segment when full


def test_the_block_causal_mask_lets_a_token_see_only_its_own_examples_past():
    row = pack_row([example([1, 2, 3], [0, 1, 1]), example([4, 5], [0, 1])], 7)
    mask = block_causal_mask(torch.from_numpy(row.segment_ids)[None])[0, 0]
    segments = row.segment_ids.tolist()
    for i in range(7):
        for j in range(7):
            assert bool(mask[i, j]) == (segments[i] == segments[j] and j <= i), (i, j)


def test_cu_seqlens_bound_every_segment_of_the_flattened_batch():
    rows = [
        pack_row([example([1, 2, 3], [0, 1, 1]), example([4, 5], [0, 1])], 8),
        pack_row([example(list(range(8)), [1] * 8)], 8),
    ]
    batch = collate(rows)
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.cu_seqlens.tolist() == [0, 3, 5, 8, 16]
    assert batch.max_seqlen == 8
    assert batch.input_ids.shape == batch.labels.shape == batch.position_ids.shape == (2, 8)
    # The boundaries are where the segment ids change, row after row.
    flat = batch.segment_ids + torch.arange(2)[:, None] * 100
    changes = (torch.nonzero(flat.reshape(-1)[1:] != flat.reshape(-1)[:-1]).flatten() + 1).tolist()
    assert [0, *changes, 16] == batch.cu_seqlens.tolist()
