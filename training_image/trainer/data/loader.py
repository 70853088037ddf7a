"""Training data: token shards read by memory map, or a synthetic source; exact positions for resume.

Shards are what `trainer.data.shard_index` validated: trainstack token shards (index.json, written by
`trainstack data prepare`) or a Megatron indexed dataset of another tool. Their token ids, in index order,
form one stream; a sample is a window of seq_len + 1 consecutive tokens of it (inputs = window[:-1],
targets = window[1:]), window w starting at token w * seq_len, so the stream holds
(total_tokens - 1) // seq_len windows and none is lost at a shard's end (a window may span two shards,
as Megatron's samples span documents). Sample s of the run is window order(s mod W), epoch s // W, where
`WindowOrder` is a seeded pseudo-random permutation of the W windows, new each epoch: a prepared dataset
keeps documents in input-file order (one shard per input file), and the permutation mixes the whole
corpus without a shuffle pass or an index in memory. The data position stays one integer (samples
consumed so far), exact across restarts and world sizes.

Every window's ids are checked against the model's vocabulary as it is read (a max/min over seq_len + 1
ids): an id outside it is one line naming the shard and position (exit 2), not an embedding crash or a
device-side assert.

Within an optimizer step that starts at position p, micro-step m of rank r (world W, micro-batch b)
takes samples p + (m * W + r) * b ... + b - 1; the step consumes global_batch samples in total.

Under context parallelism, rank r is data-parallel rank r // cp of world / cp (the CP ranks of one
group read the same samples), and keeps only its chunks of each (trainer.distributed.context_parallel).

`Prefetcher` reads those micro-batches ahead on a background thread (into pinned host memory on CUDA)
so the step loop never waits on a read; the loop copies each to the GPU without blocking.

Fine-tuning (`training.objective: sft`) reads a chat dataset through `trainer.data.packing.PackedChat`
instead: sample s is packed row s (a permutation of the packed sequences, new each epoch, exactly as
windows above), so the same position arithmetic, checkpointed position and resume apply; its
micro-batches carry the rows' labels (-100 outside the targets), position ids, segment ids and
cu_seqlens (`Batch.packed`).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from trainer.data.manifest import check_tokenizer, read_manifest
from trainer.data.shard_index import FORMAT, INDEX_FILE, DatasetIndex, read_dataset  # noqa: F401 (re-exported)
from trainstack.errors import TrainstackError

log = logging.getLogger("trainer.data")
OPEN_SHARDS = 256  # memory maps kept open at once (each holds a file descriptor)


class TokenSource(Protocol):
    name: str

    def sample(self, index: int) -> np.ndarray:
        """Window `index` (any non-negative int): seq_len + 1 token ids, int64."""
        ...


@dataclass(frozen=True)
class PackedLayout:
    """A packed micro-batch's layout beside its tokens and labels (trainer.data.packing.collate): what
    the model's `packed` argument reads (trainer.models.model.PackedRows)."""

    position_ids: torch.Tensor  # (micro_batch, seq_len) int64, restarting at 0 per example
    segment_ids: torch.Tensor  # (micro_batch, seq_len) int64
    cu_seqlens: torch.Tensor  # (segments + 1,) int32, the batch flattened row after row
    max_seqlen: int


@dataclass(frozen=True)
class Batch:
    inputs: torch.Tensor  # (micro_batch, seq_len) int64
    targets: torch.Tensor  # packed rows: their labels, -100 where nothing is learnt
    sample_indices: tuple[int, ...]
    packed: PackedLayout | None = None  # packed chat rows (training.objective sft); None: token windows


_MASK64 = (1 << 64) - 1


def _mix(value: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread 64-bit hash of an integer."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


class WindowOrder:
    """A seeded permutation of range(n), different for each epoch, computed per index in O(1) memory:
    a 4-round Feistel network over the smallest even power of two >= n, cycle-walking until the value
    falls inside range(n) (fewer than 4 steps on average)."""

    ROUNDS = 4

    def __init__(self, n: int, seed: int):
        self.n = n
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)
        self.mask = (1 << self.half) - 1
        self.seed = int.from_bytes(hashlib.blake2b(f"trainstack-window-order:{seed}".encode()).digest()[:8])

    def __call__(self, index: int, epoch: int = 0) -> int:
        keys = [_mix(self.seed ^ _mix((epoch << 8) | r)) for r in range(self.ROUNDS)]
        value = index
        while True:
            left, right = value >> self.half, value & self.mask
            for key in keys:
                left, right = right, left ^ (_mix(right ^ key) & self.mask)
            value = (left << self.half) | right
            if value < self.n:
                return value


