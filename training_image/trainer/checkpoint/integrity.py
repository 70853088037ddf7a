"""Digests computed as DCP writes, and checked as DCP reads: no checkpoint byte is read twice for them.

Writing: `DigestingWrites` stands in for a DCP storage writer's file system (torch's `FileSystem` on a
local directory, s3torchconnector's `S3FileSystem` on S3). Every stream DCP opens is wrapped: each
`write` goes to the real stream (a file, a multipart upload) and into a SHA-256, so when the stream
closes its size and digest are known without reading anything back. A stream that is written out of
order (a seek) would make the digest wrong, so its size is checked against the stream's own position.

Reading: `VerifiedReads` stands in for a DCP storage reader's file system. Every file of the checkpoint
is verified by exactly one rank (its writer's rank modulo the world; `.metadata` by every rank that
reads it): a file DCP opens on the rank that verifies it is read whole, front to back, checked, and
then served from memory, so no unverified byte reaches `torch.load` or `pickle` (and with the world
size unchanged every rank reads exactly its own files: nothing is read twice). Files a rank verifies
but DCP did not need there are streamed through the digest after the load. Other ranks' range reads
go to the backend's own reader (s3torchconnector's DCP-optimised ranged reader on S3).
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Callable, Generator, Iterable
from contextlib import contextmanager
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemBase

from trainer.runtime import faults
from trainstack.protocol.checkpoint_format import (
    DCP_METADATA,
    SHARD,
    FileRecord,
    digest_of,
    new_digest,
    owner_rank,
)

STREAM_CHUNK = 8 * 2**20  # bytes per read when a file is only streamed through the digest


class IntegrityError(Exception):
    """A checkpoint file that is not what its marker recorded: the message names the file."""


def verifier_of(name: str, world: int) -> int | None:
    """The rank that verifies file `name` on a load by `world` ranks (None: every rank that reads it)."""
    if name == DCP_METADATA:
        return None
    owner = owner_rank(name)
    return None if owner is None else owner % world


def _name(path: str | os.PathLike) -> str:
    return os.path.basename(os.fspath(path).rstrip("/"))


class _Delegating(FileSystemBase):
    """Every FileSystemBase method passed to the wrapped file system."""

    def __init__(self, inner: FileSystemBase):
        self.inner = inner

    def concat_path(self, path, suffix):
        return self.inner.concat_path(path, suffix)

    def rename(self, path, new_path) -> None:
        self.inner.rename(path, new_path)

    def init_path(self, path):
        return self.inner.init_path(path)

    def mkdir(self, path) -> None:
        self.inner.mkdir(path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def exists(self, path) -> bool:
        return self.inner.exists(path)

    def rm_file(self, path) -> None:
        self.inner.rm_file(path)

    @contextmanager
    def create_stream(self, path, mode: str) -> Generator[io.IOBase, None, None]:
        with self.inner.create_stream(path, mode) as stream:
            yield stream


class _HashingStream:
    """A write stream that hashes what it passes on. DCP calls write, tell, flush, close and (local,
    for fsync) fileno; anything else is the wrapped stream's."""

    def __init__(self, inner: Any, on_first_write: Callable[[], None] | None = None):
        self._inner = inner
        self._digest = new_digest()
        self.size = 0
        self.position: int | None = None  # the wrapped stream's own position when it was closed
        self._on_first_write = on_first_write

    def write(self, data: Any) -> int:
        written = self._inner.write(data)
        view = memoryview(data).cast("B")
        if written is not None and written != view.nbytes:
            raise OSError(f"short write: {written} of {view.nbytes} bytes")
        self._digest.update(view)
        self.size += view.nbytes
        if self._on_first_write is not None:
            hook, self._on_first_write = self._on_first_write, None
            self._inner.flush()  # the partial file exists on disk when the fault strikes
            hook()
        return view.nbytes

    def close(self) -> None:
        if (
            self.position is None
            and hasattr(self._inner, "tell")
            and not getattr(self._inner, "closed", False)
        ):
            self.position = self._inner.tell()
        self._inner.close()

    def seek(self, *args: Any) -> int:
        raise io.UnsupportedOperation("checkpoint files are written front to back (their digest)")

    def seekable(self) -> bool:
        return False

    def writable(self) -> bool:
        return True

    @property
    def hexdigest(self) -> str:
        return self._digest.hexdigest()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class DigestingWrites(_Delegating):
    """A storage writer's file system that records {name: FileRecord} of every file written whole."""

    def __init__(self, inner: FileSystemBase, step: int, rank: int):
        super().__init__(inner)
        self.step, self.rank = step, rank
        self.written: dict[str, FileRecord] = {}
        self._lock = threading.Lock()  # DCP writes a rank's files from several threads

    @contextmanager
    def create_stream(self, path, mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "wb":
            with self.inner.create_stream(path, mode) as stream:
                yield stream
            return
        name = _name(path)
        hook = None
        if SHARD.match(name) and faults.kills_at("mid-shards", self.step, self.rank):
            hook = lambda: faults.point("mid-shards", self.step, self.rank)  # noqa: E731
        with self.inner.create_stream(path, mode) as stream:
            hashing = _HashingStream(stream, hook)
            yield hashing  # type: ignore[misc]
            if hashing.position is None and hasattr(stream, "tell") and not getattr(stream, "closed", False):
                hashing.position = stream.tell()
            position = hashing.size if hashing.position is None else hashing.position
            if position != hashing.size:
                raise OSError(f"{name}: written out of order ({position} != {hashing.size} bytes)")
        # The inner stream has closed without error: the file (or S3 object) now holds these bytes.
        with self._lock:
            self.written[name] = FileRecord(hashing.size, hashing.hexdigest)

    def rename(self, path, new_path) -> None:
        self.inner.rename(path, new_path)  # DCP writes .metadata.tmp, then renames it (S3: copies)
        with self._lock:
            record = self.written.pop(_name(path), None)
            if record is not None:
                self.written[_name(new_path)] = record


class VerifiedReads(_Delegating):
    """A storage reader's file system that checks every file this rank verifies against its record.

    `open_whole(name)`: a context manager streaming that file front to back (trainer.storage's
    `open_read`). A mismatch raises IntegrityError (inside DCP, which then fails the load on every
    rank) and is kept in `problem` for the agreement that follows."""

    def __init__(
        self,
        inner: FileSystemBase,
        records: dict[str, FileRecord],
        rank: int,
        world: int,
        open_whole: Callable[[str], Any],
    ):
        super().__init__(inner)
        self.records, self.rank, self.world = records, rank, world
        self.open_whole = open_whole
        self.verified: set[str] = set()
        self.problem: str | None = None

    def mine(self) -> list[str]:
        """The files this rank must verify."""
        return sorted(n for n in self.records if verifier_of(n, self.world) in (None, self.rank))

    def _fail(self, problem: str) -> IntegrityError:
        self.problem = self.problem or problem
        return IntegrityError(problem)

    def read_whole(self, name: str) -> bytes:
        """The file's bytes, checked against its record (raises IntegrityError)."""
        record = self.records.get(name)
        if record is None:
            raise self._fail(f"{name} is not listed in the checkpoint's marker")
        try:
            with self.open_whole(name) as stream:
                data = stream.read()
        except FileNotFoundError:
            raise self._fail(f"{name} is missing") from None
        problem = record.problem(name, len(data), digest_of(data) if record.sha256 else None)
        if problem is not None:
            raise self._fail(problem)
        self.verified.add(name)
        return data

    @contextmanager
    def create_stream(self, path, mode: str) -> Generator[io.IOBase, None, None]:
        name = _name(path)
        if mode == "rb" and verifier_of(name, self.world) in (None, self.rank):
            yield io.BytesIO(self.read_whole(name))  # type: ignore[misc]
            return
        with self.inner.create_stream(path, mode) as stream:
            yield stream

    def verify_rest(self, names: Iterable[str] | None = None) -> None:
        """Stream every file this rank verifies and has not read yet through the digest."""
        for name in names if names is not None else self.mine():
            if name in self.verified:
                continue
            record = self.records.get(name)
            if record is None:
                raise self._fail(f"{name} is not listed in the checkpoint's marker")
            digest, size = new_digest(), 0
            try:
                with self.open_whole(name) as stream:
                    while chunk := stream.read(STREAM_CHUNK):
                        digest.update(chunk)
                        size += len(chunk)
            except FileNotFoundError:
                raise self._fail(f"{name} is missing") from None
            problem = record.problem(name, size, digest.hexdigest() if record.sha256 else None)
            if problem is not None:
                raise self._fail(problem)
            self.verified.add(name)
