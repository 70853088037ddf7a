"""`trainstack data prepare --format chat`: JSONL conversations -> a chat dataset (token shards with a
loss mask beside them, trainer.data.chat_shards says the format), rendered by a base model's chat
template (trainer.prepare.chat).

    prepare_chat(SRC..., base=BASE_DIR, out=DEST, seq_len=N)

SRC: JSONL files, or directories (every .jsonl/.ndjson/.json below, gzip too) or s3:// prefixes, listed as
trainer.prepare.pipeline lists them; DEST: a directory or an s3:// prefix; BASE_DIR: a local folder with
the base model's tokenizer.json and tokenizer_config.json (or chat_template.jinja).

Each input file is one unit of work with a completion marker (`_prepare/done/<id>.json`), as for
pretraining text: a rerun skips the files already done, `_prepare/config.json` refuses an output made
with other settings (template, tokenizer, seq_len, validation fraction, shard size), an output holding
other files' markers is refused, one writer at a time holds the output (pipeline.writer_lock), and the
root manifest.json is written last. Conversations are held out for validation by a hash of the line
(trainer.prepare.inputs.in_validation), into `validation/`, with their masks: validation is a masked
loss on held-out conversations.

On SageMaker Processing (trainstack.aws.processing), each instance runs this with its share of the
files (`LOCAL=URI` sources name each file by its S3 URI) and `--no-finalize`: it writes its files'
shards, masks and markers and no index (it sees only its share, so neither the other-corpus check nor
the indexes are its to do); `trainstack data prepare` then runs it once more here, every file done,
which checks the markers and writes the indexes and manifests.

Not yet here (docs/sft.md): a process pool (files are processed one after another in this process: on
Processing, one file at a time per instance), and a base folder in S3 (the CLI stages its tokenizer files
for a Processing job).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np

from trainer.data.chat_shards import MASK_DTYPE, MASK_FORMAT, mask_name, sequence_lengths
from trainer.data.manifest import DATASET_FORMAT
from trainer.data.packing import pack_best_fit_decreasing, packing_efficiency
from trainer.data.shard_index import FORMAT, MANIFEST_FILE
from trainer.prepare.chat import ChatCounts, ChatTokenizer, Example, read_examples
from trainer.prepare.inputs import in_validation
from trainer.prepare.pipeline import (
    DEFAULT_SHARD_TOKENS,
    DEFAULT_VALIDATION_FRACTION,
    DONE_PREFIX,
    TOOL,
    VALIDATION,
    Unit,
    check_output,
    done_markers,
    list_units,
    other_corpus,
    write_split,
    writer_lock,
)
from trainer.prepare.shard_writer import ShardWriter
from trainer.prepare.store import S3Store, open_store, split_s3
from trainstack import __version__
from trainstack.errors import TrainstackError

BATCH_EXAMPLES = 256  # examples handed to the shard writer at once


class MaskedShardWriter:
    """Token shards through trainer.prepare.shard_writer.ShardWriter (same names, cuts, .idx, hashes),
    and beside each `X.bin` its mask `X.mask`, cut at the same token counts. Its entries are the token
    writer's, with `mask`, `mask_sha256` and `targets` added."""

    def __init__(self, store, prefix: str, dtype: str, eos_id: int, shard_tokens: int, relative_to: str = ""):
        self.store, self.prefix, self.relative_to = store, prefix, relative_to
        self.tokens = ShardWriter(store, prefix, dtype, eos_id, shard_tokens, relative_to)
        self.entries: list[dict] = []
        self._open = None  # (context, stream, digest, bytes written, targets)

    def add_examples(self, examples: list[Example]) -> None:
        if not examples:
            return
        lengths = np.fromiter((e.ids.size for e in examples), dtype=np.int64, count=len(examples))
        flat = np.concatenate([e.ids for e in examples])
        masks = np.concatenate([e.mask for e in examples]).astype(np.uint8, copy=False)
        before = len(self.tokens.entries)
        self.tokens.add_documents(flat, lengths)
        at = 0
        for entry in self.tokens.entries[before:]:  # token shards this call closed: their masks end too
            take = entry["tokens"] - (self._open[3] if self._open else 0)
            self._write(masks[at : at + take])
            at += take
            self._finish(entry)
        self._write(masks[at:])

    def _write(self, part: np.ndarray) -> None:
        if not part.size:
            return
        if self._open is None:
            name = mask_name(f"{self.prefix}-{len(self.entries):05d}.bin")
            context = self.store.writer(name)
            self._open = [context, context.__enter__(), hashlib.sha256(), 0, 0, name]
        data = part.tobytes()
        self._open[1].write(data)
        self._open[2].update(data)
        self._open[3] += part.size
        self._open[4] += int(part.sum(dtype=np.int64))

    def _finish(self, entry: dict) -> None:
        context, _, digest, written, targets, name = self._open
        context.__exit__(None, None, None)
        self._open = None
        expected = mask_name(self.relative_to + entry["file"])
        if name != expected or written != entry["tokens"]:  # the two writers disagree: a bug, never data
            raise RuntimeError(
                f"mask {name} ({written} bytes) beside {entry['file']} ({entry['tokens']} tokens)"
            )
        self.entries.append(
            {
                **entry,
                "mask": name[len(self.relative_to) :],
                "mask_sha256": digest.hexdigest(),
                "targets": targets,
            }
        )

    def remove_leftovers(self) -> None:
        self.tokens.remove_leftovers()  # the same prefix: token shards, indexes and masks

    def close(self) -> list[dict]:
        entries_before = len(self.tokens.entries)
        self.tokens.close()
        for entry in self.tokens.entries[entries_before:]:
            self._finish(entry)
        return self.entries

    def abort(self) -> None:
        if self._open is not None:
            self._open[0].__exit__(RuntimeError, RuntimeError("aborted"), None)
            self._open = None
        self.tokens.abort()


