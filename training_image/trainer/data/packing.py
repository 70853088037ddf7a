"""Packing fine-tuning examples into sequences of seq_len without letting them see each other.

**Which examples share a sequence**: best-fit decreasing (`pack_best_fit_decreasing`), TRL's
`packing_strategy="bfd"` and torchtune's `PackedDataset(split_across_pack=False)`: examples in
decreasing length (ties in dataset order), each into the open sequence it fills most (the least room
left that still holds it; ties: the earliest opened), a new sequence when none holds it. An example is
never split (a split one would lose its context, or its targets). Room is found in O(log seq_len) per
example (a sorted list of the room sizes present, a heap of sequences per size): a million examples
pack in seconds.

**Packing efficiency** is the share of non-padding positions: tokens / (sequences * seq_len).

**One packed row** (`pack_row`): the examples' tokens back to back, then padding to seq_len. Each
example keeps its own L positions (as TRL's padding-free batches do, not L - 1): `labels[j]` is the
example's next token where that token is a target, else -100 (transformers' ignore index, what
`F.cross_entropy` skips), and -100 at each example's last position (its next token is another
example's) and on padding. `position_ids` restart at 0 for each example (and for the padding run), so
rotary positions are the ones the example would have alone. `segment_ids` number the examples 0, 1, ...
and the padding run gets the next number.

**Attention that never crosses an example**: on CPU (and any SDPA backend that takes a mask),
`trainer.models.model.block_causal_mask`, built by the model from `segment_ids`, gives the boolean
(batch, 1, seq, seq) mask, True where query i may attend to key j: same segment and j <= i. Memory is
seq^2 bytes per row: fine on CPU and in tests, not at 128K tokens. On GPU, the variable-length kernels
(flash attention's `flash_attn_varlen_func`, Transformer Engine's `thd` format, which the model's TE
path uses) take `cu_seqlens` instead: the int32 cumulative boundaries of every segment of the batch
flattened row after row, with `max_seqlen`. There the padding run is a segment of its own and is still
computed (dropping it needs cu_seqlens_padded, not used yet).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainer.data.chat_shards import ChatShards, read_chat_dataset
from trainer.data.loader import WindowOrder
from trainer.data.manifest import check_tokenizer, read_manifest
from trainer.data.shard_index import INDEX_FILE
from trainstack.errors import TrainstackError

IGNORE_INDEX = -100  # what torch.nn.functional.cross_entropy skips by default (transformers' labels)


def pack_best_fit_decreasing(lengths: Sequence[int] | np.ndarray, capacity: int) -> list[list[int]]:
    """Example numbers per sequence (each list in the order placed), sequences in the order opened.
    Every length must be 1..capacity (longer examples are dropped before packing, never cut)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and (int(lengths.min()) < 1 or int(lengths.max()) > capacity):
        raise ValueError(
            f"example lengths must be 1..{capacity}, got {int(lengths.min())}..{int(lengths.max())}"
        )
    order = np.argsort(-lengths, kind="stable")  # decreasing, ties in dataset order
    bins: list[list[int]] = []
    rooms: list[int] = []  # sorted room sizes that some open sequence has
    holders: dict[int, list[int]] = {}  # room size -> heap of sequence numbers with that room
    for example in order.tolist():
        size = int(lengths[example])
        at = bisect.bisect_left(rooms, size)
        if at == len(rooms):
            number, room = len(bins), capacity
            bins.append([])
        else:
            room = rooms[at]
            heap = holders[room]
            number = heapq.heappop(heap)
            if not heap:
                del holders[room]
                rooms.pop(at)
        bins[number].append(example)
        left = room - size
        if left:
            heap = holders.get(left)
            if heap is None:
                holders[left] = heap = []
                bisect.insort(rooms, left)
            heapq.heappush(heap, number)
    return bins


def packing_efficiency(total_tokens: int, sequences: int, capacity: int) -> float:
    """Share of non-padding positions when `total_tokens` fill `sequences` rows of `capacity`."""
    return total_tokens / (sequences * capacity) if sequences else 0.0


@dataclass(frozen=True)
class PackedRow:
    input_ids: np.ndarray  # (seq_len,) int64
    labels: np.ndarray  # (seq_len,) int64, IGNORE_INDEX where nothing is learnt
    position_ids: np.ndarray  # (seq_len,) int64, restarting at 0 per example
    segment_ids: np.ndarray  # (seq_len,) int64: example 0, 1, ..., then the padding run
    lengths: tuple[int, ...]  # each example's tokens, then the padding (if any)
    examples: int  # how many of `lengths` are examples (the rest is the padding run)


