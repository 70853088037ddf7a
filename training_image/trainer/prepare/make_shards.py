"""`python -m trainer.prepare.make_shards`: the earlier command for text files, now a front for
trainer.prepare.

    python -m trainer.prepare.make_shards --tokenizer bytes --out DIR a.txt b.txt ...

Each file is one document (trainer.prepare's plain-text format), nothing is held out for validation,
and the shards, index.json and manifest.json are what `trainstack data prepare` writes. `--seed` is
accepted and ignored: documents are no longer shuffled when written, the trainer visits windows in a
seeded permutation of the whole stream instead (trainer.data.loader.WindowOrder). New work:
`trainstack data prepare` (docs/data.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path

from trainer.data.shard_index import INDEX_FILE
from trainer.prepare.pipeline import DEFAULT_SHARD_TOKENS, prepare
from trainstack.errors import TrainstackError


def write_shards(
    texts: Iterable[Path],
    out: Path,
    tokenizer: str = "bytes",
    eos_token: str | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    seed: int = 0,
    workers: int = 1,
) -> dict:
    """Token shards of `texts` (one document each) in `out`; returns the index.json written."""
    paths = [str(p) for p in texts]
    for p in paths:
        if not Path(p).is_file():
            raise TrainstackError(f"{p}: input text file not found")
    prepare(
        paths,
        tokenizer,
        str(out),
        validation_fraction=0.0,
        eos_token=eos_token,
        shard_tokens=shard_tokens,
        workers=workers,
    )
    return json.loads((Path(out) / INDEX_FILE).read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.prepare.make_shards", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("texts", nargs="+", type=Path, help="text files, one document each")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--tokenizer", default="bytes", help="'bytes' or a local tokenizer.json")
    parser.add_argument("--eos-token", default=None, help="end-of-document token (tokenizer.json only)")
    parser.add_argument(
        "--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard file"
    )
    parser.add_argument("--seed", type=int, default=0, help="ignored (kept for old command lines)")
    args = parser.parse_args(argv)
    try:
        index = write_shards(
            args.texts, args.out, args.tokenizer, args.eos_token, args.shard_tokens, args.seed
        )
    except TrainstackError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    tokens = sum(s["tokens"] for s in index["shards"])
    print(
        f"wrote {len(index['shards'])} shard(s), {tokens} tokens, vocab {index['vocab_size']} to {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