class ShardedTokens:
    """Windows of seq_len + 1 tokens over a validated dataset's token stream (see the module doc)."""

    def __init__(self, dataset: DatasetIndex, seq_len: int, model_vocab: int, seed: int = 0, name: str = ""):
        self.dataset, self.seq_len, self.vocab = dataset, seq_len, model_vocab
        self.name = name or f"shards:sha256={dataset.content_sha256[:16]}"
        where = dataset.directory / INDEX_FILE if dataset.kind == "trainstack" else dataset.directory
        if dataset.vocab_size is not None and dataset.vocab_size > model_vocab:
            raise TrainstackError(
                f"{where}: vocab_size: the shards use {dataset.vocab_size} token ids but model.vocab "
                f"is {model_vocab}"
            )
        if dataset.max_token_id is not None and dataset.max_token_id >= model_vocab:
            raise TrainstackError(
                f"{where}: max_token_id: the shards hold token id {dataset.max_token_id}, outside "
                f"model.vocab {model_vocab}"
            )
        self.shards = [s for s in dataset.shards if s.tokens]
        self.starts = np.cumsum([0] + [s.tokens for s in self.shards]).tolist()  # token offset per shard
        total_tokens = self.starts[-1]
        self.total_windows = (total_tokens - 1) // seq_len if total_tokens > seq_len else 0
        if self.total_windows == 0:
            raise TrainstackError(
                f"{where}: the shards hold {total_tokens} tokens, fewer than one window of {seq_len + 1}"
            )
        self.order = WindowOrder(self.total_windows, seed)
        self._maps: OrderedDict[int, np.memmap] = OrderedDict()
        self._lock = threading.Lock()  # the prefetcher and validation may read from two threads

    def _map(self, shard: int) -> np.memmap:
        with self._lock:
            tokens = self._maps.get(shard)
            if tokens is None:
                spec = self.shards[shard]
                tokens = np.memmap(spec.path, dtype=spec.dtype, mode="r")
                self._maps[shard] = tokens
                if len(self._maps) > OPEN_SHARDS:
                    self._maps.popitem(last=False)
            else:
                self._maps.move_to_end(shard)
            return tokens

    def window(self, window: int) -> np.ndarray:
        """Window `window` of the stream in stream order (no permutation), checked against the vocab."""
        start = window * self.seq_len
        end = start + self.seq_len + 1
        pieces = []
        shard = bisect.bisect_right(self.starts, start) - 1
        position = start
        while position < end:
            offset = position - self.starts[shard]
            take = min(end - position, self.shards[shard].tokens - offset)
            pieces.append(np.asarray(self._map(shard)[offset : offset + take], dtype=np.int64))
            position += take
            shard += 1
        ids = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.vocab:
            bad = int(np.flatnonzero((ids < 0) | (ids >= self.vocab))[0])
            shard = bisect.bisect_right(self.starts, start + bad) - 1
            raise TrainstackError(
                f"{self.shards[shard].path}: token {start + bad - self.starts[shard]} is id {int(ids[bad])}, "
                f"outside model.vocab {self.vocab} (shards made with another tokenizer?)"
            )
        return ids

    def sample(self, index: int) -> np.ndarray:
        epoch, window = divmod(index, self.total_windows)
        return self.window(self.order(window, epoch))


class SyntheticTokens:
    """A fixed, learnable synthetic set for tests and benchmarks (no files, no downloads).

    Token t+1 follows token t along one random cycle through the vocabulary (a seeded permutation), from
    a start point that depends only on the sample index: a bigram a small model learns quickly, so a
    falling loss shows the training loop works; any sample is computable on any rank in O(seq_len).
    """

    def __init__(self, vocab: int, seq_len: int, seed: int):
        self.seq_len, self.vocab = seq_len, vocab
        self.cycle = np.random.default_rng(seed).permutation(vocab).astype(np.int64)
        self.name = f"synthetic:vocab={vocab},seed={seed}"

    def sample(self, index: int) -> np.ndarray:
        start = int(np.random.default_rng([index, 0x5EED]).integers(self.vocab))
        return self.cycle[(start + np.arange(self.seq_len + 1)) % self.vocab]


def open_source(
    data_dir: Path | None,
    seq_len: int,
    vocab: int,
    seed: int,
    *,
    tokenizer: str | None = None,
    uri: str | None = None,
) -> TokenSource:
    """Shards from `data_dir` (trainstack's or a Megatron indexed dataset); the synthetic set when None.

    `tokenizer`: the identity the recipe expects (`data.tokenizer`), checked against the dataset's
    manifest. `uri`: where the data lives in S3 (`data.train_s3_uri`; SageMaker's channel config,
    inputdataconfig.json, names no URI). The source's name, which checkpoints record and a resume
    compares, is the dataset's content hash and that URI, never the mount path, which is the same for
    every job (/opt/ml/input/data/train).
    """
    if data_dir is None:
        return SyntheticTokens(vocab, seq_len, seed)
    dataset = read_dataset(Path(data_dir))
    _refuse_chat(dataset)
    if tokenizer is not None:
        check_tokenizer(read_manifest(dataset.directory), dataset.directory, tokenizer, "data.tokenizer")
    name = f"shards:sha256={dataset.content_sha256[:16]}" + (f"@{uri}" if uri else "")
    return ShardedTokens(dataset, seq_len, vocab, seed, name)


