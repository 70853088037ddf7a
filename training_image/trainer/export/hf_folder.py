"""`python -m trainer.export`: a run's checkpoint as a Hugging Face folder (docs/models.md).

    python -m trainer.export --checkpoint DIR|s3://... [--step N] --out DIR|s3://... [--recipe R]

Writes what transformers' `from_pretrained` and vLLM read: `model-0000i-of-0000N.safetensors` with
`model.safetensors.index.json`, `config.json` (architecture, model_type, token ids; the base model's
own config carried over when the run started from one), `generation_config.json`, the tokenizer files
(`--tokenizer`, else the recipe's `export.tokenizer`, else the base model's), and `export.json` last
(what was exported, from where): a folder without it is unfinished. Weights are BF16 unless told
otherwise; Transformer Engine's `_extra_state` and the optimizer state are not exported.

Speed and memory: each of our parameters is read once from the checkpoint's files (CheckpointTensors:
the byte ranges DCP's metadata names; a local file's page-cache pages mapped, not copied; one ranged
GET per saved chunk on S3), split into the Hugging Face tensors it holds (Q/K/V, gate/up), cast in
blocks of WRITE_CHUNK_BYTES and written behind a safetensors header computed before any tensor is
read, a writer thread writing one block while the next is cast. No output file is held whole: peak
host memory is about the largest FP32 parameter plus two blocks (bench/hf_export_import.py measures it
beside `safetensors.save_file` and a naive whole-model export). With an s3:// --out each file is
uploaded while the next is written and removed once uploaded, so local disk holds two files at most.

Exit codes: 0 written; 2 a mistake in the input (no complete checkpoint, a recipe that does not match
it, a bad location), one line naming it.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import mmap
import shutil
import struct
import sys
import tempfile
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex

from trainer.checkpoint.manager import complete_steps, storage_completeness_problem
from trainer.config import load_recipe
from trainer.export.chat_model import chat_end_of_turn, export_generation_config
from trainer.hf.conversion import Piece, parameter_shapes, pieces
from trainer.hf.files import Folder, open_folder, tokenizer_files
from trainer.storage import open_storage, step_dir_name
from trainstack.errors import TrainstackError
from trainstack.recipes.hf_config import hf_config_from_shape
from trainstack.recipes.schema import Recipe

log = logging.getLogger("trainer.export")
DTYPES = {"bf16": (torch.bfloat16, "bfloat16"), "fp32": (torch.float32, "float32")}
INDEX = "model.safetensors.index.json"
RECORD = "export.json"  # written last: the folder is complete
DEFAULT_MAX_SHARD_GB = 2.0


@dataclass(frozen=True)
class ExportResult:
    checkpoint: str
    step: int
    out: str
    dtype: str
    files: int
    tensors: int
    bytes_written: int  # safetensors payload
    bytes_read: int  # FP32 tensors read from the checkpoint
    seconds: float
    tokenizer: str | None
    recipe: str
    run: str | None


def plan_files(hf_pieces: list[Piece], itemsize: int, max_bytes: float) -> list[list[Piece]]:
    """Consecutive pieces grouped into files of at most `max_bytes` (a larger tensor gets its own)."""
    files: list[list[Piece]] = [[]]
    size = 0
    for piece in hf_pieces:
        nbytes = itemsize * _numel(piece.shape)
        if files[-1] and size + nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(piece)
        size += nbytes
    return files


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32"}
# Cast and written in pieces of this size (the output buffers are no bigger). Small enough that a block
# the cast just wrote is still in the cache when the writer thread copies it into the page cache (the
# 0.4B export, 10 runs each on the idle 2-core machine: 64 MiB 0.65-1.06 s, 4 MiB 0.49-0.84 s; both the
# cast and the write are memory-bound there: docs/benchmarks.md, "Export on the idle machine").
WRITE_CHUNK_BYTES = 4 * 2**20


def _write_file(path: Path, group: list[Piece], source: CheckpointTensors, dtype: torch.dtype) -> int:
    """One output file: its header, then each piece's rows from the parameter holding them (read once
    for all its pieces: Q/K/V and gate/up are row blocks of one parameter). Written to `.tmp`, then
    renamed. Returns the payload's bytes."""
    last_use = {piece.ours: i for i, piece in enumerate(group)}
    loaded: dict[str, list[tuple[int, torch.Tensor]]] = {}
    tmp = path.with_name(path.name + ".tmp")
    writer = _FileWriter(tmp, dtype)
    try:
        writer.header(safetensors_header([(piece.hf, dtype, piece.shape) for piece in group]))
        for i, piece in enumerate(group):
            if piece.ours not in loaded:
                loaded[piece.ours] = source.load(f"model.{piece.ours}")
            _write_piece(writer, piece, loaded[piece.ours])
            if last_use[piece.ours] == i:  # a parameter split across files is read again by the next one
                source.release(loaded.pop(piece.ours))
    finally:
        writer.close()
    tmp.replace(path)
    return sum(dtype.itemsize * _numel(piece.shape) for piece in group)


