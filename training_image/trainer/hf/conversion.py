"""Hugging Face weights in and out of the trainer's model (docs/models.md).

The state-dict adapter, both directions, is one table (`pieces`): each Hugging Face tensor is a block
of rows of one of our parameters. Our fused parameters hold several (shared/README.md section 14,
measured against transformers): `q_proj | k_proj | v_proj` stacked on dim 0 are `attention.qkv.weight`
(and their biases `attention.qkv.bias`, Qwen2), `gate_proj | up_proj` are `feed_forward.fc1_weight`;
everything else is one tensor for one tensor. No RoPE permutation: both models rotate split halves.

Loading a base model (`load_base`, at step 0 of a run with `model.init_from`): after the config was
checked against the recipe's shape, every rank asks torch.distributed.checkpoint's
HuggingFaceStorageReader for exactly the rows of each Hugging Face tensor that fall in its own FSDP
shard and writes them into that shard in place. The request for a block of rows is a `_RowWindow`: the
chunk it covers and the view of the local shard it lands in (DCP reads the byte range of that slice
from the safetensors file). No rank reads, or holds, more than its own shards.

Writing a folder from a checkpoint is trainer.export (one tensor at a time); `to_hf` and `from_hf`
below convert whole state dicts (tests and small models).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from trainstack.errors import TrainstackError
from trainstack.recipes.hf_config import HfConfigError, shape_mismatch
from trainstack.recipes.schema import ModelShape

log = logging.getLogger("trainer.hf")  # its log lines' name before the package move
# Tensors a Hugging Face folder may hold that carry no weights of the model (older Llama exports saved
# the rotary inverse frequencies): ignored on import.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Piece:
    """One Hugging Face tensor: rows [start, start + shape[0]) of our parameter `ours`."""

    hf: str
    ours: str
    start: int
    shape: tuple[int, ...]


def pieces(shape: ModelShape) -> list[Piece]:
    """Every Hugging Face tensor of a model of this shape, in the order transformers names them."""
    h, q, kv, f = shape.hidden, shape.q_dim, shape.kv_dim, shape.ffn
    out = [Piece("model.embed_tokens.weight", "tok_embeddings.weight", 0, (shape.vocab, h))]
    for i in range(shape.layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        qkv = ours + "attention.qkv."
        out.append(Piece(hf + "input_layernorm.weight", qkv + "layer_norm_weight", 0, (h,)))
        for name, start, rows in (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)):
            out.append(Piece(f"{hf}self_attn.{name}.weight", qkv + "weight", start, (rows, h)))
            if shape.attention_bias:
                out.append(Piece(f"{hf}self_attn.{name}.bias", qkv + "bias", start, (rows,)))
        out.append(Piece(hf + "self_attn.o_proj.weight", ours + "attention.proj.weight", 0, (h, q)))
        mlp = ours + "feed_forward."
        out.append(Piece(hf + "post_attention_layernorm.weight", mlp + "layer_norm_weight", 0, (h,)))
        out.append(Piece(hf + "mlp.gate_proj.weight", mlp + "fc1_weight", 0, (f, h)))
        out.append(Piece(hf + "mlp.up_proj.weight", mlp + "fc1_weight", f, (f, h)))
        out.append(Piece(hf + "mlp.down_proj.weight", mlp + "fc2_weight", 0, (h, f)))
    out.append(Piece("model.norm.weight", "norm.weight", 0, (h,)))
    if not shape.tied_embeddings:  # tied: lm_head is the embedding, which transformers re-ties on load
        out.append(Piece("lm_head.weight", "output.weight", 0, (shape.vocab, h)))
    return out


def parameter_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Our parameter -> its full shape, from the pieces it is made of."""
    rows: dict[str, int] = {}
    rest: dict[str, tuple[int, ...]] = {}
    for piece in pieces(shape):
        rows[piece.ours] = max(rows.get(piece.ours, 0), piece.start + piece.shape[0])
        rest[piece.ours] = piece.shape[1:]
    return {name: (rows[name], *rest[name]) for name in rows}


