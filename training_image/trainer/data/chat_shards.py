"""Chat (fine-tuning) datasets: token shards with a loss mask beside them, read example by example.

What `trainstack data prepare --format chat` writes (trainer.prepare.chat_prepare) is a trainstack token
dataset (trainer.data.shard_index: `index.json`, `shards/*.bin` + Megatron `.idx`, `manifest.json`, a
`validation/` split), one conversation per document (the .idx's sequences: one per example, the
template's own tokens, no end-of-document id added), plus:

- beside each token shard `X.bin`, its loss mask `X.mask`: one uint8 per token, in the same order
  (byte i is token i's flag), 1 where the token is a target (an assistant token the model learns to
  produce; trainer.prepare.chat says which), 0 elsewhere. Nothing else: no header, its length is the
  shard's token count. One byte per token, not one bit: a window of it is a memory-map slice at the
  same offsets as the tokens', read as fast as the tokens (a bit-packed mask would need unpacking and
  byte-aligned cuts), for 25-50% more bytes than the token ids (int32 / uint16 ids).
- in index.json, `"loss_mask": {"format": "trainstack-loss-mask-v1", "dtype": "uint8", "seq_len": N}`
  (N: the longest example kept, what the set was prepared for) and in each shard entry `"mask"` (its
  file, relative like `file`), `"mask_sha256"` (SHA-256 of its bytes, computed while written) and
  `"targets"` (the number of 1 bytes). index.json's bytes are the dataset's identity
  (DatasetIndex.content_sha256), so the masks' hashes are part of it.
- in manifest.json, a `"chat"` block: the template, the rule that chose the targets, the counts of
  examples, target tokens, dropped and skipped lines, and the packing efficiency at seq_len.

`read_chat_dataset` validates all of it (one line naming the file and field for any mistake) after
`read_dataset` has validated the token shards, and gives each example's shard and offset from the
.idx files' sequence lengths. `ChatShards.example(i)` reads example i's ids and mask by memory map.
"""

from __future__ import annotations

import bisect
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.data.megatron_index import HEADER_BYTES, read_index
from trainer.data.shard_index import INDEX_FILE, DatasetIndex, inside, read_dataset
from trainstack.errors import TrainstackError

MASK_FORMAT = "trainstack-loss-mask-v1"
MASK_DTYPE = "uint8"
MASK_SUFFIX = ".mask"
OPEN_SHARDS = 256  # memory maps kept open at once, as trainer.data.loader keeps them


def mask_name(token_file: str) -> str:
    """The mask file beside a token shard: `X.bin` -> `X.mask`."""
    return token_file.removesuffix(".bin") + MASK_SUFFIX


@dataclass(frozen=True)
class ChatShard:
    tokens: Path
    mask: Path
    dtype: str
    lengths: np.ndarray  # int64, tokens of each example in the shard
    starts: np.ndarray  # int64, each example's first token in the shard
    targets: int


@dataclass(frozen=True)
class ChatDataset:
    index: DatasetIndex
    shards: tuple[ChatShard, ...]
    seq_len: int  # the longest example the set holds at most (what it was prepared for)

    @property
    def lengths(self) -> np.ndarray:
        """Every example's token count, in dataset order."""
        return np.concatenate([s.lengths for s in self.shards]) if self.shards else np.zeros(0, np.int64)

    @property
    def targets(self) -> int:
        return sum(s.targets for s in self.shards)


def sequence_lengths(idx_path: Path) -> np.ndarray:
    """The sequence lengths of a Megatron .idx (validated by read_index first), as int64."""
    index = read_index(idx_path)
    lengths = np.fromfile(idx_path, dtype=np.int32, count=index.sequences, offset=HEADER_BYTES)
    return lengths.astype(np.int64)


