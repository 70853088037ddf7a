"""Where checkpoints live: a local directory (CPU runs, tests) or an S3 prefix (SageMaker), one interface.

The checkpoint manager (trainer.checkpoint.manager) sees only this: the step directories present, the files of
one and their sizes, small whole-file reads and writes, deleting a step, and the DCP storage writer and
reader for a step. Both backends give the same guarantee for a small file: a reader sees all of it or
none of it (local: write to `.tmp`, then rename; S3: a PUT is atomic, and s3torchconnector's writer
abandons the upload when the write raises, so no partial object appears).

S3 goes through `s3torchconnector` (AWS's DCP storage writer and reader on the AWS CRT): every rank
writes its own shards straight to the run's prefix, so a checkpoint is durable when the save returns,
and on resume each rank reads only the byte ranges of its own shards. No SageMaker CheckpointConfig:
its sync would restore every kept checkpoint onto every node before the job starts and does not
guarantee that files written in the last seconds before a stop are uploaded.

Region: AWS_REGION, else AWS_DEFAULT_REGION (the launcher sets AWS_REGION in the job's environment).
Endpoint: AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL (the local emulator); with an endpoint override
addressing is path-style, as emulators need.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, StorageReader, StorageWriter

from trainstack.errors import TrainstackError
from trainstack.protocol.checkpoint_format import MARKER, STEP_DIR, step_dir_name

# DCP's writer threads per rank. S3: several concurrent multipart uploads per rank keep a node's
# 8 ranks busy enough to approach the network; local disk: one file per rank is enough.
S3_WRITER_THREADS = 4

# What s3torchconnector 1.5.0 raises for a key that does not exist (S3Exception, whose text is
# mountpoint-s3-client's error chain; the strings its own tests pin): a GET says "The key does not
# exist", a HEAD (which its readers make to learn an object's size) "The object was not found". Every
# other S3Exception (a missing bucket: "The bucket does not exist", access denied, throttling, the
# network) stays an error.
S3_MISSING_KEY = ("Service error: The key does not exist", "Service error: The object was not found")


def is_missing_key(error: BaseException) -> bool:
    """Whether an s3torchconnector error says the object does not exist (and nothing else)."""
    text = str(error)
    return any(text == form or text.startswith(form + ":") for form in S3_MISSING_KEY)


class CheckpointStorage(Protocol):
    location: str  # what the log shows: a path or an s3:// URI
    shared: bool  # one store seen by every rank (S3) rather than possibly one directory per node

    def steps(self) -> list[int]:
        """Steps with a step directory (complete or not), newest first."""
        ...

    def files(self, step: int) -> dict[str, int]:
        """Name -> size of every file in the step's directory (names relative to it)."""
        ...

    def read(self, step: int, name: str) -> bytes | None:
        """The whole file, or None when it does not exist."""
        ...

    def write(self, step: int, name: str, data: bytes) -> None:
        """Write a whole file; readers see all of it or none of it."""
        ...

    def open_read(self, step: int, name: str) -> Iterator[BinaryIO]:
        """A context manager: the file as a stream read front to back; FileNotFoundError when absent."""
        ...

    def delete(self, step: int) -> None: ...

    def prepare(self, step: int) -> None:
        """Make the step's directory writable (local: create it)."""
        ...

    def checkpoint_id(self, step: int) -> str: ...

    def writer(self, step: int) -> StorageWriter: ...

    def reader(self, step: int) -> StorageReader: ...


@dataclass
class LocalStorage:
    root: Path
    shared: bool = False  # may be node-local (one directory per node): each node prunes its own

    @property
    def location(self) -> str:
        return str(self.root)

    def _dir(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        found = [int(m.group(1)) for p in self.root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name))]
        return sorted(found, reverse=True)

    def files(self, step: int) -> dict[str, int]:
        directory = self._dir(step)
        if not directory.is_dir():
            return {}
        return {p.name: p.stat().st_size for p in directory.iterdir() if p.is_file()}

    def read(self, step: int, name: str) -> bytes | None:
        path = self._dir(step) / name
        return path.read_bytes() if path.is_file() else None

    @contextmanager
    def open_read(self, step: int, name: str) -> Iterator[BinaryIO]:
        with (self._dir(step) / name).open("rb") as stream:
            yield stream

    def write(self, step: int, name: str, data: bytes) -> None:
        path = self._dir(step) / name
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def delete(self, step: int) -> None:
        # The marker first: a delete cut short leaves an incomplete folder, never a damaged "complete" one.
        (self._dir(step) / MARKER).unlink(missing_ok=True)
        shutil.rmtree(self._dir(step), ignore_errors=True)

    def prepare(self, step: int) -> None:
        self._dir(step).mkdir(parents=True, exist_ok=True)

    def checkpoint_id(self, step: int) -> str:
        return str(self._dir(step))

    def writer(self, step: int) -> StorageWriter:
        return FileSystemWriter(self._dir(step))

    def reader(self, step: int) -> StorageReader:
        return FileSystemReader(self._dir(step))


