"""The event files trainer.metrics.tensorboard writes, read back by TensorBoard's own EventAccumulator (dev
extra), not by our code: what SageMaker syncs to S3 from TensorBoardOutputConfig's LocalPath must open
in it."""

from __future__ import annotations

import pytest
from trainer.metrics import tensorboard

pytestmark = pytest.mark.fast


def test_crc32c_is_castagnoli():
    # The CRC-32C check value (RFC 3720 appendix B.4; the catalogue's "123456789" vector).
    assert tensorboard.crc32c(b"123456789") == 0xE3069283


def test_tensorboards_reader_reads_every_scalar_by_step(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = tensorboard.EventWriter(tmp_path / "ts-platform-tiny--a")
    losses = {1: 5.5, 2: 4.25, 10: 3.125, 2**40: 2.0}  # a step past 32 bits: int64 varints
    for step, loss in losses.items():
        writer.scalars(step, {"loss": loss, "lr": 3e-4}, wall_time=1_700_000_000.0 + step % 1000)
    writer.close()
    assert writer.path.name.startswith("events.out.tfevents.")

    reader = EventAccumulator(str(tmp_path / "ts-platform-tiny--a"))
    reader.Reload()
    assert sorted(reader.Tags()["scalars"]) == ["loss", "lr"]
    loss = reader.Scalars("loss")
    assert [(e.step, e.value) for e in loss] == list(losses.items())
    assert [e.wall_time for e in loss][:2] == [1_700_000_001.0, 1_700_000_002.0]
    assert reader.Scalars("lr")[0].value == pytest.approx(3e-4)  # a float32, as TensorBoard stores it


def test_every_job_of_a_run_writes_into_the_runs_folder(tmp_path):
    env = {"TRAINSTACK_TENSORBOARD_DIR": str(tmp_path)}
    assert tensorboard.default_directory("ts-nlp-8b--main", "8b", env) == tmp_path / "ts-nlp-8b--main"
    assert tensorboard.default_directory(None, "8b", env) == tmp_path / "8b"
