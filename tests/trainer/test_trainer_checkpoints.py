"""Checkpoint rules in this process as a world of one (gloo, CPU): pruning, FP8 extra state, staging,
and the S3 backend against the local emulator's S3 (moto server)."""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from trainer.checkpoint.manager import (
    MARKER,
    CheckpointManager,
    TrainerState,
    complete_steps,
    completeness_problem,
    prune_candidates,
    step_dirs,
    storage_completeness_problem,
)
from trainer.storage import S3_WRITER_THREADS, S3Storage, open_storage, s3_settings

from trainstack.errors import TrainstackError

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parents[2]


def tiny_training(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return model, optimizer, scheduler


def train_step(model, optimizer) -> None:
    model(torch.ones(3, 4)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def state_at(step: int) -> TrainerState:
    return TrainerState(step=step, samples_consumed=step * 8, data_source="synthetic", world_size=1)


@pytest.mark.parametrize(
    ("present", "complete", "keep", "deleted"),
    [
        ([30, 20, 10], [20, 10], 1, [10]),  # 30 is half-written: never one of keep, left for later
        ([30, 20, 10], [20, 10], 2, []),
        ([40, 30, 20, 10], [40, 20], 2, [10, 30]),  # incomplete between kept ones goes too
        ([30, 20], [], 1, []),  # nothing complete yet: delete nothing
        ([20, 10, 5], [20, 10, 5], 3, []),
    ],
)
def test_prune_deletes_only_what_is_older_than_the_kept_complete_ones(present, complete, keep, deleted):
    assert prune_candidates(present, complete, keep) == deleted


def test_a_half_written_newer_checkpoint_never_pushes_out_the_last_complete_one(world_of_one, tmp_path):
    """keep: 1. An earlier job saved step 10, then died while saving step 30 (its manifest written, no
    COMPLETE.json). This job resumes from 10 and saves step 20: step 20 must survive, complete. Counting
    step 30 as one of `keep` deleted 20 and 10, leaving no complete checkpoint at all."""
    root = tmp_path / "ck"
    model, optimizer, scheduler = tiny_training()
    earlier = CheckpointManager(root, keep=3, rank=0, world=1)
    earlier.save(model, optimizer, scheduler, state_at(10), blocking=True)
    earlier.save(model, optimizer, scheduler, state_at(30), blocking=True)
    (root / "step-000000030" / MARKER).unlink()  # killed before the marker
    earlier.close()

    resumed = CheckpointManager(root, keep=1, rank=0, world=1)
    assert resumed.discover() == 10
    resumed.save(model, optimizer, scheduler, state_at(20), blocking=True)
    resumed.close()
    assert completeness_problem(root / "step-000000020") is None
    assert [step for step, _ in step_dirs(root)] == [30, 20]  # 10 pruned; the stale 30 left, skipped
    assert complete_steps(open_storage(root)) == [20]


class DelayedScalingLinear(torch.nn.Linear):
    """Behaves as Transformer Engine's modules do with `_extra_state` (TE 2.x,
    transformer_engine/pytorch/module/base.py, TransformerEngineBaseModule): `get_extra_state` returns
    `torch.empty(0, dtype=torch.uint8)` until the module has run an FP8 forward (`fp8_checkpoint`
    false), then the pickled FP8 metadata (delayed scaling: scales and amax history) as a uint8 tensor;
    `set_extra_state` ignores an empty tensor and restores the metadata from a non-empty one."""

    def __init__(self, *args, amax_history_len: int = 16, **kwargs):
        super().__init__(*args, **kwargs)
        self.fp8 = False
        self.fp8_meta = {"fp8_checkpoint": False, "amax_history_len": amax_history_len}

    def forward(self, x):
        self.fp8 = self.fp8_meta["fp8_checkpoint"] = True  # TE: init_fp8_metadata in the first forward
        history = self.fp8_meta.setdefault("amax_history", torch.zeros(self.fp8_meta["amax_history_len"]))
        history.copy_(torch.roll(history, 1))
        history[0] = x.detach().abs().max()
        self.fp8_meta["scale"] = 448.0 / history.max()
        return super().forward(x)

    def get_extra_state(self) -> torch.Tensor:
        if not (self.fp8_meta["fp8_checkpoint"] or self.fp8):
            return torch.empty(0, dtype=torch.uint8)
        state = {"amax_history": self.fp8_meta["amax_history"].clone(), "scale": self.fp8_meta["scale"]}
        return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
            return
        restored = pickle.loads(state.detach().cpu().numpy().tobytes())
        self.fp8_meta.update(restored, fp8_checkpoint=True)


def fp8_like_training():
    torch.manual_seed(0)
    model = torch.nn.Sequential(DelayedScalingLinear(4, 4), DelayedScalingLinear(4, 2))
    mesh = init_device_mesh("cpu", (1,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return model, optimizer, scheduler


def test_delayed_fp8_extra_state_resumes_into_a_model_before_its_first_fp8_forward(world_of_one, tmp_path):
    model, optimizer, scheduler = fp8_like_training()
    for _ in range(3):
        train_step(model, optimizer)
    assert model[0].get_extra_state().numel() > 0
    manager = CheckpointManager(tmp_path / "ck", keep=2, rank=0, world=1)
    manager.save(model, optimizer, scheduler, state_at(3), blocking=True)

    fresh, fresh_optimizer, fresh_scheduler = fp8_like_training()
    assert fresh[0].get_extra_state().numel() == 0  # as TE: nothing until the first FP8 forward
    state = manager.load(manager.discover(), fresh, fresh_optimizer, fresh_scheduler)
    manager.close()
    assert state.step == 3
    for saved, loaded in zip(model, fresh, strict=True):
        assert torch.equal(saved.fp8_meta["amax_history"], loaded.fp8_meta["amax_history"])
        assert saved.fp8_meta["scale"] == loaded.fp8_meta["scale"]
        assert torch.equal(saved.weight.full_tensor(), loaded.weight.full_tensor())


def test_async_save_holds_the_state_of_its_step_though_training_goes_on(world_of_one, tmp_path):
    """The host copy is taken before the next optimizer step (wait_for_staging), so what is written is
    the saved step's state even while the loop trains on."""
    model, optimizer, scheduler = tiny_training()
    train_step(model, optimizer)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    manager = CheckpointManager(tmp_path / "ck", keep=2, rank=0, world=1, asynchronous=True)
    manager.save(model, optimizer, scheduler, state_at(1))
    manager.wait_for_staging()
    for _ in range(3):  # changes every weight in place while the save may still be writing
        train_step(model, optimizer)
    assert manager.wait()
    fresh, fresh_optimizer, fresh_scheduler = tiny_training(seed=1)
    manager.load(manager.discover(), fresh, fresh_optimizer, fresh_scheduler)
    manager.close()
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_synchronous_saves_return_complete_and_hold_the_state_of_their_step(world_of_one, tmp_path):
    """--sync-checkpoints: every save is made from the state of its step while the loop waits. It used
    to be written on the background thread from the live weights while training went on, and marked
    complete holding later weights."""
    model, optimizer, scheduler = tiny_training()
    train_step(model, optimizer)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    manager = CheckpointManager(tmp_path / "ck", keep=2, rank=0, world=1, asynchronous=False)
    manager.save(model, optimizer, scheduler, state_at(1))  # no blocking=True: the manager is synchronous
    assert manager.in_flight() is None
    assert completeness_problem(tmp_path / "ck" / "step-000000001") is None
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)  # what the loop does next, at once
    manager.close()
    fresh, fresh_optimizer, fresh_scheduler = tiny_training(seed=1)
    reader = CheckpointManager(tmp_path / "ck", keep=2, rank=0, world=1)
    reader.load(reader.discover(), fresh, fresh_optimizer, fresh_scheduler)
    reader.close()
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_no_step_0_checkpoint_is_written(world_of_one, tmp_path):
    model, optimizer, scheduler = tiny_training()
    manager = CheckpointManager(tmp_path / "ck", keep=2, rank=0, world=1)
    with pytest.raises(ValueError, match="no step-0 checkpoint"):
        manager.save(model, optimizer, scheduler, state_at(0), blocking=True)
    manager.close()
    assert not (tmp_path / "ck").exists()


def test_every_recipes_shard_objects_stay_within_s3_multipart_limits():
    """Amazon S3 multipart upload limits (S3 User Guide, "Amazon S3 multipart upload limits"): at most
    10,000 parts per upload, parts of 5 MiB to 5 GiB. One DCP writer thread's object holds a rank's
    share of 12 bytes per parameter split over S3_WRITER_THREADS; with s3torchconnector's part size
    it must fit 10,000 parts. The emulator enforces none of this."""
    from s3torchconnector import S3ClientConfig

    from trainstack.recipes.loader import resolve

    part = S3ClientConfig().part_size
    assert 5 * 2**20 <= part <= 5 * 2**30
    for path in sorted((REPO / "recipes").glob("*.yaml")):
        recipe = resolve(str(path)).recipe
        per_object = 12 * recipe.model.total_params / recipe.world_size / S3_WRITER_THREADS
        assert per_object <= 10_000 * part, (recipe.name, per_object / 2**30)


def test_s3_location_needs_a_region_and_an_s3_uri(monkeypatch):
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    with pytest.raises(TrainstackError, match="AWS_REGION"):
        open_storage("s3://bucket/run/")
    assert s3_settings({"AWS_DEFAULT_REGION": "eu-west-1", "AWS_ENDPOINT_URL": "http://x"}) == (
        "eu-west-1",
        "http://x",
    )
    both = {"AWS_REGION": "us-west-2", "AWS_ENDPOINT_URL_S3": "http://s3", "AWS_ENDPOINT_URL": "http://x"}
    assert s3_settings(both) == ("us-west-2", "http://s3")
    with pytest.raises(TrainstackError, match="only s3://"):
        open_storage("gs://bucket/run/")


@pytest.fixture(scope="module")
def s3_bucket():
    """The local emulator's S3 with one bucket; yields (environment, bucket name)."""
    pytest.importorskip("boto3")
    from trainstack.emulator.endpoint import Emulator

    with Emulator() as emulator:
        env, client = emulator.env(), emulator.client("s3")
        client.create_bucket(Bucket="trainstack-checkpoints")
        yield env, "trainstack-checkpoints", client


@pytest.mark.slow
def test_s3_read_of_a_missing_key_is_absent_and_every_other_error_stays_an_error(s3_bucket, monkeypatch):
    """s3torchconnector 1.5.0 says "Service error: The key does not exist" for a GET of a missing key;
    treating only "not found" as absent made every read of a missing file raise: a step folder without
    its marker on discovery, a new rank's rank file on a resume with more ranks."""
    from s3torchconnectorclient import S3Exception

    env, bucket, _ = s3_bucket
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    storage = open_storage(f"s3://{bucket}/missing-keys/run-a/")
    storage.write(7, "rank-00000.pt", b"state")
    assert storage.read(7, "rank-00000.pt") == b"state"
    assert storage.read(7, "rank-00003.pt") is None  # a resume on more ranks than saved
    assert storage.read(8, MARKER) is None  # a folder that does not exist at all
    with pytest.raises(FileNotFoundError), storage.open_read(7, "rank-00003.pt") as stream:
        stream.read()
    with storage.open_read(7, "rank-00000.pt") as stream:
        assert stream.read() == b"state"
    elsewhere = open_storage("s3://no-such-bucket-anywhere/run-a/")
    with pytest.raises(S3Exception, match="The bucket does not exist"):
        elsewhere.read(7, MARKER)


@pytest.mark.slow
def test_s3_checkpoints_save_resume_prune_and_skip_truncated_objects(world_of_one, s3_bucket, monkeypatch):
    env, bucket, client = s3_bucket
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    uri = f"s3://{bucket}/checkpoints/platform/tiny/run-a/"
    storage = open_storage(uri)
    assert isinstance(storage, S3Storage) and storage.location == uri
    model, optimizer, scheduler = tiny_training()
    manager = CheckpointManager(storage, keep=2, rank=0, world=1, run="run-a")
    assert manager.discover() is None
    for step in (1, 2, 3):
        manager.wait_for_staging()  # as the loop does before every optimizer step
        train_step(model, optimizer)
        manager.save(model, optimizer, scheduler, state_at(step), blocking=step == 3)
        if step == 2:
            expected = {k: v.clone() for k, v in model.state_dict().items()}
    manager.close()
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="checkpoints/")["Contents"]}
    prefix = "checkpoints/platform/tiny/run-a/"
    assert {k.split("/")[4] for k in keys} == {"step-000000002", "step-000000003"}  # keep: 2
    assert {k.removeprefix(prefix + "step-000000003/") for k in keys if "step-000000003" in k} == {
        *(f"__0_{thread}.distcp" for thread in range(S3_WRITER_THREADS)),  # one object per writer thread
        ".metadata",
        "rank-00000.pt",
        "manifest-rank00000.json",
        MARKER,
    }
    assert storage_completeness_problem(storage, 3) is None
    # Each object's SHA-256 was taken from the bytes as they were uploaded; boto3 reads them back here.
    recorded = json.loads(
        client.get_object(Bucket=bucket, Key=prefix + "step-000000003/" + MARKER)["Body"].read()
    )
    assert set(recorded["files"]) == {
        k.removeprefix(prefix + "step-000000003/") for k in keys if "step-000000003" in k
    } - {MARKER}
    for name, record in recorded["files"].items():
        body = client.get_object(Bucket=bucket, Key=prefix + "step-000000003/" + name)["Body"].read()
        assert record == {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()}, name

    # A shard object replaced by half of itself (a copy cut short): skipped for the previous one.
    shard_key = prefix + "step-000000003/__0_0.distcp"
    body = client.get_object(Bucket=bucket, Key=shard_key)["Body"].read()
    client.put_object(Bucket=bucket, Key=shard_key, Body=body[: len(body) // 2])
    assert "truncated" in storage_completeness_problem(storage, 3)
    fresh, fresh_optimizer, fresh_scheduler = tiny_training(seed=1)
    reader = CheckpointManager(open_storage(uri), keep=2, rank=0, world=1)
    assert reader.discover() == 2
    state = reader.load(2, fresh, fresh_optimizer, fresh_scheduler)
    reader.close()
    assert state == state_at(2)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, expected[key]), key
    marker = client.get_object(Bucket=bucket, Key=prefix + "step-000000002/" + MARKER)["Body"].read()
    assert b'"run": "run-a"' in marker and b'"samples_consumed": 16' in marker
