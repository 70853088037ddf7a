"""`trainstack checkpoints RUN`: against the emulator's S3, checkpoints the trainer's CheckpointManager
wrote there through s3torchconnector, the run found through its registry as `stop`/`resume` find it."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
from typer.testing import CliRunner

from trainstack.aws.checkpoints import S3_PAGE_KEYS, S3Location, list_checkpoints
from trainstack.cli.main import app
from trainstack.protocol.checkpoint_format import MARKER

pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")

RUN = "ts-platform-tiny-cpu--ckpt1"
BUCKET = "trainstack-ck"
PREFIX = f"s3://{BUCKET}/checkpoints/platform/tiny-cpu/ckpt1/"
DAMAGED_SHARD = "__0_0.distcp"  # DCP's first writer thread gets the largest tensors


def _save_three(env: dict[str, str], tmp_path) -> None:
    """Steps 1, 2, 3 of a tiny model, saved by the trainer's CheckpointManager as a world of one."""
    import os

    import torch.distributed as dist
    from trainer.checkpoint.manager import CheckpointManager, TrainerState

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(64, 64)
        optimizer = torch.optim.AdamW(model.parameters())
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        manager = CheckpointManager(PREFIX, keep=3, rank=0, world=1, run=RUN)
        for step in (1, 2, 3):
            model(torch.ones(2, 64)).sum().backward()
            optimizer.step()
            state = TrainerState(step=step, samples_consumed=step * 8, data_source="synthetic", world_size=1)
            manager.save(model, optimizer, scheduler, state, blocking=True)
        manager.close()
        del model, optimizer, manager
    finally:
        dist.destroy_process_group()
        for name, value in saved.items():
            os.environ.pop(name) if value is None else os.environ.update({name: value})


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    from trainstack.emulator.endpoint import Emulator

    with Emulator() as running:
        s3 = running.client("s3")
        s3.create_bucket(Bucket=BUCKET)
        _save_three(running.env(), tmp_path_factory.mktemp("store"))
        key = "checkpoints/platform/tiny-cpu/ckpt1/step-00000000{}/{}"
        s3.delete_object(Bucket=BUCKET, Key=key.format(3, MARKER))  # a save killed before its marker
        shard = s3.get_object(Bucket=BUCKET, Key=key.format(2, DAMAGED_SHARD))["Body"].read()
        assert shard
        garbage = bytes(b ^ 0x5A for b in shard)  # same size: only a digest tells
        s3.put_object(Bucket=BUCKET, Key=key.format(2, DAMAGED_SHARD), Body=garbage)
        register_run(running)
        yield running