def _write_piece(writer: _FileWriter, piece: Piece, blocks: list[tuple[int, torch.Tensor]]) -> None:
    """The rows of `piece` from the blocks (one per saving rank) that hold them."""
    for first, block in blocks:
        lo = max(piece.start, first)
        hi = min(piece.start + piece.shape[0], first + block.shape[0])
        if hi > lo:
            writer.rows(block[lo - first : hi - first])


class CheckpointTensors:
    """Our FP32 parameters straight from a DCP checkpoint's files, one parameter at a time.

    DCP keeps each tensor chunk (one per saving rank: FSDP shards rows) as a `torch.save` archive at a
    byte range of a `.distcp` file, named in the checkpoint's metadata. A chunk is read in one request
    (local file or one ranged S3 GET) into a buffer of its own size; its archive's table of contents is
    parsed in place (the tensor's shape and strides from a meta-device load, the data record's offset),
    and the tensor is a view of that buffer: no second copy, no load planning per tensor. Anything
    else (a transformed chunk, a chunk that is not a block of whole rows, an archive of another form)
    is read through `dcp.load` instead.
    """

    def __init__(self, storage, step: int):
        self.storage, self.step = storage, step
        self.reader = storage.reader(step)
        self.metadata = self.reader.read_metadata()
        self.bytes_read = 0
        self._streams: dict[str, Any] = {}
        self._free: list[memoryview] = []  # buffers of written parameters, reused
        self._lent: dict[int, Any] = {}
        self._unmap: list[mmap.mmap] = []

    def load(self, name: str) -> list[tuple[int, torch.Tensor]]:
        """Parameter `name` ("model." + ours) as (first row, rows) blocks covering it, in row order."""
        stored = self.metadata.state_dict_metadata[name]
        blocks = []
        for chunk in sorted(stored.chunks, key=lambda c: c.offsets[0]):
            tensor = self._read_chunk(name, stored, chunk)
            if tensor is None:
                self.release(blocks)
                return [(0, self._dcp_load(name, tuple(stored.size)))]
            blocks.append((int(chunk.offsets[0]), tensor))
        return blocks

    def _read_chunk(self, name: str, stored, chunk) -> torch.Tensor | None:
        whole_rows = all(o == 0 for o in chunk.offsets[1:]) and tuple(chunk.sizes[1:]) == tuple(
            stored.size[1:]
        )
        info = self.metadata.storage_data[MetadataIndex(name, chunk.offsets)]
        if not whole_rows or info.transform_descriptors or stored.properties.dtype != torch.float32:
            return None
        stream = self._stream(info.relative_path)
        mapped = _map_range(stream, info.offset, info.length)
        if mapped is not None:  # a local file: its page-cache pages, no copy
            base, buffer = mapped
        else:
            base = self._buffer(info.length)
            buffer = base[: info.length]
            _read_range(
                stream, info.offset, buffer, f"{self.storage.checkpoint_id(self.step)}{info.relative_path}"
            )
        tensor = _archived_tensor(buffer, tuple(chunk.sizes))
        if tensor is None:
            self._give_back(base)
            return None
        self.bytes_read += tensor.numel() * 4
        self._lent[id(tensor)] = base
        return tensor

    def _give_back(self, base) -> None:
        if isinstance(base, mmap.mmap):
            self._unmap.append(base)  # closed once no tensor views it (close() sweeps what is left)
        else:
            self._free.append(base)

    def _buffer(self, nbytes: int) -> memoryview:
        """A buffer for one chunk: a released one when one is large enough (memory the process already
        touched costs no page faults; a fresh one costs one per page), else a new one."""
        fits = [b for b in self._free if len(b) >= nbytes]
        if fits:
            best = min(fits, key=len)
            self._free.remove(best)
            return best
        if self._free:  # too small for what is coming: give it back to the system
            self._free.remove(min(self._free, key=len))
        return memoryview(torch.empty(nbytes, dtype=torch.uint8).numpy()).cast("B")

    def release(self, blocks: list[tuple[int, torch.Tensor]]) -> None:
        """The blocks of a parameter are written: their buffers serve the next reads."""
        for _, block in blocks:
            buffer = self._lent.pop(id(block), None)
            if buffer is not None:
                self._give_back(buffer)
        blocks.clear()  # the views go before their mappings are closed
        self._close_maps()

    def _close_maps(self) -> None:
        still = []
        for mapping in self._unmap:
            try:
                mapping.close()
            except BufferError:  # a view of it is still alive somewhere: later
                still.append(mapping)
        self._unmap = still

    def _stream(self, relative_path: str):
        if relative_path not in self._streams:
            self._streams[relative_path] = self.storage.open_ranges(self.step, relative_path)
        return self._streams[relative_path]

    def _dcp_load(self, name: str, size: tuple[int, ...]) -> torch.Tensor:
        self.reader.read_metadata = lambda *args, **kwargs: self.metadata  # every dcp.load asks again
        tensors = {name: torch.empty(size, dtype=torch.float32)}
        with warnings.catch_warnings():  # one process, no process group: DCP warns that it assumes so
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(tensors, storage_reader=self.reader, no_dist=True)
        self.bytes_read += tensors[name].numel() * 4
        return tensors[name]

    def close(self) -> None:
        self._lent = {}
        self._close_maps()
        for stream in self._streams.values():
            stream.close()
        self._streams = {}


