"""Write token shards (the format in trainer.data) from text files with a LOCAL tokenizer.

    python -m trainer.make_shards --tokenizer bytes --out DIR a.txt b.txt ...
    python -m trainer.make_shards --tokenizer tokenizer.json --eos-token '<|end_of_text|>' --out DIR *.txt

`bytes` is a built-in byte-level tokenizer (ids 0-255 are the UTF-8 bytes, 256 is end-of-document; a
model needs vocab >= 257). A tokenizer.json file is read with the `tokenizers` package if it is
installed. Nothing is downloaded. Each input file is one document; documents are shuffled with
`--seed` before writing (the trainer reads windows in order), and shards are cut at
`--shard-tokens` tokens. Then upload DIR to the recipe's data.train_s3_uri.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from trainer.data import FORMAT, INDEX_FILE
from trainstack.errors import TrainstackError

BYTES_EOS = 256


def load_tokenizer(spec: str, eos_token: str | None) -> tuple[Callable[[str], list[int]], int, int, str]:
    """(encode, vocab_size, eos_id, description) for `bytes` or a local tokenizer.json."""
    if spec == "bytes":
        return (lambda text: list(text.encode("utf-8"))), BYTES_EOS + 1, BYTES_EOS, "bytes"
    path = Path(spec)
    if not path.is_file():
        raise TrainstackError(f"{spec}: tokenizer file not found (give a local tokenizer.json, or 'bytes')")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TrainstackError(
            f"{spec}: reading tokenizer.json needs the 'tokenizers' package (pip install tokenizers), "
            "or use --tokenizer bytes"
        ) from None
    tokenizer = Tokenizer.from_file(str(path))
    candidates = [eos_token] if eos_token else ["<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>"]
    ids = [tokenizer.token_to_id(t) for t in candidates]
    eos_id = next((i for i in ids if i is not None), None)
    if eos_id is None:
        raise TrainstackError(f"{spec}: none of {candidates} is a token; pass --eos-token")
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    return encode, tokenizer.get_vocab_size(with_added_tokens=True), eos_id, path.name


def write_shards(
    texts: Iterable[Path],
    out: Path,
    tokenizer: str = "bytes",
    eos_token: str | None = None,
    shard_tokens: int = 1 << 28,
    seed: int = 0,
) -> dict:
    encode, vocab, eos_id, description = load_tokenizer(tokenizer, eos_token)
    dtype = "uint16" if vocab <= np.iinfo(np.uint16).max + 1 else "uint32"
    paths = sorted(Path(p) for p in texts)
    for p in paths:
        if not p.is_file():
            raise TrainstackError(f"{p}: input text file not found")
    random.Random(seed).shuffle(paths)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict] = []
    buffer: list[int] = []

    def flush() -> None:
        name = f"shard-{len(shards):05d}.bin"
        np.asarray(buffer, dtype=dtype).tofile(out / name)
        shards.append({"file": name, "tokens": len(buffer)})
        buffer.clear()

    for p in paths:
        buffer.extend(encode(p.read_text(encoding="utf-8", errors="replace")))
        buffer.append(eos_id)
        if len(buffer) >= shard_tokens:
            flush()
    if buffer:
        flush()
    index = {
        "format": FORMAT,
        "dtype": dtype,
        "vocab_size": vocab,
        "eos_id": eos_id,
        "tokenizer": description,
        "shards": shards,
    }
    # index.json last and atomically: a directory without it is visibly unfinished.
    tmp = out / (INDEX_FILE + ".tmp")
    tmp.write_text(json.dumps(index, indent=1) + "\n")
    tmp.replace(out / INDEX_FILE)
    return index


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.make_shards", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("texts", nargs="+", type=Path, help="text files, one document each")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--tokenizer", default="bytes", help="'bytes' or a local tokenizer.json")
    parser.add_argument("--eos-token", default=None, help="end-of-document token (tokenizer.json only)")
    parser.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per shard file")
    parser.add_argument("--seed", type=int, default=0, help="document shuffle seed")
    args = parser.parse_args(argv)
    try:
        index = write_shards(
            args.texts, args.out, args.tokenizer, args.eos_token, args.shard_tokens, args.seed
        )
    except TrainstackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tokens = sum(s["tokens"] for s in index["shards"])
    print(
        f"wrote {len(index['shards'])} shard(s), {tokens} tokens, vocab {index['vocab_size']} to {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