def register_run(running) -> None:
    """The two things `find_run` reads: the deployed stacks' outputs and the run's registry item."""
    table = "runs-platform-tiny-cpu"
    running.client("dynamodb").create_table(
        TableName=table,
        KeySchema=[{"AttributeName": "run", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "run", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )
    now = datetime.now(UTC).isoformat()
    item = {
        "run": RUN,
        "run_id": "ckpt1",
        "recipe": "tiny-cpu",
        "team": "platform",
        "run_state": "stopped",
        "current_job": f"{RUN}-1",
        "job_index": 1,
        "last_job": 3,
        "checkpoint_uri": PREFIX,
        "steps": 60,
        "tokens_per_step": 512,
        "usd_per_hour": 98.3,
        "created": now,
        "updated": now,
    }
    typed = {k: {"N": str(v)} if isinstance(v, int | float) else {"S": v} for k, v in item.items()}
    running.client("dynamodb").put_item(TableName=table, Item=typed)
    cloudformation = running.client("cloudformation")
    for suffix, outputs in (("Data", {"RunTableName": table}), ("Launcher", {"StateMachineArn": "arn:x"})):
        template = {
            "Resources": {"Placeholder": {"Type": "AWS::CloudFormation::WaitConditionHandle"}},
            "Outputs": {k: {"Value": v} for k, v in outputs.items()},
        }
        cloudformation.create_stack(
            StackName=f"Trainstack-platform-tiny-cpu-{suffix}", TemplateBody=json.dumps(template)
        )


def cli(running, *args: str):
    return CliRunner(env={**running.env(), "COLUMNS": "160", "NO_COLOR": "1"}).invoke(app, [*args, "--local"])


def test_lists_every_kept_checkpoint_of_a_run_with_step_size_age_and_state(emulator):
    result = cli(emulator, "checkpoints", RUN, "--json")
    assert result.exit_code == 0, result.output
    listed = json.loads(result.stdout)
    assert [c["step"] for c in listed] == [3, 2, 1]
    assert [c["state"] for c in listed] == ["incomplete", "complete", "complete"]  # garbage: same size
    assert (
        listed[0]["problem"] == "no COMPLETE.json (interrupted while writing; manifests of ranks 0 written)"
    )
    objects = emulator.client("s3").list_objects_v2(Bucket=BUCKET, Prefix="checkpoints/")["Contents"]
    step1 = [o for o in objects if "/step-000000001/" in o["Key"]]
    assert listed[2]["size_bytes"] == sum(o["Size"] for o in step1) and listed[2]["files"] == len(step1)
    assert 0 <= listed[2]["age_s"] < 600 and listed[2]["verified"] is False
    shown = cli(emulator, "checkpoints", RUN)
    assert "The next job resumes from step 2 if its digests match" in shown.stdout


def test_verify_reads_every_byte_and_names_the_file_whose_digest_differs(emulator):
    result = cli(emulator, "checkpoints", RUN, "--verify", "--json")
    assert result.exit_code == 1, result.output  # a damaged checkpoint was found
    listed = {c["step"]: c for c in json.loads(result.stdout)}
    assert listed[2]["state"] == "damaged"
    assert (
        listed[2]["problem"] == f"{DAMAGED_SHARD}: sha256 mismatch (its bytes changed after it was written)"
    )
    assert listed[1]["state"] == "complete" and listed[1]["verified"] is True
    assert "reading every byte" in result.stderr and " read (" in result.stderr
    shown = cli(emulator, "checkpoints", RUN, "--verify")
    assert "The next job resumes from step 1." in shown.stdout
    assert f"damaged: {DAMAGED_SHARD}: sha256 mismatch" in shown.stdout


def test_an_s3_prefix_or_a_local_directory_works_too_and_an_unknown_run_is_one_line(emulator, tmp_path):
    by_prefix = cli(emulator, "checkpoints", PREFIX, "--json")
    assert [c["step"] for c in json.loads(by_prefix.stdout)] == [3, 2, 1]
    empty = CliRunner().invoke(app, ["checkpoints", str(tmp_path), "--json"])
    assert empty.exit_code == 0 and json.loads(empty.stdout) == []
    unknown = cli(emulator, "checkpoints", "ts-platform-tiny-cpu--nosuchrun")
    assert unknown.exit_code == 2
    assert unknown.stderr.count("\n") == 1 and "unknown run ts-platform-tiny-cpu--nosuchrun" in unknown.stderr


def test_listing_follows_every_page_of_list_objects_v2(emulator):
    """S3 returns at most 1,000 keys per ListObjectsV2 response ("the response might contain fewer keys
    but will never contain more", S3 API reference, ListObjectsV2 MaxKeys); a run keeps thousands of
    objects per checkpoint at scale. The emulator pages as S3 does when asked for 2 keys per page."""
    assert S3_PAGE_KEYS == 1000
    s3 = emulator.client("s3")
    paged = list_checkpoints(S3Location(s3, PREFIX, page_keys=2))
    whole = list_checkpoints(S3Location(s3, PREFIX))
    assert [(c.step, c.state, c.size, c.files) for c in paged] == [
        (c.step, c.state, c.size, c.files) for c in whole
    ]
    assert all(c.files > 2 for c in paged)
