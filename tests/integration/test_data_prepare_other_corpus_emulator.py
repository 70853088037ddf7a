"""`trainstack data prepare` on AWS (a SageMaker Processing job), against the emulator's S3 (issue 40 item
6): an `--out` prefix that holds another corpus prepared with the same settings is refused in one line
before the processing job is created (on AWS the instances would be paid for, then the final index
would replace that corpus), as `trainer.prepare` refuses it when it runs here."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from trainstack.cli.main import app

pytestmark = pytest.mark.slow

BUCKET = "corpora"


@pytest.fixture(scope="module")
def emulator():
    from trainstack.emulator.endpoint import Emulator

    with Emulator(jobs="hold") as running:
        s3 = running.client("s3")
        s3.create_bucket(Bucket=BUCKET)
        for name in ("a.jsonl", "b.jsonl"):
            s3.put_object(Bucket=BUCKET, Key=f"code/{name}", Body=b'{"text": "def f(): pass"}\n')
        # What an earlier `data prepare s3://corpora/web/ --out s3://corpora/tokens/` left: its marker.
        marker = {"uri": f"s3://{BUCKET}/web/part0.jsonl", "size": 10, "tokens": {"train": 3}}
        s3.put_object(
            Bucket=BUCKET, Key="tokens/_prepare/done/0123456789abcdef.json", Body=json.dumps(marker)
        )
        yield running


def test_a_processing_job_into_another_corpus_is_refused_before_it_is_created(emulator):
    env = {**emulator.env(), "COLUMNS": "200", "NO_COLOR": "1"}
    result = CliRunner(env=env).invoke(
        app,
        ["data", "prepare", f"s3://{BUCKET}/code/", "--tokenizer", "bytes", "--out", f"s3://{BUCKET}/tokens/",
         "--recipe", "1b-bf16"],
    )  # fmt: skip
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"error: --out s3://{BUCKET}/tokens/: holds a dataset prepared from other files "
        f"(s3://{BUCKET}/web/part0.jsonl, not among the inputs given); give another --out, or empty it "
        "first (data prepare deletes nothing in S3)"
    ]
    assert emulator.client("sagemaker").list_processing_jobs()["ProcessingJobSummaries"] == []
