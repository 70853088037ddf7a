"""`data prepare --format chat` against the local emulator's S3 (issue 38: the same local and emulator
paths as pretraining data): conversations read from an S3 prefix, the chat dataset written to one
(token shards, masks, indexes, manifests), and read back exactly as the template tokenized them."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sft_helpers import CONVERSATIONS, base_folder, write_jsonl
from trainer.data.chat_shards import ChatShards, read_chat_dataset
from trainer.prepare.chat import ChatTokenizer
from trainer.prepare.chat_prepare import prepare_chat

pytestmark = pytest.mark.slow  # an emulator of its own


def test_conversations_from_s3_to_a_chat_dataset_in_s3(tmp_path, monkeypatch):
    pytest.importorskip("boto3")
    from trainstack.emulator.endpoint import Emulator

    base = base_folder(tmp_path / "base", "llama3")
    conversations = [
        [{**m, "content": f"{m['content']} {i}"} for m in CONVERSATIONS[i % 4]] for i in range(40)
    ]
    source = write_jsonl(tmp_path / "chats.jsonl", [*conversations, "{not json"])
    with Emulator() as emulator:
        for name, value in emulator.env().items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", emulator.env()["AWS_ENDPOINT_URL"])
        s3 = emulator.client("s3")
        for bucket in ("chats", "data"):
            s3.create_bucket(Bucket=bucket)
        s3.upload_file(str(source), "chats", "in/part0.jsonl")
        manifest = prepare_chat(
            ["s3://chats/in/"],
            str(base),
            "s3://data/sft/",
            seq_len=512,
            validation_fraction=0.2,
            shard_tokens=400,
        )
        local = tmp_path / "dataset"
        for item in s3.list_objects_v2(Bucket="data", Prefix="sft/")["Contents"]:
            path = local / item["Key"].removeprefix("sft/")
            path.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file("data", item["Key"], str(path))
    assert manifest["sources"][0]["uri"] == "s3://chats/in/part0.jsonl"
    assert manifest["chat"]["first_skipped"] == ["s3://chats/in/part0.jsonl: line 41: not JSON"]
    chat = ChatTokenizer(base)
    expected = {(e.ids.tobytes(), e.mask.tobytes()) for e in map(chat.encode, conversations)}
    read = set()
    for directory in (local, local / "validation"):
        shards = ChatShards(read_chat_dataset(directory))
        for i in range(shards.count):
            ids, mask = shards.example(i)
            read.add((ids.tobytes(), mask.astype(np.uint8).tobytes()))
    assert read == expected
    held = json.loads((local / "validation" / "manifest.json").read_text())
    assert manifest["chat"]["examples"] + held["chat"]["examples"] == 40
    assert len(json.loads((local / "index.json").read_text())["shards"]) > 1
