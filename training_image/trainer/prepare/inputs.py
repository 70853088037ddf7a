"""The inputs of `trainer.prepare`: which files, their records, and the tokenizer that encodes them.

Formats, by file name (a trailing `.gz` is read through gzip):

- **JSONL** (`.jsonl`, `.ndjson`, `.json`): one JSON object per line; the document is its `--text-field`.
- **Parquet** (`.parquet`): the document is the `--text-field` column, read one record batch at a time.
- **plain text** (`.txt`, `.md`, `.text`, `.rst`, and any file named explicitly with another ending):
  the whole file is one document, tokenized in pieces cut at line breaks (at most TEXT_PIECE_BYTES each).

Nothing is held in memory whole: JSONL is read line by line, Parquet batch by batch, text piece by piece,
and any document longer than TEXT_PIECE_BYTES is tokenized in pieces (memory per worker: one batch of
documents, their token ids and the shard writer's buffer; bench/data_prepare.py measures it). The
`tokenizers` library needs about 100 bytes of memory per byte of ONE text it encodes (alignments and
token strings of the whole text at once: measured 470 MB for a 4 MiB text), so a long document is cut
into pieces of at most TEXT_PIECE_BYTES (256 KiB: ~25 MB of it) at a line break followed by a non-space
(else a space, else anywhere), each encoded on its own: for byte-level BPE tokenizers (GPT-2's, Llama
3's pre-tokenizer) the ids are those of the whole text; for others they can differ where a piece ends.

One JSONL line (one record) is read whole, so it is bounded: a line longer than MAX_RECORD_BYTES is a bad
record (skipped and counted, its end found in bounded reads). The bound is what a worker can hold three
times over (the line, its parsed text, that text's UTF-8 for the validation hash) beside the tokenizer's
~100 MB for a piece, on the 2 GiB per core the smallest Processing instances give: 64 MiB of text is
about 16M tokens, thousands of training windows; a longer line is almost always a broken export.

Bad records: a line that is not UTF-8, not a JSON object, nested deeper than the JSON parser allows, or
longer than MAX_RECORD_BYTES (for text, a file that is not UTF-8: it is one document) is skipped and
counted; more than `max_bad_records` in one file stops with one line naming the file and the first bad
line. A record without the text field stops at once (one line naming the file, line and the fields the
record has): a wrong `--text-field` is not a bad record. Empty or null texts are skipped. A damaged
file (a truncated or corrupt `.gz`, a `.gz` that is not gzip, a file that cannot be read) stops with one
line naming it and where: it is not one record, and nothing of it is kept (no marker, no shard).
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING

from trainstack.errors import TrainstackError

if TYPE_CHECKING:
    import numpy as np

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
TEXT_PIECE_BYTES = 256 << 10  # ~25 MB of the tokenizer's working memory per piece (module doc)
SPLIT_KEY_BYTES = 1 << 20  # what a text file's validation hash reads (its first MiB; a dataset's split)
MAX_RECORD_BYTES = 64 << 20  # one JSONL line or Parquet value (see the module doc for why)
READ_BYTES = 1 << 20  # what one bounded read takes when skipping the rest of an over-long line
BATCH_DOCUMENTS = 256
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
    split_key: bytes | None  # what the validation split hashes; None: the text's UTF-8 (computed only
    # when a split is asked for: a copy of every text otherwise held for nothing)
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
                f"{name}: {self.bad} bad records (not UTF-8, not JSON objects, too deep or too long), more "
                f"than --max-bad-records {limit} (first: {self.first_bad})"
            )


def _open_binary(path: Path):
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")


class _Damaged:
    """Turns what reading a damaged file raises into one line naming it and where it broke."""

    def __init__(self, name: str, where: str = ""):
        self.name, self.where = name, where

    def __enter__(self) -> _Damaged:
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is None or isinstance(exc, TrainstackError):
            return False
        at = f" ({self.where})" if self.where else ""
        if isinstance(exc, gzip.BadGzipFile):
            raise TrainstackError(f"{self.name}: not a gzip file{at}: {exc}") from None
        if isinstance(exc, EOFError):
            raise TrainstackError(
                f"{self.name}: the gzip stream ends early{at} (a truncated or partly copied file)"
            ) from None
        if isinstance(exc, zlib.error):
            raise TrainstackError(f"{self.name}: corrupt gzip data{at}: {exc}") from None
        if isinstance(exc, OSError):
            raise TrainstackError(f"{self.name}: cannot be read{at}: {exc.strerror or exc}") from None
        return False


def _lines(
    stream, counts: RecordCounts, max_bad: int, name: str, damaged: _Damaged
) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of a binary stream, each read in at most MAX_RECORD_BYTES + 1 bytes: a longer
    line is a bad record, its rest skipped in bounded reads (memory never holds more than the bound)."""
    number = 0
    while True:
        damaged.where = f"line {number + 1}"
        raw = stream.readline(MAX_RECORD_BYTES + 1)
        if not raw:
            return
        number += 1
        if len(raw) > MAX_RECORD_BYTES and not raw.endswith(b"\n"):
            skipped = len(raw)
            del raw
            while (rest := stream.readline(READ_BYTES)) and not rest.endswith(b"\n"):
                skipped += len(rest)
            counts.bad_record(
                f"line {number}: a record of more than {MAX_RECORD_BYTES >> 20} MiB "
                f"({skipped + len(rest):,} bytes; the bound of one record)",
                max_bad,
                name,
            )
            continue
        yield number, raw


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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
    with _Damaged(name) as damaged, _open_binary(path) as stream:
        for number, raw in _lines(stream, counts, max_bad, name, damaged):
            if not raw.strip():
                continue
            try:
                # A byte-order mark opens some exported files: it is not part of the first record.
                record = json.loads(raw.decode("utf-8-sig" if number == 1 else "utf-8"))
            except UnicodeDecodeError as exc:
                counts.bad_record(
                    f"line {number}: not UTF-8 (byte {exc.start + 1} of the line)", max_bad, name
                )
                continue
            except json.JSONDecodeError:
                counts.bad_record(f"line {number}: not JSON", max_bad, name)
                continue
            except RecursionError:  # json's C parser recurses once per level of nesting
                counts.bad_record(f"line {number}: nested deeper than the JSON parser allows", max_bad, name)
                continue
            if not isinstance(record, dict):
                counts.bad_record(f"line {number}: not a JSON object", max_bad, name)
                continue
            if field not in record:
                fields = ", ".join(sorted(record)[:8]) or "none"
                raise TrainstackError(
                    f"{name}: line {number}: no field {field!r} (the record has: {fields}); pass --text-field"
                )
            text = record.pop(field)
            del record
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
            if b"\\u" in raw and not _encodable(text):  # only a JSON escape can make a lone surrogate
                counts.bad_record(
                    f"line {number}: field {field!r} holds a lone surrogate (a \\ud800-\\udfff escape): "
                    "not text UTF-8 can hold",
                    max_bad,
                    name,
                )
                continue
            yield Document(text, None)


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
    damaged = _Damaged(name)
    batches = table.iter_batches(batch_size=BATCH_DOCUMENTS, columns=[field])
    while True:
        damaged.where = f"the record batch after row {row}"
        try:
            with damaged:
                batch = next(batches)
        except StopIteration:
            return
        except Exception as exc:  # pyarrow's ArrowInvalid / OSError for a corrupt page
            if isinstance(exc, TrainstackError):
                raise
            detail = " ".join(str(exc).split())[:200]
            raise TrainstackError(f"{name}: a corrupt Parquet page after row {row} ({detail})") from None
        for value in batch.column(0).to_pylist():
            row += 1
            if isinstance(value, str | bytes) and len(value) > MAX_RECORD_BYTES:
                counts.bad_record(
                    f"row {row}: a record of more than {MAX_RECORD_BYTES >> 20} MiB (the bound of a record)",
                    max_bad,
                    name,
                )
                continue
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
            yield Document(value, None)


