"""What a data directory holds, validated before any shard is opened.

Two layouts are read (docs/data.md):

- **trainstack token shards**: `index.json` (format `trainstack-tokens-v1`) listing `.bin` files of raw
  little-endian token ids, each with a Megatron `.idx` beside it when written by `trainer.prepare`, and
  a `manifest.json` (tokenizer, sources, splits; trainer.data.manifest).
- **Megatron indexed datasets** written by other tools (Megatron-LM's preprocess_data.py, datatrove,
  NeMo Curator): no index.json, one or more `<prefix>.idx` / `<prefix>.bin` pairs anywhere below the
  directory, told apart by the .idx header (`MMIDIDX`, trainer.data.megatron_index).

What `trainstack data prepare` left unfinished (killed, or `--no-finalize` instances not yet finalized:
its `_prepare/` folder without the root `manifest.json`, which it writes last) is refused in one line
saying to run it again, wherever it lies below the directory: its shards are a part of the inputs, and
files of a killed run may be among them. A prepared dataset's validation split (a folder whose
manifest.json says `"split": "validation"`) is never read as training data: index.json lists only the
training split's shards (an entry inside the split is refused), and the Megatron scan skips such folders.

Every mistake is one line naming the file and field (a TrainstackError, exit 2), never a traceback, and
no path outside the data directory is ever opened: entries are relative, without `..`, and resolve
(symlinks followed) inside the directory, checked before a file is touched.

The dataset's content hash (`DatasetIndex.content_sha256`) is what identifies the data in a checkpoint
(trainer.data.loader.open_source): for trainstack shards the bytes of index.json, which lists every shard's
SHA-256 (computed while it was written) and token count; for Megatron datasets every .idx file's bytes
with its name and its .bin's size. Re-tokenised, re-shuffled or appended shards under the same prefix
change it; so does renaming a shard. Shard contents are not re-hashed at start (terabytes on every rank).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from trainer.data.megatron_index import is_megatron_index, read_index
from trainstack.errors import TrainstackError

FORMAT = "trainstack-tokens-v1"
INDEX_FILE = "index.json"
MANIFEST_FILE = "manifest.json"
PREPARE_STATE = "_prepare"  # trainer.prepare's settings and completion markers (trainer.prepare)
PREPARE_CONFIG = f"{PREPARE_STATE}/config.json"
VALIDATION_PATH = "validation"  # where trainer.prepare writes the held-out split, beside the shards
# uint32 is what make_shards wrote for vocabularies past 65,536 before Megatron-compatible indexes (whose
# dtype codes have no uint32); trainer.prepare writes int32 there, as Megatron does.
DTYPES = ("uint16", "int32", "uint32")


@dataclass(frozen=True)
class ShardFile:
    path: Path
    name: str  # relative to the data directory, as listed
    tokens: int
    dtype: str


@dataclass(frozen=True)
class DatasetIndex:
    directory: Path
    kind: str  # "trainstack" or "megatron"
    shards: tuple[ShardFile, ...]
    content_sha256: str
    vocab_size: int | None  # declared by index.json; Megatron datasets declare none
    max_token_id: int | None  # the largest id written, where the index records it

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)


def read_dataset(directory: Path) -> DatasetIndex:
    """The validated index of `directory`: trainstack shards if it holds index.json, else Megatron's."""
    directory = Path(directory)
    if not directory.exists():
        raise TrainstackError(f"--data-dir {directory}: does not exist")
    if not directory.is_dir():
        raise TrainstackError(f"--data-dir {directory}: not a directory (give the folder holding index.json)")
    _refuse_unfinished(directory)
    if (directory / INDEX_FILE).exists():
        return _read_trainstack(directory)
    return _read_megatron(directory)


def _refuse_unfinished(directory: Path, roots: list[Path] | None = None) -> None:
    """One line for a `trainstack data prepare` output (`directory`, or each of `roots` found below it)
    that has no root manifest (it writes that last): killed, interrupted, or not finalized."""
    for root in [directory] if roots is None else roots:
        if not (root / PREPARE_CONFIG).is_file() or (root / MANIFEST_FILE).is_file():
            continue
        done = root / PREPARE_STATE / "done"
        files = sum(1 for p in done.iterdir() if p.suffix == ".json") if done.is_dir() else 0
        where = "--data-dir " + str(directory) + ("" if root == directory else f": {root}")
        raise TrainstackError(
            f"{where}: an unfinished `trainstack data prepare` output ({files} input file(s) done, no "
            f"{MANIFEST_FILE}): run the same prepare command again to finish it, then train on it"
        )