def _dtype(vocab_size: int) -> str:
    # Megatron's choice, as trainer.prepare.inputs.TokenizerInfo makes it.
    return "uint16" if vocab_size <= 1 << 16 else "int32"


def _process(unit: Unit, chat: ChatTokenizer, store, settings: dict, scratch: Path) -> dict:
    """One JSONL file -> its shards, masks and completion marker; returns the marker."""
    started = time.monotonic()
    path, downloaded = Path(unit.local) if unit.local else None, False
    if path is None:
        bucket, key = split_s3(unit.uri)
        path = scratch / f"{unit.id}{''.join(Path(key).suffixes[-2:])}"
        S3Store(f"s3://{bucket}/").download(key, path)
        downloaded = True
    name = f"{unit.stem}-{unit.id}"
    dtype = _dtype(chat.vocab_size)
    shard_tokens = settings["shard_tokens"]
    writers = {
        "train": MaskedShardWriter(store, f"shards/{name}", dtype, chat.eos_id, shard_tokens),
        VALIDATION: MaskedShardWriter(
            store, f"{VALIDATION}/shards/{name}", dtype, chat.eos_id, shard_tokens, f"{VALIDATION}/"
        ),
    }
    batches: dict[str, list[Example]] = {"train": [], VALIDATION: []}
    examples = {"train": 0, VALIDATION: 0}
    counts = ChatCounts()
    for writer in writers.values():
        writer.remove_leftovers()
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rb") as stream:
            for _, raw, example in read_examples(stream, chat, settings["seq_len"], counts):
                split = VALIDATION if in_validation(raw.strip(), settings["validation_fraction"]) else "train"
                batches[split].append(example)
                examples[split] += 1
                if len(batches[split]) >= BATCH_EXAMPLES:
                    writers[split].add_examples(batches[split])
                    batches[split] = []
        for split, writer in writers.items():
            writer.add_examples(batches[split])
        shards = {split: writer.close() for split, writer in writers.items()}
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        for writer in writers.values():
            writer.abort()
        raise TrainstackError(f"{unit.uri}: cannot be read ({exc})") from None
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    finally:
        if downloaded:
            path.unlink(missing_ok=True)
    marker = {
        "uri": unit.uri,
        "size": unit.size,
        "documents": examples,
        "tokens": {split: sum(s["tokens"] for s in entries) for split, entries in shards.items()},
        "targets": {split: sum(s["targets"] for s in entries) for split, entries in shards.items()},
        "lines": counts.lines,
        "too_long": counts.too_long,
        "skipped_records": counts.skipped_lines,
        "skipped_by_reason": dict(counts.skipped),
        "first_skipped": counts.first_skipped,
        "shards": shards,
        "seconds": round(time.monotonic() - started, 3),
    }
    store.write(f"{DONE_PREFIX}{unit.id}.json", json.dumps(marker).encode())
    return marker


