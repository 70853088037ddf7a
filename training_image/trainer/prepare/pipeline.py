"""`python -m trainer.prepare`: raw text (JSONL, Parquet, plain text) -> token shards, on every core.

    python -m trainer.prepare SRC... --tokenizer tokenizer.json --out DEST [--text-field text]
        [--validation-fraction 0.005] [--workers N] [--shard-tokens N] [--max-bad-records N]

SRC: files, directories (every JSONL/Parquet/text file below) or s3:// prefixes; DEST: a directory or an
s3:// prefix; the tokenizer: a local tokenizer.json, one in S3, or `bytes` (built-in, byte level).
Nothing is downloaded from a model hub. `trainstack data prepare` runs this same entrypoint here, against
the local emulator (`--local`), or on every instance of a SageMaker Processing job (docs/data.md).

One input file is one unit of work, tokenized by one worker of a process pool (one per core): its
documents go to shards `shards/<file>-<id>-NNNNN.bin` (+ `.idx`), those held out for validation to
`validation/shards/...`, and when they are written a completion marker `_prepare/done/<id>.json` records
what the file gave. A rerun skips every file with a marker (so an interrupted preparation resumes; a file
whose size changed is redone), then writes `index.json` and `manifest.json` for each split from the
markers, the root manifest last: a prefix without it is visibly unfinished. `--no-finalize` (each
instance of a Processing job) leaves that to the run that sees every marker, and takes no writer lock:
each instance writes only its share's files, and the emulator runs a job's instances on one machine.

Settings that change what is written (tokenizer, text field, validation fraction, shard size) are kept
in `_prepare/config.json`; an output that holds a dataset made otherwise, or any other dataset, is refused.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import multiprocessing
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from trainer.data.manifest import DATASET_FORMAT
from trainer.data.shard_index import FORMAT, INDEX_FILE, MANIFEST_FILE
from trainer.prepare.inputs import (
    TEXT_PIECE_BYTES,
    Encoder,
    RecordCounts,
    TokenizerInfo,
    cut_pieces,
    format_of,
    in_validation,
    load_tokenizer,
    read_documents,
)
from trainer.prepare.store import S3Store, open_store, split_s3
from trainstack import __version__
from trainstack.errors import TrainstackError
from trainstack.units import data_size

TOOL = "trainstack data prepare"
CONFIG_KEY = "_prepare/config.json"
DONE_PREFIX = "_prepare/done/"
VALIDATION = "validation"
DEFAULT_VALIDATION_FRACTION = 0.005
DEFAULT_SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 ids per shard file
DEFAULT_MAX_BAD_RECORDS = 100
BATCH_DOCUMENTS = 256
# What one encode_batch call takes: every Encoding of the batch is alive at once (ids, token strings,
# masks: measured ~100 bytes per token, 25 MiB for 1 MiB of code, 118 MiB for 4 MiB), so 4 MiB made a
# worker's peak higher than a plain script's, for no speed (a call's own cost is nothing beside 1 MiB).
BATCH_CHARS = 1 << 20


@dataclass(frozen=True)
class Unit:
    uri: str  # what names the file everywhere (markers, manifest, messages)
    size: int
    fmt: str
    local: str | None  # a local path, or None for an S3 object (downloaded by the worker)

    @property
    def id(self) -> str:
        return hashlib.sha256(self.uri.encode()).hexdigest()[:16]

    @property
    def stem(self) -> str:
        base = self.uri.rstrip("/").rsplit("/", 1)[-1]
        base = re.sub(r"(\.gz)?$", "", base, flags=re.I).rsplit(".", 1)[0]
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", base)[:40] or "input"


@dataclass(frozen=True)
class Settings:
    out: str
    tokenizer: str  # a local path or "bytes"
    tokenizer_shown: str  # as the user gave it
    eos_token: str | None
    text_field: str
    validation_fraction: float
    shard_tokens: int
    max_bad_records: int
    scratch: str


# --- inputs -------------------------------------------------------------------------------------------


def list_units(sources: list[str], out: str) -> list[Unit]:
    """Every input file of `sources`, sorted by URI, skipping what lies under the output."""
    units: dict[str, Unit] = {}
    for source in sources:
        local, _, mapped = source.partition("=") if "=s3://" in source else (source, "", "")
        if local.startswith("s3://"):
            units.update((u.uri, u) for u in _s3_units(local, out))
            continue
        path = Path(local)
        if not path.exists():
            raise TrainstackError(f"{source}: {_why_missing(path)}")
        base = mapped.rstrip("/") if mapped else None
        for file, explicit in (
            [(path, True)] if path.is_file() else [(p, False) for p in sorted(path.rglob("*"))]
        ):
            if any(p.startswith(".") for p in file.parts[-1:]):
                continue
            fmt = format_of(file.name, explicit)
            if fmt is None:
                continue
            if file.is_symlink() and not file.exists():  # an input named like one, that leads nowhere
                raise TrainstackError(f"{file}: {_why_missing(file)}")
            if not file.is_file() or _under_local(file, out):
                continue
            uri = f"{base}/{file.relative_to(path).as_posix()}" if base else str(file)
            units[uri] = Unit(uri, file.stat().st_size, fmt, str(file))
    return sorted(units.values(), key=lambda u: u.uri)


def _why_missing(path: Path) -> str:
    """Why a path that does not exist as a file does not: a symlink loop, a dangling link, or nothing."""
    if not path.is_symlink():
        return "no such file or directory"
    try:
        path.resolve(strict=True)
    except RuntimeError:  # pathlib's "Symlink loop from ..." (Python 3.11)
        return "a symbolic link that loops back on itself (a symlink cycle): it leads to no file"
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symbolic link that loops back on itself (a symlink cycle): it leads to no file"
        return f"a symbolic link to {os.readlink(path)}, which does not exist"
    return "no such file or directory"


def _under_local(file: Path, out: str) -> bool:
    return not out.startswith("s3://") and file.resolve().is_relative_to(Path(out).resolve())


def _s3_units(uri: str, out: str) -> list[Unit]:
    bucket, prefix = split_s3(uri)
    store = S3Store(f"s3://{bucket}/")
    found = []
    for key, size in sorted(store.list(prefix).items()):
        full = f"s3://{bucket}/{key}"
        if out.startswith("s3://") and full.startswith(out.rstrip("/") + "/"):
            continue
        fmt = format_of(key, explicit=key == prefix)
        if fmt is not None and not key.endswith("/"):
            found.append(Unit(full, size, fmt, None))
    if not found:
        raise TrainstackError(f"{uri}: no JSONL, Parquet or text objects under this prefix")
    return found


# --- the worker -------------------------------------------------------------------------------------


_state: dict = {}


def _die_with_parent(parent: int) -> None:
    """A pool worker ends when the process that started it does (Linux PR_SET_PDEATHSIG): a killed
    `data prepare` must not leave orphans writing shards and markers beside the rerun that resumes it."""
    if sys.platform != "linux":
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the request was in place
        os._exit(1)


def _init_worker(settings: Settings, parent: int | None = None, loaded: tuple | None = None) -> None:
    if parent is not None:
        _die_with_parent(parent)
    # One process per core: the tokenizer's own thread pool would oversubscribe them.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _state.clear()
    _state.update(settings=settings, store=open_store(settings.out))
    if loaded is not None:
        _state.update(info=loaded[0], encode=loaded[1])


def _tokenizer() -> tuple[TokenizerInfo, Encoder]:
    """This worker's tokenizer, loaded on first use (a failure is then a task's one-line error, not a
    broken pool)."""
    if "encode" not in _state:
        settings = _state["settings"]
        _state["info"], _state["encode"] = load_tokenizer(
            settings.tokenizer, settings.eos_token, settings.tokenizer_shown
        )
    return _state["info"], _state["encode"]


def describe_tokenizer() -> TokenizerInfo:
    """Run in a pool worker: the tokenizer's facts, so the parent need not load it too (a load is a
    fixed cost per process: 0.1-0.5 s of CPU for a 32K-128K vocabulary)."""
    return _tokenizer()[0]


def process_unit(unit: Unit) -> dict:
    """Tokenize one input file into its shards and write its completion marker; returns the marker."""
    from trainer.prepare.shard_writer import ShardWriter  # numpy: only the processes that tokenize

    settings, store = _state["settings"], _state["store"]
    info, encode = _tokenizer()
    started = time.monotonic()
    path, downloaded = _local_copy(unit, settings)
    name = f"{unit.stem}-{unit.id}"
    writers = {
        "train": ShardWriter(store, f"shards/{name}", info.dtype, info.eos_id, settings.shard_tokens),
        VALIDATION: ShardWriter(
            store,
            f"{VALIDATION}/shards/{name}",
            info.dtype,
            info.eos_id,
            settings.shard_tokens,
            f"{VALIDATION}/",
        ),
    }
    documents = {"train": 0, VALIDATION: 0}
    counts = RecordCounts()
    batch: list = []
    batch_chars = 0

    def split_of(key: bytes | None, text: str | None = None) -> str:
        if settings.validation_fraction <= 0:
            return "train"
        key = text.encode("utf-8") if key is None else key
        return VALIDATION if in_validation(key, settings.validation_fraction) else "train"

    def flush() -> None:
        nonlocal batch, batch_chars
        texts: dict[str, list[str]] = {"train": [], VALIDATION: []}
        for document in batch:
            texts[split_of(document.split_key, document.text)].append(document.text)
        for split, chosen in texts.items():
            if chosen:  # order within a split is the input's
                writers[split].add_documents(*encode.documents(chosen, info.dtype))
                documents[split] += len(chosen)
        batch, batch_chars = [], 0

    def in_pieces(split_key: bytes | None, text: str | None, pieces) -> None:
        # One long document: each piece encoded on its own (trainer.prepare.inputs says why).
        flush()
        split = split_of(split_key, text)
        for piece in pieces:
            writers[split].add(encode.pieces([piece])[0])
        writers[split].end_document()
        documents[split] += 1

    for writer in writers.values():
        writer.remove_leftovers()  # of a run killed while writing this file: nothing stale stays beside
    try:
        for document in read_documents(
            path, unit.uri, unit.fmt, settings.text_field, counts, settings.max_bad_records
        ):
            if document.text is None:  # a plain-text file: one document, in pieces
                in_pieces(document.split_key, None, document.pieces)
                continue
            if len(document.text) > TEXT_PIECE_BYTES:
                in_pieces(document.split_key, document.text, cut_pieces(document.text))
                continue
            batch.append(document)
            batch_chars += len(document.text)
            if len(batch) >= BATCH_DOCUMENTS or batch_chars >= BATCH_CHARS:
                flush()
        flush()
        shards = {split: writer.close() for split, writer in writers.items()}
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
        "documents": documents,
        "tokens": {split: sum(s["tokens"] for s in entries) for split, entries in shards.items()},
        "skipped_records": counts.bad,
        "empty_records": counts.empty,
        "first_skipped": counts.first_bad,
        "shards": shards,
        "seconds": round(time.monotonic() - started, 3),
    }
    store.write(f"{DONE_PREFIX}{unit.id}.json", json.dumps(marker).encode())
    return marker


def _local_copy(unit: Unit, settings: Settings) -> tuple[Path, bool]:
    if unit.local is not None:
        return Path(unit.local), False
    bucket, key = split_s3(unit.uri)
    suffix = "".join(Path(key).suffixes[-2:])
    destination = Path(settings.scratch) / f"{unit.id}{suffix}"
    S3Store(f"s3://{bucket}/").download(key, destination)
    return destination, True


# --- the run --------------------------------------------------------------------------------------------

LOCK_DIR_ENV = "TRAINSTACK_PREPARE_LOCK_DIR"  # default: the temp directory


def lock_path(out: str) -> Path:
    """The lock file of one output on this machine: a local output by its real path, S3 by its URI."""
    where = out.rstrip("/") if out.startswith("s3://") else str(Path(out).resolve())
    folder = Path(os.environ.get(LOCK_DIR_ENV) or tempfile.gettempdir()) / "trainstack-prepare-locks"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / (hashlib.sha256(where.encode()).hexdigest()[:16] + ".lock")


@contextmanager
def writer_lock(out: str) -> Iterator[None]:
    """One preparation writes one output at a time on a machine: an exclusive flock held by this process
    for the whole run (the kernel drops it when the process ends, killed or not; its pool workers die
    with it, PR_SET_PDEATHSIG). A second one, a rerun beside a writer that is still alive included, is
    refused in one line naming the writer's pid."""
    import fcntl

    path = lock_path(out)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise TrainstackError(
                f"--out {out}: another data preparation (pid {holder}) is writing it on this machine; wait "
                "for it to end or stop it, then rerun to resume"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


# What a preparation writes under its output (the only things --overwrite deletes).
DATASET_PARTS = ("_prepare/", "shards/", f"{VALIDATION}/", INDEX_FILE, MANIFEST_FILE)


def other_corpus(store, done: dict[str, dict], units: list[Unit], overwrite: bool) -> dict[str, dict]:
    """The markers to resume from. Files finished earlier that are not among this run's inputs mean the
    output holds another corpus (prepared with the same settings): resuming would drop it from the index
    without a word, so it is refused in one line, or with `overwrite` deleted first (local outputs)."""
    inputs = {u.uri for u in units}
    foreign = sorted(uri for uri in done if uri not in inputs)
    if not foreign:
        return done
    more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
    if not overwrite:
        raise TrainstackError(
            f"--out {store.uri}: holds a dataset prepared from other files ({foreign[0]}{more}, not among "
            "the inputs given); give another --out, or --overwrite to replace it"
        )
    delete_dataset(store, "of other files")
    return {}


def delete_dataset(store, what: str) -> None:
    """--overwrite: delete what an earlier preparation wrote under a local output (DATASET_PARTS only)."""
    if isinstance(store, S3Store):
        raise TrainstackError(
            f"--overwrite: {store.uri} is in S3, where this preparation deletes nothing; empty it first "
            f"(`aws s3 rm --recursive {store.uri}`) or give another --out"
        )
    import shutil

    for part in DATASET_PARTS:
        path = store.root / part
        if path.is_dir():
            shutil.rmtree(path)
        elif path.is_file():
            path.unlink()
    print(f"prepare: --overwrite: deleted the dataset {what} in {store.uri}", file=sys.stderr)


def check_output(store, config: dict, overwrite: bool = False) -> bool:
    """Refuse an output that holds another dataset; record this one's settings on first use. With
    `overwrite`, a dataset prepared with other settings is deleted instead (local outputs): True then,
    and nothing done before is kept."""
    recorded = store.read(CONFIG_KEY)
    if recorded is None:
        held = [k for k in store.list() if k in (INDEX_FILE, MANIFEST_FILE) or k.endswith((".bin", ".idx"))]
        if held:
            raise TrainstackError(
                f"--out {store.uri}: already holds a dataset ({held[0]}) not made by this preparation; "
                "give an empty prefix"
            )
        store.write(CONFIG_KEY, json.dumps(config, indent=1).encode())
        return False
    try:
        before = json.loads(recorded)
    except json.JSONDecodeError:
        raise TrainstackError(f"{store.uri}{CONFIG_KEY}: not valid JSON") from None
    if before != config and not store.list(DONE_PREFIX):
        # Nothing was finished under the old settings (a first run that stopped on bad input): start over.
        store.write(CONFIG_KEY, json.dumps(config, indent=1).encode())
        return False
    for key, value in config.items():
        if before.get(key) == value:
            continue
        if overwrite:
            delete_dataset(store, f"prepared with {key} {before.get(key)!r}")
            store.write(CONFIG_KEY, json.dumps(config, indent=1).encode())
            return True
        raise TrainstackError(
            f"--out {store.uri}: already holds a dataset prepared with {key} {before.get(key)!r}, not "
            f"{value!r}; give another prefix, --overwrite to replace it (a local one), or the same "
            "settings to resume it"
        )
    return False


def done_markers(store) -> dict[str, dict]:
    markers = {}
    for key in sorted(store.list(DONE_PREFIX)):
        if key.endswith(".json"):
            marker = json.loads(store.read(key))
            markers[marker["uri"]] = marker
    return markers


class Progress:
    """`files, tokens, tokens/s, ETA` on stderr, at most every `every_s` seconds and at the end."""

    def __init__(self, total_files: int, total_bytes: int, every_s: float = 2.0):
        self.total_files, self.total_bytes, self.every_s = total_files, total_bytes, every_s
        self.files = self.bytes = self.tokens = 0
        self.started = self.shown = time.monotonic()

    def add(self, unit: Unit, marker: dict, force: bool = False) -> None:
        if marker["skipped_records"]:  # each file with bad records is named, with its first
            print(
                f"prepare: {unit.uri}: {marker['skipped_records']} bad record(s) skipped "
                f"(first: {marker['first_skipped']})",
                file=sys.stderr,
                flush=True,
            )
        self.files += 1
        self.bytes += unit.size
        self.tokens += sum(marker["tokens"].values())
        now = time.monotonic()
        if force or self.files == self.total_files or now - self.shown >= self.every_s:
            self.shown = now
            print(self.line(now), file=sys.stderr, flush=True)

    def line(self, now: float) -> str:
        elapsed = max(now - self.started, 1e-9)
        rate = self.tokens / elapsed
        left = (self.total_bytes - self.bytes) / (self.bytes / elapsed) if self.bytes else float("nan")
        eta = time.strftime("%H:%M:%S", time.gmtime(left)) if left == left else "?"
        share = 100.0 * self.bytes / self.total_bytes if self.total_bytes else 100.0
        return (
            f"prepare: {self.files}/{self.total_files} files, {self.tokens:,} tokens, {rate:,.0f} tokens/s, "
            f"{share:.0f}% of {data_size(self.total_bytes)}, ETA {eta}"
        )


def prepare(
    sources: list[str],
    tokenizer: str,
    out: str,
    *,
    text_field: str = "text",
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
    eos_token: str | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    workers: int | None = None,
    max_bad_records: int = DEFAULT_MAX_BAD_RECORDS,
    finalize: bool = True,
    overwrite: bool = False,
) -> dict:
    """Prepare `sources` into `out`; returns the root manifest (or, without finalize, a summary).
    `overwrite`: an output holding a dataset of other files is deleted first (local outputs only)."""
    if not 0 <= validation_fraction < 1:
        raise TrainstackError(f"--validation-fraction {validation_fraction}: expected 0 <= F < 1")
    if shard_tokens < 1 or max_bad_records < 0:
        raise TrainstackError("--shard-tokens must be positive and --max-bad-records non-negative")
    if workers is not None and workers < 1:
        raise TrainstackError(f"--workers {workers}: expected at least 1 (default: one per core)")
    store = open_store(out)
    with tempfile.TemporaryDirectory(prefix="trainstack-prepare-") as scratch, ExitStack() as stack:
        if finalize:  # before anything under `out` is read or written (module doc: --no-finalize)
            stack.enter_context(writer_lock(out))
        local_tokenizer = _tokenizer_file(tokenizer, Path(scratch))
        units = list_units(sources, out)
        if not units:
            raise TrainstackError(f"{' '.join(sources)}: no JSONL, Parquet or text files found")
        done = done_markers(store)
        if finalize:  # an instance of a Processing job sees only its share of the files
            done = other_corpus(store, done, units, overwrite)
        pending = [u for u in units if done.get(u.uri, {}).get("size") != u.size]
        workers = max(1, min(workers or os.cpu_count() or 1, len(pending) or 1))
        settings = Settings(
            out=out,
            tokenizer=local_tokenizer,
            tokenizer_shown=tokenizer,
            eos_token=eos_token,
            text_field=text_field,
            validation_fraction=validation_fraction,
            shard_tokens=shard_tokens,
            max_bad_records=max_bad_records,
            scratch=scratch,
        )
        if workers > 1:  # the workers load the tokenizer; one of them tells this process what it is
            pool = stack.enter_context(_pool(settings, workers))
            loaded, info = None, pool.submit(describe_tokenizer).result()
        else:
            pool, loaded = None, load_tokenizer(local_tokenizer, eos_token, tokenizer)
            info = loaded[0]
        config = {
            "format": DATASET_FORMAT,
            "tokenizer": info.identity,
            "eos_id": info.eos_id,
            "dtype": info.dtype,
            "text_field": text_field,
            "validation_fraction": validation_fraction,
            "shard_tokens": shard_tokens,
        }
        if check_output(store, config, overwrite and finalize):
            done, pending = {}, units  # the dataset of other settings is gone: every file again
        if pending and finalize:
            # The output is about to change: until its indexes are rewritten it must read as unfinished
            # (the trainer refuses a prepared output without its root manifest), not as the old dataset.
            store.discard(MANIFEST_FILE)
        print(
            f"prepare: {len(units)} input files ({data_size(sum(u.size for u in units))}), "
            f"{len(units) - len(pending)} already done; tokenizer {info.file} ({info.identity[:19]}, vocab "
            f"{info.vocab_size}, eos {info.eos_id}); {workers} worker(s); output {store.uri}",
            file=sys.stderr,
            flush=True,
        )
        _run(pending, settings, loaded, pool)
    if not finalize:
        return {"files": len(units), "processed": len(pending)}
    return write_indexes(store, info, config, [u.uri for u in units])


def _tokenizer_file(tokenizer: str, scratch: Path) -> str:
    if not tokenizer.startswith("s3://"):
        return tokenizer
    bucket, key = split_s3(tokenizer)
    destination = scratch / (Path(key).name or "tokenizer.json")
    data = S3Store(f"s3://{bucket}/").read(key)
    if data is None:
        raise TrainstackError(f"--tokenizer {tokenizer}: no such object")
    destination.write_bytes(data)
    return str(destination)


@contextmanager
def _pool(settings: Settings, workers: int) -> Iterator[ProcessPoolExecutor]:
    """Worker processes; on any error the files not started are cancelled (those finished keep their
    markers) and the pool is waited for."""
    context = multiprocessing.get_context("spawn")  # fork after torch/tokenizers threads can deadlock
    pool = ProcessPoolExecutor(
        workers, mp_context=context, initializer=_init_worker, initargs=(settings, os.getpid())
    )
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def _run(pending: list[Unit], settings: Settings, loaded: tuple | None, pool) -> None:
    """`pending` on this process (`loaded`: its tokenizer) or on `pool`, largest file first."""
    progress = Progress(len(pending), sum(u.size for u in pending))
    largest_first = sorted(pending, key=lambda u: -u.size)  # the long files start first: a shorter tail
    if pool is None:
        _init_worker(settings, loaded=loaded)  # the tokenizer already loaded here: not a second time
        for unit in largest_first:
            progress.add(unit, process_unit(unit))
        return
    futures = {pool.submit(process_unit, unit): unit for unit in largest_first}
    remaining = set(futures)
    while remaining:
        finished, remaining = wait(remaining, return_when=FIRST_COMPLETED)
        for future in finished:
            progress.add(futures[future], future.result())


def write_indexes(store, info: TokenizerInfo, config: dict, uris: list[str]) -> dict:
    """index.json and manifest.json for each split, from the markers of `uris` (root manifest last)."""
    markers = done_markers(store)
    missing = [u for u in uris if u not in markers]
    if missing:
        raise TrainstackError(
            f"{missing[0]}: not prepared yet ({len(missing)} files missing); rerun to resume"
        )
    chosen = [markers[u] for u in uris]
    splits = [VALIDATION, "train"] if config["validation_fraction"] > 0 else ["train"]
    manifests = {}
    if not any(m["shards"]["train"] for m in chosen):  # checked before any index is written
        skipped = [m for m in chosen if m["skipped_records"]]
        why = (
            f" ({sum(m['skipped_records'] for m in skipped)} bad record(s) skipped; first: "
            f"{skipped[0]['uri']}: {skipped[0]['first_skipped']})"
            if skipped
            else ""
        )
        raise TrainstackError(f"{uris[0]}: the inputs hold no document to train on{why}")
    for split in splits:
        entries = [entry for m in chosen for entry in m["shards"][split]]
        index = {
            "format": FORMAT,
            "dtype": info.dtype,
            "vocab_size": info.vocab_size,
            "eos_id": info.eos_id,
            "tokenizer": info.file,
            "shards": entries,
        }
        index_data = (json.dumps(index, indent=1) + "\n").encode()
        base = "" if split == "train" else f"{VALIDATION}/"
        manifest = {
            "format": DATASET_FORMAT,
            "split": split,
            "tool": {"name": TOOL, "version": __version__},
            "tokenizer": {
                "identity": info.identity,
                "file": info.file,
                "vocab_size": info.vocab_size,
                "eos_id": info.eos_id,
            },
            "dtype": info.dtype,
            "documents": sum(m["documents"][split] for m in chosen),
            "tokens": sum(e["tokens"] for e in entries),
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
            "text_field": config["text_field"],
            "shard_tokens": config["shard_tokens"],
        }
        write_split(store, base, split, index_data, manifest, manifests, config["validation_fraction"])
    return manifests["train"]


def write_split(
    store, base: str, split: str, index_data: bytes, manifest: dict, manifests: dict, fraction: float
) -> None:
    """Write one split's index and manifest (the train split's names the held-out split written before
    it), and keep the manifest in `manifests` by split. Text and chat datasets alike."""
    if split == "train" and VALIDATION in manifests:
        held = manifests[VALIDATION]
        manifest["validation"] = {
            "fraction": fraction,
            "path": VALIDATION,
            "documents": held["documents"],
            "tokens": held["tokens"],
            "index_sha256": held["index_sha256"],
        }
    store.write(f"{base}{INDEX_FILE}", index_data)
    store.write(f"{base}{MANIFEST_FILE}", (json.dumps(manifest, indent=1) + "\n").encode())
    manifests[split] = manifest


# --- command line -----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.prepare",
        description="Tokenize JSONL, Parquet or text files into token shards (trainstack's index plus a "
        "Megatron .idx per shard), on every core; a rerun resumes.",
    )
    parser.add_argument("sources", nargs="+", metavar="SRC", help="files, directories or s3:// prefixes")
    parser.add_argument("--tokenizer", required=True, help="tokenizer.json (local or s3://), or 'bytes'")
    parser.add_argument("--out", required=True, help="output directory or s3:// prefix")
    parser.add_argument("--text-field", default="text", help="JSONL field / Parquet column (default: text)")
    parser.add_argument(
        "--validation-fraction",
        type=float,
        default=DEFAULT_VALIDATION_FRACTION,
        help="share of documents held out, by a hash of each "
        f"(default {DEFAULT_VALIDATION_FRACTION}; 0: none)",
    )
    parser.add_argument(
        "--eos-token", help="end-of-document token of the tokenizer (default: the usual names)"
    )
    parser.add_argument(
        "--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard file"
    )
    parser.add_argument("--workers", type=int, help="worker processes (default: one per core)")
    parser.add_argument(
        "--max-bad-records",
        type=int,
        default=DEFAULT_MAX_BAD_RECORDS,
        help="per file: records that are not UTF-8 or JSON, skipped, before it stops "
        f"(default {DEFAULT_MAX_BAD_RECORDS})",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a dataset of other files already in --out (local outputs)",
    )
    parser.add_argument(
        "--no-finalize",
        action="store_true",
        help="process files only; write no index (Processing job instances)",
    )
    return parser


