"""Formats against a writer and a reader the project did not write: megatron-core (NVIDIA's
megatron/core/datasets/indexed_dataset.py, the dev extra). Its IndexedDatasetBuilder writes a Megatron
indexed dataset that the trainer trains on; its IndexedDataset reads the shards `trainer.prepare` writes."""

from __future__ import annotations

import importlib
import importlib.util
import json
import socket
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from trainer.data.loader import open_source
from trainer.prepare.pipeline import prepare

pytestmark = pytest.mark.fast

TINY = Path(__file__).parent / "fixtures" / "tiny.yaml"


@pytest.fixture(scope="module")
def megatron():
    """megatron-core's indexed_dataset module, unchanged. Importing it through `megatron.core` runs the
    package's __init__ (model parallelism, optimizers, Transformer Engine probes: 11 s here), so the
    three packages around it are entered as bare namespaces and the one helper it takes from
    megatron.core.utils, `log_single_rank` (a logging call, not on the read or write path), is given;
    everything else it imports (object_storage_utils, msc_utils) is megatron-core's own."""
    spec = importlib.util.find_spec("megatron")
    if spec is None:
        pytest.skip("megatron-core is not installed (the dev extra)")
    root = Path(spec.submodule_search_locations[0])
    saved = {name: sys.modules.get(name) for name in ("megatron", "megatron.core", "megatron.core.datasets")}
    saved["megatron.core.utils"] = sys.modules.get("megatron.core.utils")
    for name in ("megatron", "megatron.core", "megatron.core.datasets"):
        package = types.ModuleType(name)
        package.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
        sys.modules[name] = package
    utils = types.ModuleType("megatron.core.utils")
    utils.log_single_rank = lambda logger, level, message, *args, **kwargs: logger.log(level, message, *args)
    sys.modules["megatron.core.utils"] = utils
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # its numpy 2 copy= warning
        module = importlib.import_module("megatron.core.datasets.indexed_dataset")
        yield module
    for name, previous in saved.items():
        if previous is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = previous


@pytest.fixture
def one_thread():
    """One intra-op thread, as the torchrun tests give each rank (OMP_NUM_THREADS=1): on the 2 shared
    cores, torch's default pool spends most of a tiny model's step waiting for the other thread."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def learnable_documents(count: int, seed: int) -> list[np.ndarray]:
    """Documents that walk a fixed cycle through 0..255 (a bigram a tiny model learns) and end in 256."""
    rng = np.random.default_rng(seed)
    cycle = rng.permutation(256)
    docs = []
    for _ in range(count):
        start, length = int(rng.integers(256)), int(rng.integers(40, 120))
        docs.append(np.append(cycle[(start + np.arange(length)) % 256], 256))
    return docs


def test_trains_on_a_megatron_dataset_written_by_megatron_core(
    megatron, tmp_path, monkeypatch, capsys, one_thread
):
    data = tmp_path / "megatron"
    data.mkdir()
    written = []
    for part in range(2):  # two prefixes, as preprocess_data.py writes with --partitions
        prefix = str(data / f"corpus_{part}_text_document")
        builder = megatron.IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
        for doc in learnable_documents(30, seed=part):
            builder.add_document(torch.from_numpy(doc), [len(doc)])
            written.append(doc)
        builder.finalize(prefix + ".idx")
    stream = np.concatenate(written)

    source = open_source(data, seq_len=32, vocab=257, seed=0)
    assert source.total_windows == (stream.size - 1) // 32
    for i in range(0, source.total_windows, 7):  # each sample is its window of the documents' tokens
        w = source.order(i)
        assert np.array_equal(source.sample(i), stream[32 * w : 32 * w + 33])

    from trainer.__main__ import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", port)
    code = main(
        ["--recipe", str(TINY), "--device", "cpu", "--set", "model.vocab=257", "--max-steps", "10"]
        + [
            "--set",
            "training.micro_batch=1",
            "--set",
            "training.global_batch=8",
            "--set",
            "training.warmup_steps=2",
        ]
        + ["--data-dir", str(data), "--checkpoint-dir", str(tmp_path / "ck")]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err[-2000:]
    losses = [
        float(line.split()[1].split("=")[1]) for line in captured.out.splitlines() if line.startswith("step=")
    ]
    assert len(losses) == 10 and losses[-1] < losses[0] - 0.3, losses


def test_megatron_core_reads_the_shards_prepare_writes(megatron, tmp_path):
    inputs = tmp_path / "in"
    inputs.mkdir()
    texts = [f"document {i}: " + "lorem ipsum dolor sit amet " * (i + 1) for i in range(40)]
    (inputs / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    manifest = prepare([str(inputs)], "bytes", str(tmp_path / "out"), validation_fraction=0.2, workers=1)
    held = manifest["validation"]
    assert manifest["documents"] + held["documents"] == 40 and 0 < held["documents"] < 40
    seen = []
    for split in ("", "validation/"):
        index = json.loads((tmp_path / "out" / split / "index.json").read_text())
        for entry in index["shards"]:
            dataset = megatron.IndexedDataset(
                str(tmp_path / "out" / split / entry["file"]).removesuffix(".bin")
            )
            assert len(dataset) == entry["documents"] == len(dataset.document_indices) - 1
            assert int(dataset.sequence_lengths.sum()) == entry["tokens"]
            for i in range(len(dataset)):
                tokens = dataset[i]
                assert tokens[-1] == 256  # each document ends with the end-of-document id
                seen.append(bytes(tokens[:-1].astype(np.uint8)).decode())
    assert sorted(seen) == sorted(texts)  # every document once, in exactly one split
