"""Training data: token shards read by memory map, or a synthetic source; exact positions for resume.

Token-shard format (written by `python -m trainer.make_shards`), one directory:

    index.json          {"format": "trainstack-tokens-v1", "dtype": "uint16" | "uint32",
                         "vocab_size": int, "eos_id": int, "tokenizer": str,
                         "shards": [{"file": "shard-00000.bin", "tokens": int}, ...]}
    shard-00000.bin     raw little-endian token ids, documents joined with eos_id between them

A sample is a window of seq_len + 1 consecutive tokens inside one shard (inputs = window[:-1],
targets = window[1:]); shard k holds (tokens_k - 1) // seq_len windows, taken in order. Sample index s
of the run maps to window s mod total_windows (epoch s // total_windows), so the data position is one
integer: samples consumed so far. Shuffle documents when writing shards, not here: reading stays a
contiguous memory-mapped slice, and the position stays exact across restarts and world sizes.

Within an optimizer step that starts at position p, micro-step m of rank r (world W, micro-batch b)
takes samples p + (m * W + r) * b ... + b - 1; the step consumes global_batch samples in total.

`Prefetcher` reads those micro-batches ahead on a background thread (into pinned host memory on CUDA)
so the step loop never waits on a read; the loop copies each to the GPU without blocking.
"""

from __future__ import annotations

import bisect
import json
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from trainstack.errors import TrainstackError

FORMAT = "trainstack-tokens-v1"
INDEX_FILE = "index.json"
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class TokenSource(Protocol):
    name: str

    def sample(self, index: int) -> np.ndarray:
        """Window `index` (any non-negative int): seq_len + 1 token ids, int64."""
        ...


@dataclass(frozen=True)
class Batch:
    inputs: torch.Tensor  # (micro_batch, seq_len) int64
    targets: torch.Tensor
    sample_indices: tuple[int, ...]


class ShardedTokens:
    """Windows of seq_len + 1 tokens over the shards listed in `directory/index.json`."""

    def __init__(self, directory: Path, seq_len: int, model_vocab: int):
        self.directory, self.seq_len = Path(directory), seq_len
        index_path = self.directory / INDEX_FILE
        try:
            index = json.loads(index_path.read_text())
        except FileNotFoundError:
            raise TrainstackError(
                f"{index_path}: no token-shard index (write one with python -m trainer.make_shards)"
            ) from None
        except json.JSONDecodeError as exc:
            raise TrainstackError(f"{index_path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
        if index.get("format") != FORMAT:
            raise TrainstackError(f"{index_path}: format: expected {FORMAT!r}, got {index.get('format')!r}")
        if index.get("dtype") not in DTYPES:
            raise TrainstackError(
                f"{index_path}: dtype: expected one of {sorted(DTYPES)}, got {index.get('dtype')!r}"
            )
        if int(index.get("vocab_size", 0)) > model_vocab:
            raise TrainstackError(
                f"{index_path}: vocab_size: the shards use {index['vocab_size']} token ids but model.vocab "
                f"is {model_vocab}"
            )
        self.name = f"shards:{self.directory}"
        self.maps: list[np.memmap] = []
        self.starts: list[int] = []  # cumulative window count before each shard
        total = 0
        for entry in index.get("shards", []):
            path = self.directory / entry["file"]
            if not path.is_file():
                raise TrainstackError(f"{index_path}: shards: {entry['file']} is listed but missing")
            tokens = np.memmap(path, dtype=DTYPES[index["dtype"]], mode="r")
            if tokens.size != int(entry["tokens"]):
                raise TrainstackError(
                    f"{path}: holds {tokens.size} tokens, index.json says {entry['tokens']} (truncated copy?)"
                )
            windows = (tokens.size - 1) // seq_len if tokens.size > seq_len else 0
            if windows:
                self.maps.append(tokens)
                self.starts.append(total)
                total += windows
        if total == 0:
            raise TrainstackError(f"{index_path}: no shard holds a full window of {seq_len + 1} tokens")
        self.total_windows = total

    def sample(self, index: int) -> np.ndarray:
        window = index % self.total_windows
        shard = bisect.bisect_right(self.starts, window) - 1
        offset = (window - self.starts[shard]) * self.seq_len
        return np.asarray(self.maps[shard][offset : offset + self.seq_len + 1], dtype=np.int64)


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


def open_source(data_dir: Path | None, seq_len: int, vocab: int, seed: int) -> TokenSource:
    """Shards from `data_dir` when it holds an index.json; the synthetic set when data_dir is None."""
    if data_dir is None:
        return SyntheticTokens(vocab, seq_len, seed)
    return ShardedTokens(data_dir, seq_len, vocab)


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

    def __init__(self, source: TokenSource, plan: Iterator[range], device: torch.device, depth: int = 4):
        self.device = device
        self._pin = device.type == "cuda"
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(source, plan), name="prefetch", daemon=True)
        self._thread.start()

    def _run(self, source: TokenSource, plan: Iterator[range]) -> None:
        try:
            for indices in plan:
                windows = torch.from_numpy(np.stack([source.sample(i) for i in indices]))
                if self._pin:
                    windows = windows.pin_memory()
                if not self._put((indices, windows)):
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
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        indices, windows = item
        if indices != expected:  # the plan and the loop disagree: a bug, never silently wrong data
            raise RuntimeError(f"prefetched samples {indices}, the step needs {expected}")
        if self._pin:
            windows = windows.to(self.device, non_blocking=True)
        return Batch(windows[:, :-1], windows[:, 1:], tuple(indices))

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
