"""The trainer's fine-tuning loss equals transformers' (issue 38, section 5), through the trainer's own
code: a chat dataset prepared by `prepare_chat`, read by `open_chat` (PackedChat rows) through the
`Prefetcher`, the model's real forward with the `Packed` layout the loader builds (the block-causal
mask and RoPE at the rows' position ids, built by the model itself), `target_scale` and `micro_step`
(sum of the target tokens' losses over the global batch's target count), and the `Validator`'s masked
loss on the held-out split. The reference is transformers' LlamaForCausalLM with the same weights, each
conversation alone, `labels = -100` outside the targets: its loss is the mean over that conversation's
targets, weighted here by their count, within 1e-4 (float32 on CPU).

The control: the same packed rows through the pretraining forward (one causal sequence, positions
0..seq-1) give another loss, so the comparison can fail."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from sft_trainer_helpers import llama_base, prepare, sft_recipe
from torch.distributed.fsdp import MixedPrecisionPolicy
from trainer.config import Layout, resolve_layout
from trainer.data.chat_shards import ChatShards, read_chat_dataset
from trainer.data.loader import Prefetcher, micro_batch_plan
from trainer.data.packing import IGNORE_INDEX, collate, open_chat, pack_row
from trainer.distributed import parallel
from trainer.distributed.parallel import build_mesh, shard_model
from trainer.hf.conversion import from_hf, load_base
from trainer.models.model import Packed, build_model, compile_blocks, pytorch_backend
from trainer.train import micro_step, target_scale
from trainer.validation import ValidationSet, Validator

from trainstack.recipes.schema import Validation

pytestmark = pytest.mark.fast

SEQ_LEN = 256
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def setup(transformers, tmp_path_factory):
    root = tmp_path_factory.mktemp("sft-loss")
    reference, _ = llama_base(transformers, root / "base", SEQ_LEN)
    data = prepare(root, root / "base", count=40, seq_len=SEQ_LEN, validation_fraction=0.35)
    recipe = sft_recipe(root / "base", seq_len=SEQ_LEN, micro_batch=1, global_batch=8, loss_chunk_tokens=64)
    return reference, data, recipe


@pytest.fixture
def fp32_compute(monkeypatch):
    """FSDP2 computing in float32 (the trainer's BF16 policy otherwise): the comparison is exact math."""
    policy = MixedPrecisionPolicy(
        param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    monkeypatch.setattr(parallel, "MIXED_PRECISION", policy)


def examples(directory) -> list[tuple[np.ndarray, np.ndarray]]:
    shards = ChatShards(read_chat_dataset(directory))
    return [shards.example(i) for i in range(shards.count)]


def reference_losses(reference, chats) -> list[tuple[float, int]]:
    """transformers, one conversation at a time: (its mean loss over its targets, its target count)."""
    out = []
    with torch.no_grad():
        for ids, mask in chats:
            labels = torch.where(torch.from_numpy(mask.copy()), torch.from_numpy(ids.copy()), IGNORE_INDEX)
            loss = reference(input_ids=torch.from_numpy(ids.copy())[None], labels=labels[None]).loss
            out.append((float(loss), int((labels[1:] != IGNORE_INDEX).sum())))
    return out


def reference_mean(reference, chats) -> float:
    losses = reference_losses(reference, chats)
    return sum(loss * n for loss, n in losses) / sum(n for _, n in losses)


def plain_model(recipe, reference):
    """Our model (unsharded) with the reference's weights."""
    model = build_model(recipe.model, SEQ_LEN, pytorch_backend(), recipe.training.loss_chunk_tokens)
    model.to_empty(device="cpu")
    model.load_state_dict(from_hf(reference.state_dict(), recipe.model))
    model.init_rope()
    return model.eval()


def no_autocast():
    return torch.autocast("cpu", enabled=False)


def test_packed_rows_through_the_trainer_step_give_transformers_loss(setup, world_of_one, fp32_compute):
    """One optimizer step over every packed row of the set (micro-batches of one row), as the training
    loop runs it: its loss is transformers' mean over every conversation's targets."""
    reference, data, recipe = setup
    source = open_chat(data, SEQ_LEN, recipe.model.vocab, recipe.training.seed)
    rows = len(source)
    assert source.shards.count >= 2 * rows  # several conversations per row
    model = build_model(recipe.model, SEQ_LEN, pytorch_backend(), recipe.training.loss_chunk_tokens)
    mesh = build_mesh("cpu", 1, 1)
    shard_model(model, mesh)
    model.to_empty(device="cpu")
    model.init_weights()
    load_base(model, Path(recipe.model.init_from), recipe.model)
    layout = Layout(world=1, shard=1, micro_batch=1, grad_accum=rows, global_batch=rows)
    batches = Prefetcher(source, micro_batch_plan(0, rows, rows, 0, 1, 1), torch.device("cpu"))
    try:
        read = [batches.next(range(i, i + 1)) for i in range(rows)]
    finally:
        batches.close()
    assert sorted(i for b in read for i in b.sample_indices) == list(range(rows))
    scale = target_scale(read, layout.data_ranks)
    step_loss = sum(
        float(micro_step(model, mesh, b.inputs, b.targets, no_autocast, rows, i == rows - 1, b.packed, scale))
        for i, b in enumerate(read)
    )
    expected = reference_mean(reference, examples(data))
    assert abs(step_loss - expected) < TOLERANCE, (step_loss, expected)
    assert next(model.parameters()).grad is not None  # the backward ran


def test_one_conversation_per_row_gives_each_conversations_own_transformers_loss(setup):
    """Unpacked: each conversation alone in a row (then padding), its masked loss through the model's
    packed forward equals transformers' for that conversation."""
    reference, data, recipe = setup
    model = plain_model(recipe, reference)
    chats = examples(data)[:8]
    expected = reference_losses(reference, chats)
    with torch.no_grad():
        for (ids, mask), (loss, targets) in zip(chats, expected, strict=True):
            batch = collate([pack_row([(ids, mask)], SEQ_LEN)])
            packed = Packed(batch.position_ids, batch.segment_ids, batch.cu_seqlens, batch.max_seqlen)
            summed = float(model(batch.input_ids, batch.labels, packed=packed))
            assert int((batch.labels != IGNORE_INDEX).sum()) == targets
            assert abs(summed / targets - loss) < TOLERANCE, (summed / targets, loss)


def test_without_the_packed_layout_the_same_rows_leak_and_the_loss_differs(setup):
    """The control: the rows through the pretraining forward (causal over the whole row, positions
    0..seq-1): examples see each other, and the loss over the same targets moves by far more than 1e-4."""
    reference, data, recipe = setup
    model = plain_model(recipe, reference)
    source = open_chat(data, SEQ_LEN, recipe.model.vocab, recipe.training.seed)
    total, targets = 0.0, 0
    with torch.no_grad():
        for i in range(len(source)):
            batch = collate([source.row(i)])
            mean_over_positions = float(model(batch.input_ids, batch.labels))
            total += mean_over_positions * batch.labels.numel()  # -100 positions add nothing
            targets += int((batch.labels != IGNORE_INDEX).sum())
    expected = reference_mean(reference, examples(data))
    assert abs(total / targets - expected) > 100 * TOLERANCE, (total / targets, expected)


def test_validation_on_held_out_conversations_is_their_masked_transformers_loss(setup, world_of_one):
    reference, data, recipe = setup
    model = plain_model(recipe, reference)
    held_out = open_chat(data / "validation", SEQ_LEN, recipe.model.vocab, recipe.training.seed)
    rows = len(held_out)
    assert rows >= 2 and held_out.shards.count > rows  # packed several to a row
    layout = resolve_layout(
        recipe.model_copy(
            update={"training": recipe.training.model_copy(update={"global_batch": rows, "micro_batch": 1})}
        ),
        1,
        "test",
    )
    validator = Validator(
        [ValidationSet(None, held_out)], Validation(every_steps=1, batches=1), layout, 0, torch.device("cpu")
    )
    values = validator.evaluate(model, no_autocast)
    expected = reference_mean(reference, examples(data / "validation"))
    assert abs(values["val_loss"] - expected) < TOLERANCE, (values, expected)


@pytest.mark.slow
def test_compiled_blocks_take_packed_rows_and_give_eagers_loss(setup):
    """torch.compile per block (fullgraph, as `training.compile` does) with the `Packed` argument: the
    same summed losses as eager, and the backward runs."""
    reference, data, recipe = setup
    model = plain_model(recipe, reference)
    source = open_chat(data, SEQ_LEN, recipe.model.vocab, recipe.training.seed)
    batches = [collate([source.row(i), source.row(i + 1)]) for i in (0, 2)]

    def losses():
        return [
            model(
                b.input_ids,
                b.labels,
                packed=Packed(b.position_ids, b.segment_ids, b.cu_seqlens, b.max_seqlen),
            )
            for b in batches
        ]

    eager = [float(loss.detach()) for loss in losses()]
    compile_blocks(model)
    compiled = losses()
    assert [float(loss.detach()) for loss in compiled] == pytest.approx(eager, rel=1e-6)
    sum(compiled).backward()
    assert model.layers[0].attention.qkv.weight.grad is not None
