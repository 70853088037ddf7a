"""Models in and out on the local emulator, end to end, the way the demo and the tests run the trainer.

A base model folder in the emulator's S3 -> the trainer's start from it (`model.init_from` an s3://
prefix: staged to local disk, loaded into the shards) -> a checkpoint written straight to S3 -> the
deployment's Export state machine (its real definition, interpreted by the emulator) creates the export
job and records it in the run registry -> the emulator runs the job's container (its own entry point and
arguments, `python -m trainer.export`, the recipe as its hyperparameters: trainstack.emulator.jobs)
against the emulator's S3 -> the folder in S3 holds the base's tensors, config.json and the tokenizer;
`trainstack runs`' view lists the export.
"""

from __future__ import annotations

import io
import json
import time

import pytest
import torch
from safetensors.torch import load, save
from trainer.checkpoint.manager import CheckpointManager, TrainerState
from trainer.distributed.parallel import build_mesh, shard_model
from trainer.hf.conversion import pieces, start_from_base, to_hf
from trainer.models.model import build_model, pytorch_backend
from trainer.optim import build_optimizer, build_scheduler
from trainer_helpers import TINY

from trainstack.aws.export_job import export_input, export_job_request
from trainstack.aws.registry import run_from_item
from trainstack.aws.request import Runtime
from trainstack.recipes.hf_config import hf_config_from_shape
from trainstack.recipes.loader import resolve
from trainstack.recipes.naming import job_name_prefix, run_checkpoint_prefix, run_name
from trainstack.recipes.schema import to_hyperparameters

pytestmark = pytest.mark.slow
BUCKET = "trainstack-data"
RUN_ID = "hf-1"


@pytest.fixture(scope="module")
def cloud():
    pytest.importorskip("boto3")
    from trainstack.emulator.endpoint import Emulator

    with Emulator().start(timeout_s=180) as emulator:
        emulator.client("s3").create_bucket(Bucket=BUCKET)
        emulator.client("dynamodb").create_table(
            TableName="runs",
            KeySchema=[{"AttributeName": "run", "KeyType": "HASH"}],
            AttributeDefinitions=[{"AttributeName": "run", "AttributeType": "S"}],
            BillingMode="PAY_PER_REQUEST",
        )
        yield emulator