def _map_range(stream, offset: int, length: int) -> tuple[mmap.mmap, memoryview] | None:
    """Bytes [offset, offset + length) of a local file mapped read-only into memory (the page cache's
    own pages: reading them costs no copy; mapped up front, MAP_POPULATE, rather than one page fault at a
    time), or None for a stream that is not a local file (S3)."""
    try:
        fileno = stream.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    mapping = mmap.mmap(
        fileno,
        length + offset - start,
        flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
        prot=mmap.PROT_READ,
        offset=start,
    )
    return mapping, memoryview(mapping)[offset - start : offset - start + length]


def _read_range(stream, offset: int, buffer: memoryview, where: str) -> None:
    stream.seek(offset)
    done = 0
    while done < len(buffer):
        n = stream.readinto(buffer[done:])
        if not n:
            raise TrainstackError(f"{where}: ends inside a tensor (a damaged checkpoint)")
        done += n


class _BufferFile(io.RawIOBase):
    """A read-only file over a buffer without copying it (io.BytesIO copies a bytearray)."""

    def __init__(self, buffer) -> None:
        self._view, self._at = memoryview(buffer), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self._at = offset + (0, self._at, len(self._view))[whence]
        return self._at

    def tell(self) -> int:
        return self._at

    def readinto(self, target) -> int:
        n = max(0, min(len(target), len(self._view) - self._at))
        target[:n] = self._view[self._at : self._at + n]
        self._at += n
        return n


_META_BY_PICKLE: dict[bytes, Any] = {}


def _archived_tensor(buffer: bytearray, size: tuple[int, ...]) -> torch.Tensor | None:
    """The FP32 tensor a `torch.save` archive in `buffer` holds, as a view of the buffer; None when the
    archive is not one little-endian FP32 storage of the expected size."""
    try:
        archive = torch._C.PyTorchFileReader(_BufferFile(buffer))
        names = archive.get_all_records()
        records = [r for r in names if r.startswith("data/") or "/data/" in r]
        byteorder = next((r for r in names if r.endswith("byteorder")), None)
        pickle = next((r for r in names if r.endswith("data.pkl")), None)
        if len(records) != 1 or pickle is None:
            return None
        if byteorder and bytes(archive.get_record(byteorder)) != b"little":
            return None
        # The tensor's shape, strides and offset without its data: the archive's pickle, loaded on the meta
        # device; the same pickle (every layer's tensor of one shape) is loaded once.
        key = bytes(archive.get_record(pickle))
        meta = _META_BY_PICKLE.get(key)
        if meta is None:
            meta = torch.load(_BufferFile(buffer), map_location="meta", weights_only=True)
            if len(_META_BY_PICKLE) < 4096:
                _META_BY_PICKLE[key] = meta
    except Exception:  # not the form DCP writes today: dcp.load reads it
        return None
    nbytes = archive.get_record_size(records[0])
    if (
        not isinstance(meta, torch.Tensor)
        or meta.dtype != torch.float32
        or tuple(meta.shape) != size
        or meta.untyped_storage().nbytes() != nbytes
    ):
        return None
    with warnings.catch_warnings():  # a read-only mapping: the tensor is only ever read
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        storage = torch.frombuffer(
            buffer, dtype=torch.float32, offset=archive.get_record_offset(records[0]), count=nbytes // 4
        )
    return storage.as_strided(meta.shape, meta.stride(), meta.storage_offset())


