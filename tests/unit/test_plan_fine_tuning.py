"""`plan` of a fine-tuning recipe prices epochs over the prepared chat set, read from its manifest.

The manifest is a real one: `trainstack data prepare --format chat` of docs/sft.md's tiny base and 146
lines (144 conversations), and the rows it reports are checked against the trainer's own packing of the
written set (PackedChat over ChatShards: the rows an sft run's loader steps through). `plan` reads it
where the job would, `<data.train_s3_uri>/manifest.json` in S3 (moto's in-process S3 here)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainstack.cli.main import app
from trainstack.planner import plan
from trainstack.planner.fine_tuning import ManifestProblem, plan_fine_tuning
from trainstack.recipes.loader import resolve

pytestmark = pytest.mark.fast
REPO = Path(__file__).resolve().parents[2]
BUCKET, PREFIX = "chat-sets", "support/v1/"
URI = f"s3://{BUCKET}/{PREFIX}"
SEQ_LEN = 256
TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n{% generation %}"
    "{{ m.content }}<|im_end|>{% endgeneration %}\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def chat_set(tmp_path_factory) -> Path:
    """docs/sft.md's walkthrough set, prepared by the CLI at seq_len 256."""
    import tokenizers as k

    root = tmp_path_factory.mktemp("sft")
    byte = k.pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {c: i for i, c in enumerate(sorted(byte.alphabet()))} | {
        s: 256 + i for i, s in enumerate(specials)
    }
    tok = k.Tokenizer(k.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = byte, k.decoders.ByteLevel()
    tok.add_special_tokens(specials)
    (root / "base").mkdir()
    tok.save(str(root / "base" / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": TEMPLATE}
    (root / "base" / "tokenizer_config.json").write_text(json.dumps(config))
    chats = [
        [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": f"What is {a} plus {b}?"},
            {"role": "assistant", "content": str(a + b)},
        ]
        for a in range(12)
        for b in range(12)
    ]
    (root / "chats.jsonl").write_text("\n".join(json.dumps({"messages": c}) for c in chats) + "\n")
    done = subprocess.run(
        [sys.executable, "-m", "trainstack.cli.main", "data", "prepare", str(root / "chats.jsonl")]
        + ["--format", "chat", "--tokenizer", str(root / "base"), "--out", str(root / "set")]
        + ["--seq-len", str(SEQ_LEN), "--validation-fraction", "0.1"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    return root / "set"


def _recipe(*overrides: str):
    return resolve(
        "8b-sft", overrides=(f"data.train_s3_uri={URI}", f"training.seq_len={SEQ_LEN}", *overrides)
    ).recipe


def test_epochs_are_steps_over_the_rows_the_trainer_packs(chat_set):
    from trainer.data.chat_shards import ChatShards, read_chat_dataset
    from trainer.data.packing import PackedChat

    manifest = json.loads((chat_set / "manifest.json").read_text())
    shards = ChatShards(read_chat_dataset(str(chat_set)))
    packed = PackedChat(shards, SEQ_LEN)
    rows = len(packed)
    recipe = _recipe("training.global_batch=8", "training.micro_batch=1", "training.steps=50")
    planned = plan(recipe)
    figures = plan_fine_tuning(recipe, manifest, "m", planned.run.hours, planned.cost.total_usd)
    assert figures.rows == rows and not figures.rows_estimated
    assert figures.epochs == pytest.approx(50 * 8 / rows)
    assert figures.examples == shards.count and figures.tokens == manifest["tokens"]
    assert figures.packing_efficiency == pytest.approx(packed.efficiency, abs=1e-6)
    # the positions the plan prices hold the epochs' tokens and the rest is padding
    assert figures.positions_computed == 50 * 8 * SEQ_LEN == planned.cost.tokens
    assert figures.tokens_trained == pytest.approx(figures.epochs * manifest["tokens"])
    assert figures.padding_share == pytest.approx(1 - figures.tokens_trained / figures.positions_computed)
    assert figures.steps_for(2, 8) == math.ceil(2 * rows / 8)
    assert figures.usd_per_epoch == pytest.approx(planned.cost.total_usd / figures.epochs)
    assert any("published full fine-tuning runs train 1-3 epochs" in n for n in figures.notes)  # ~9 epochs


def test_a_set_packed_at_another_seq_len_is_estimated_and_said(chat_set):
    manifest = json.loads((chat_set / "manifest.json").read_text())
    recipe = _recipe("training.seq_len=512")
    figures = plan_fine_tuning(recipe, manifest, "m", 1.0, 100.0)
    efficiency = manifest["chat"]["packing"]["efficiency"]
    assert figures.rows_estimated and figures.rows == math.ceil(manifest["tokens"] / (512 * efficiency))
    assert any("prepared for seq_len 256" in note for note in figures.notes)


def test_a_pretraining_manifest_is_not_a_chat_set():
    with pytest.raises(ManifestProblem, match="chat: missing: not a chat dataset"):
        plan_fine_tuning(_recipe(), {"format": "trainstack-dataset-v1", "tokens": 10}, "m", 1.0, 1.0)


def test_a_fine_tunes_learning_rate_is_judged_against_fine_tuning_runs_not_pretraining_fits():
    from trainstack.planner import sanity

    recipe = resolve("8b-sft").recipe
    fields = {c.field for c in sanity.check(recipe, plan(recipe))}
    assert "training.lr" not in fields and "training.global_batch" not in fields  # 5e-6: Tulu 3's 8B rate
    high = resolve("8b-sft", overrides=("training.lr=1e-3",)).recipe
    (concern,) = [c for c in sanity.check(high, plan(high)) if c.field == "training.lr"]
    assert "overwrites what the base learned" in concern.message
    # the same rate pretraining from scratch is not warned about: the fits there are pretraining's
    assert not [
        c
        for c in sanity.check(resolve("8b-fp8").recipe, plan(resolve("8b-fp8").recipe))
        if c.field == "training.lr"
    ]


@pytest.fixture
def s3(monkeypatch):
    from moto import mock_aws

    for key in ("AWS_ENDPOINT_URL", "AWS_PROFILE", "TRAINSTACK_AWS_ENDPOINT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    with mock_aws():
        import boto3

        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        yield client


def _plan_json(*overrides: str):
    args = ["plan", "8b-sft", "--json", "-q", "--set", f"data.train_s3_uri={URI}"]
    for item in (f"training.seq_len={SEQ_LEN}", *overrides):
        args += ["--set", item]
    return CliRunner().invoke(app, args, env={**os.environ})


def test_plan_reads_the_manifest_from_the_data_channel_and_prices_epochs(s3, chat_set):
    s3.put_object(Bucket=BUCKET, Key=PREFIX + "manifest.json", Body=(chat_set / "manifest.json").read_bytes())
    result = _plan_json("training.global_batch=8", "training.micro_batch=1", "training.steps=11")
    assert result.exit_code == 0, result.output
    block = json.loads(result.stdout)["fine_tuning"]
    assert block["priced"] and block["manifest"] == f"{URI}manifest.json"
    assert block["rows"] == 43 and block["epochs"] == pytest.approx(11 * 8 / 43)
    assert block["packing_efficiency"] == pytest.approx(0.796239)
    text = CliRunner().invoke(
        app,
        ["plan", "8b-sft", "-q", "--set", f"data.train_s3_uri={URI}", "--set", f"training.seq_len={SEQ_LEN}"],
    )
    assert "fine-tuning data: " in text.stdout and "at 79.6% efficiency" in text.stdout


def test_plan_without_the_manifest_says_so_in_one_line_and_stands(s3):
    result = _plan_json()
    assert result.exit_code == 0, result.output
    block = json.loads(result.stdout)["fine_tuning"]
    assert not block["priced"] and "no such object" in block["reason"]
    text = CliRunner().invoke(app, ["plan", "8b-sft", "-q", "--set", f"data.train_s3_uri={URI}"])
    lines = [line for line in text.stdout.splitlines() if line.startswith("fine-tuning")]
    assert len(lines) == 1 and "need the prepared set's manifest" in lines[0]


def test_plan_refuses_a_pretraining_set_in_one_line_naming_the_data_channel(s3):
    manifest = {"format": "trainstack-dataset-v1", "tokens": 1000, "documents": 3}
    s3.put_object(Bucket=BUCKET, Key=PREFIX + "manifest.json", Body=json.dumps(manifest).encode())
    result = _plan_json()
    assert result.exit_code == 2
    assert "data.train_s3_uri: " in result.output and "not a chat dataset" in result.output


def test_plan_notes_a_chat_template_the_export_would_ship_other_than_the_sets(s3, chat_set):
    s3.put_object(Bucket=BUCKET, Key=PREFIX + "manifest.json", Body=(chat_set / "manifest.json").read_bytes())
    base = ("--set", f"model.init_from=s3://{BUCKET}/base/")
    config = {"eos_token": "<|im_end|>", "chat_template": TEMPLATE}
    s3.put_object(Bucket=BUCKET, Key="base/tokenizer_config.json", Body=json.dumps(config).encode())
    same = _plan_json(*base[1:])
    assert same.exit_code == 0, same.output
    template = json.loads(same.stdout)["fine_tuning"]["template"]
    assert template["compared"] and template["same"]  # the set was prepared with this folder's template
    # chat_template.jinja wins over tokenizer_config.json's, as transformers reads them: another format
    s3.put_object(Bucket=BUCKET, Key="base/chat_template.jinja", Body=TEMPLATE.replace("\n", " ").encode())
    other = _plan_json(*base[1:])
    assert other.exit_code == 0, other.output
    assert not json.loads(other.stdout)["fine_tuning"]["template"]["same"]
    args = ["plan", "8b-sft", "-q", "--set", f"data.train_s3_uri={URI}", *base]
    text = CliRunner(env={"COLUMNS": "400"}).invoke(app, [*args, "--set", f"training.seq_len={SEQ_LEN}"])
    shown = " ".join(text.stdout.split())  # the plan's lines are wrapped at its width
    assert "the set was rendered with another chat template" in shown
    assert f"than the one the export ships from model.init_from s3://{BUCKET}/base/" in shown
