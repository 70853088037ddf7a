"""`data prepare --format chat` as a SageMaker Processing job, on the emulator: the CreateProcessingJob
request trainstack builds for conversations (trainstack.aws.processing, checked against botocore's
model), its base folder's tokenizer files staged under the output (not its weights), run by the
emulator on 2 instances (ShardedByS3Key: each its share of 3 JSONL files, the real `python -m
trainer.prepare --format chat ... --no-finalize`), then the finalize this machine does (as
trainstack.api.data does after the job): the dataset is the one a single local run makes of the same
files: the same conversations, tokens, targets and packing, and the trainer reads it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
BUCKET = "chat-corpus"
OUT = f"s3://{BUCKET}/prepared/"
TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n{% generation %}"
    "{{ m.content }}<|im_end|>{% endgeneration %}\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _base(folder: Path) -> Path:
    """docs/sft.md's base tokenizer files, plus a stand-in for the weights the job must not copy."""
    import tokenizers as k

    byte = k.pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {c: i for i, c in enumerate(sorted(byte.alphabet()))} | {
        s: 256 + i for i, s in enumerate(specials)
    }
    tok = k.Tokenizer(k.models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = byte, k.decoders.ByteLevel()
    tok.add_special_tokens(specials)
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"\0" * 4096)
    return folder


def _files(folder: Path) -> list[Path]:
    """docs/sft.md's 144 conversations and 2 bad lines, in 3 files."""
    chats = [
        json.dumps(
            {
                "messages": [
                    {"role": "system", "content": "Answer in one word."},
                    {"role": "user", "content": f"What is {a} plus {b}?"},
                    {"role": "assistant", "content": str(a + b)},
                ]
            }
        )
        for a in range(12)
        for b in range(12)
    ] + ["{not json", json.dumps({"messages": [{"role": "user", "content": "hi"}]})]
    folder.mkdir(parents=True)
    paths = []
    for i in range(3):
        path = folder / f"part{i}.jsonl"
        path.write_text("\n".join(chats[i::3]) + "\n")
        paths.append(path)
    return paths


def test_conversations_prepared_by_a_processing_job_equal_a_local_preparation(tmp_path):
    from trainstack.api.data import _stage_chat_base, entrypoint_args
    from trainstack.aws.processing import check_processing_request, create_processing_job_request
    from trainstack.emulator.endpoint import Emulator
    from trainstack.planner.data_prep import plan_prepare

    base, files = _base(tmp_path / "base"), _files(tmp_path / "chats")
    local_out = tmp_path / "local-set"
    here = subprocess.run(
        [sys.executable, "-m", "trainer.prepare"]
        + entrypoint_args([str(tmp_path / "chats")], str(base), str(local_out), format="chat", seq_len=256,
                          validation_fraction=0.1),
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert here.returncode == 0, here.stderr
    with Emulator() as emulator:
        env = {**os.environ, **emulator.env(), "AWS_ENDPOINT_URL_S3": emulator.endpoint}
        s3, sagemaker = emulator.client("s3"), emulator.client("sagemaker")
        s3.create_bucket(Bucket=BUCKET)
        for path in files:
            s3.upload_file(str(path), BUCKET, f"chats/{path.name}")
        staged = _stage_chat_base(s3, str(base), OUT, dry_run=False)
        assert staged == f"{OUT}_prepare/base/"
        listed = s3.list_objects_v2(Bucket=BUCKET, Prefix="prepared/_prepare/base/")["Contents"]
        assert sorted(o["Key"].rsplit("/", 1)[1] for o in listed) == [
            "tokenizer.json",
            "tokenizer_config.json",
        ]

        plan = plan_prepare({"jsonl": sum(p.stat().st_size for p in files)}, 3, chat=True, instance_count=2)
        request = create_processing_job_request(
            job_name="ts-prep-platform-chat--1", role_arn="arn:aws:iam::123456789012:role/prep",
            image_uri="123456789012.dkr.ecr.us-east-1.amazonaws.com/trainstack:1",
            sources=[f"s3://{BUCKET}/chats/"], tokenizer=staged, out=OUT, plan=plan, region="us-east-1",
            kms_key_arn=None, tags={"project": "trainstack"}, validation_fraction=0.1, fmt="chat",
            seq_len=256,
        )  # fmt: skip
        assert check_processing_request(request) == []
        assert plan.instance.name == "ml.c5.xlarge" and "1 worker each" in plan.describe()
        sagemaker.create_processing_job(**request)
        deadline = time.monotonic() + 300
        while (job := sagemaker.describe_processing_job(ProcessingJobName="ts-prep-platform-chat--1"))[
            "ProcessingJobStatus"
        ] not in ("Completed", "Failed", "Stopped"):
            assert time.monotonic() < deadline
            time.sleep(1)
        assert job["ProcessingJobStatus"] == "Completed", job.get("FailureReason")
        markers = s3.list_objects_v2(Bucket=BUCKET, Prefix="prepared/_prepare/done/")["Contents"]
        assert len(markers) == 3  # every file, by one instance or the other
        assert "Contents" not in s3.list_objects_v2(Bucket=BUCKET, Prefix="prepared/manifest.json")

        # The finalize, as trainstack.api.data runs it after the job: every file done, the indexes written.
        final = subprocess.run(
            [sys.executable, "-m", "trainer.prepare"]
            + entrypoint_args([f"s3://{BUCKET}/chats/"], str(base), OUT, format="chat", seq_len=256,
                              validation_fraction=0.1),
            cwd=REPO, env=env, capture_output=True, text=True,
        )  # fmt: skip
        assert final.returncode == 0, final.stderr
        assert "3 already done" in final.stderr
        copy = tmp_path / "aws-set"
        for item in s3.list_objects_v2(Bucket=BUCKET, Prefix="prepared/")["Contents"]:
            path = copy / item["Key"].removeprefix("prepared/")
            path.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(BUCKET, item["Key"], str(path))

    from trainer.data.chat_shards import ChatShards, read_chat_dataset

    ours, theirs = (json.loads((d / "manifest.json").read_text()) for d in (copy, local_out))
    assert ours["chat"]["packing"] == theirs["chat"]["packing"]
    for key in (
        "examples",
        "target_tokens",
        "lines",
        "skipped_lines",
        "dropped_too_long",
        "skipped_by_reason",
    ):
        assert ours["chat"][key] == theirs["chat"][key], key
    assert (
        ours["tokens"] == theirs["tokens"]
        and ours["validation"]["documents"] == theirs["validation"]["documents"]
    )

    def examples(folder: Path) -> list[tuple]:
        shards = ChatShards(read_chat_dataset(str(folder)))
        return sorted(
            tuple(zip(*(a.tolist() for a in shards.example(i)), strict=True)) for i in range(shards.count)
        )

    assert examples(copy) == examples(local_out)  # the same conversations, ids and masks