def _text(path: Path, name: str, counts: RecordCounts, max_bad: int) -> Iterator[Document]:
    # First pass: is the whole file UTF-8? (A document is all or nothing; its tokens are written as
    # they come in the second pass.) The split is decided by the first SPLIT_KEY_BYTES.
    decoder = codecs.getincrementaldecoder("utf-8")()
    head = b""
    offset = 0
    with _Damaged(name, "reading it") as damaged, _open_binary(path) as stream:
        try:
            while block := stream.read(READ_BYTES):
                damaged.where = f"after byte {offset:,}"
                head = head or block
                decoder.decode(block)
                offset += len(block)
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as exc:
            # A text file is one document: one bad record, named (and the byte where it breaks).
            at = offset - len(decoder.getstate()[0]) + exc.start
            counts.bad_record(f"byte {at + 1:,}: not UTF-8 (the whole file is one document)", max_bad, name)
            return
    if not head.strip():
        counts.empty += 1
        return
    yield Document(None, head[:SPLIT_KEY_BYTES], pieces=_text_pieces(path, name))


def _text_pieces(path: Path, name: str) -> Iterator[str]:
    """The file's text in pieces of at most TEXT_PIECE_BYTES characters (`cut_pieces`), read in blocks."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    pending = ""
    with _Damaged(name, "reading it"), _open_binary(path) as stream:
        while block := stream.read(TEXT_PIECE_BYTES):
            pending += decoder.decode(block)
            while len(pending) > TEXT_PIECE_BYTES:
                cut = _cut(pending)
                yield pending[:cut]
                pending = pending[cut:]
        pending += decoder.decode(b"", final=True)
    yield from cut_pieces(pending)


def _cut(text: str) -> int:
    """Where the first piece of `text` (longer than TEXT_PIECE_BYTES) ends, within its first
    TEXT_PIECE_BYTES characters, at the last place where the pre-tokenizers of the byte-level BPE family
    (GPT-2's regex, Llama 3's) split the same way in the pieces as in the whole text, so the pieces' ids
    are the whole text's:

    1. after a line break between two non-spaces (no pre-token joins it to what follows; a run of white
       space at a piece's end would be one pre-token where the whole text has two);
    2. else before a single space between a non-space and a letter (the space opens the next word's
       pre-token in both; Python's topics.py has 700 KB of indented lines and no place 1);
    3. else after the last line break, the last space, or at the limit (ids may differ there).
    """
    end = TEXT_PIECE_BYTES
    while (at := text.rfind("\n", 0, end)) > 0:
        if not text[at - 1].isspace() and not text[at + 1].isspace():
            return at + 1
        end = at
    end = TEXT_PIECE_BYTES
    while (at := text.rfind(" ", 0, end)) > 0:
        if not text[at - 1].isspace() and text[at + 1].isalpha():
            return at
        end = at
    for separator in ("\n", " "):
        at = text.rfind(separator, 0, TEXT_PIECE_BYTES)
        if at > 0:
            return at + 1
    return TEXT_PIECE_BYTES


def cut_pieces(text: str) -> Iterator[str]:
    """`text` in pieces of at most TEXT_PIECE_BYTES characters, each tokenized on its own (the module doc
    says why); a text within the limit is one piece, itself."""
    while len(text) > TEXT_PIECE_BYTES:
        cut = _cut(text)
        yield text[:cut]
        text = text[cut:]
    if text:
        yield text


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


class Encoder:
    """Token ids of texts: `pieces` for the parts of one long document, `documents` for a batch of whole
    ones, returned as the shard writer takes them (one array in the shard's dtype, each document's ids
    followed by the end-of-document id, and each one's length with it). One conversion per batch, not
    one per document: per-document numpy calls were a tenth of the worker's time on short documents."""

    def __init__(self, tokenizer, eos_id: int):
        self.eos = eos_id
        # encode_batch_fast: no offsets (faster); older libraries have only encode_batch.
        self._batch = (
            None if tokenizer is None else getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        )

    def pieces(self, texts: list[str]) -> list[np.ndarray]:
        import numpy as np  # here, not at the top: a preparation's parent lists inputs but encodes none

        if self._batch is None:  # the byte-level tokenizer: ids are the UTF-8 bytes
            return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
        return [np.asarray(e.ids, dtype=np.int64) for e in self._batch(texts, add_special_tokens=False)]

    def documents(self, texts: list[str], dtype: str) -> tuple[np.ndarray, np.ndarray]:
        import numpy as np

        eos = self.eos
        if self._batch is None:
            parts = [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
            lengths = np.fromiter((p.size + 1 for p in parts), dtype=np.int64, count=len(parts))
            flat = np.empty(int(lengths.sum()), dtype=dtype)
            ends = np.cumsum(lengths)
            flat[ends - 1] = eos
            for part, end in zip(parts, ends.tolist(), strict=True):
                flat[end - 1 - part.size : end - 1] = part
            return flat, lengths
        encoded = [e.ids for e in self._batch(texts, add_special_tokens=False)]
        lengths = np.fromiter((len(ids) + 1 for ids in encoded), dtype=np.int64, count=len(encoded))
        # One pass from the ids' lists into the array (measured: half the time of growing one list and
        # converting it, on par with one np.array per document).
        flat = np.fromiter(
            chain.from_iterable(chain(ids, (eos,)) for ids in encoded), dtype=dtype, count=int(lengths.sum())
        )
        return flat, lengths


def load_tokenizer(
    path: str, eos_token: str | None, shown: str | None = None
) -> tuple[TokenizerInfo, Encoder]:
    """`bytes`, or a local tokenizer.json read with the `tokenizers` library (nothing is downloaded)."""
    from trainer.data.manifest import tokenizer_identity

    if path == "bytes":
        return TokenizerInfo("bytes", "bytes", BYTES_EOS + 1, BYTES_EOS), Encoder(None, BYTES_EOS)
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
    return info, Encoder(tokenizer, eos_id)
