"""Token-shard datasets for the blend and validation tests, written in trainer.data.loader's format."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def write_dataset(directory: Path, first_token: int, tokens: int = 4000, shift: int = 0) -> Path:
    """A token-shard directory (trainer.data.loader's format) whose token t is first_token + (t + shift) % 50:
    a source a tiny model learns in a few steps, told apart from another by its token range."""
    directory.mkdir(parents=True)
    values = (first_token + (np.arange(tokens) + shift) % 50).astype(np.uint16)
    values.tofile(directory / "shard-00000.bin")
    index = {
        "format": "trainstack-tokens-v1",
        "dtype": "uint16",
        "vocab_size": 256,
        "eos_id": 0,
        "tokenizer": "test",
        "shards": [{"file": "shard-00000.bin", "tokens": tokens}],
    }
    (directory / "index.json").write_text(json.dumps(index))
    return directory