def s3_settings(environ: dict[str, str] | None = None) -> tuple[str, str | None]:
    """(region, endpoint override or None) for s3torchconnector, from the environment."""
    env = os.environ if environ is None else environ
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if not region:
        raise TrainstackError(
            "checkpoint location is an s3:// URI but neither AWS_REGION nor AWS_DEFAULT_REGION is set "
            "(set AWS_REGION to the bucket's region in the job's environment)"
        )
    return region, env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None


class S3Storage:
    """Checkpoints under s3://bucket/prefix/step-NNNNNNNNN/, through s3torchconnector's client."""

    shared = True

    def __init__(self, uri: str, region: str, endpoint: str | None = None):
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client

        match = re.match(r"^s3://([^/]+)/?(.*)$", uri)
        if not match or not match.group(1):
            raise TrainstackError(f"checkpoint location {uri!r}: expected s3://BUCKET/PREFIX/")
        self.bucket = match.group(1)
        self.prefix = match.group(2).strip("/")
        self.prefix = f"{self.prefix}/" if self.prefix else ""
        self.location = f"s3://{self.bucket}/{self.prefix}"
        self.region, self.endpoint = region, endpoint
        # Emulators (moto) answer path-style requests only; real S3 takes virtual-hosted style.
        self.config = S3ClientConfig(force_path_style=endpoint is not None)
        self.client = S3Client(region, endpoint=endpoint, s3client_config=self.config)

    def _key(self, step: int, name: str = "") -> str:
        return f"{self.prefix}{step_dir_name(step)}/{name}"

    def _list(self, prefix: str, delimiter: str = "") -> tuple[list, list[str]]:
        objects, prefixes = [], []
        for page in self.client.list_objects(self.bucket, prefix, delimiter):
            objects.extend(page.object_info)
            prefixes.extend(page.common_prefixes)
        return objects, prefixes

    def steps(self) -> list[int]:
        _, prefixes = self._list(self.prefix, "/")
        found = []
        for prefix in prefixes:
            match = STEP_DIR.match(prefix[len(self.prefix) :].rstrip("/"))
            if match:
                found.append(int(match.group(1)))
        return sorted(found, reverse=True)

    def files(self, step: int) -> dict[str, int]:
        base = self._key(step)
        objects, _ = self._list(base)
        return {info.key[len(base) :]: int(info.size) for info in objects}

    def read(self, step: int, name: str) -> bytes | None:
        from s3torchconnectorclient import S3Exception

        try:
            return self.client.get_object(self.bucket, self._key(step, name)).read()
        except S3Exception as exc:
            if is_missing_key(exc):
                return None
            raise

    @contextmanager
    def open_read(self, step: int, name: str) -> Iterator[BinaryIO]:
        from s3torchconnectorclient import S3Exception

        # The default (sequential) reader: one front-to-back GET, which the CRT splits into parallel parts.
        try:
            yield self.client.get_object(self.bucket, self._key(step, name))
        except S3Exception as exc:
            if is_missing_key(exc):
                raise FileNotFoundError(f"{self.checkpoint_id(step)}{name}") from None
            raise

    def write(self, step: int, name: str, data: bytes) -> None:
        with self.client.put_object(self.bucket, self._key(step, name)) as stream:
            stream.write(data)

    def delete(self, step: int) -> None:
        # S3 has no directories: delete the step's objects one by one (s3torchconnector has no batch
        # delete). A few objects per rank per checkpoint.
        # The marker first: a delete cut short leaves an incomplete folder, never a damaged "complete" one.
        objects, _ = self._list(self._key(step))
        for info in sorted(objects, key=lambda info: info.key != self._key(step, MARKER)):
            self.client.delete_object(self.bucket, info.key)

    def prepare(self, step: int) -> None:
        pass

    def checkpoint_id(self, step: int) -> str:
        return f"s3://{self.bucket}/{self._key(step)}"

    def _file_system(self, reader_constructor=None):
        from s3torchconnector.dcp import S3FileSystem

        # Our client (explicit endpoint, path-style when overridden) instead of the writer's own,
        # which would read only AWS_ENDPOINT_URL and address the bucket virtual-hosted style.
        return S3FileSystem(self.region, s3_client=self.client, reader_constructor=reader_constructor)

    def writer(self, step: int) -> StorageWriter:
        from s3torchconnector.dcp import S3StorageWriter

        writer = S3StorageWriter(
            self.region, self.checkpoint_id(step), s3client_config=self.config, thread_count=S3_WRITER_THREADS
        )
        writer.fs = self._file_system()
        return writer

    def reader(self, step: int) -> StorageReader:
        from s3torchconnector.dcp import S3StorageReader

        reader = S3StorageReader(self.region, self.checkpoint_id(step), s3client_config=self.config)
        # Keep the reader's DCP-optimised range reader: prepare_local_plan gives it each rank's ranges.
        reader.fs = self._file_system(reader._reader_constructor)
        return reader


def open_storage(location: str | Path) -> CheckpointStorage:
    """An s3:// URI -> S3Storage; anything else is a local directory."""
    text = str(location)
    if text.startswith("s3://"):
        region, endpoint = s3_settings()
        return S3Storage(text, region, endpoint)
    if "://" in text:
        raise TrainstackError(f"checkpoint location {text!r}: only s3:// URIs and local paths are supported")
    return LocalStorage(Path(text))
