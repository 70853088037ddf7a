"""Writes token shards: `<name>.bin` (token ids, each document followed by the end-of-document id) and
the Megatron `<name>.idx` beside it (one sequence per document), so every shard is a Megatron indexed
dataset. The .bin's SHA-256, token and document counts and largest id are computed while writing (no
re-read) for the dataset's index.json. A shard is closed at the first document boundary past
`shard_tokens` tokens and the next one opened."""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field

import numpy as np

from trainer.data.megatron_index import index_bytes
from trainstack.errors import TrainstackError

FLUSH_TOKENS = 1 << 20
MAX_DOCUMENT_TOKENS = (1 << 31) - 1  # Megatron's sequence lengths are int32


@dataclass
class _Open:
    name: str
    context: object
    stream: object
    digest: object = field(default_factory=hashlib.sha256)
    tokens: int = 0
    lengths: array = field(default_factory=lambda: array("i"))
    largest: int = 0


class ShardWriter:
    """Shards `<prefix>-00000.bin`, `-00001.bin`, ... in `store` (trainer.prepare.store)."""

    def __init__(self, store, prefix: str, dtype: str, eos_id: int, shard_tokens: int, relative_to: str = ""):
        self.store, self.prefix, self.dtype, self.eos = store, prefix, np.dtype(dtype), eos_id
        self.shard_tokens, self.relative_to = shard_tokens, relative_to
        self.entries: list[dict] = []
        self._open: _Open | None = None
        self._buffer: list[np.ndarray] = []
        self._buffered = 0
        self._document = 0  # tokens of the document being written

    def add(self, ids: np.ndarray) -> None:
        """Part (or all) of the current document's token ids."""
        if self._open is None:
            self._start()
        ids = np.asarray(ids)
        if ids.size:
            self._open.largest = max(self._open.largest, int(ids.max()))
            self._buffer.append(ids.astype(self.dtype, copy=False))
            self._buffered += ids.size
            self._document += ids.size
        if self._buffered >= FLUSH_TOKENS:
            self._flush()

    def end_document(self) -> None:
        self.add(np.asarray([self.eos]))
        if self._document > MAX_DOCUMENT_TOKENS:
            raise TrainstackError(f"a document of {self._document} tokens exceeds Megatron's int32 lengths")
        self._open.lengths.append(self._document)
        self._document = 0
        if self._open.tokens + self._buffered >= self.shard_tokens:
            self._finish()

    def close(self) -> list[dict]:
        if self._open is not None:
            self._finish()
        return self.entries

    def abort(self) -> None:
        if self._open is not None:
            self._open.context.__exit__(RuntimeError, RuntimeError("aborted"), None)
            self._open = None

    def _start(self) -> None:
        name = f"{self.prefix}-{len(self.entries):05d}.bin"
        context = self.store.writer(name)
        self._open = _Open(name, context, context.__enter__())

    def _flush(self) -> None:
        if self._buffer:
            data = np.concatenate(self._buffer).tobytes()
            self._open.stream.write(data)
            self._open.digest.update(data)
            self._open.tokens += self._buffered
            self._buffer, self._buffered = [], 0

    def _finish(self) -> None:
        self._flush()
        shard = self._open
        shard.context.__exit__(None, None, None)
        self._open = None
        self.store.write(shard.name[: -len(".bin")] + ".idx", index_bytes(self.dtype.name, shard.lengths))
        self.entries.append(
            {
                "file": shard.name[len(self.relative_to) :],
                "tokens": shard.tokens,
                "documents": len(shard.lengths),
                "sha256": shard.digest.hexdigest(),
                "max_token_id": shard.largest,
            }
        )