def _is_validation_split(folder: Path) -> bool:
    """Whether `folder` holds a prepared dataset's validation split (its manifest says so)."""
    try:
        return json.loads((folder / MANIFEST_FILE).read_bytes()).get("split") == "validation"
    except (OSError, ValueError, AttributeError, RecursionError):
        return False  # no manifest, or not a prepared dataset's: the formats' own checks speak for it


def inside(root: Path, name: object, where: str) -> Path:
    """`root / name` if `name` is a relative path that stays inside root (symlinks resolved), else one
    line naming `where`. Nothing is opened."""
    if not isinstance(name, str) or not name:
        raise TrainstackError(f"{where}: expected a relative file name, got {name!r}")
    pure = PurePosixPath(name)
    if pure.is_absolute() or name.startswith("\\") or ":" in pure.parts[0]:
        raise TrainstackError(f"{where}: {name!r} is an absolute path; shard files must be inside {root}")
    if ".." in pure.parts:
        raise TrainstackError(f"{where}: {name!r} leaves the data directory ('..'); shards must be inside it")
    path = root / pure
    resolved, base = path.resolve(), root.resolve()
    if not resolved.is_relative_to(base):
        raise TrainstackError(f"{where}: {name!r} resolves to {resolved}, outside the data directory {root}")
    return path


def _load_json_object(path: Path) -> dict:
    try:
        text = path.read_bytes()
    except IsADirectoryError:
        raise TrainstackError(f"{path}: is a directory, expected a JSON file") from None
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        detail = f"{exc.msg}, line {exc.lineno}" if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
        raise TrainstackError(f"{path}: not valid JSON ({detail})") from None
    if not isinstance(data, dict):
        raise TrainstackError(f"{path}: expected a JSON object, got a {type(data).__name__}")
    return data