def pack_row(examples: Sequence[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int = 0) -> PackedRow:
    """One row of seq_len from (ids, mask) examples (mask: True where the token is a target)."""
    input_ids = np.full(seq_len, pad_id, dtype=np.int64)
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    position_ids = np.zeros(seq_len, dtype=np.int64)
    segment_ids = np.zeros(seq_len, dtype=np.int64)
    lengths = []
    at = 0
    for segment, (ids, mask) in enumerate(examples):
        n = len(ids)
        if at + n > seq_len:
            raise ValueError(f"examples of {at + n}+ tokens do not fit in {seq_len}")
        input_ids[at : at + n] = ids
        # Position j predicts token j + 1 of the same example, learnt where that token is a target.
        targets = np.where(np.asarray(mask[1:], dtype=bool), ids[1:], IGNORE_INDEX)
        labels[at : at + n - 1] = targets
        position_ids[at : at + n] = np.arange(n)
        segment_ids[at : at + n] = segment
        lengths.append(n)
        at += n
    if at < seq_len:
        position_ids[at:] = np.arange(seq_len - at)
        segment_ids[at:] = len(examples)
        lengths.append(seq_len - at)
    return PackedRow(input_ids, labels, position_ids, segment_ids, tuple(lengths), len(examples))


@dataclass(frozen=True)
class PackedBatch:
    input_ids: torch.Tensor  # (batch, seq) int64
    labels: torch.Tensor
    position_ids: torch.Tensor
    segment_ids: torch.Tensor
    cu_seqlens: torch.Tensor  # (segments + 1,) int32, over the batch flattened row after row
    max_seqlen: int


def collate(rows: Sequence[PackedRow]) -> PackedBatch:
    """A micro-batch of packed rows, with the varlen kernels' cu_seqlens over all of them."""
    segments = [n for row in rows for n in row.lengths]
    cu = np.zeros(len(segments) + 1, dtype=np.int32)
    np.cumsum(segments, out=cu[1:])
    return PackedBatch(
        torch.from_numpy(np.stack([r.input_ids for r in rows])),
        torch.from_numpy(np.stack([r.labels for r in rows])),
        torch.from_numpy(np.stack([r.position_ids for r in rows])),
        torch.from_numpy(np.stack([r.segment_ids for r in rows])),
        torch.from_numpy(cu),
        max(segments),
    )


class PackedChat:
    """A chat dataset's examples packed into rows of seq_len (best-fit decreasing, computed once from
    the .idx lengths), row `index` of the run being packed sequence WindowOrder(index mod S, epoch) of
    the S sequences: the order is new each epoch, the packing the same (it depends on the lengths
    alone), and the data position stays one integer, as for token windows (trainer.data.loader)."""

    def __init__(self, shards: ChatShards, seq_len: int, seed: int = 0, pad_id: int = 0, name: str = ""):
        lengths = shards.dataset.lengths
        if lengths.size == 0:
            raise TrainstackError(f"{shards.dataset.index.directory}: the chat dataset holds no example")
        longest = int(lengths.max())
        if longest > seq_len:
            raise TrainstackError(
                f"training.seq_len: {seq_len} is shorter than the dataset's longest example ({longest} "
                f"tokens, {shards.dataset.index.directory}); prepare it again with that seq_len, or raise it"
            )
        self.shards, self.seq_len, self.pad_id = shards, seq_len, pad_id
        self.bins = pack_best_fit_decreasing(lengths, seq_len)
        self.tokens = int(lengths.sum())
        self.efficiency = packing_efficiency(self.tokens, len(self.bins), seq_len)
        self.order = WindowOrder(len(self.bins), seed)
        # What a checkpoint records and a resume compares (trainer.data.loader.same_data): the dataset's
        # content hash, never its mount path. The packing follows from the data and seq_len, both fixed
        # within a run (a seq_len change is refused on resume).
        self.name = name or f"chat:sha256={shards.dataset.index.content_sha256[:16]}"

    def micro_batch(self, indices: Sequence[int]) -> PackedBatch:
        """Rows `indices` collated (what trainer.data.loader.Prefetcher reads for packed sources)."""
        return collate([self.row(i) for i in indices])

    @property
    def total_windows(self) -> int:
        """Packed rows per epoch (the name validation reads for any source's epoch size)."""
        return len(self.bins)

    def __len__(self) -> int:
        return len(self.bins)

    def row(self, index: int) -> PackedRow:
        epoch, sequence = divmod(index, len(self.bins))
        examples = [self.shards.example(i) for i in self.bins[self.order(sequence, epoch)]]
        return pack_row(examples, self.seq_len, self.pad_id)


def open_chat(
    directory: Path,
    seq_len: int,
    vocab: int,
    seed: int,
    *,
    tokenizer: str | None = None,
    uri: str | None = None,
) -> PackedChat:
    """A chat dataset (`data prepare --format chat`) as `training.objective: sft` reads it: its examples
    packed into rows of seq_len, row s of the run being packed sequence WindowOrder(s mod S, epoch) of
    the S sequences, so the data position is one integer (rows consumed), resumed exactly as token
    windows are. Every id is checked against model.vocab as it is read. `tokenizer` and `uri` as in
    trainer.data.loader.open_source."""
    dataset = read_chat_dataset(Path(directory))  # one line naming the file and field for a non-chat set
    index = dataset.index
    where = index.directory / INDEX_FILE
    if index.vocab_size is not None and index.vocab_size > vocab:
        raise TrainstackError(
            f"{where}: vocab_size: the shards use {index.vocab_size} token ids but model.vocab is {vocab}"
        )
    if tokenizer is not None:
        check_tokenizer(read_manifest(index.directory), index.directory, tokenizer, "data.tokenizer")
    name = f"chat:sha256={index.content_sha256[:16]}" + (f"@{uri}" if uri else "")
    return PackedChat(ChatShards(dataset, vocab), seq_len, seed, name=name)
