"""Validation (trainer.validation) in this process as a world of one: the same batches every time, the
mean loss an independent computation gives, and no trace left in training (no gradients, FSDP intact)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from trainer.config import resolve_layout
from trainer.data.loader import SyntheticTokens, load_batch, micro_batch_indices
from trainer.distributed.parallel import set_gradient_sync, shard_model
from trainer.models.model import build_model, pytorch_backend
from trainer.optim import build_optimizer
from trainer.validation import SYNTHETIC_HELD_OUT, HeldOut, ValidationSet, Validator
from trainer_helpers import TINY

from trainstack.recipes.loader import resolve
from trainstack.recipes.schema import Validation

pytestmark = pytest.mark.fast

SETTINGS = Validation(every_steps=5, batches=2)


class Recording:
    """A token source that remembers which samples were read."""

    def __init__(self, source):
        self.source, self.name, self.read = source, source.name, []

    def sample(self, index):
        self.read.append(index)
        return self.source.sample(index)


@pytest.fixture(scope="module")
def recipe():
    return resolve(str(TINY)).recipe


def plain_model(recipe, seed: int = 0):
    """The tiny model unsharded, in FP32."""
    torch.manual_seed(seed)
    model = build_model(
        recipe.model, recipe.training.seq_len, pytorch_backend(), recipe.training.loss_chunk_tokens
    )
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def sharded_model(recipe, seed: int = 0):
    torch.manual_seed(seed)
    model = build_model(
        recipe.model, recipe.training.seq_len, pytorch_backend(), recipe.training.loss_chunk_tokens
    )
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    shard_model(model, mesh)
    model.to_empty(device="cpu")
    model.init_weights()
    return model, mesh


def reference_mean_loss(model, source, samples: int) -> float:
    """Independently of the validator and the chunked loss: every sample's full logits at once and
    torch's own cross-entropy over all their tokens."""
    windows = torch.from_numpy(np.stack([source.sample(i) for i in range(samples)]))
    inputs, targets = windows[:, :-1], windows[:, 1:]
    with torch.no_grad():
        x = model.tok_embeddings(inputs)
        for block in model.layers:
            x = block._forward(x, model.rope())
        logits = model.output(model.norm(x)).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).item()


def test_every_evaluation_reads_the_same_samples_and_gives_the_mean_loss_over_them(world_of_one, recipe):
    layout = resolve_layout(recipe, 1, "test")
    held_out = HeldOut(
        SyntheticTokens(recipe.model.vocab, recipe.training.seq_len, recipe.training.seed), SYNTHETIC_HELD_OUT
    )
    recording = Recording(held_out)
    validator = Validator([ValidationSet(None, recording)], SETTINGS, layout, 0, torch.device("cpu"))
    model = plain_model(recipe)
    first = validator.evaluate(model, contextlib.nullcontext)
    read_first, recording.read = recording.read, []
    second = validator.evaluate(model, contextlib.nullcontext)
    samples = SETTINGS.batches * recipe.training.global_batch
    assert read_first == recording.read == list(range(samples))  # samples 0..N-1, in order, both times
    assert first == second
    assert first["val_loss"] == pytest.approx(reference_mean_loss(model, held_out, samples), rel=1e-5)
    assert model.training  # eval mode was restored


def test_the_split_a_two_rank_job_evaluates_is_the_one_rank_job_s(recipe):
    one = Validator(
        [ValidationSet(None, None)], SETTINGS, resolve_layout(recipe, 1, "t"), 0, torch.device("cpu")
    )
    two = [
        Validator(
            [ValidationSet(None, None)], SETTINGS, resolve_layout(recipe, 2, "t"), rank, torch.device("cpu")
        )
        for rank in (0, 1)
    ]

    def flat(v):
        return [i for r in v.plan for i in r]

    assert sorted(flat(two[0]) + flat(two[1])) == flat(one) == list(range(32))


def test_validation_leaves_no_gradient_and_training_continues_as_without_it(world_of_one, recipe):
    """FSDP2 model: step, validate, step gives exactly the losses and weights of step, step."""
    layout = resolve_layout(recipe, 1, "test")
    source = SyntheticTokens(recipe.model.vocab, recipe.training.seq_len, recipe.training.seed)
    validator = Validator(
        [ValidationSet(None, HeldOut(source, SYNTHETIC_HELD_OUT))], SETTINGS, layout, 0, torch.device("cpu")
    )

    def train(validate: bool) -> tuple[list[float], list[torch.Tensor], dict]:
        model, mesh = sharded_model(recipe)
        optimizer = build_optimizer(model, recipe.training, "cpu")
        losses, values = [], {}
        for step in range(2):
            for micro in range(2):
                batch = load_batch(
                    source,
                    micro_batch_indices(step * 4, micro, 0, 1, layout.micro_batch),
                    torch.device("cpu"),
                )
                set_gradient_sync(model, mesh, last_micro_step=micro == 1)
                loss = model(batch.inputs, batch.targets)
                (loss / 2).backward()
                losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if validate and step == 0:
                values = validator.evaluate(model, contextlib.nullcontext)
                assert all(p.grad is None for p in model.parameters())
                again = validator.evaluate(model, contextlib.nullcontext)
                assert again == values  # the same fixed batches, the same sharded weights: the same loss
        return losses, [p.full_tensor().clone() for p in model.parameters()], values

    plain_losses, plain_weights, _ = train(validate=False)
    losses, weights, values = train(validate=True)
    assert np.isfinite(values["val_loss"]) and set(values) == {"val_loss"}
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights, strict=True))