def _refuse_chat(dataset: DatasetIndex) -> None:
    """A chat (fine-tuning) dataset read as token windows would make every token a target and run
    examples into each other: refused under `training.objective: pretrain` (docs/sft.md)."""
    index = dataset.directory / INDEX_FILE
    if dataset.kind == "trainstack" and json.loads(index.read_bytes()).get("loss_mask") is not None:
        raise TrainstackError(
            f"{index}: loss_mask: a chat dataset (`data prepare --format chat`) under training.objective "
            "pretrain, which would ignore its loss mask and example boundaries; set training.objective: "
            "sft to fine-tune on it (docs/sft.md)"
        )


def micro_batch_indices(position: int, micro_step: int, rank: int, world: int, micro_batch: int) -> range:
    first = position + (micro_step * world + rank) * micro_batch
    return range(first, first + micro_batch)


def load_batch(source: TokenSource, indices: range, device: torch.device) -> Batch:
    windows = torch.from_numpy(np.stack([source.sample(i) for i in indices]))
    if device.type == "cuda":
        windows = windows.pin_memory().to(device, non_blocking=True)
    return Batch(windows[:, :-1], windows[:, 1:], tuple(indices))


def micro_batch_plan(
    position: int, grad_accum: int, global_batch: int, rank: int, world: int, micro_batch: int
) -> Iterator[range]:
    """This rank's micro-batches from data position `position` on, step after step."""
    while True:
        for micro_step in range(grad_accum):
            yield micro_batch_indices(position, micro_step, rank, world, micro_batch)
        position += global_batch


class Prefetcher:
    """Micro-batches of one rank, read `depth` ahead on a daemon thread, in the order of
    `micro_batch_plan`. On CUDA each is pinned there and copied to the device with non_blocking in
    `next` (the caching host allocator keeps a pinned block until its copy has run). A read error is
    raised by `next`, in the training thread."""

    def __init__(
        self,
        source: TokenSource,
        plan: Iterator[range],
        device: torch.device,
        depth: int = 4,
        split: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        self.device = device
        self._pin = device.type == "cuda"
        # Context parallelism: this rank's chunks of each sample (ContextParallel.split), cut here so
        # only they are copied to the device.
        self._split = split
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(source, plan), name="prefetch", daemon=True)
        self._thread.start()
        self.waited_s = 0.0  # time `next` blocked on an empty queue: the loop waiting for data (metric line)

    def _run(self, source: TokenSource, plan: Iterator[range]) -> None:
        packed_rows = hasattr(source, "micro_batch")  # trainer.data.packing.PackedChat
        if packed_rows and self._split is not None:
            self._put(ValueError("packed rows cannot be split for context parallelism"))
            return
        try:
            for indices in plan:
                if packed_rows:
                    if not self._put((indices, *_packed_tensors(source, indices, self._pin))):
                        return
                    continue
                windows = torch.from_numpy(np.stack([source.sample(i) for i in indices]))
                pair = (windows[:, :-1], windows[:, 1:])
                if self._split is not None:
                    pair = tuple(self._split(t) for t in pair)
                if self._pin:
                    pair = tuple(t.pin_memory() for t in pair)
                if not self._put((indices, pair, None)):
                    return
        except BaseException as exc:  # handed to the training thread
            self._put(exc)

    def _put(self, item: object) -> bool:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def next(self, expected: range) -> Batch:
        try:
            item = self._queue.get_nowait()
        except queue.Empty:  # the reader is behind: the training loop waits for data
            started = time.perf_counter()
            item = self._queue.get()
            self.waited_s += time.perf_counter() - started
        if isinstance(item, BaseException):
            raise item
        indices, (inputs, targets), packed = item
        if indices != expected:  # the plan and the loop disagree: a bug, never silently wrong data
            raise RuntimeError(f"prefetched samples {indices}, the step needs {expected}")
        if self._pin:
            inputs = inputs.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
            if packed is not None:
                positions, segments, cu_seqlens, max_seqlen = packed
                packed = (
                    positions.to(self.device, non_blocking=True),
                    segments.to(self.device, non_blocking=True),
                    cu_seqlens.to(self.device, non_blocking=True),
                    max_seqlen,
                )
        return Batch(inputs, targets, tuple(indices), None if packed is None else PackedLayout(*packed))

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)


def _packed_tensors(source, indices: range, pin: bool) -> tuple[tuple, tuple]:
    """((input_ids, labels), (position_ids, segment_ids, cu_seqlens, max_seqlen)) of packed rows."""
    batch = source.micro_batch(indices)
    pair = (batch.input_ids, batch.labels)
    layout = (batch.position_ids, batch.segment_ids, batch.cu_seqlens)
    if pin:
        pair = tuple(t.pin_memory() for t in pair)
        layout = tuple(t.pin_memory() for t in layout)
    return pair, (*layout, batch.max_seqlen)


def same_data(recorded: str, current: str) -> bool:
    """Whether a checkpoint trained on `recorded` may resume on `current` (TokenSource names).

    Checkpoints written before data identities were content hashes recorded the mount path
    (`shards:/opt/ml/input/data/train`), which names no content: those resume, with a warning, as they
    did then."""
    if recorded == current:
        return True
    if recorded.startswith("shards:/") and current.startswith("shards:sha256="):
        log.warning(
            "the checkpoint recorded its data as a path (%s), not a content hash: cannot check it is %s",
            recorded,
            current,
        )
        return True
    return False
