"""A run's checkpoints as `trainstack checkpoints` shows them: every step folder, its size, age and state.

The folders are listed from the run's S3 prefix (boto3) or from a local directory; each folder's state
comes from the format's own checks (trainstack.protocol.checkpoint_format.inspect, the very checks the
trainer makes before it loads anything): complete, incomplete (a save that never finished) or damaged
(naming the file). `verify` reads every byte of a folder and compares each file's SHA-256 with the one
recorded while it was written, which only the load (or this) can tell for same-size damage.

S3 requests: ListObjectsV2 (through boto3's paginator: S3 returns at most 1,000 keys per response, "the
response might contain fewer keys but will never contain more", S3 API reference) and GetObject; the
caller needs s3:ListBucket and s3:GetObject on the checkpoint bucket and kms:Decrypt on its key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from trainstack.errors import TrainstackError
from trainstack.protocol.checkpoint_format import (
    COMPLETE,
    DAMAGED,
    Inspection,
    inspect,
    new_digest,
    step_dir_name,
    step_of,
)

S3_PAGE_KEYS = 1000  # ListObjectsV2's documented maximum per response
READ_CHUNK = 8 * 2**20


@dataclass(frozen=True)
class StoredFile:
    size: int
    modified: datetime


class Location(Protocol):
    where: str  # an s3:// URI or a path, for messages

    def steps(self) -> list[int]: ...

    def listing(self, step: int) -> dict[str, StoredFile]: ...

    def read(self, step: int, name: str) -> bytes | None: ...

    def chunks(self, step: int, name: str) -> Iterator[bytes]: ...


class S3Location:
    def __init__(self, client: Any, uri: str, page_keys: int = S3_PAGE_KEYS):
        parts = urlsplit(uri)
        if parts.scheme != "s3" or not parts.netloc:
            raise TrainstackError(f"checkpoint location {uri!r}: expected s3://BUCKET/PREFIX/")
        self.client, self.bucket, self.page_keys = client, parts.netloc, page_keys
        prefix = parts.path.strip("/")
        self.prefix = f"{prefix}/" if prefix else ""
        self.where = f"s3://{self.bucket}/{self.prefix}"

    def _pages(self, prefix: str, delimiter: str | None = None) -> Iterator[dict[str, Any]]:
        arguments = {"Bucket": self.bucket, "Prefix": prefix}
        if delimiter:
            arguments["Delimiter"] = delimiter
        paginator = self.client.get_paginator("list_objects_v2")
        yield from paginator.paginate(**arguments, PaginationConfig={"PageSize": self.page_keys})

    def steps(self) -> list[int]:
        found = []
        for page in self._pages(self.prefix, "/"):
            for common in page.get("CommonPrefixes", []):
                step = step_of(common["Prefix"][len(self.prefix) :].rstrip("/"))
                if step is not None:
                    found.append(step)
        return sorted(found, reverse=True)

    def _key(self, step: int, name: str = "") -> str:
        return f"{self.prefix}{step_dir_name(step)}/{name}"

    def listing(self, step: int) -> dict[str, StoredFile]:
        base = self._key(step)
        return {
            item["Key"][len(base) :]: StoredFile(int(item["Size"]), item["LastModified"])
            for page in self._pages(base)
            for item in page.get("Contents", [])
        }

    def read(self, step: int, name: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(step, name))["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None

    def chunks(self, step: int, name: str) -> Iterator[bytes]:
        body = self.client.get_object(Bucket=self.bucket, Key=self._key(step, name))["Body"]
        yield from body.iter_chunks(READ_CHUNK)


class LocalLocation:
    def __init__(self, root: Path):
        self.root = root
        self.where = str(root)

    def steps(self) -> list[int]:
        found = [step_of(p.name) for p in self.root.iterdir() if p.is_dir()] if self.root.is_dir() else []
        return sorted((s for s in found if s is not None), reverse=True)

    def listing(self, step: int) -> dict[str, StoredFile]:
        folder = self.root / step_dir_name(step)
        files = {}
        for path in folder.iterdir():
            if path.is_file():
                stat = path.stat()
                files[path.name] = StoredFile(stat.st_size, datetime.fromtimestamp(stat.st_mtime, UTC))
        return files

    def read(self, step: int, name: str) -> bytes | None:
        path = self.root / step_dir_name(step) / name
        return path.read_bytes() if path.is_file() else None

    def chunks(self, step: int, name: str) -> Iterator[bytes]:
        with (self.root / step_dir_name(step) / name).open("rb") as stream:
            while chunk := stream.read(READ_CHUNK):
                yield chunk


@dataclass(frozen=True)
class CheckpointView:
    step: int
    state: str  # complete, incomplete or damaged
    problem: str | None  # why not complete, naming the file
    size: int  # bytes stored in the folder
    files: int
    modified: datetime | None  # the newest file's time
    verified: bool = False  # every file's digest was read and matched (`verify`)
    inspection: Inspection | None = None

    def age_s(self, now: datetime) -> float | None:
        return None if self.modified is None else max((now - self.modified).total_seconds(), 0.0)

    def as_dict(self, now: datetime) -> dict[str, Any]:
        return {
            "step": self.step,
            "state": self.state,
            "problem": self.problem,
            "size_bytes": self.size,
            "files": self.files,
            "modified": self.modified.isoformat() if self.modified else None,
            "age_s": self.age_s(now),
            "verified": self.verified,
        }


def view(step: int, stored: dict[str, StoredFile], inspection: Inspection) -> CheckpointView:
    """One folder's line (pure): what is stored, and what the format's checks found."""
    newest = max((f.modified for f in stored.values()), default=None)
    return CheckpointView(
        step,
        inspection.state,
        inspection.problem,
        sum(f.size for f in stored.values()),
        len(stored),
        newest,
        inspection=inspection,
    )


def list_checkpoints(location: Location) -> list[CheckpointView]:
    """Every step folder of the location, newest first, with the cheap checks' state."""
    views = []
    for step in location.steps():
        stored = location.listing(step)
        found = inspect(
            step, {n: f.size for n, f in stored.items()}, lambda name, s=step: location.read(s, name)
        )
        views.append(view(step, stored, found))
    return views


