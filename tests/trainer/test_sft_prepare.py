"""A chat dataset on disk (issue 38): conversations prepared into token shards with the loss mask
beside them, read back example by example exactly as the chat template gave them, its report (skipped
lines, dropped examples, packing efficiency), resumption, and the refusals of a damaged one."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sft_helpers import CONVERSATIONS, base_folder, write_jsonl
from trainer.data.chat_shards import ChatShards, read_chat_dataset
from trainer.data.packing import PackedChat
from trainer.data.shard_index import read_dataset
from trainer.prepare.chat import ChatTokenizer
from trainer.prepare.chat_prepare import prepare_chat, summary

from trainstack.errors import TrainstackError

pytestmark = pytest.mark.fast

SEQ_LEN = 80


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return base_folder(tmp_path_factory.mktemp("base") / "qwen2", "qwen2")


def many_conversations(count: int) -> list[list[dict]]:
    """Distinct conversations of varied length (a number in each, so each hashes apart)."""
    made = []
    for i in range(count):
        turns = CONVERSATIONS[i % len(CONVERSATIONS)]
        made.append(
            [
                {**m, "content": f"{m['content']} #{i}" if m["role"] != "system" else m["content"]}
                for m in turns
            ]
        )
    return made


@pytest.fixture(scope="module")
def prepared(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    conversations = many_conversations(60)
    records = [*conversations[:30], "{broken", {"no": "messages"}, *conversations[30:]]
    records = [r if isinstance(r, list | str) else json.dumps(r) for r in records]
    write_jsonl(root / "in" / "a.jsonl", records[:40])
    write_jsonl(root / "in" / "b.jsonl", records[40:])
    out = root / "out"
    manifest = prepare_chat(
        [str(root / "in")], str(base), str(out), seq_len=SEQ_LEN, validation_fraction=0.2, shard_tokens=500
    )
    return conversations, out, manifest


def test_every_kept_conversation_reads_back_as_the_template_tokenized_it(base, prepared):
    conversations, out, manifest = prepared
    chat = ChatTokenizer(base)
    expected = [chat.encode(c) for c in conversations]
    kept = {(e.ids.tobytes(), e.mask.tobytes()) for e in expected if e.ids.size <= SEQ_LEN}
    read = set()
    for directory in (out, out / "validation"):
        shards = ChatShards(read_chat_dataset(directory), model_vocab=chat.vocab_size)
        for i in range(shards.count):
            ids, mask = shards.example(i)
            read.add((ids.tobytes(), mask.astype(np.uint8).tobytes()))
    assert read == kept
    assert len(read_dataset(out).shards) > 2  # several token shards, each with its own mask
    too_long = sum(e.ids.size > SEQ_LEN for e in expected)
    assert too_long > 0 and manifest["chat"]["dropped_too_long"] == too_long


def test_the_manifest_reports_skipped_lines_by_number_dropped_examples_and_packing(prepared):
    conversations, out, manifest = prepared
    chat = manifest["chat"]
    assert chat["skipped_lines"] == 2
    assert chat["skipped_by_reason"] == {"not JSON": 1, "no 'messages' list": 1}
    assert [s.rsplit("/", 1)[-1] for s in chat["first_skipped"]] == [
        "a.jsonl: line 31: not JSON",
        "a.jsonl: line 32: no 'messages' list",
    ]
    held = json.loads((out / "validation" / "manifest.json").read_text())
    assert chat["examples"] + held["chat"]["examples"] + chat["dropped_too_long"] == len(conversations)
    assert held["chat"]["examples"] > 0 and manifest["validation"]["documents"] == held["chat"]["examples"]
    packed = PackedChat(ChatShards(read_chat_dataset(out)), SEQ_LEN)
    assert chat["packing"]["sequences"] == len(packed)
    assert chat["packing"]["efficiency"] == pytest.approx(packed.efficiency, abs=1e-6)
    assert 0.5 < packed.efficiency <= 1
    assert "packed" in summary(manifest, str(out)) and "2 line(s) skipped" in summary(manifest, str(out))


def test_the_mask_beside_each_shard_is_one_byte_per_token_and_its_hash_is_in_the_index(prepared):
    import hashlib

    _, out, _ = prepared
    index = json.loads((out / "index.json").read_text())
    assert index["loss_mask"] == {"format": "trainstack-loss-mask-v1", "dtype": "uint8", "seq_len": SEQ_LEN}
    for entry in index["shards"]:
        mask = (out / entry["mask"]).read_bytes()
        assert entry["mask"] == entry["file"].removesuffix(".bin") + ".mask"
        assert len(mask) == entry["tokens"] and set(mask) <= {0, 1}
        assert hashlib.sha256(mask).hexdigest() == entry["mask_sha256"]
        assert mask.count(1) == entry["targets"] > 0


def test_packed_rows_hold_every_example_once_per_epoch(prepared):
    _, out, _ = prepared
    shards = ChatShards(read_chat_dataset(out))
    packed = PackedChat(shards, SEQ_LEN, seed=3)
    tokens = 0
    targets = 0
    for r in range(len(packed)):
        row = packed.row(r)
        tokens += sum(row.lengths[: row.examples])
        targets += int((row.labels != -100).sum())
    index = json.loads((out / "index.json").read_text())
    assert tokens == sum(e["tokens"] for e in index["shards"])
    # Each example's first token is never a label (nothing precedes it in its example).
    first_targets = sum(int(shards.example(i)[1][0]) for i in range(shards.count))
    assert targets == sum(e["targets"] for e in index["shards"]) - first_targets
    with pytest.raises(TrainstackError, match="training.seq_len: 8 is shorter"):
        PackedChat(shards, 8)


def test_a_rerun_resumes_and_other_settings_are_refused(base, prepared):
    _, out, _ = prepared
    before = (out / "index.json").read_bytes()
    source = str(out.parent / "in")
    prepare_chat([source], str(base), str(out), seq_len=SEQ_LEN, validation_fraction=0.2, shard_tokens=500)
    assert (out / "index.json").read_bytes() == before
    with pytest.raises(TrainstackError, match="seq_len 80, not 100") as error:
        prepare_chat([source], str(base), str(out), seq_len=100, validation_fraction=0.2, shard_tokens=500)
    assert "\n" not in str(error.value)


def test_a_truncated_mask_or_a_dataset_without_masks_is_refused_in_one_line(base, prepared, tmp_path):
    import shutil

    _, out, _ = prepared
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    index = json.loads((copy / "index.json").read_text())
    victim = copy / index["shards"][1]["mask"]
    victim.write_bytes(victim.read_bytes()[:-3])
    with pytest.raises(TrainstackError, match=r"\.mask: .* bytes, its shard holds .* tokens"):
        read_chat_dataset(copy)
    del index["loss_mask"]
    (copy / "index.json").write_text(json.dumps(index))
    with pytest.raises(TrainstackError, match="loss_mask: missing"):
        read_chat_dataset(copy)


def test_nothing_to_train_on_is_one_line_naming_the_first_skipped_line(base, tmp_path):
    source = write_jsonl(tmp_path / "x.jsonl", [json.dumps({"text": "not a chat"})])
    with pytest.raises(TrainstackError, match="no conversation to train on .*line 1: no 'messages' list"):
        prepare_chat([str(source)], str(base), str(tmp_path / "out"), seq_len=SEQ_LEN)


def test_trainstack_data_prepare_format_chat_writes_the_dataset(base, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    source = write_jsonl(tmp_path / "in" / "chats.jsonl", many_conversations(12) + ["{bad"])
    out = tmp_path / "out"
    trainstack = Path(sys.executable).with_name("trainstack")
    command = [str(trainstack), "data", "prepare", str(source), "--format", "chat", "--tokenizer", str(base)]
    done = subprocess.run([*command, "--out", str(out), "--seq-len", "512"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "12 conversations" in done.stdout and "1 line(s) skipped" in done.stdout
    assert ChatShards(read_chat_dataset(out)).count == 12
    refused = subprocess.run([*command, "--out", str(tmp_path / "other")], capture_output=True, text=True)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        "error: --seq-len: --format chat needs the training sequence length (at least 2 tokens): longer "
        "conversations are dropped, never cut"
    ]


def test_the_pretraining_loader_refuses_a_chat_dataset_in_one_line(prepared):
    from trainer.data.loader import open_source

    _, out, _ = prepared
    with pytest.raises(TrainstackError, match="loss_mask: a chat dataset") as error:
        open_source(out, 64, 1000, 0)
    assert "\n" not in str(error.value)


def test_an_output_of_other_conversations_or_with_a_live_writer_is_refused(base, prepared, tmp_path):
    from trainer.prepare.pipeline import writer_lock

    _, out, _ = prepared
    other = write_jsonl(tmp_path / "other.jsonl", many_conversations(3))
    settings = dict(seq_len=SEQ_LEN, validation_fraction=0.2, shard_tokens=500)
    with pytest.raises(TrainstackError, match="holds a dataset prepared from other files"):
        prepare_chat([str(other)], str(base), str(out), **settings)
    fresh = tmp_path / "fresh"
    with writer_lock(str(fresh)), pytest.raises(TrainstackError, match="another data preparation"):
        prepare_chat([str(other)], str(base), str(fresh), **settings)
    assert not fresh.exists()  # nothing written beside the live writer


def test_a_preparation_stopped_by_a_damaged_file_resumes_to_the_same_dataset(base, tmp_path, capsys):
    import gzip

    conversations = many_conversations(20)
    write_jsonl(tmp_path / "in" / "a.jsonl", conversations[:10])
    damaged = tmp_path / "in" / "b.jsonl.gz"
    whole = gzip.compress("".join(json.dumps({"messages": c}) + "\n" for c in conversations[10:]).encode())
    damaged.write_bytes(whole[: len(whole) // 2])  # a truncated copy
    out = tmp_path / "out"
    settings = dict(seq_len=SEQ_LEN * 10, validation_fraction=0.0, shard_tokens=300)
    with pytest.raises(TrainstackError, match=r"b.jsonl.gz: cannot be read"):
        prepare_chat([str(tmp_path / "in")], str(base), str(out), **settings)
    assert not (out / "manifest.json").exists()  # visibly unfinished
    assert not [p for p in (out / "shards").iterdir() if p.name.startswith("b-")]  # nothing of b kept
    damaged.write_bytes(whole)
    capsys.readouterr()
    resumed = prepare_chat([str(tmp_path / "in")], str(base), str(out), **settings)
    assert "1 already done" in capsys.readouterr().err
    fresh = prepare_chat([str(tmp_path / "in")], str(base), str(tmp_path / "fresh"), **settings)
    assert resumed["chat"]["examples"] == fresh["chat"]["examples"] == 20
    assert (out / "index.json").read_bytes() == (tmp_path / "fresh" / "index.json").read_bytes()


def test_overwrite_replaces_a_local_dataset_of_other_conversations_through_the_command(base, tmp_path):
    """`trainstack data prepare --format chat --overwrite`: as for text, the dataset of other files in a
    local --out is deleted and this one written (without it, refused in one line)."""
    import subprocess
    import sys
    from pathlib import Path

    first = write_jsonl(tmp_path / "a" / "chats.jsonl", many_conversations(5))
    second = write_jsonl(tmp_path / "b" / "chats.jsonl", many_conversations(7))
    out = tmp_path / "out"
    trainstack = Path(sys.executable).with_name("trainstack")

    def prepare(source, *extra):
        command = [
            str(trainstack),
            "data",
            "prepare",
            str(source),
            "--format",
            "chat",
            "--tokenizer",
            str(base),
        ]
        return subprocess.run(
            [*command, "--out", str(out), "--seq-len", "512", *extra], capture_output=True, text=True
        )

    assert prepare(first).returncode == 0
    refused = prepare(second)
    assert refused.returncode == 2 and "holds a dataset prepared from other files" in refused.stderr
    replaced = prepare(second, "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert "--overwrite: deleted the dataset of other files" in replaced.stderr
    assert ChatShards(read_chat_dataset(out)).count == 7
