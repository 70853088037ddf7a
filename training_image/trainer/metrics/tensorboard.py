"""TensorBoard event files written directly: the zero-dependency tracking fallback.

torch.utils.tensorboard needs the `tensorboard` package (with grpcio, markdown, werkzeug and its own
protobuf): too much for the training image to carry for a few scalars. The format is small and stable:
a file named `events.out.tfevents.<time>.<host>.<pid>` holding TFRecords, each an `Event` protocol buffer.

TFRecord (tensorflow/core/lib/io/record_writer.cc): uint64 length, uint32 masked CRC-32C of the length,
the data, uint32 masked CRC-32C of the data, all little-endian; masked = ((crc >> 15) | (crc << 17)) +
0xa282ead8. Event (tensorflow/core/util/event.proto): wall_time = 1 (double), step = 2 (int64),
file_version = 3 (string, "brain.Event:2" in the first record), summary = 5 (Summary). Summary
(tensorflow/core/framework/summary.proto): repeated Value value = 1; Value: tag = 1 (string),
simple_value = 2 (float). tests/trainer/test_tracking_tensorboard.py reads what this writes with
TensorBoard's own EventAccumulator (dev extra), not with this code.

On SageMaker the files go under TensorBoardOutputConfig's LocalPath (documented default
/opt/ml/output/tensorboard), which SageMaker syncs to the config's S3OutputPath while the job runs.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path

from trainstack.protocol.container import opt_ml

SAGEMAKER_LOCAL_PATH = opt_ml("output/tensorboard")  # TensorBoardOutputConfig.LocalPath default
FILE_VERSION = "brain.Event:2"


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # Castagnoli, reflected
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """One TFRecord around `data`."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc(length)) + data + struct.pack("<I", masked_crc(data))


# --- protocol buffer wire format: only what Event needs ---------------------------------------------


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # int64 negatives as two's complement, as protobuf encodes them
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _bytes_field(field: int, payload: bytes) -> bytes:
    return _key(field, 2) + _varint(len(payload)) + payload


def scalar_value(tag: str, value: float) -> bytes:
    """Summary.Value {tag, simple_value}."""
    return _bytes_field(1, tag.encode()) + _key(2, 5) + struct.pack("<f", value)


def event(
    wall_time: float, step: int, *, file_version: str | None = None, scalars: dict | None = None
) -> bytes:
    """An Event with a file version or a Summary of scalars."""
    out = _key(1, 1) + struct.pack("<d", wall_time) + _key(2, 0) + _varint(step)
    if file_version is not None:
        out += _bytes_field(3, file_version.encode())
    if scalars:
        summary = b"".join(_bytes_field(1, scalar_value(tag, float(v))) for tag, v in scalars.items())
        out += _bytes_field(5, summary)
    return out


class EventWriter:
    """Append scalar events to one new event file in `directory`; flushed after every write."""

    def __init__(self, directory: Path, clock=time.time) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        now = clock()
        self.path = directory / f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}"
        self._file = open(self.path, "ab")  # noqa: SIM115 (kept open for the job's life)
        self._write(event(now, 0, file_version=FILE_VERSION))

    def scalars(self, step: int, values: dict[str, float], wall_time: float | None = None) -> None:
        self._write(event(self._clock() if wall_time is None else wall_time, step, scalars=values))

    def _write(self, data: bytes) -> None:
        self._file.write(record(data))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def default_directory(run: str | None, recipe: str, environ: dict[str, str] | None = None) -> Path:
    """$TRAINSTACK_TENSORBOARD_DIR, else SageMaker's LocalPath when in a job, else ./tensorboard; one
    folder per trainstack run below it, so every job of a run adds to one TensorBoard run."""
    env = os.environ if environ is None else environ
    if env.get("TRAINSTACK_TENSORBOARD_DIR"):
        base = Path(env["TRAINSTACK_TENSORBOARD_DIR"])
    elif SAGEMAKER_LOCAL_PATH.parent.is_dir():
        base = SAGEMAKER_LOCAL_PATH
    else:
        base = Path("tensorboard")
    return base / (run or recipe)
