"""A prepared dataset's manifest (`manifest.json` beside its index) and the tokenizer checks built on it.

Written by trainer.prepare at the root of a dataset and in its `validation/` split:

    {"format": "trainstack-dataset-v1", "split": "train" | "validation",
     "tool": {"name": "trainstack data prepare", "version": "0.1.0"},
     "tokenizer": {"identity": "sha256:<hex>" | "bytes", "file": "tokenizer.json", "vocab_size": N,
                   "eos_id": K},
     "dtype": "uint16" | "int32", "documents": D, "tokens": T,
     "sources": [{"uri": ..., "documents": d, "tokens": t, "skipped_records": s}, ...],
     "validation": {"fraction": f, "path": "validation", "documents": d, "tokens": t} | null,
     "index_sha256": "<sha256 of this split's index.json>", "text_field": ..., "shard_tokens": ...}

A tokenizer's identity is `sha256:` and the SHA-256 of its tokenizer.json bytes (what `sha256sum` prints),
or `bytes` for the built-in byte-level tokenizer. A recipe names the tokenizer it expects in
`data.tokenizer`; a model initialised from a base (`model.init_from`) checks the base's tokenizer.json
with `require_tokenizer(data_dir, tokenizer_identity(base / "tokenizer.json"), "model.init_from")`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from trainer.data.shard_index import MANIFEST_FILE
from trainstack.errors import TrainstackError

DATASET_FORMAT = "trainstack-dataset-v1"
BYTES_TOKENIZER = "bytes"
log = logging.getLogger("trainer.data")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_identity(path: Path | str) -> str:
    """`bytes`, or `sha256:<hex>` of a tokenizer.json file's bytes."""
    if str(path) == BYTES_TOKENIZER:
        return BYTES_TOKENIZER
    return f"sha256:{file_sha256(Path(path))}"


def read_manifest(directory: Path) -> dict | None:
    """The dataset's manifest.json, or None where there is none (Megatron datasets of other tools, shards
    written before manifests); one line for one that is not a manifest."""
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise TrainstackError(f"{path}: not valid JSON") from None
    if not isinstance(manifest, dict) or manifest.get("format") != DATASET_FORMAT:
        raise TrainstackError(f"{path}: format: expected a {DATASET_FORMAT!r} manifest")
    tokenizer = manifest.get("tokenizer")
    if not isinstance(tokenizer, dict) or not isinstance(tokenizer.get("identity"), str):
        raise TrainstackError(f"{path}: tokenizer.identity: missing")
    return manifest


def check_tokenizer(manifest: dict | None, directory: Path, expected: str, source: str) -> None:
    """Refuse (one line) shards made with another tokenizer than `expected`, which `source` names (a
    recipe field). Without a manifest nothing can be checked: a warning says so."""
    if manifest is None:
        log.warning(
            "%s is %s, but %s has no %s recording its tokenizer (a dataset of another tool): not checked",
            source,
            expected,
            directory,
            MANIFEST_FILE,
        )
        return
    found = manifest["tokenizer"]["identity"]
    if found != expected:
        raise TrainstackError(
            f"{Path(directory) / MANIFEST_FILE}: tokenizer: the shards were made with {found} "
            f"({manifest['tokenizer'].get('file', '?')}), {source} is {expected}; re-prepare the data with "
            "that tokenizer or fix the recipe"
        )


def require_tokenizer(directory: Path, expected: str, source: str) -> None:
    """`check_tokenizer` on the manifest in `directory` (for callers outside the data loader, e.g. the
    `model.init_from` check)."""
    check_tokenizer(read_manifest(directory), directory, expected, source)