def _sharded(recipe):
    model = build_model(
        recipe.model, recipe.training.seq_len, pytorch_backend(), recipe.training.loss_chunk_tokens
    )
    shard_model(model, build_mesh("cpu", 1, 1))
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def test_base_in_s3_to_export_in_s3_through_the_export_state_machine(
    cloud, world_of_one, monkeypatch, tmp_path
):
    for name, value in cloud.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TRAINSTACK_BASE_DIR", str(tmp_path / "staged"))
    s3 = cloud.client("s3")
    tiny = resolve(str(TINY)).recipe
    shape = tiny.model.model_copy(update={"attention_bias": True, "norm_eps": 1e-6})

    # A base model folder in S3 (random weights in Hugging Face names, two files and a tokenizer file).
    torch.manual_seed(3)
    base = {
        k: v.clone()
        for k, v in to_hf({k: torch.randn(v) for k, v in _full_shapes(shape).items()}, shape).items()
    }
    names = sorted(base)
    for index, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :]), start=1):
        body = save({k: base[k].to(torch.bfloat16) for k in part}, metadata={"format": "pt"})
        s3.put_object(Bucket=BUCKET, Key=f"bases/tiny/model-0000{index}-of-00002.safetensors", Body=body)
    config = hf_config_from_shape(shape, max_position_embeddings=64, eos_token_id=255)
    s3.put_object(Bucket=BUCKET, Key="bases/tiny/config.json", Body=json.dumps(config).encode())
    s3.put_object(Bucket=BUCKET, Key="bases/tiny/tokenizer.json", Body=b'{"version": "1.0"}')
    recipe = tiny.model_copy(
        update={
            "model": shape.model_copy(update={"init_from": f"s3://{BUCKET}/bases/tiny/"}),
            "export": tiny.export.model_copy(update={"dtype": "fp32"}),  # compared exactly below
        }
    )

    # The trainer's step 0: staged from S3, loaded into the shards; saved straight to S3.
    model = _sharded(recipe)
    loaded = start_from_base(model, recipe.model, local_rank=0)
    assert loaded.tensors == len(pieces(shape))
    run = run_name(recipe, None, RUN_ID)
    checkpoint_uri = f"s3://{BUCKET}/{run_checkpoint_prefix(recipe, None, RUN_ID)}"
    optimizer = build_optimizer(model, recipe.training, "cpu")
    manager = CheckpointManager(checkpoint_uri, keep=1, rank=0, world=1, asynchronous=False, run=run)
    manager.save(
        model,
        optimizer,
        build_scheduler(optimizer, recipe.training),
        TrainerState(5, 80, "synthetic", 1),
        blocking=True,
    )
    manager.close()

    # The run's registry item, then the Export state machine as the stack deploys it.
    now = "2026-12-01T00:00:00+00:00"
    item = {
        "run": {"S": run}, "run_id": {"S": RUN_ID}, "recipe": {"S": recipe.name}, "team": {"S": "platform"},
        "run_state": {"S": "completed"}, "current_job": {"S": f"{run}-1"}, "job_index": {"N": "1"},
        "last_job": {"N": "20"}, "jobs": {"L": [{"S": f"{run}-1"}]}, "checkpoint_uri": {"S": checkpoint_uri},
        "steps": {"N": "5"}, "tokens_per_step": {"N": "512"}, "usd_per_hour": {"N": "55"},
        "created": {"S": now}, "updated": {"S": now},
        # the run's recorded request: the export takes its hyperparameters from it (stacks/export.py)
        "request": {"S": json.dumps({"HyperParameters": to_hyperparameters(recipe)})},
    }  # fmt: skip
    dynamodb = cloud.client("dynamodb")
    dynamodb.put_item(TableName="runs", Item=item)
    from stacks.export import export_definition, recorded_export_request

    request = recorded_export_request(
        export_job_request(
            recipe,
            None,
            job_name=Runtime("$.Export.Job"),
            checkpoint_uri=Runtime("$.Export.Checkpoint"),
            out_parent=Runtime("$.Export.OutParent"),
            step=Runtime("States.Format('{}', $.Step)"),
            role_arn="arn:aws:iam::123456789012:role/execution",
            image_uri="123456789012.dkr.ecr.us-east-1.amazonaws.com/trainstack:test",
            bucket_name=BUCKET,
        )
    )
    exports_base = f"s3://{BUCKET}/exports/platform/{recipe.name}/"
    sfn = cloud.client("stepfunctions")
    machine = sfn.create_state_machine(
        name="Export",
        definition=json.dumps(export_definition(request, "runs", exports_base)),
        roleArn="arn:aws:iam::123456789012:role/export",
    )["stateMachineArn"]
    arn = sfn.start_execution(stateMachineArn=machine, input=json.dumps(export_input(run, RUN_ID)))[
        "executionArn"
    ]
    deadline = time.monotonic() + 60
    while (described := sfn.describe_execution(executionArn=arn))[
        "status"
    ] == "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert described["status"] == "SUCCEEDED", described
    job = cloud.client("sagemaker").describe_training_job(TrainingJobName=f"{run}-X1")
    assert job["TrainingJobName"].startswith(job_name_prefix(recipe, None))
    assert job["ResourceConfig"]["InstanceType"].startswith("ml.m5.")
    arguments = job["AlgorithmSpecification"]["ContainerArguments"]
    assert arguments == [
        "--checkpoint",
        checkpoint_uri,
        "--out-parent",
        f"{exports_base}{RUN_ID}/",
        "--step",
        "0",
    ]
    record = run_from_item(dynamodb.get_item(TableName="runs", Key={"run": {"S": run}})["Item"])
    ((export,),) = (record.exports,)
    assert (export["job"], export["step"], export["reason"]) == (f"{run}-X1", 0, "cli")

    # The emulator runs the job's container: its recipe (hyperparameters) and its own arguments.
    from trainstack.emulator import events

    ended = events.wait_for_status(cloud.env(), f"{run}-X1", timeout_s=600)
    assert ended["TrainingJobStatus"] == "Completed", ended.get("FailureReason")
    out = f"exports/platform/{recipe.name}/{RUN_ID}/step-5/"
    # The folder `trainstack runs` names for it: the step the job reported (its export:step metric).
    from trainstack.aws.runs import export_folder

    assert export_folder(export, ended) == f"s3://{BUCKET}/{out}"
    listed = {o["Key"].removeprefix(out) for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=out)["Contents"]}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "export.json",
    } <= listed
    exported = {}
    for name in listed:
        if name.endswith(".safetensors"):
            exported.update(load(s3.get_object(Bucket=BUCKET, Key=out + name)["Body"].read()))
    assert set(exported) == set(base)
    for name, tensor in base.items():  # the base in BF16, through FP32 masters, exported in FP32: equal
        assert torch.equal(exported[name], tensor.to(torch.bfloat16).float()), name
    written = json.loads(s3.get_object(Bucket=BUCKET, Key=out + "config.json")["Body"].read())
    assert (written["model_type"], written["eos_token_id"]) == ("qwen2", 255)
    assert (
        json.load(io.BytesIO(s3.get_object(Bucket=BUCKET, Key=out + "export.json")["Body"].read()))["run"]
        == run
    )


def _full_shapes(shape):
    from trainer.hf.conversion import parameter_shapes

    return parameter_shapes(shape)
