"""The inputs of `trainer.prepare`: which files, their records, and the tokenizer that encodes them.

Formats, by file name (a trailing `.gz` is read through gzip):

- **JSONL** (`.jsonl`, `.ndjson`, `.json`): one JSON object per line; the document is its `--text-field`.
- **Parquet** (`.parquet`): the document is the `--text-field` column, read one record batch at a time.
- **plain text** (`.txt`, `.md`, `.text`, `.rst`, and any file named explicitly with another ending):
  the whole file is one document, tokenized in pieces cut at line breaks (at most TEXT_PIECE_BYTES each).

Nothing is held in memory whole: JSONL is read line by line, Parquet batch by batch, text piece by piece
(memory per worker: one batch of documents, their token ids and the shard writer's buffer;
bench/data_prepare.py measures it).

Bad records: a line that is not UTF-8 or not a JSON object (for text, a file that is not UTF-8) is
skipped and counted; more than `max_bad_records` in one file stops with one line naming the file and
the first bad line. A record without the text field stops at once (one line naming the file, line and
the fields the record has): a wrong `--text-field` is not a bad record. Empty or null texts are skipped.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainstack.errors import TrainstackError

FORMATS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
    ".txt": "text",
    ".md": "text",
    ".text": "text",
    ".rst": "text",
}
TEXT_PIECE_BYTES = 1 << 20
BATCH_DOCUMENTS = 256
BATCH_CHARS = 4 << 20
BYTES_EOS = 256  # the byte-level tokenizer: ids 0-255 are UTF-8 bytes, 256 ends a document
EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eos|>")


def format_of(name: str, explicit: bool = False) -> str | None:
    """The input format of a file name; None for a file a directory listing skips."""
    lowered = name.lower().removesuffix(".gz")
    found = FORMATS.get(Path(lowered).suffix)
    return found if found or not explicit else "text"


@dataclass
class Document:
    text: str | None  # None: a text file's pieces follow through `pieces`
    split_key: bytes  # what the validation split hashes
    pieces: Iterator[str] | None = None


@dataclass
class RecordCounts:
    documents: int = 0
    bad: int = 0
    empty: int = 0
    first_bad: str = ""

    def bad_record(self, where: str, limit: int, name: str) -> None:
        self.bad += 1
        self.first_bad = self.first_bad or where
        if self.bad > limit:
            raise TrainstackError(
                f"{name}: {self.bad} records are not UTF-8 or not JSON objects, more than --max-bad-records "
                f"{limit} (first: {self.first_bad})"
            )


def _open_binary(path: Path):
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")


def read_documents(
    path: Path, name: str, fmt: str, text_field: str, counts: RecordCounts, max_bad: int
) -> Iterator[Document]:
    """Documents of one input file (`name` is what messages call it: its URI)."""
    if fmt == "jsonl":
        yield from _jsonl(path, name, text_field, counts, max_bad)
    elif fmt == "parquet":
        yield from _parquet(path, name, text_field, counts, max_bad)
    else:
        yield from _text(path, name, counts, max_bad)


def _jsonl(path: Path, name: str, field: str, counts: RecordCounts, max_bad: int) -> Iterator[Document]:
    with _open_binary(path) as stream:
        for number, raw in enumerate(stream, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                counts.bad_record(f"line {number}: not UTF-8", max_bad, name)
                continue
            except json.JSONDecodeError:
                counts.bad_record(f"line {number}: not JSON", max_bad, name)
                continue
            if not isinstance(record, dict):
                counts.bad_record(f"line {number}: not a JSON object", max_bad, name)
                continue
            if field not in record:
                fields = ", ".join(sorted(record)[:8]) or "none"
                raise TrainstackError(
                    f"{name}: line {number}: no field {field!r} (the record has: {fields}); pass --text-field"
                )
            text = record[field]
            if not isinstance(text, str):
                if text is not None:
                    raise TrainstackError(
                        f"{name}: line {number}: field {field!r} is a {type(text).__name__}, not a string"
                    )
                counts.empty += 1
                continue
            if not text:
                counts.empty += 1
                continue
            yield Document(text, text.encode("utf-8"))


def _parquet(path: Path, name: str, field: str, counts: RecordCounts, max_bad: int) -> Iterator[Document]:
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError and others for a file that is not one
        raise TrainstackError(f"{name}: not a Parquet file ({' '.join(str(exc).split())[:200]})") from None
    columns = table.schema_arrow.names
    if field not in columns:
        raise TrainstackError(
            f"{name}: no column {field!r} (columns: {', '.join(columns[:12])}); pass --text-field"
        )
    row = 0
    for batch in table.iter_batches(batch_size=BATCH_DOCUMENTS, columns=[field]):
        for value in batch.column(0).to_pylist():
            row += 1
            if isinstance(value, bytes):
                try:
                    value = value.decode("utf-8")
                except UnicodeDecodeError:
                    counts.bad_record(f"row {row}: not UTF-8", max_bad, name)
                    continue
            if value is None or value == "":
                counts.empty += 1
                continue
            if not isinstance(value, str):
                raise TrainstackError(f"{name}: column {field!r} holds {type(value).__name__}, not text")
            yield Document(value, value.encode("utf-8"))


def _text(path: Path, name: str, counts: RecordCounts, max_bad: int) -> Iterator[Document]:
    # First pass: is the whole file UTF-8? (A document is all or nothing; its tokens are written as
    # they come in the second pass.) The split is decided by the first TEXT_PIECE_BYTES.
    decoder = codecs.getincrementaldecoder("utf-8")()
    head = b""
    with _open_binary(path) as stream:
        try:
            while block := stream.read(TEXT_PIECE_BYTES):
                head = head or block
                decoder.decode(block)
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            counts.bad_record("the file is not UTF-8", max_bad, name)
            return
    if not head.strip():
        counts.empty += 1
        return
    yield Document(None, head[:TEXT_PIECE_BYTES], pieces=_text_pieces(path))


def _text_pieces(path: Path) -> Iterator[str]:
    piece: list[bytes] = []
    size = 0
    with _open_binary(path) as stream:
        for line in stream:
            piece.append(line)
            size += len(line)
            if size >= TEXT_PIECE_BYTES:
                yield b"".join(piece).decode("utf-8")
                piece, size = [], 0
    if piece:
        yield b"".join(piece).decode("utf-8")


def in_validation(split_key: bytes, fraction: float) -> bool:
    """The held-out share, by a hash of the document: the same text always lands in the same split."""
    if fraction <= 0:
        return False
    value = int.from_bytes(hashlib.blake2b(split_key, digest_size=8).digest(), "big")
    return value < fraction * 2**64


# --- the tokenizer ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenizerInfo:
    identity: str  # "bytes" or "sha256:<hex>" (trainer.data.manifest.tokenizer_identity)
    file: str  # what the manifest names: the file name, or "bytes"
    vocab_size: int
    eos_id: int

    @property
    def dtype(self) -> str:
        # Megatron's choice: uint16 while every id fits, else int32 (its dtype codes have no uint32).
        return "uint16" if self.vocab_size <= 1 << 16 else "int32"


Encoder = Callable[[list[str]], list[np.ndarray]]


def load_tokenizer(
    path: str, eos_token: str | None, shown: str | None = None
) -> tuple[TokenizerInfo, Encoder]:
    """`bytes`, or a local tokenizer.json read with the `tokenizers` library (nothing is downloaded)."""
    from trainer.data.manifest import tokenizer_identity

    if path == "bytes":
        info = TokenizerInfo("bytes", "bytes", BYTES_EOS + 1, BYTES_EOS)
        return info, lambda texts: [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
    shown = shown or path
    file = Path(path)
    if not file.is_file():
        raise TrainstackError(f"--tokenizer {shown}: not found (give a tokenizer.json file, or 'bytes')")
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as exc:  # the library raises a bare Exception for a file it cannot parse
        detail = " ".join(str(exc).split())[:160]
        raise TrainstackError(
            f"--tokenizer {shown}: not a tokenizer.json the tokenizers library reads ({detail})"
        ) from None
    candidates = [eos_token] if eos_token else list(EOS_CANDIDATES)
    eos_id = next((i for i in (tokenizer.token_to_id(t) for t in candidates) if i is not None), None)
    if eos_id is None:
        raise TrainstackError(f"--tokenizer {shown}: none of {candidates} is a token of it; pass --eos-token")
    info = TokenizerInfo(tokenizer_identity(file), Path(shown).name, tokenizer.get_vocab_size(True), eos_id)
    batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # no offsets: faster

    def encode(texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int64) for e in batch(texts, add_special_tokens=False)]

    return info, encode