def verify(
    location: Location, checkpoint: CheckpointView, progress: Callable[[str, int], None] | None = None
) -> CheckpointView:
    """`checkpoint` after reading every file it lists and comparing sizes and digests; damaged (naming
    the first file that differs) or complete and verified. `progress(name, bytes)` after each chunk."""
    if checkpoint.state != COMPLETE or checkpoint.inspection is None:
        return checkpoint
    for name, record in sorted(checkpoint.inspection.files.items()):
        digest, size = new_digest(), 0
        for chunk in location.chunks(checkpoint.step, name):
            digest.update(chunk)
            size += len(chunk)
            if progress is not None:
                progress(name, len(chunk))
        problem = record.problem(name, size, digest.hexdigest() if record.sha256 else None)
        if problem is not None:
            return replace(checkpoint, state=DAMAGED, problem=problem)
    digested = all(record.sha256 for record in checkpoint.inspection.files.values())  # format 1: sizes only
    return replace(checkpoint, verified=digested)


def resumable(views: list[CheckpointView]) -> CheckpointView | None:
    """The folder the trainer would resume from if its load finds every digest matching."""
    return next((v for v in views if v.state == COMPLETE), None)


def step_problem(client: Any, uri: str, step: int) -> str | None:
    """Why step `step` under the run's S3 prefix is not a checkpoint to resume from, or None when it is
    (`resume --from-step`): the trainer's own cheap checks, which it repeats (with every digest) on load."""
    location = S3Location(client, uri)
    stored = location.listing(step)
    if not stored:
        return f"there is no checkpoint of step {step} under {location.where}"
    found = inspect(
        step, {name: f.size for name, f in stored.items()}, lambda name: location.read(step, name)
    )
    return None if found.usable else found.problem