def read_chat_dataset(directory: Path) -> ChatDataset:
    """The validated chat dataset in `directory` (module doc); one line for anything wrong."""
    dataset = read_dataset(Path(directory))
    where = dataset.directory / INDEX_FILE
    if dataset.kind != "trainstack":
        raise TrainstackError(
            f"{dataset.directory}: a Megatron dataset without {INDEX_FILE}: it has no loss mask (prepare "
            "the conversations with `trainstack data prepare --format chat`)"
        )
    index = json.loads(where.read_bytes())  # read_dataset checked it is a JSON object
    block = index.get("loss_mask")
    if not isinstance(block, dict):
        raise TrainstackError(
            f"{where}: loss_mask: missing (token shards without a loss mask: prepare the conversations with "
            "`trainstack data prepare --format chat`)"
        )
    if block.get("format") != MASK_FORMAT or block.get("dtype") != MASK_DTYPE:
        raise TrainstackError(
            f"{where}: loss_mask: expected format {MASK_FORMAT!r} and dtype {MASK_DTYPE!r}, got "
            f"{block.get('format')!r} / {block.get('dtype')!r}"
        )
    seq_len = block.get("seq_len")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise TrainstackError(f"{where}: loss_mask.seq_len: expected a positive integer, got {seq_len!r}")
    shards = []
    for i, (shard, entry) in enumerate(zip(dataset.shards, index["shards"], strict=True)):
        at = f"{where}: shards[{i}]"
        mask = inside(dataset.directory, entry.get("mask"), f"{at}.mask")
        if not mask.is_file():
            raise TrainstackError(f"{at}.mask: {entry.get('mask')} is listed but missing")
        if mask.stat().st_size != shard.tokens:
            raise TrainstackError(
                f"{mask}: {mask.stat().st_size} bytes, its shard holds {shard.tokens} tokens (one mask byte "
                "each; truncated copy?)"
            )
        targets = entry.get("targets")
        if isinstance(targets, bool) or not isinstance(targets, int) or not 0 <= targets <= shard.tokens:
            raise TrainstackError(f"{at}.targets: expected a count of 0..{shard.tokens}, got {targets!r}")
        idx = shard.path.with_suffix(".idx")
        if not idx.is_file():
            raise TrainstackError(f"{at}.file: {shard.name} has no .idx beside it (where its examples end)")
        lengths = sequence_lengths(idx)
        if int(lengths.sum()) != shard.tokens:
            raise TrainstackError(
                f"{idx}: its examples hold {int(lengths.sum())} tokens, the shard {shard.tokens}"
            )
        if lengths.size and int(lengths.max()) > seq_len:
            raise TrainstackError(
                f"{idx}: an example of {int(lengths.max())} tokens, longer than loss_mask.seq_len {seq_len}"
            )
        starts = np.zeros(lengths.size, dtype=np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        shards.append(ChatShard(shard.path, mask, shard.dtype, lengths, starts, targets))
    return ChatDataset(dataset, tuple(shards), seq_len)


class ChatShards:
    """Examples of a chat dataset by number (dataset order), each read by memory map: (ids, mask)."""

    def __init__(self, dataset: ChatDataset, model_vocab: int | None = None):
        self.dataset, self.vocab = dataset, model_vocab
        counts = [s.lengths.size for s in dataset.shards]
        self.first = np.cumsum([0] + counts).tolist()  # first example number of each shard
        self.count = self.first[-1]
        self._maps: OrderedDict[int, tuple[np.memmap, np.memmap]] = OrderedDict()
        self._lock = threading.Lock()  # a prefetch thread and validation may read at once

    def _map(self, shard: int) -> tuple[np.memmap, np.memmap]:
        with self._lock:
            maps = self._maps.get(shard)
            if maps is None:
                spec = self.dataset.shards[shard]
                maps = (
                    np.memmap(spec.tokens, dtype=spec.dtype, mode="r"),
                    np.memmap(spec.mask, dtype=np.uint8, mode="r"),
                )
                self._maps[shard] = maps
                if len(self._maps) > OPEN_SHARDS:
                    self._maps.popitem(last=False)
            else:
                self._maps.move_to_end(shard)
            return maps

    def example(self, number: int) -> tuple[np.ndarray, np.ndarray]:
        """Example `number`'s token ids (int64) and loss mask (bool), checked against the vocabulary."""
        if not 0 <= number < self.count:
            raise IndexError(f"example {number} of {self.count}")
        shard = bisect.bisect_right(self.first, number) - 1
        spec = self.dataset.shards[shard]
        local = number - self.first[shard]
        start, length = int(spec.starts[local]), int(spec.lengths[local])
        tokens, mask = self._map(shard)
        ids = np.asarray(tokens[start : start + length], dtype=np.int64)
        if self.vocab is not None and ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab):
            bad = int(np.flatnonzero((ids < 0) | (ids >= self.vocab))[0])
            raise TrainstackError(
                f"{spec.tokens}: token {start + bad} is id {int(ids[bad])}, outside model.vocab {self.vocab} "
                "(shards made with another tokenizer?)"
            )
        return ids, np.asarray(mask[start : start + length]).view(np.bool_)  # 0/1 bytes: a view, no copy
