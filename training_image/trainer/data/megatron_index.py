"""Megatron's indexed-dataset index (`<prefix>.idx` beside `<prefix>.bin`): read and write.

The layout Megatron-LM, Megatron-Bridge, datatrove and NeMo Curator share (megatron-core,
megatron/core/datasets/indexed_dataset.py, `_IndexWriter` / `_IndexReader`), all little-endian:

    b"MMIDIDX\\x00\\x00"              9-byte magic
    <Q  version                      always 1
    <B  dtype code                   1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32,
                                     8 uint16
    <Q  sequence count S
    <Q  document count D             entries in the document index (D - 1 documents: it starts with 0)
    int32[S]  sequence lengths       tokens per sequence
    int64[S]  sequence pointers      byte offset of each sequence in the .bin
    int64[D]  document index         0, then one past the last sequence of each document
    (int8[S]  sequence modes         multimodal datasets only; not read here)

`<prefix>.bin` holds the token ids of every sequence back to back in that dtype. trainstack writes one
sequence per document (the document's tokens and its end-of-document id), so the document index is
0, 1, ..., S.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainstack.errors import TrainstackError

if TYPE_CHECKING:
    import numpy as np

# numpy is imported where an index is read or written, not here: the data-preparation job's parent
# process imports this module (through the shard index's file names) and never touches an index.
MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {
    1: "uint8",
    2: "int8",
    3: "int16",
    4: "int32",
    5: "int64",
    6: "float64",
    7: "float32",
    8: "uint16",
}
CODE_OF = {name: code for code, name in DTYPE_CODES.items()}
TOKEN_DTYPES = ("uint8", "int8", "int16", "int32", "int64", "uint16")  # integer ids only
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8


def is_megatron_index(path: Path) -> bool:
    """Whether `path` starts with Megatron's index magic (what tells such a dataset apart)."""
    try:
        with open(path, "rb") as stream:
            return stream.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def index_bytes(dtype: str, sequence_lengths: Sequence[int] | np.ndarray) -> bytes:
    """The .idx of one document per sequence, for a .bin of `dtype` token ids."""
    import numpy as np

    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        pointers[1:] = np.cumsum(lengths[:-1], dtype=np.int64) * itemsize
    documents = np.arange(len(lengths) + 1, dtype=np.int64)
    header = MAGIC + struct.pack("<Q", VERSION) + struct.pack("<B", CODE_OF[np.dtype(dtype).name])
    counts = struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(documents))
    return header + counts + lengths.tobytes() + pointers.tobytes() + documents.tobytes()


@dataclass(frozen=True)
class MegatronIndex:
    path: Path
    dtype: str
    sequences: int
    documents: int  # documents (the document index's entries less its leading 0)
    tokens: int  # sum of the sequence lengths: what the .bin must hold


def read_index(path: Path) -> MegatronIndex:
    """The header and token count of a Megatron .idx; one line naming the file for anything malformed."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as stream:
            head = stream.read(HEADER_BYTES)
    except OSError as exc:
        raise TrainstackError(f"{path}: cannot read the Megatron index ({exc.strerror})") from None
    if len(head) < HEADER_BYTES or head[: len(MAGIC)] != MAGIC:
        raise TrainstackError(f"{path}: not a Megatron indexed-dataset index (no MMIDIDX header)")
    (version,) = struct.unpack_from("<Q", head, len(MAGIC))
    (code,) = struct.unpack_from("<B", head, len(MAGIC) + 8)
    sequences, entries = struct.unpack_from("<QQ", head, len(MAGIC) + 9)
    if version != VERSION:
        raise TrainstackError(f"{path}: Megatron index version {version}, expected {VERSION}")
    if DTYPE_CODES.get(code) not in TOKEN_DTYPES:
        raise TrainstackError(f"{path}: dtype code {code} is not an integer token type {TOKEN_DTYPES}")
    needed = HEADER_BYTES + sequences * (4 + 8) + entries * 8
    if size < needed:
        raise TrainstackError(
            f"{path}: {size} bytes, the header's {sequences} sequences and {entries} document entries need "
            f"{needed} (truncated copy?)"
        )
    import numpy as np

    lengths = np.memmap(path, dtype=np.int32, mode="r", offset=HEADER_BYTES, shape=(sequences,))
    if sequences and int(lengths.min()) < 0:
        raise TrainstackError(f"{path}: a negative sequence length (corrupt index)")
    tokens = int(lengths.sum(dtype=np.int64))
    del lengths
    return MegatronIndex(path, DTYPE_CODES[code], sequences, max(entries - 1, 0), tokens)
