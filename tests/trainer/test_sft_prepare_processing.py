"""`--format chat` as a Processing job's instances run it (trainer.prepare.chat_prepare, `--no-finalize`):
each instance gets its share of the files (`LOCAL=URI` names each by its S3 URI, as ShardedByS3Key
copies them) and writes only their shards, masks and markers; a share run without `--no-finalize` would
read the other instance's markers as another corpus and stop; the finalize, every file done, writes the
dataset a single run writes. (The same on the emulator's Processing job: tests/integration/
test_chat_prepare_processing_emulator.py.)"""

from __future__ import annotations

import json
import shutil

import pytest
from sft_helpers import CONVERSATIONS, base_folder, write_jsonl
from trainer.data.chat_shards import ChatShards, read_chat_dataset
from trainer.prepare.chat_prepare import main, prepare_chat

from trainstack.errors import TrainstackError

pytestmark = pytest.mark.fast
URI = "s3://chat-corpus/support/"


def _examples(folder) -> list[tuple]:
    shards = ChatShards(read_chat_dataset(str(folder)))
    return sorted(
        tuple(zip(*(a.tolist() for a in shards.example(i)), strict=True)) for i in range(shards.count)
    )


def test_instances_with_no_finalize_then_the_finalize_make_the_single_runs_dataset(tmp_path):
    base = base_folder(tmp_path / "base", "qwen2")
    files = [write_jsonl(tmp_path / "all" / f"part{i}.jsonl", CONVERSATIONS * (i + 2)) for i in range(3)]
    shares = {0: (0, 2), 1: (1,)}  # what ShardedByS3Key gives two instances of three objects
    for instance, parts in shares.items():
        share = tmp_path / f"instance{instance}"
        share.mkdir()
        for p in parts:
            shutil.copy(files[p], share / files[p].name)
    out = tmp_path / "set"
    for instance in shares:
        args = ["--format", "chat", f"{tmp_path / f'instance{instance}'}={URI}", "--tokenizer", str(base)]
        assert main([*args, "--out", str(out), "--seq-len", "128", "--no-finalize"]) == 0
        assert not (out / "manifest.json").exists()  # no index until the finalize
    # An instance's share run as a finalizing one sees the other's files as another corpus.
    with pytest.raises(TrainstackError, match="holds a dataset prepared from other files"):
        prepare_chat([f"{tmp_path / 'instance1'}={URI}"], str(base), str(out), seq_len=128)
    sources = [f"{tmp_path / f'instance{i}'}={URI}" for i in shares]
    manifest = prepare_chat(sources, str(base), str(out), seq_len=128)  # the finalize: every file done
    single = prepare_chat([f"{tmp_path / 'all'}={URI}"], str(base), str(tmp_path / "single"), seq_len=128)
    assert [s["uri"] for s in manifest["sources"]] == [f"{URI}part{i}.jsonl" for i in range(3)]
    for key in ("tokens", "documents"):
        assert manifest[key] == single[key], key
    assert manifest["chat"]["packing"] == single["chat"]["packing"]
    assert manifest["chat"]["target_tokens"] == single["chat"]["target_tokens"]
    assert _examples(out) == _examples(tmp_path / "single")
    assert json.loads((out / "index.json").read_text()) == json.loads(
        (tmp_path / "single" / "index.json").read_text()
    )