def prepare_chat(
    sources: list[str],
    base: str,
    out: str,
    *,
    seq_len: int,
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    overwrite: bool = False,
    finalize: bool = True,
) -> dict:
    """Prepare the conversations of `sources` into `out` (`overwrite`: replace a local dataset of other
    files there, as for text); returns the root manifest, or without `finalize` (a Processing instance:
    module doc) a summary of the files it processed."""
    if seq_len < 2:
        raise TrainstackError(f"--seq-len {seq_len}: expected at least 2 tokens")
    if not 0 <= validation_fraction < 1:
        raise TrainstackError(f"--validation-fraction {validation_fraction}: expected 0 <= F < 1")
    if shard_tokens < 1:
        raise TrainstackError(f"--shard-tokens {shard_tokens}: must be positive")
    chat = ChatTokenizer(Path(base))
    from trainer.data.manifest import tokenizer_identity

    identity = tokenizer_identity(chat.tokenizer_path)
    store = open_store(out)
    # One writer per output on this machine, as for text (pipeline.writer_lock); not for a Processing
    # instance's share (--no-finalize): each instance writes only its own files, and the emulator runs
    # a job's instances on one machine, where one lock for all would refuse every instance but one.
    with writer_lock(out) if finalize else nullcontext():
        units = list_units(sources, out)
        if not units:
            raise TrainstackError(f"{' '.join(sources)}: no JSONL files found")
        other = next((u for u in units if u.fmt != "jsonl"), None)
        if other is not None:
            raise TrainstackError(f"{other.uri}: a {other.fmt} file; --format chat reads JSONL conversations")
        settings = {
            "format": DATASET_FORMAT,
            "kind": "chat",
            "tokenizer": identity,
            "chat_template_sha256": chat.template_sha256,
            "eos_id": chat.eos_id,
            "dtype": _dtype(chat.vocab_size),
            "seq_len": seq_len,
            "validation_fraction": validation_fraction,
            "shard_tokens": shard_tokens,
        }
        check_output(store, settings)
        # Files finished earlier that are not among these inputs: another corpus, refused as for text (an
        # instance of a Processing job sees only its share of the files: the finalize checks it).
        done = done_markers(store)
        if finalize:
            done = other_corpus(store, done, units, overwrite)
        pending = [u for u in units if done.get(u.uri, {}).get("size") != u.size]
        if pending and finalize:
            store.discard(MANIFEST_FILE)  # unfinished until the indexes are rewritten (as pipeline.prepare)
        print(
            f"prepare: {len(units)} conversation files, {len(units) - len(pending)} already done; template "
            f"{chat.template_from} (targets: {chat.targets_rule}); tokenizer {identity[:19]}, vocab "
            f"{chat.vocab_size}; seq_len {seq_len}; output {store.uri}",
            file=sys.stderr,
            flush=True,
        )
        with tempfile.TemporaryDirectory(prefix="trainstack-prepare-") as scratch:
            for unit in pending:
                marker = _process(unit, chat, store, settings, Path(scratch))
                if marker["skipped_records"]:
                    print(
                        f"prepare: {unit.uri}: {marker['skipped_records']} line(s) skipped (first: "
                        f"{marker['first_skipped'][0]})",
                        file=sys.stderr,
                        flush=True,
                    )
        if not finalize:
            return {"files": len(units), "processed": len(pending)}
        return write_chat_indexes(store, chat, settings, [u.uri for u in units])