def to_hf(state: Mapping[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """Our (full, unsharded) state dict -> Hugging Face tensors (views; `_extra_state` is dropped)."""
    return {p.hf: state[p.ours].narrow(0, p.start, p.shape[0]) for p in pieces(shape)}


def from_hf(hf_state: Mapping[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """Hugging Face tensors -> our (full) state dict, fused parameters concatenated."""
    parts: dict[str, list[torch.Tensor]] = {}
    for piece in pieces(shape):
        parts.setdefault(piece.ours, []).append(hf_state[piece.hf])
    state = {name: torch.cat(ts) if len(ts) > 1 else ts[0] for name, ts in parts.items()}
    if shape.tied_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    return state


# --- checks -----------------------------------------------------------------------------------------
def tensor_problem(metadata: Metadata, shape: ModelShape, where: str) -> str | None:
    """The first tensor of the folder that does not fit the recipe's shape (one line), or None."""
    stored = {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items()}
    expected = pieces(shape)
    for piece in expected:
        if piece.hf not in stored:
            return f"{where}: tensor {piece.hf} is missing (the recipe's shape needs it)"
        if stored[piece.hf] != piece.shape:
            return (
                f"{where}: tensor {piece.hf} has shape {list(stored[piece.hf])}, the recipe's shape needs "
                f"{list(piece.shape)}"
            )
    known = {p.hf for p in expected} | ({"lm_head.weight"} if shape.tied_embeddings else set())
    for name in sorted(stored):
        if name not in known and not name.endswith(IGNORED_SUFFIXES):
            return f"{where}: tensor {name} has no place in the recipe's model (the shape has no such weight)"
    return None


def check_base(folder: Path, shape: ModelShape, what: str) -> tuple[HuggingFaceStorageReader, Metadata]:
    """The folder's config and tensors against the recipe's shape; TrainstackError (exit 2) naming the
    first mismatching field or tensor. Returns the reader and the folder's tensor metadata."""
    config_path = folder / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise TrainstackError(
            f"{what}: {config_path}: file not found (a Hugging Face folder has one)"
        ) from None
    except ValueError as exc:
        raise TrainstackError(f"{what}: {config_path}: not valid JSON ({exc})") from None
    try:
        problem = shape_mismatch(shape, config, f"{what}: {config_path}")
    except HfConfigError as exc:
        raise TrainstackError(str(exc)) from None
    if problem:
        raise TrainstackError(problem)
    reader = HuggingFaceStorageReader(str(folder))
    metadata = reader.read_metadata()
    if not metadata.state_dict_metadata:
        raise TrainstackError(f"{what}: {folder}: no .safetensors files")
    problem = tensor_problem(metadata, shape, f"{what}: {folder}")
    if problem:
        raise TrainstackError(problem)
    return reader, metadata


# --- loading into the sharded model ------------------------------------------------------------------
class _RowWindow:
    """A DCP load target: rows [row, row + len(dest)) of a stored tensor of `size`, landing in `dest`
    (a view of this rank's local shard). DCP plans reads from `__create_chunk_list__`, as it does for a
    DTensor's local shard."""

    def __init__(self, dest: torch.Tensor, size: tuple[int, ...], row: int):
        self.dest, self._size, self.row = dest, torch.Size(size), row

    def size(self) -> torch.Size:
        return self._size

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        offsets = torch.Size((self.row,) + (0,) * (len(self._size) - 1))
        return [ChunkStorageMetadata(offsets=offsets, sizes=self.dest.size())]


class _WindowPlanner(DefaultLoadPlanner):
    """DCP's default load planner over a flat dict of `_RowWindow`s. Its set-up would run every value
    through `_init_state_dict`, which keeps tensors only (anything else becomes None), so the windows
    are taken as they are; nothing needs flattening."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        target = self.state_dict[index.fqn]
        return target.dest if isinstance(target, _RowWindow) else super().lookup_tensor(index)


def _local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(this rank's local tensor, the global row its first row is) of a parameter, sharded or not."""
    if isinstance(param, DTensor):
        _, offsets = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        return param.to_local(), int(offsets[0])
    return param, 0


def row_windows(model: torch.nn.Module, shape: ModelShape) -> dict[str, _RowWindow]:
    """For every Hugging Face tensor, the rows of it that this rank's shards hold (possibly none)."""
    params = dict(model.named_parameters())  # a tied head is the embedding: listed once
    windows = {}
    for piece in pieces(shape):
        local, first = _local_rows(params[piece.ours])
        lo = max(piece.start, first)
        hi = min(piece.start + piece.shape[0], first + local.shape[0])
        hi = max(hi, lo)
        windows[piece.hf] = _RowWindow(local[lo - first : hi - first], piece.shape, lo - piece.start)
    return windows


@dataclass(frozen=True)
class BaseLoad:
    folder: str
    tensors: int
    bytes_read: int  # by this rank
    seconds: float


@torch.no_grad()
def load_base(
    model: torch.nn.Module, folder: Path, shape: ModelShape, what: str = "model.init_from", group=None
) -> BaseLoad:
    """Load a checked Hugging Face folder into the (sharded) model in place, each rank its own rows."""
    started = time.monotonic()
    reader, metadata = check_base(folder, shape, what)
    windows = row_windows(model, shape)
    dcp.load(windows, storage_reader=reader, planner=_WindowPlanner(), process_group=group)
    dtypes = {k: v.properties.dtype for k, v in metadata.state_dict_metadata.items()}
    read = sum(w.dest.numel() * dtypes[name].itemsize for name, w in windows.items())
    return BaseLoad(str(folder), len(windows), read, time.monotonic() - started)


# --- where the base model is read from ---------------------------------------------------------------
SAGEMAKER_BASE_CHANNEL = "SM_CHANNEL_BASE"  # the launcher's `base` input channel (trainstack.aws.request)


def base_folder(init_from: str, local_rank: int, group=None) -> Path:
    """A local directory holding the base model `init_from` names.

    A local directory is used as it is. An s3:// prefix is the `base` input channel on SageMaker (the
    launcher asks SageMaker to copy it onto every node's local disk before the job starts); elsewhere
    (a local run, the emulator) each node's first rank copies its files to local disk, streamed, while
    the node's other ranks wait. Either way every rank then reads only its own rows from local files.
    """
    from trainer.hf.files import open_folder

    folder = open_folder(init_from, "model.init_from")
    if not folder.is_s3:
        if not folder.root.is_dir():
            raise TrainstackError(f"model.init_from: {init_from}: no such directory")
        return folder.root
    channel = os.environ.get(SAGEMAKER_BASE_CHANNEL)
    if channel:
        return Path(channel)
    target = Path(os.environ.get("TRAINSTACK_BASE_DIR", tempfile.gettempdir())) / (
        "trainstack-base-" + hashlib.sha256(init_from.encode()).hexdigest()[:12]
    )
    error = None
    if local_rank == 0:
        try:
            files = folder.files()
            if "config.json" not in files:
                raise TrainstackError(f"model.init_from: {init_from}: no config.json there")
            for name, size in sorted(files.items()):
                done = target / name
                if not (done.is_file() and done.stat().st_size == size):
                    folder.download(name, done)
        except Exception as exc:  # every rank must reach the agreement below
            error = exc
    failed = torch.tensor([0 if error is None else 1])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if error is not None:
        raise error
    if int(failed):
        raise TrainstackError(f"model.init_from: {init_from}: copying it to local disk failed on a node")
    return target


def start_from_base(model: torch.nn.Module, shape: ModelShape, local_rank: int, group=None) -> BaseLoad:
    """Step 0 of a run with `model.init_from`: the base model's weights in the sharded model."""
    folder = base_folder(shape.init_from, local_rank, group)
    return load_base(model, folder, shape, group=group)