def summary(manifest: dict, out: str) -> str:
    held = manifest.get("validation") or {"documents": 0, "tokens": 0}
    return (
        f"prepared {out}: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens to train on, "
        f"{held['documents']:,} documents ({held['tokens']:,} tokens) held out for validation; "
        f"{sum(s['skipped_records'] for s in manifest['sources'])} records skipped. "
        f"Recipe: data.tokenizer: {manifest['tokenizer']['identity']}"
    )


def empty_validation_warning(manifest: dict) -> str | None:
    """The line said when a held-out split was asked for and none came out: the split is by a hash of
    each document, so a small corpus at a small fraction holds out none, and a recipe that validates on
    it is refused at launch (trainstack.aws.dataset_check), or by the trainer at step 0."""
    held = manifest.get("validation")
    if held is None or held["documents"]:
        return None
    return (
        f"prepare: warning: --validation-fraction {held['fraction']} held out no document (the share is by "
        "a hash of each); a recipe with validation cannot use this dataset: rerun with a larger fraction "
        "(and --overwrite, or another --out), or train without validation"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = prepare(
            args.sources,
            args.tokenizer,
            args.out,
            text_field=args.text_field,
            validation_fraction=args.validation_fraction,
            eos_token=args.eos_token,
            shard_tokens=args.shard_tokens,
            workers=args.workers,
            max_bad_records=args.max_bad_records,
            finalize=not args.no_finalize,
            overwrite=args.overwrite,
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
        print(f"processed {result['processed']} of {result['files']} files (no index written: --no-finalize)")
    else:
        print(summary(result, args.out))
        if (warning := empty_validation_warning(result)) is not None:
            print(warning, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