def safetensors_header(entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> bytes:
    """A safetensors file's first bytes: the little-endian u64 header size, then the JSON header
    (name -> dtype, shape, data_offsets; tensors stored back to back in the order given), padded with
    spaces to 8 bytes as safetensors itself does."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for name, dtype, shape in entries:
        nbytes = dtype.itemsize * _numel(shape)
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [at, at + nbytes],
        }
        at += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class _FileWriter:
    """One safetensors file written front to back: the header first (every size is known before any
    tensor is read), then each tensor cast into one of two reused buffers of WRITE_CHUNK_BYTES, which a
    writer thread writes while the next block is cast into the other (the cast and the write overlap;
    both release the GIL). A tensor already in the output dtype is written from where it lies."""

    def __init__(self, path: Path, dtype: torch.dtype):
        self.dtype = dtype
        self.file = open(path, "wb", buffering=0)  # noqa: SIM115 (closed by close())
        self.buffers = [torch.empty(WRITE_CHUNK_BYTES // dtype.itemsize, dtype=dtype) for _ in range(2)]
        self.writes: list[Future | None] = [None, None]  # the write in flight from each buffer
        self.turn = 0
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="export-writer")

    def header(self, data: bytes) -> None:
        self._write(memoryview(data))

    def rows(self, source: torch.Tensor) -> None:
        """Write `source` (rows of an FP32 tensor) in the output dtype."""
        if source.dtype == self.dtype and source.is_contiguous():
            self._wait()
            self._write(_bytes_of(source))
            return
        per_row = max(1, _numel(tuple(source.shape[1:])))
        step = max(1, self.buffers[0].numel() // per_row)
        for first in range(0, source.shape[0], step):
            block = source[first : first + step]
            if (pending := self.writes[self.turn]) is not None:
                pending.result()  # this buffer's previous write is done (or raises)
            out = self.buffers[self.turn][: block.numel()].view(block.shape)
            out.copy_(block)
            self.writes[self.turn] = self.thread.submit(self._write, _bytes_of(out))
            self.turn ^= 1

    def _wait(self) -> None:
        for i, pending in enumerate(self.writes):
            if pending is not None:
                self.writes[i] = None
                pending.result()

    def _write(self, data: memoryview) -> None:
        while data:
            data = data[self.file.write(data) :]

    def close(self) -> None:
        try:
            self._wait()
        finally:
            self.thread.shutdown(wait=True)
            self.file.close()


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B") if tensor.numel() else memoryview(b"")


def check_checkpoint(metadata, recipe: Recipe, where: str) -> None:
    """Every parameter of the recipe's shape in the checkpoint, with its shape (one line otherwise)."""
    stored = metadata.state_dict_metadata
    for name, shape in parameter_shapes(recipe.model).items():
        key = f"model.{name}"
        if key not in stored:
            raise TrainstackError(f"{where}: {key} is not in the checkpoint (is --recipe the run's recipe?)")
        if tuple(stored[key].size) != shape:
            raise TrainstackError(
                f"{where}: {key} has shape {list(stored[key].size)}, recipe {recipe.name}'s model needs "
                f"{list(shape)} (is --recipe the run's recipe?)"
            )


def choose_step(storage, step: int | None) -> int:
    if step is None:
        found = complete_steps(storage)
        if not found:
            raise TrainstackError(f"--checkpoint {storage.location}: no complete checkpoint there")
        return found[0]
    problem = storage_completeness_problem(storage, step)
    if problem is not None:
        raise TrainstackError(
            f"--step {step}: {storage.location.rstrip('/')}/{step_dir_name(step)}: {problem}"
        )
    return step


def _base_config(recipe: Recipe) -> tuple[dict | None, Folder | None]:
    if not recipe.model.init_from:
        return None, None
    folder = open_folder(recipe.model.init_from, "model.init_from")
    try:
        raw = folder.read("config.json")
    except Exception as exc:  # the export still has a config of its own; say so
        log.warning(
            "base model config unreadable (%s: %s): writing a config from the recipe", type(exc).__name__, exc
        )
        return None, folder
    return (json.loads(raw) if raw else None), folder


def export(
    recipe: Recipe,
    checkpoint: str,
    out: str,
    step: int | None = None,
    dtype: str = "bf16",
    tokenizer: str | None = None,
    max_shard_gb: float = DEFAULT_MAX_SHARD_GB,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> ExportResult:
    threads = torch.get_num_threads()
    # The cast on one intra-op thread, the writes on the writer thread: two cores busy, and no OpenMP
    # workers spinning between blocks (measured: a quarter fewer CPU-seconds than two cast threads for
    # the same wall time, bench/hf_export_import.py).
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            # One process, no process group: DCP says it assumes a single process on every load and save.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            return _export(
                recipe, checkpoint, out, step, dtype, tokenizer, max_shard_gb, bos_token_id, eos_token_id
            )
    finally:
        torch.set_num_threads(threads)


def _export(recipe, checkpoint, out, step, dtype, tokenizer, max_shard_gb, bos_token_id, eos_token_id):
    started = time.monotonic()
    storage = open_storage(checkpoint)
    step = choose_step(storage, step)
    where = f"{storage.location.rstrip('/')}/{step_dir_name(step)}"
    marker = json.loads(storage.read(step, "COMPLETE.json") or b"{}")
    source = CheckpointTensors(storage, step)
    check_checkpoint(source.metadata, recipe, where)
    target = open_folder(out, "--out")
    torch_dtype, dtype_name = DTYPES[dtype]
    hf_pieces = pieces(recipe.model)
    files = plan_files(hf_pieces, torch_dtype.itemsize, max_shard_gb * 1e9)
    staging = Path(tempfile.mkdtemp(prefix="trainstack-export-")) if target.is_s3 else target.root
    staging.mkdir(parents=True, exist_ok=True)
    weight_map, written = {}, 0
    # s3:// --out: file i is uploaded (and then removed) while file i + 1 is written: local disk holds
    # two files at most, and the upload's time hides behind the reading and casting.
    uploads = ThreadPoolExecutor(1, thread_name_prefix="export-upload") if target.is_s3 else None
    uploading: Future | None = None
    try:
        for index, group in enumerate(files, start=1):
            name = f"model-{index:05d}-of-{len(files):05d}.safetensors"
            written += _write_file(staging / name, group, source, torch_dtype)
            weight_map.update(dict.fromkeys((piece.hf for piece in group), name))
            if uploads is not None:
                if uploading is not None:
                    uploading.result()
                uploading = uploads.submit(_upload_and_remove, target, staging / name, name)
            log.info("wrote %s (%d of %d, %.2f GB so far)", name, index, len(files), written / 1e9)
        if uploading is not None:
            uploading.result()
    finally:
        source.close()
        if uploads is not None:
            uploads.shutdown(wait=True)
    target.write(INDEX, _json({"metadata": {"total_size": written}, "weight_map": weight_map}))

    base, base_folder = _base_config(recipe)
    config = hf_config_from_shape(
        recipe.model,
        base=base,
        max_position_embeddings=recipe.training.seq_len,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        dtype=dtype_name,
    )
    target.write("config.json", _json(config))
    tokenizer_dir = Path(tempfile.mkdtemp(prefix="trainstack-tokenizer-"))
    try:
        shipped = _copy_tokenizer(tokenizer or recipe.export.tokenizer, base_folder, target, tokenizer_dir)
        # A fine-tune stops at the end of its turn (trainer.export.chat_model): the end-of-turn token of
        # the shipped chat template joins generation_config.json's eos_token_id.
        turn_end = None
        if recipe.training.objective == "sft":
            found = chat_end_of_turn(tokenizer_dir if shipped else None, recipe.model.vocab, shipped)
            turn_end = found[0]
    finally:
        shutil.rmtree(tokenizer_dir, ignore_errors=True)
    generation = export_generation_config(config, _base_generation(base_folder), turn_end)
    target.write("generation_config.json", _json(generation))
    result = ExportResult(
        checkpoint=storage.location,
        step=step,
        out=target.location,
        dtype=dtype_name,
        files=len(files),
        tensors=len(hf_pieces),
        bytes_written=written,
        bytes_read=source.bytes_read,
        seconds=time.monotonic() - started,
        tokenizer=shipped,
        recipe=recipe.name,
        run=marker.get("run"),
    )
    target.write(RECORD, _json(asdict(result)))
    return result


def _upload_and_remove(target: Folder, local: Path, name: str) -> None:
    target.upload(local, name)
    local.unlink()


def _base_generation(base: Folder | None) -> dict | None:
    """The base folder's generation_config.json (its sampling defaults and token ids), if it has one."""
    if base is None:
        return None
    try:
        raw = base.read("generation_config.json")
        found = json.loads(raw) if raw else None
    except Exception as exc:  # the export writes token ids of its own; say so
        log.warning(
            "base generation_config.json unreadable (%s: %s): written from the config",
            type(exc).__name__,
            exc,
        )
        return None
    return found if isinstance(found, dict) else None


def _copy_tokenizer(location: str | None, base: Folder | None, target: Folder, keep: Path) -> str | None:
    """Copy the tokenizer files from `location`, else from the base model's folder, a copy of each
    left in `keep` (the chat template is read from it); their source."""
    candidates = [open_folder(location, "--tokenizer")] if location else []
    if base is not None:
        candidates.append(base)
    for folder in candidates:
        names = tokenizer_files(folder)
        if not names:
            if location and folder.location == location:
                raise TrainstackError(
                    f"--tokenizer {location}: no tokenizer files there (tokenizer.json, ...)"
                )
            continue
        for name in names:
            folder.download(name, keep / name)
            target.upload(keep / name, name)
        return folder.location
    log.warning(
        "no tokenizer files shipped: pass --tokenizer (or set export.tokenizer) so the folder loads with "
        "AutoTokenizer; the weights and config are complete"
    )
    return None


def _json(value) -> bytes:
    return (json.dumps(value, indent=2) + "\n").encode()


EPILOG = """\
examples:
  python -m trainer.export --recipe tests/trainer/fixtures/tiny.yaml --checkpoint ck --out hf-model
  AWS_REGION=us-west-2 python -m trainer.export --checkpoint s3://bucket/checkpoints/platform/8b-fp8/main/ \\
      --step 38000 --out s3://bucket/exports/platform/8b-fp8/main/step-38000/

exit codes: 0 written; 2 a mistake in the input (one line names it)
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.export",
        description="Write a Hugging Face folder (safetensors, config, tokenizer) from a trainer checkpoint.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
    parser.add_argument(
        "--checkpoint", required=True, metavar="DIR_OR_S3_URI", help="the run's checkpoint location"
    )
    parser.add_argument(
        "--step", type=int, help="the checkpoint to export (default, or 0: the newest complete one)"
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", metavar="DIR_OR_S3_URI", help="where the folder goes")
    where.add_argument(
        "--out-parent",
        metavar="DIR_OR_S3_URI",
        help="write the folder to PARENT/step-N/, N the step exported (the export job's form)",
    )
    parser.add_argument(
        "--recipe",
        help="the run's recipe (YAML, name or JSON); default /opt/ml/input/config/hyperparameters.json",
    )
    parser.add_argument(
        "--tokenizer", metavar="DIR_OR_S3_URI", help="tokenizer files to ship (default: the base model's)"
    )
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), help="weights' dtype (default: the recipe's export.dtype, bf16)"
    )
    parser.add_argument(
        "--max-shard-gb", type=float, default=DEFAULT_MAX_SHARD_GB, help="largest output file, GB"
    )
    parser.add_argument(
        "--bos-token-id", type=int, help="written into config.json (default: the base model's)"
    )
    parser.add_argument(
        "--eos-token-id", type=int, help="written into config.json (default: the base model's)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.max_shard_gb <= 0:
        parser.error("--max-shard-gb must be > 0")
    try:
        recipe, _ = load_recipe(args.recipe)
        step, out = args.step or None, args.out
        if out is None:  # PARENT/step-N/: the export job does not know N before it looks
            step = choose_step(open_storage(args.checkpoint), step)
            out = f"{args.out_parent.rstrip('/')}/step-{step}/"
        result = export(
            recipe,
            args.checkpoint,
            out,
            step=step,
            dtype=args.dtype or recipe.export.dtype,
            tokenizer=args.tokenizer,
            max_shard_gb=args.max_shard_gb,
            bos_token_id=args.bos_token_id,
            eos_token_id=args.eos_token_id,
        )
    except TrainstackError as exc:  # one line, also in the job's failure file (trainer.runtime.failure)
        from trainer.runtime.failure import report_failure

        return report_failure(exc.exit_code, str(exc))
    print(
        f"exported step {result.step} to {result.out}: {result.files} file(s), "
        f"{result.bytes_written / 1e9:.2f} GB {result.dtype} in {result.seconds:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