def write_chat_indexes(store, chat: ChatTokenizer, settings: dict, uris: list[str]) -> dict:
    """index.json and manifest.json of each split from the markers of `uris` (root manifest last)."""
    markers = done_markers(store)
    missing = [u for u in uris if u not in markers]
    if missing:
        raise TrainstackError(
            f"{missing[0]}: not prepared yet ({len(missing)} files missing); rerun to resume"
        )
    chosen = [markers[u] for u in uris]
    if not any(m["shards"]["train"] for m in chosen):
        first = next((m["first_skipped"][0] for m in chosen if m["first_skipped"]), None)
        too_long = sum(m["too_long"] for m in chosen)
        skipped = sum(m["skipped_records"] for m in chosen)
        raise TrainstackError(
            f"{uris[0]}: the inputs hold no conversation to train on ({skipped} "
            f"line(s) skipped{f', first: {first}' if first else ''}; {too_long} longer than --seq-len "
            f"{settings['seq_len']})"
        )
    seq_len = settings["seq_len"]
    splits = [VALIDATION, "train"] if settings["validation_fraction"] > 0 else ["train"]
    manifests: dict[str, dict] = {}
    for split in splits:
        entries = [entry for m in chosen for entry in m["shards"][split]]
        base = "" if split == "train" else f"{VALIDATION}/"
        index = {
            "format": FORMAT,
            "dtype": settings["dtype"],
            "vocab_size": chat.vocab_size,
            "eos_id": chat.eos_id,
            "tokenizer": chat.tokenizer_path.name,
            "loss_mask": {"format": MASK_FORMAT, "dtype": MASK_DTYPE, "seq_len": seq_len},
            "shards": entries,
        }
        index_data = (json.dumps(index, indent=1) + "\n").encode()
        lengths = _example_lengths(store, base, entries)
        sequences = len(pack_best_fit_decreasing(lengths, seq_len)) if lengths.size else 0
        tokens = int(lengths.sum())
        manifest = {
            "format": DATASET_FORMAT,
            "split": split,
            "tool": {"name": TOOL, "version": __version__},
            "tokenizer": {
                "identity": settings["tokenizer"],
                "file": chat.tokenizer_path.name,
                "vocab_size": chat.vocab_size,
                "eos_id": chat.eos_id,
            },
            "dtype": settings["dtype"],
            "documents": sum(m["documents"][split] for m in chosen),
            "tokens": tokens,
            "sources": [
                {
                    "uri": m["uri"],
                    "documents": m["documents"][split],
                    "tokens": m["tokens"][split],
                    "skipped_records": m["skipped_records"],
                }
                for m in chosen
            ],
            "validation": None,
            "index_sha256": hashlib.sha256(index_data).hexdigest(),
            "shard_tokens": settings["shard_tokens"],
            "chat": {
                "template": chat.template_from,
                "template_sha256": chat.template_sha256,
                "targets": chat.targets_rule,
                "seq_len": seq_len,
                "examples": int(lengths.size),
                "target_tokens": sum(m["targets"][split] for m in chosen),
                "lines": sum(m["lines"] for m in chosen),
                "dropped_too_long": sum(m["too_long"] for m in chosen),
                "skipped_lines": sum(m["skipped_records"] for m in chosen),
                "skipped_by_reason": _sum_reasons(chosen),
                "first_skipped": [f"{m['uri']}: {s}" for m in chosen for s in m["first_skipped"]][:20],
                "packing": {
                    "strategy": "best-fit decreasing",
                    "sequences": sequences,
                    "efficiency": round(packing_efficiency(tokens, sequences, seq_len), 6),
                },
            },
        }
        write_split(store, base, split, index_data, manifest, manifests, settings["validation_fraction"])
    return manifests["train"]


