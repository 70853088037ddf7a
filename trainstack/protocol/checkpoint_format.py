"""The checkpoint folder's format, defined once: file names, the marker and manifest schema, the digest.

The trainer writes it (training_image/trainer/checkpoint/manager.py), the trainer and `trainstack checkpoints`
read it. Standard library only: the training image imports this module.

One checkpoint is one folder under the run's location (a local directory or an s3:// prefix):

    step-000001000/
        __0_0.distcp ...           DCP shards of {"model", "optim"}: rank r writes __r_*.distcp
        .metadata                  DCP's index (rank 0), a pickle: unpickled only once its digest matched
        rank-00000.pt ...          per-rank trainer state: step, data position, LR scheduler, RNG states
        manifest-rank00000.json    per rank, after its shards: its own files, each {size, sha256}
        COMPLETE.json              rank 0, last: the state and every other file, each {size, sha256}

Format 2 (this one). Every file's SHA-256 is computed while it is written (the bytes hashed as they
stream to the file or the S3 upload, never read back), and the marker lists every file of the folder
but itself, so the marker alone says what a complete checkpoint holds:

    COMPLETE.json = {"format": 2, "digest": "sha256", "step": 1000, "world_size": 16,
                     "samples_consumed": 512000, "data_source": "...", "run": "...",
                     "files": {".metadata": {"size": 31337, "sha256": "<64 hex>"}, "__0_0.distcp": ..., ...}}
    manifest-rankNNNNN.json = {"format": 2, "digest": "sha256", "step": 1000, "rank": 3, "world_size": 16,
                               "files": {"__3_0.distcp": {"size": ..., "sha256": ...}, "rank-00003.pt": ...}}

Format 1 (written before digests were recorded, still read): the marker has no "format" and no
"files"; each manifest maps its files to their sizes. Such a checkpoint is checked by sizes only.

`inspect` makes the cheap checks anyone can make from a listing and the marker (no tensor data is
read): the marker parses and is consistent (step, a world size of at least one rank, exactly the files
such a world writes), every listed file is present with its listed size. Digests are checked by whoever
reads the bytes: the trainer on load, `trainstack checkpoints --verify`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

FORMAT = 2
DIGEST = "sha256"  # hashlib name; about 1 GiB/s per core with SHA-NI (docs/benchmarks.md)
MARKER = "COMPLETE.json"
DCP_METADATA = ".metadata"
STEP_DIR = re.compile(r"^step-(\d{9})$")
SHARD = re.compile(r"^__(\d+)_(\d+)\.distcp$")
EXTRAS = re.compile(r"^rank-(\d{5,})\.pt$")
MANIFEST = re.compile(r"^manifest-rank(\d{5,})\.json$")
HEX_DIGEST = re.compile(r"^[0-9a-f]{64}$")
MAX_WORLD_SIZE = 65536  # 8192 nodes of 8 GPUs: far above any recipe; a larger number is damage

COMPLETE, INCOMPLETE, DAMAGED = "complete", "incomplete", "damaged"
ABANDONED = "abandoned"  # the marker key of a folder left behind by `resume --from-step`


def step_dir_name(step: int) -> str:
    return f"step-{step:09d}"


def step_of(directory_name: str) -> int | None:
    match = STEP_DIR.match(directory_name)
    return int(match.group(1)) if match else None


def manifest_name(rank: int) -> str:
    return f"manifest-rank{rank:05d}.json"


def extras_name(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def owner_rank(name: str) -> int | None:
    """The rank that wrote file `name` of a checkpoint (.metadata: rank 0), None for the marker or
    a name the format does not have."""
    if name == DCP_METADATA:
        return 0
    for pattern in (SHARD, EXTRAS, MANIFEST):
        match = pattern.match(name)
        if match:
            return int(match.group(1))
    return None


def new_digest() -> Any:
    return hashlib.new(DIGEST)


def digest_of(data: bytes | bytearray | memoryview) -> str:
    return hashlib.new(DIGEST, data).hexdigest()


class FormatProblem(ValueError):
    """A marker or manifest that does not follow the format: the message names the file and field."""


@dataclass(frozen=True)
class FileRecord:
    size: int
    sha256: str | None  # None: a format-1 checkpoint, sizes only

    def as_json(self) -> dict[str, Any]:
        return {"size": self.size, DIGEST: self.sha256}

    def problem(self, name: str, size: int, sha256: str | None) -> str | None:
        """Why bytes of `size` with digest `sha256` are not this file, or None when they are."""
        if size != self.size:
            how = "truncated" if size < self.size else "grown"
            return f"{name} has {size} bytes, expected {self.size} ({how})"
        if self.sha256 is not None and sha256 is not None and sha256 != self.sha256:
            return f"{name}: {DIGEST} mismatch (its bytes changed after it was written)"
        return None


def record_of(data: bytes) -> FileRecord:
    return FileRecord(len(data), digest_of(data))


@dataclass(frozen=True)
class Marker:
    """COMPLETE.json, parsed and checked for consistency."""

    format: int
    step: int
    world_size: int
    samples_consumed: int
    data_source: str
    run: str | None
    files: dict[str, FileRecord] | None  # format 2: every file but the marker; format 1: None
    fields: dict[str, Any] = field(default_factory=dict)  # the document as written (others' fields too)


def _document(values: dict[str, Any]) -> bytes:
    return (json.dumps(values, indent=1) + "\n").encode()


def _records(files: Mapping[str, FileRecord]) -> dict[str, Any]:
    return {name: files[name].as_json() for name in sorted(files)}


def manifest_document(*, step: int, rank: int, world_size: int, files: Mapping[str, FileRecord]) -> bytes:
    return _document(
        {
            "format": FORMAT,
            "digest": DIGEST,
            "step": step,
            "rank": rank,
            "world_size": world_size,
            "files": _records(files),
        }
    )


def marker_document(
    *,
    step: int,
    world_size: int,
    samples_consumed: int,
    data_source: str,
    run: str | None,
    files: Mapping[str, FileRecord],
    **more: Any,
) -> bytes:
    """The marker's bytes. `more`: further JSON fields (kept by readers in `Marker.fields`)."""
    values = {
        "format": FORMAT,
        "digest": DIGEST,
        "step": step,
        "world_size": world_size,
        "samples_consumed": samples_consumed,
        "data_source": data_source,
        "run": run,
        **more,
        "files": _records(files),
    }
    return _document(values)


