"""The CreateProcessingJob request for `data prepare --format chat` (trainstack.aws.processing): checked
against botocore's model of CreateProcessingJob (ProcessingInputs at most 10, ContainerArguments at most
100 of at most 256 characters), the base's tokenizer files one FullyReplicated input, the container's
command line the one trainer.prepare.chat_prepare parses, and the plan one process per small instance."""

from __future__ import annotations

import datetime

import pytest

from trainstack.aws.processing import (
    CHAT_BASE_STAGING,
    MAX_INPUTS,
    check_processing_request,
    create_processing_job_request,
    job_name,
)
from trainstack.aws.request_check import PLACEHOLDERS
from trainstack.planner.data_prep import CHAT_INSTANCE, plan_prepare

pytestmark = pytest.mark.fast
OUT = "s3://chat-sets/support/v1/"


def _request(sources: list[str], **plan):
    planned = plan_prepare({"jsonl": 50 * 10**9}, 400, chat=True, **plan)
    return planned, create_processing_job_request(
        job_name=job_name("nlp", "8b-sft", datetime.datetime(2026, 12, 6)),
        role_arn=PLACEHOLDERS["role_arn"],
        image_uri=PLACEHOLDERS["image_uri"],
        sources=sources,
        tokenizer=OUT + CHAT_BASE_STAGING,
        out=OUT,
        plan=planned,
        region="us-west-2",
        kms_key_arn=PLACEHOLDERS["kms_key_arn"],
        tags={"project": "trainstack", "team": "nlp"},
        validation_fraction=0.01,
        fmt="chat",
        seq_len=4096,
    )


def test_a_chat_request_passes_botocores_model_with_the_base_one_replicated_input():
    planned, request = _request(["s3://raw/chats/a/", "s3://raw/chats/b/"])
    assert check_processing_request(request) == []
    inputs = {i["InputName"]: i["S3Input"] for i in request["ProcessingInputs"]}
    assert inputs["base"]["S3Uri"] == OUT + "_prepare/base/"  # the staged tokenizer files, not the weights
    assert inputs["base"]["S3DataDistributionType"] == "FullyReplicated"
    assert (
        inputs["src0"]["S3DataDistributionType"]
        == inputs["src1"]["S3DataDistributionType"]
        == "ShardedByS3Key"
    )
    args = request["AppSpecification"]["ContainerArguments"]
    from trainer.prepare.chat_prepare import build_parser

    parsed = build_parser().parse_args(args)  # what the container's entry point reads
    assert parsed.format == "chat" and parsed.no_finalize and parsed.seq_len == 4096
    assert parsed.tokenizer == "/opt/ml/processing/input/base" and parsed.out == OUT
    assert parsed.sources == [
        "/opt/ml/processing/input/src0=s3://raw/chats/a/",
        "/opt/ml/processing/input/src1=s3://raw/chats/b/",
    ]
    # one process per instance: small instances, as many as the 2-hour target needs (50 GB of JSONL)
    assert planned.instance.name == CHAT_INSTANCE and planned.workers == 1 and planned.instance_count > 1


def test_a_chat_request_takes_at_most_nine_sources_beside_the_base():
    """CreateProcessingJob takes at most 10 ProcessingInputs (botocore's model); the base is one."""
    _, fits = _request([f"s3://raw/chats/{i}/" for i in range(MAX_INPUTS - 1)])
    assert check_processing_request(fits) == []
    _, over = _request([f"s3://raw/chats/{i}/" for i in range(MAX_INPUTS)])
    assert [(f.path, f.message) for f in check_processing_request(over)] == [
        ("ProcessingInputs", "11 items, more than SageMaker's maximum of 10")
    ]


def test_data_prepare_dry_run_of_conversations_on_aws_prints_the_chat_request_and_stages_nothing(
    tmp_path, monkeypatch
):
    import json

    from moto import mock_aws
    from typer.testing import CliRunner

    from trainstack.cli.main import app

    for key in ("AWS_ENDPOINT_URL", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in (("AWS_REGION", "us-west-2"), ("AWS_DEFAULT_REGION", "us-west-2")):
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    base = tmp_path / "base"
    base.mkdir()
    (base / "tokenizer.json").write_text("{}")
    (base / "tokenizer_config.json").write_text("{}")
    with mock_aws():
        import boto3

        s3 = boto3.client("s3", region_name="us-west-2")
        for bucket in ("raw", "chat-sets"):
            s3.create_bucket(Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
        s3.put_object(Bucket="raw", Key="chats/a.jsonl", Body=b'{"messages": []}\n')
        result = CliRunner().invoke(
            app,
            ["data", "prepare", "s3://raw/chats/", "--format", "chat", "--tokenizer", str(base), "--out", OUT,
             "--seq-len", "4096", "--recipe", "8b-sft", "--dry-run"],
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        request = json.loads(result.stdout[result.stdout.index("{") :])
        assert "Contents" not in s3.list_objects_v2(Bucket="chat-sets")  # a dry run stages nothing
    args = request["AppSpecification"]["ContainerArguments"]
    assert args[:2] == ["--format", "chat"] and "--no-finalize" in args
    assert {i["InputName"] for i in request["ProcessingInputs"]} == {"src0", "base"}
    assert request["ProcessingResources"]["ClusterConfig"]["InstanceType"] == CHAT_INSTANCE