def _example_lengths(store, base: str, entries: list[dict]) -> np.ndarray:
    """Every example's token count, from the shards' .idx files (local: read in place; S3: fetched)."""
    parts = []
    for entry in entries:
        key = base + entry["file"].removesuffix(".bin") + ".idx"
        local = getattr(store, "root", None)
        if local is not None:
            parts.append(sequence_lengths(Path(local) / key))
            continue
        with tempfile.NamedTemporaryFile(suffix=".idx") as copy:
            copy.write(store.read(key))
            copy.flush()
            parts.append(sequence_lengths(Path(copy.name)))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _sum_reasons(markers: list[dict]) -> dict[str, int]:
    total: dict[str, int] = {}
    for marker in markers:
        for reason, n in marker["skipped_by_reason"].items():
            total[reason] = total.get(reason, 0) + n
    return dict(sorted(total.items(), key=lambda kv: -kv[1]))


def summary(manifest: dict, out: str) -> str:
    chat = manifest["chat"]
    held = manifest.get("validation") or {"documents": 0}
    return (
        f"prepared {out}: {chat['examples']:,} conversations ({manifest['tokens']:,} tokens, "
        f"{chat['target_tokens']:,} targets) to train on, {held['documents']:,} held out for validation; "
        f"{chat['skipped_lines']} line(s) skipped, {chat['dropped_too_long']} longer than seq_len "
        f"{chat['seq_len']} dropped; packed {chat['packing']['sequences']:,} sequences, efficiency "
        f"{100 * chat['packing']['efficiency']:.1f}%. Recipe: data.tokenizer: "
        f"{manifest['tokenizer']['identity']}"
    )


# --- command line (`python -m trainer.prepare --format chat ...`) --------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.prepare --format chat",
        description="Render JSONL conversations with a base model's chat template into token shards with "
        "a loss mask beside them; a rerun resumes.",
    )
    parser.add_argument("--format", choices=["chat"], required=True)
    parser.add_argument(
        "sources", nargs="+", metavar="SRC", help="JSONL files, directories or s3:// prefixes"
    )
    parser.add_argument(
        "--tokenizer", required=True, help="the base model's folder (tokenizer.json, tokenizer_config.json)"
    )
    parser.add_argument("--out", required=True, help="output directory or s3:// prefix")
    parser.add_argument(
        "--seq-len", type=int, required=True, help="the training sequence length: longer examples are dropped"
    )
    parser.add_argument(
        "--validation-fraction",
        type=float,
        default=DEFAULT_VALIDATION_FRACTION,
        help=f"share of conversations held out, by a hash of each (default {DEFAULT_VALIDATION_FRACTION})",
    )
    parser.add_argument(
        "--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard file"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a local dataset of other files in --out"
    )
    parser.add_argument(
        "--no-finalize",
        action="store_true",
        help="write this run's files only, no index (a Processing job's instance; the CLI finalizes)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        manifest = prepare_chat(
            args.sources,
            args.tokenizer,
            args.out,
            seq_len=args.seq_len,
            validation_fraction=args.validation_fraction,
            shard_tokens=args.shard_tokens,
            overwrite=args.overwrite,
            finalize=not args.no_finalize,
        )
    except TrainstackError as exc:  # one line, also the job's ExitMessage (trainer.runtime.failure)
        from trainer.runtime.failure import report_failure
        from trainstack.protocol.exit_codes import MESSAGE_FILE

        return report_failure(exc.exit_code, str(exc), MESSAGE_FILE)
    except KeyboardInterrupt:
        print(
            "interrupted: files finished so far are kept; rerun the same command to resume", file=sys.stderr
        )
        return 130
    if args.no_finalize:
        print(
            f"processed {manifest['processed']} of {manifest['files']} files "
            "(no index written: --no-finalize)"
        )
        return 0
    print(summary(manifest, args.out))
    return 0