def abandoned_marker_document(resumed_from: int) -> bytes:
    """The marker that replaces a checkpoint's when a job resumes from an earlier step (`resume
    --from-step`): the folder is abandoned, its files are deleted next, and nothing resumes from it."""
    return _document({ABANDONED: True, "resumed_from": resumed_from})


def abandoned_from(raw: bytes) -> int | None:
    """The step a job resumed from when it abandoned this folder, or None for any other marker."""
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if (
        isinstance(value, dict)
        and value.get(ABANDONED) is True
        and isinstance(value.get("resumed_from"), int)
    ):
        return value["resumed_from"]
    return None


def _object(raw: bytes, name: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise FormatProblem(f"{name}: not valid JSON") from None
    if not isinstance(value, dict):
        raise FormatProblem(f"{name}: not a JSON object")
    return value


def _integer(values: dict[str, Any], key: str, name: str, low: int, high: int | None = None) -> int:
    value = values.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise FormatProblem(f"{name}: {key}: expected an integer, found {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f"at least {low}"
        raise FormatProblem(f"{name}: {key}: {value} is out of range ({bound})")
    return value


def _file_records(value: Any, name: str, format_: int) -> dict[str, FileRecord]:
    if not isinstance(value, dict):
        raise FormatProblem(f"{name}: files: expected an object of file names")
    records = {}
    for file_name, entry in value.items():
        if not isinstance(file_name, str) or owner_rank(file_name) is None:
            raise FormatProblem(f"{name}: files: {file_name!r} is not a file of a checkpoint")
        if format_ == 1:
            if not isinstance(entry, int) or isinstance(entry, bool) or entry < 0:
                raise FormatProblem(f"{name}: files: {file_name}: expected a size in bytes")
            records[file_name] = FileRecord(entry, None)
            continue
        if not isinstance(entry, dict):
            raise FormatProblem(f"{name}: files: {file_name}: expected {{size, {DIGEST}}}")
        size, digest = entry.get("size"), entry.get(DIGEST)
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise FormatProblem(f"{name}: files: {file_name}: size: expected a size in bytes")
        if not isinstance(digest, str) or not HEX_DIGEST.match(digest):
            raise FormatProblem(f"{name}: files: {file_name}: {DIGEST}: expected 64 hex digits")
        records[file_name] = FileRecord(size, digest)
    return records


def _format(values: dict[str, Any], name: str) -> int:
    if "format" not in values:
        return 1
    if values["format"] != FORMAT or values.get("digest") != DIGEST:
        raise FormatProblem(
            f"{name}: format {values.get('format')!r} with digest {values.get('digest')!r}: this trainer "
            f"reads format {FORMAT} ({DIGEST}) and format 1"
        )
    return FORMAT


def expected_files_problem(files: Mapping[str, FileRecord], world_size: int) -> str | None:
    """Why `files` are not exactly what a world of `world_size` ranks writes, or None."""
    for rank in range(world_size):
        for required in (extras_name(rank), manifest_name(rank)):
            if required not in files:
                return f"files: {required} is not listed (world_size {world_size})"
    if DCP_METADATA not in files:
        return f"files: {DCP_METADATA} is not listed"
    if not any(SHARD.match(name) for name in files):
        return "files: no .distcp shard is listed"
    for name in files:
        owner = owner_rank(name)
        if owner is None or owner >= world_size:
            return f"files: {name} does not belong to a world of {world_size} ranks"
    return None


def parse_marker(raw: bytes, step: int) -> Marker:
    """COMPLETE.json of step `step`, checked; raises FormatProblem naming the field."""
    values = _object(raw, MARKER)
    format_ = _format(values, MARKER)
    found = _integer(values, "step", MARKER, 0)
    if found != step:
        raise FormatProblem(f"{MARKER}: step: {found}, but the folder is {step_dir_name(step)}")
    world = _integer(values, "world_size", MARKER, 1, MAX_WORLD_SIZE)
    samples = _integer(values, "samples_consumed", MARKER, 0)
    source = values.get("data_source")
    if not isinstance(source, str) or not source:
        raise FormatProblem(f"{MARKER}: data_source: expected the name of the token source")
    run = values.get("run")
    if run is not None and not isinstance(run, str):
        raise FormatProblem(f"{MARKER}: run: expected a run name or null")
    files = None
    if format_ == FORMAT:
        files = _file_records(values.get("files"), MARKER, format_)
        problem = expected_files_problem(files, world)
        if problem is not None:
            raise FormatProblem(f"{MARKER}: {problem}")
    return Marker(format_, found, world, samples, source, run, files, values)


def parse_manifest(
    raw: bytes, step: int, rank: int, world_size: int | None = None, format_: int | None = None
) -> dict[str, FileRecord]:
    """Rank `rank`'s manifest of step `step`: its files; raises FormatProblem naming the field."""
    name = manifest_name(rank)
    values = _object(raw, name)
    found_format = _format(values, name)
    if format_ is not None and found_format != format_:
        raise FormatProblem(f"{name}: format {found_format}, but {MARKER} is format {format_}")
    if _integer(values, "step", name, 0) != step:
        raise FormatProblem(f"{name}: step: {values['step']}, but the folder is {step_dir_name(step)}")
    if _integer(values, "rank", name, 0) != rank:
        raise FormatProblem(f"{name}: rank: {values['rank']}, but the file is rank {rank}'s")
    if found_format == FORMAT and world_size is not None:
        if _integer(values, "world_size", name, 1, MAX_WORLD_SIZE) != world_size:
            raise FormatProblem(f"{name}: world_size: {values['world_size']}, but {MARKER} says {world_size}")
    files = _file_records(values.get("files"), name, found_format)
    foreign = [f for f in files if owner_rank(f) != rank]
    if foreign:
        raise FormatProblem(f"{name}: files: {foreign[0]} is not rank {rank}'s")
    return files


@dataclass(frozen=True)
class Inspection:
    """What the cheap checks found in one step folder."""

    step: int
    state: str  # COMPLETE, INCOMPLETE (never finished) or DAMAGED (finished, then something changed)
    problem: str | None  # why it is not complete, naming the file; None when complete
    marker: Marker | None = None
    files: dict[str, FileRecord] = field(default_factory=dict)  # what a complete folder holds

    @property
    def usable(self) -> bool:
        return self.state == COMPLETE

    @property
    def size(self) -> int:
        return sum(record.size for record in self.files.values())


# The order missing files are reported in: a missing manifest names the rank that had not finished.
def _report_order(name: str) -> tuple[int, str]:
    kind = 0 if MANIFEST.match(name) else 1 if EXTRAS.match(name) else 2 if name == DCP_METADATA else 3
    return kind, name


def inspect(step: int, present: Mapping[str, int], read: Callable[[str], bytes | None]) -> Inspection:
    """The cheap checks of step folder `step`: `present` maps every file in it to its size, `read`
    returns a small file's bytes (the marker; format 1's manifests) or None when it is absent."""
    raw = read(MARKER) if MARKER in present else None
    if raw is None:
        finished = sorted(int(m.group(1)) for n in present if (m := MANIFEST.match(n)))
        note = f"; manifests of ranks {_ranks(finished)} written" if finished else ""
        return Inspection(step, INCOMPLETE, f"no {MARKER} (interrupted while writing{note})")
    if (resumed_from := abandoned_from(raw)) is not None:
        return Inspection(step, INCOMPLETE, f"abandoned: a job resumed from step {resumed_from} instead")
    try:
        marker = parse_marker(raw, step)
        files = marker.files if marker.files is not None else _format1_files(marker, present, read)
    except FormatProblem as problem:
        return Inspection(step, DAMAGED, str(problem))
    missing = sorted((n for n in files if n not in present), key=_report_order)
    if missing:
        more = f" ({len(missing)} files missing)" if len(missing) > 1 else ""
        owner = owner_rank(missing[0])
        why = (
            f" (rank {owner} had not finished, or its files were lost)" if MANIFEST.match(missing[0]) else ""
        )
        return Inspection(step, DAMAGED, f"{missing[0]} is missing{why}{more}", marker, files)
    for name in sorted(files, key=_report_order):
        problem = files[name].problem(name, present[name], None)
        if problem is not None:
            return Inspection(step, DAMAGED, problem, marker, files)
    return Inspection(step, COMPLETE, None, marker, files)


def _format1_files(
    marker: Marker, present: Mapping[str, int], read: Callable[[str], bytes | None]
) -> dict[str, FileRecord]:
    files: dict[str, FileRecord] = {}
    for rank in range(marker.world_size):
        name = manifest_name(rank)
        raw = read(name) if name in present else None
        if raw is None:
            raise FormatProblem(f"{name} is missing (rank {rank} had not finished, or its files were lost)")
        files.update(parse_manifest(raw, marker.step, rank, format_=1))
        files[name] = FileRecord(present[name], None)
    problem = expected_files_problem(files, marker.world_size)
    if problem is not None:
        raise FormatProblem(f"the manifests: {problem}")
    return files


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8])
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
