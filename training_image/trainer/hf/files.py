"""A Hugging Face folder where it lives: a local directory or an S3 prefix, one small interface.

Used by trainer.hf.conversion (a base model to start from, `model.init_from`) and trainer.export (the folder a
run ends with). S3 goes through s3torchconnector's client, as the checkpoints do (trainer.storage:
region and endpoint from the environment, path-style addressing against an emulator): listing, whole
reads of small files (config.json, tokenizer files), and streamed copies of large ones in
COPY_CHUNK_BYTES pieces, so no file is ever held whole in memory.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from trainer.storage import s3_settings
from trainstack.errors import TrainstackError

COPY_CHUNK_BYTES = 16 * 2**20
# Tokenizer files a Hugging Face folder may carry (transformers' AutoTokenizer and vLLM read these).
TOKENIZER_FILES = re.compile(
    r"^(tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|added_tokens\.json|vocab\.json|"
    r"vocab\.txt|merges\.txt|tokenizer\.model|spiece\.model|chat_template\.jinja|chat_template\.json)$"
)


@dataclass(frozen=True)
class Folder:
    """A local directory (`root`) or an S3 prefix (`bucket`, `prefix` ending in / or empty)."""

    location: str
    root: Path | None = None
    bucket: str | None = None
    prefix: str = ""

    @property
    def is_s3(self) -> bool:
        return self.bucket is not None

    def _client(self):
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client

        region, endpoint = s3_settings()
        return S3Client(
            region, endpoint=endpoint, s3client_config=S3ClientConfig(force_path_style=bool(endpoint))
        )

    def files(self) -> dict[str, int]:
        """Name -> size of the files directly in the folder."""
        if self.root is not None:
            if not self.root.is_dir():
                return {}
            return {p.name: p.stat().st_size for p in self.root.iterdir() if p.is_file()}
        found = {}
        for page in self._client().list_objects(self.bucket, self.prefix, "/"):
            for info in page.object_info:
                found[info.key[len(self.prefix) :]] = int(info.size)
        return found

    def read(self, name: str) -> bytes | None:
        if self.root is not None:
            path = self.root / name
            return path.read_bytes() if path.is_file() else None
        from s3torchconnectorclient import S3Exception

        try:
            return self._client().get_object(self.bucket, self.prefix + name).read()
        except S3Exception as exc:
            if "not found" in str(exc).lower():
                return None
            raise

    def download(self, name: str, target: Path) -> None:
        """Copy one file to `target`, streamed."""
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        if self.root is not None:
            shutil.copyfile(self.root / name, tmp)
        else:
            stream = self._client().get_object(self.bucket, self.prefix + name)
            with open(tmp, "wb") as out:
                while chunk := stream.read(COPY_CHUNK_BYTES):
                    out.write(chunk)
        tmp.replace(target)

    def upload(self, source: Path, name: str) -> None:
        """Copy a local file into the folder, streamed (S3: one multipart upload)."""
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = self.root / (name + ".tmp")
            shutil.copyfile(source, tmp)
            tmp.replace(self.root / name)
            return
        with self._client().put_object(self.bucket, self.prefix + name) as stream, open(source, "rb") as src:
            while chunk := src.read(COPY_CHUNK_BYTES):
                stream.write(chunk)

    def write(self, name: str, data: bytes) -> None:
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = self.root / (name + ".tmp")
            tmp.write_bytes(data)
            tmp.replace(self.root / name)
            return
        with self._client().put_object(self.bucket, self.prefix + name) as stream:
            stream.write(data)


def open_folder(location: str | Path, what: str) -> Folder:
    """`what` names the setting in errors (e.g. "model.init_from")."""
    text = str(location)
    if text.startswith("s3://"):
        match = re.match(r"^s3://([^/]+)/?(.*)$", text)
        if not match or not match.group(1):
            raise TrainstackError(f"{what}: {text!r}: expected s3://BUCKET/PREFIX/")
        prefix = match.group(2).strip("/")
        return Folder(text, bucket=match.group(1), prefix=f"{prefix}/" if prefix else "")
    if "://" in text:
        raise TrainstackError(f"{what}: {text!r}: only s3:// URIs and local directories are supported")
    return Folder(text, root=Path(text))


def tokenizer_files(folder: Folder) -> list[str]:
    return sorted(name for name in folder.files() if TOKENIZER_FILES.match(name))
