"""Where `trainer.prepare` reads and writes: a local directory or an S3 prefix, one small interface.

S3 goes through s3torchconnector's client (already in the training image for checkpoints; no boto3
there): listing, whole-object reads of small files, streaming multipart writes of shards, and ranged
reads that copy an input object to local scratch disk in 8 MiB pieces, so no object is ever held in
memory whole (its sequential reader would buffer all it has read). Region: AWS_REGION, else
AWS_DEFAULT_REGION; endpoint: AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL (the local emulator, addressed
path-style).

Small files are whole-or-nothing on both: local files are written to `.tmp` and renamed, an S3 PUT is
atomic. A completion marker is written only after the files it lists, so a marker means they exist.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Protocol

from trainstack.errors import TrainstackError

PIECE_BYTES = 8 << 20


def split_s3(uri: str) -> tuple[str, str]:
    """(bucket, key prefix) of an s3:// URI; one line for anything else."""
    match = re.match(r"^s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(.*))?$", uri)
    if not match:
        raise TrainstackError(f"{uri}: expected s3://BUCKET/PREFIX")
    return match.group(1), match.group(2) or ""


class Store(Protocol):
    uri: str  # what messages show: the directory or the s3:// prefix, ending in "/"

    def list(self, prefix: str = "") -> dict[str, int]:
        """Key (relative to the store) -> size of every object under `prefix`."""
        ...

    def read(self, key: str) -> bytes | None: ...

    def write(self, key: str, data: bytes) -> None: ...

    def writer(self, key: str):  # a context manager yielding a binary stream; kept only if it exits cleanly
        ...


class LocalStore:
    def __init__(self, root: Path):
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():
            raise TrainstackError(f"--out {self.root}: exists and is not a directory")
        self.uri = f"{self.root}/"

    def list(self, prefix: str = "") -> dict[str, int]:
        base = self.root / prefix if prefix else self.root
        if not base.exists():
            return {}
        paths = [base] if base.is_file() else base.rglob("*")
        return {
            p.relative_to(self.root).as_posix(): p.stat().st_size
            for p in paths
            if p.is_file() and not p.name.endswith(".tmp")
        }

    def read(self, key: str) -> bytes | None:
        path = self.root / key
        return path.read_bytes() if path.is_file() else None

    def write(self, key: str, data: bytes) -> None:
        with self.writer(key) as stream:
            stream.write(data)

    @contextmanager
    def writer(self, key: str) -> Iterator[BinaryIO]:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as stream:
            yield stream
        os.replace(tmp, path)


class S3Store:
    def __init__(self, uri: str):
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client

        self.bucket, prefix = split_s3(uri)
        self.prefix = f"{prefix.strip('/')}/" if prefix.strip("/") else ""
        self.uri = f"s3://{self.bucket}/{self.prefix}"
        region, endpoint = s3_settings()
        # Emulators (moto) answer path-style requests only; real S3 takes virtual-hosted style.
        self.client = S3Client(
            region, endpoint=endpoint, s3client_config=S3ClientConfig(force_path_style=bool(endpoint))
        )

    def list(self, prefix: str = "") -> dict[str, int]:
        found = {}
        for page in self.client.list_objects(self.bucket, self.prefix + prefix):
            for info in page.object_info:
                found[info.key[len(self.prefix) :]] = int(info.size)
        return found

    def read(self, key: str) -> bytes | None:
        from s3torchconnectorclient import S3Exception

        try:
            return self.client.get_object(self.bucket, self.prefix + key).read()
        except S3Exception as exc:
            # s3torchconnector reports a missing key as "Service error: The key does not exist"
            if "does not exist" in str(exc) or "not found" in str(exc).lower():
                return None
            raise

    def write(self, key: str, data: bytes) -> None:
        with self.writer(key) as stream:
            stream.write(data)

    @contextmanager
    def writer(self, key: str) -> Iterator[BinaryIO]:
        # The writer's context abandons the multipart upload when the body raises: no partial object.
        with self.client.put_object(self.bucket, self.prefix + key) as stream:
            yield stream

    def download(self, key: str, destination: Path) -> None:
        """Copy one object to local disk in PIECE_BYTES ranged reads (memory stays one piece)."""
        from s3torchconnector import S3ReaderConstructor

        reader = self.client.get_object(
            self.bucket, self.prefix + key, reader_constructor=S3ReaderConstructor.range_based(buffer_size=0)
        )
        with open(destination, "wb") as out:
            while piece := reader.read(PIECE_BYTES):
                out.write(piece)


def s3_settings() -> tuple[str, str | None]:
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if not region:
        raise TrainstackError("an s3:// input or output needs AWS_REGION (or AWS_DEFAULT_REGION) set")
    return region, os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def open_store(location: str) -> LocalStore | S3Store:
    if location.startswith("s3://"):
        return S3Store(location)
    if "://" in location:
        raise TrainstackError(f"{location}: only s3:// URIs and local paths are supported")
    return LocalStore(Path(location))


def remove_local(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
