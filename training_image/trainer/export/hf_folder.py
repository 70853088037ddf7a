"""`python -m trainer.export`: a run's checkpoint as a Hugging Face folder (docs/models.md).

    python -m trainer.export --checkpoint DIR|s3://... [--step N] --out DIR|s3://... [--recipe R]

Writes what transformers' `from_pretrained` and vLLM read: `model-0000i-of-0000N.safetensors` with
`model.safetensors.index.json`, `config.json` (architecture, model_type, token ids; the base model's
own config carried over when the run started from one), `generation_config.json`, the tokenizer files
(`--tokenizer`, else the recipe's `export.tokenizer`, else the base model's), and `export.json` last
(what was exported, from where): a folder without it is unfinished. Weights are BF16 unless told
otherwise; Transformer Engine's `_extra_state` and the optimizer state are not exported.

Memory: one tensor at a time. The checkpoint's FP32 tensors are read one by one with
torch.distributed.checkpoint (only that tensor's byte ranges, from a local directory or straight from
S3), split into the Hugging Face tensors they hold (Q/K/V, gate/up), cast, and collected into one
output file of at most --max-shard-gb, which DCP's HuggingFaceStorageWriter writes before the next
file is started. Peak host memory is about twice one output file (its tensors
and their serialised bytes) plus twice the largest FP32 tensor
(bench/hf_export_import.py measures it). With an s3:// --out each file is uploaded as soon as it is
written and removed locally, so local disk holds one file too.

Exit codes: 0 written; 2 a mistake in the input (no complete checkpoint, a recipe that does not match
it, a bad location), one line naming it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter

from trainer.checkpoint.manager import complete_steps, storage_completeness_problem
from trainer.config import load_recipe
from trainer.hf.conversion import Piece, parameter_shapes, pieces
from trainer.hf.files import Folder, open_folder, tokenizer_files
from trainer.storage import open_storage, step_dir_name
from trainstack.errors import TrainstackError
from trainstack.recipes.hf_config import generation_config, hf_config_from_shape
from trainstack.recipes.schema import Recipe

log = logging.getLogger("trainer.export")
DTYPES = {"bf16": (torch.bfloat16, "bfloat16"), "fp32": (torch.float32, "float32")}
INDEX = "model.safetensors.index.json"
RECORD = "export.json"  # written last: the folder is complete
DEFAULT_MAX_SHARD_GB = 2.0
LOAD_BATCH_BYTES = 256 * 2**20  # FP32 read per dcp.load, unless one tensor is larger


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


class _TensorReader:
    """Loads FP32 tensors of a DCP checkpoint a few at a time; its metadata is read once."""

    def __init__(self, reader):
        self.reader = reader
        self.metadata = reader.read_metadata()
        reader.read_metadata = lambda *args, **kwargs: self.metadata  # every dcp.load asks again
        self.bytes_read = 0

    def load(self, sizes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        tensors = {key: torch.empty(size, dtype=torch.float32) for key, size in sizes.items()}
        dcp.load(tensors, storage_reader=self.reader, no_dist=True)
        self.bytes_read += sum(t.numel() * 4 for t in tensors.values())
        return tensors


def load_batches(names: list[str], shapes: dict[str, tuple[int, ...]]) -> list[list[str]]:
    """Our parameters in the order needed, in loads of at most LOAD_BATCH_BYTES (FP32; a larger one alone):
    each dcp.load costs a plan and a pass over the metadata, which small tensors (norms, biases) would
    otherwise pay one by one."""
    batches: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = 4 * _numel(shapes[name])
        if batches[-1] and size + nbytes > LOAD_BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(name)
        size += nbytes
    return batches


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
    with warnings.catch_warnings():
        # One process, no process group: DCP says it assumes a single process on every load and save.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return _export(
            recipe, checkpoint, out, step, dtype, tokenizer, max_shard_gb, bos_token_id, eos_token_id
        )


def _export(recipe, checkpoint, out, step, dtype, tokenizer, max_shard_gb, bos_token_id, eos_token_id):
    started = time.monotonic()
    storage = open_storage(checkpoint)
    step = choose_step(storage, step)
    where = f"{storage.location.rstrip('/')}/{step_dir_name(step)}"
    marker = json.loads(storage.read(step, "COMPLETE.json") or b"{}")
    source = _TensorReader(storage.reader(step))
    check_checkpoint(source.metadata, recipe, where)
    target = open_folder(out, "--out")
    torch_dtype, dtype_name = DTYPES[dtype]
    hf_pieces = pieces(recipe.model)
    shapes = parameter_shapes(recipe.model)
    files = plan_files(hf_pieces, torch_dtype.itemsize, max_shard_gb * 1e9)
    mapping = {piece.hf: i + 1 for i, group in enumerate(files) for piece in group}
    staging = Path(tempfile.mkdtemp(prefix="trainstack-export-")) if target.is_s3 else target.root
    staging.mkdir(parents=True, exist_ok=True)
    weight_map, written = {}, 0
    for index, group in enumerate(files, start=1):
        state: dict[str, torch.Tensor] = {}
        needed = list(dict.fromkeys(piece.ours for piece in group))
        for batch in load_batches(needed, shapes):
            loaded = source.load({f"model.{name}": shapes[name] for name in batch})
            for piece in group:
                if f"model.{piece.ours}" in loaded:
                    full = loaded[f"model.{piece.ours}"]
                    state[piece.hf] = full.narrow(0, piece.start, piece.shape[0]).to(torch_dtype, copy=True)
            del loaded  # the FP32 tensors go before the next batch is read
        dcp.save(
            state,
            storage_writer=HuggingFaceStorageWriter(str(staging), fqn_to_index_mapping=mapping),
            no_dist=True,
        )
        name = f"model-{index:05d}-of-{len(files):05d}.safetensors"
        written += sum(t.numel() * t.element_size() for t in state.values())
        weight_map.update(dict.fromkeys(state, name))
        del state
        if target.is_s3:
            target.upload(staging / name, name)
            (staging / name).unlink()
        log.info("wrote %s (%d of %d, %.2f GB so far)", name, index, len(files), written / 1e9)
    (staging / INDEX).unlink(missing_ok=True)  # the writer's index covers its last file only
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
    target.write("generation_config.json", _json(generation_config(config)))
    shipped = _copy_tokenizer(tokenizer or recipe.export.tokenizer, base_folder, target, staging)
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


def _copy_tokenizer(location: str | None, base: Folder | None, target: Folder, staging: Path) -> str | None:
    """Copy the tokenizer files from `location`, else from the base model's folder; their source."""
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
            local = staging / f".tokenizer-{name}"
            folder.download(name, local)
            target.upload(local, name)
            local.unlink()
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
    except TrainstackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(
        f"exported step {result.step} to {result.out}: {result.files} file(s), "
        f"{result.bytes_written / 1e9:.2f} GB {result.dtype} in {result.seconds:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