def _integer(value: object, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TrainstackError(f"{where}: expected an integer, got {value!r}")
    if value < minimum:
        raise TrainstackError(f"{where}: {value} is below {minimum}")
    return value


def _read_trainstack(directory: Path) -> DatasetIndex:
    index_path = directory / INDEX_FILE
    raw = index_path.read_bytes() if index_path.is_file() else b""
    index = _load_json_object(index_path)
    where = str(index_path)
    if index.get("format") != FORMAT:
        raise TrainstackError(f"{where}: format: expected {FORMAT!r}, got {index.get('format')!r}")
    dtype = index.get("dtype")
    if dtype not in DTYPES:
        raise TrainstackError(f"{where}: dtype: expected one of {list(DTYPES)}, got {dtype!r}")
    if "vocab_size" not in index:
        raise TrainstackError(f"{where}: vocab_size: missing (the tokenizer's vocabulary size)")
    vocab = _integer(index["vocab_size"], f"{where}: vocab_size", 1)
    if "eos_id" in index:
        eos = _integer(index["eos_id"], f"{where}: eos_id", 0)
        if eos >= vocab:
            raise TrainstackError(f"{where}: eos_id: {eos} is not below vocab_size {vocab}")
    entries = index.get("shards")
    if not isinstance(entries, list) or not entries:
        raise TrainstackError(
            f"{where}: shards: expected a non-empty list of {{file, tokens}}, got {entries!r}"
        )
    import numpy as np  # here: the preparation's parent imports this module for its file names only

    itemsize = np.dtype(dtype).itemsize
    # What trainer.prepare holds out sits in `validation/` (the manifest's validation.path).
    validation = [directory / VALIDATION_PATH] if _is_validation_split(directory / VALIDATION_PATH) else []
    validation = [s.resolve() for s in validation]
    shards, seen, largest = [], set(), []
    for i, entry in enumerate(entries):
        at = f"{where}: shards[{i}]"
        if not isinstance(entry, dict):
            raise TrainstackError(f"{at}: expected an object {{file, tokens}}, got {entry!r}")
        if "file" not in entry or "tokens" not in entry:
            missing = "file" if "file" not in entry else "tokens"
            raise TrainstackError(f"{at}: {missing}: missing")
        path = inside(directory, entry["file"], f"{at}.file")
        held_out = next((s for s in validation if path.resolve().is_relative_to(s)), None)
        if held_out is not None:
            raise TrainstackError(
                f"{at}.file: {entry['file']} is in the validation split {held_out}: held-out documents are "
                "never trained on"
            )
        tokens = _integer(entry["tokens"], f"{at}.tokens", 0)
        if entry["file"] in seen:
            raise TrainstackError(f"{at}.file: {entry['file']!r} is listed twice")
        seen.add(entry["file"])
        if not path.is_file():
            raise TrainstackError(f"{at}.file: {entry['file']} is listed but missing")
        size = path.stat().st_size
        if size % itemsize:
            raise TrainstackError(
                f"{path}: {size} bytes is not a whole number of {dtype} token ids ({itemsize} bytes each)"
            )
        if size // itemsize != tokens:
            raise TrainstackError(
                f"{path}: holds {size // itemsize} tokens, index.json says {tokens} (truncated copy?)"
            )
        if "max_token_id" in entry:
            largest.append(_integer(entry["max_token_id"], f"{at}.max_token_id", 0))
        shards.append(ShardFile(path, entry["file"], tokens, dtype))
    return DatasetIndex(
        directory=directory,
        kind="trainstack",
        shards=tuple(shards),
        content_sha256=hashlib.sha256(raw).hexdigest(),
        vocab_size=vocab,
        max_token_id=max(largest) if len(largest) == len(shards) else None,
    )


def _read_megatron(directory: Path) -> DatasetIndex:
    import numpy as np  # here: the preparation's parent imports this module for its file names only

    # One walk (a FastFile mount lists S3 to walk): the .idx files, and what marks prepared outputs.
    candidates, roots, held_out = [], [], []
    for folder, subfolders, files in os.walk(directory):
        here = Path(folder)
        if PREPARE_STATE in subfolders:
            roots.append(here)
        if MANIFEST_FILE in files and here != directory and _is_validation_split(here):
            held_out.append(here)
            subfolders.clear()  # held-out documents are never trained on
            continue
        subfolders[:] = sorted(d for d in subfolders if d != PREPARE_STATE)
        candidates.extend(here / f for f in files if f.endswith(".idx") and (here / f).is_file())
    _refuse_unfinished(directory, roots)
    candidates.sort()
    indexes = [p for p in candidates if is_megatron_index(inside(directory, _relative(directory, p), str(p)))]
    if not indexes:
        raise TrainstackError(
            f"{directory}: no token-shard index ({INDEX_FILE}) and no Megatron .idx file (MMIDIDX header): "
            "write shards with `trainstack data prepare`"
        )
    digest = hashlib.sha256()
    shards = []
    for idx_path in indexes:
        name = _relative(directory, idx_path)
        index = read_index(idx_path)
        bin_name = name[: -len(".idx")] + ".bin"
        bin_path = inside(directory, bin_name, str(idx_path))
        if not bin_path.is_file():
            raise TrainstackError(f"{idx_path}: its data file {bin_name} is missing")
        itemsize = np.dtype(index.dtype).itemsize
        size = bin_path.stat().st_size
        if size != index.tokens * itemsize:
            raise TrainstackError(
                f"{bin_path}: {size} bytes, its .idx lists {index.tokens} {index.dtype} tokens "
                f"({index.tokens * itemsize} bytes; truncated or mismatched copy?)"
            )
        digest.update(f"{name}\0{size}\0".encode())
        with open(idx_path, "rb") as stream:
            for block in iter(lambda: stream.read(1 << 22), b""):
                digest.update(block)
        shards.append(ShardFile(bin_path, bin_name, index.tokens, index.dtype))
    return DatasetIndex(
        directory=directory,
        kind="megatron",
        shards=tuple(shards),
        content_sha256=digest.hexdigest(),
        vocab_size=None,
        max_token_id=None,
    )


def _relative(directory: Path, path: Path) -> str:
    return path.relative_to(directory).as_posix()
