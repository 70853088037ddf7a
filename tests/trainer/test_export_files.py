"""trainer.export's own reader and writer against the outside references: DCP's `dcp.load` for what a
checkpoint holds, the `safetensors` library for the files written (cheap: no model, no transformers)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import load_file
from trainer.export.hf_folder import CheckpointTensors, Piece, _write_file, safetensors_header
from trainer.storage import LocalStorage, step_dir_name

pytestmark = pytest.mark.fast


@pytest.fixture
def checkpoint(tmp_path):
    """A DCP checkpoint as the trainer's manager writes one (step directory, one rank), holding FP32
    tensors of several layouts, a transposed (non-contiguous) one and a BF16 one among them."""
    torch.manual_seed(0)
    state = {
        "model.fused": torch.randn(10, 6),
        "model.bias": torch.randn(10),
        "model.transposed": torch.randn(6, 4).t(),
        "model.half": torch.randn(5, 3).to(torch.bfloat16),
        "optim.state": torch.randn(1000),  # between them in the file: never read
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(tmp_path / step_dir_name(1)), no_dist=True)
    return LocalStorage(tmp_path), state


def _rows(blocks):
    return torch.cat([block for _, block in blocks])


def test_checkpoint_tensors_read_what_dcp_load_reads(checkpoint):
    storage, state = checkpoint
    source = CheckpointTensors(storage, 1)
    try:
        for name in ("model.fused", "model.bias", "model.transposed", "model.half"):
            expected = {name: torch.empty(state[name].shape)}
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(expected, checkpoint_id=storage.checkpoint_id(1), no_dist=True)
            blocks = source.load(name)
            assert torch.equal(_rows(blocks), expected[name]), name
            source.release(blocks)
    finally:
        source.close()
    # every model tensor's FP32 bytes once (the BF16 one through dcp.load, as FP32), none of the optimizer's
    assert source.bytes_read == 4 * (60 + 10 + 24 + 15)


def test_written_file_is_what_safetensors_reads_with_one_header(checkpoint, tmp_path):
    storage, state = checkpoint
    group = [  # row blocks of one fused parameter, as Q/K/V are, and tensors of their own
        Piece("a.q", "fused", 0, (4, 6)),
        Piece("a.bias", "bias", 0, (10,)),
        Piece("a.k", "fused", 4, (3, 6)),
        Piece("a.v", "fused", 7, (3, 6)),
        Piece("b.t", "transposed", 0, (4, 6)),
    ]
    for dtype in (torch.bfloat16, torch.float32):
        path = tmp_path / f"out-{dtype}.safetensors"
        source = CheckpointTensors(storage, 1)
        written = _write_file(path, group, source, dtype)
        source.close()
        loaded = load_file(str(path))
        assert sorted(loaded) == sorted(p.hf for p in group)
        fused, transposed = state["model.fused"], state["model.transposed"]
        expected = {
            "a.q": fused[0:4],
            "a.k": fused[4:7],
            "a.v": fused[7:10],
            "a.bias": state["model.bias"],
            "b.t": transposed,
        }
        for name, tensor in expected.items():
            assert loaded[name].dtype == dtype
            assert torch.equal(loaded[name], tensor.to(dtype)), name  # torch's own rounding to BF16
        assert written == sum(t.numel() * dtype.itemsize for t in expected.values())
        assert (
            path.stat().st_size == len(safetensors_header([(p.hf, dtype, p.shape) for p in group])) + written
        )
        with safe_open(str(path), "pt") as opened:
            assert opened.metadata() == {"format": "pt"}  # what transformers checks before loading
        assert not path.with_name(path.name + ".tmp").exists()


def test_header_is_padded_to_eight_bytes_as_safetensors_writes_it():
    for names in (["x"], ["xy"], ["a" * 13, "b"]):
        header = safetensors_header([(n, torch.bfloat16, (3,)) for n in names])
        size = int.from_bytes(header[:8], "little")
        assert size == len(header) - 8 and size % 8 == 0
