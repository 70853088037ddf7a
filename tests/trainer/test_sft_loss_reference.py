"""Nothing leaks across packed examples (issue 38, section 5): several conversations packed into one
sequence, run through our model (pure PyTorch, CPU, float32) with the block-diagonal causal mask and
positions restarting per example, give the masked loss transformers' LlamaForCausalLM gives each
conversation alone with `labels = -100` outside the targets, within 1e-4.

The attention mask reaches the model by replacing each block's core attention (the one module the
mask changes) with scaled_dot_product_attention given `block_causal_mask`; the rotary positions go in
through the model's own `rope_positions`. The trainer's loss path is ours: `Transformer.forward`'s
chunked cross-entropy, whose sum skips -100 labels, divided by the number of targets. Without the mask
and the restarted positions the same rows give another loss (the control), so the test can fail."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sft_helpers import CONVERSATIONS, base_folder
from torch import nn
from trainer.data.packing import IGNORE_INDEX, pack_best_fit_decreasing, pack_row
from trainer.hf.conversion import from_hf
from trainer.models.model import block_causal_mask, build_model, pytorch_backend
from trainer.prepare.chat import ChatTokenizer

from trainstack.recipes.hf_config import shape_from_hf_config
from trainstack.recipes.schema import ModelShape

pytestmark = pytest.mark.fast

transformers = pytest.importorskip("transformers")
SEQ_LEN = 256
TOLERANCE = 1e-4


class MaskedCore(nn.Module):
    """Core attention through SDPA with an explicit mask (set per row) instead of is_causal."""

    def __init__(self, gqa: bool):
        super().__init__()
        self.gqa = gqa
        self.mask: torch.Tensor | None = None

    def forward(self, q, k, v):
        batch, seq = q.shape[:2]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=self.mask, enable_gqa=self.gqa
        )
        return out.transpose(1, 2).reshape(batch, seq, -1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    chat = ChatTokenizer(base_folder(tmp_path_factory.mktemp("base") / "llama3", "llama3-marked"))
    examples = []
    for i in range(3):  # twelve conversations of varied length
        for conversation in CONVERSATIONS:
            varied = [{**m, "content": m["content"] + f" ({i})" * i} for m in conversation]
            example = chat.encode(varied)
            examples.append((example.ids, example.mask.astype(bool)))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=chat.vocab_size,
        max_position_embeddings=SEQ_LEN,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        initializer_range=0.2,  # sharp attention: what one example would take from another shows
    )
    reference = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith("norm.weight"):  # not all ones: a gain applied in the wrong place shows
                param.uniform_(0.5, 1.5)
    shape = ModelShape(**shape_from_hf_config(config.to_dict()))
    model = build_model(shape, SEQ_LEN, pytorch_backend(), loss_chunk_tokens=64)
    model.to_empty(device="cpu")
    model.load_state_dict(from_hf(reference.state_dict(), shape))
    model.init_rope()
    model.eval()
    return examples, reference, model, shape, reference_loss(reference, examples)


def reference_loss(reference, examples) -> float:
    """transformers, one conversation at a time: the mean over all their targets."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, mask in examples:
            labels = torch.where(torch.from_numpy(mask), torch.from_numpy(ids), IGNORE_INDEX)
            targets = int((labels[1:] != IGNORE_INDEX).sum())
            out = reference(input_ids=torch.from_numpy(ids)[None], labels=labels[None])
            total += float(out.loss) * targets
            count += targets
    return total / count


def packed_loss(model, shape, examples, keep_apart: bool = True) -> tuple[float, int]:
    """Our model over the examples packed best-fit decreasing: (mean over targets, rows)."""
    cores = [MaskedCore(shape.heads != shape.kv_heads) for _ in model.layers]
    for block, core in zip(model.layers, cores, strict=True):
        block.attention.core = core
    bins = pack_best_fit_decreasing([ids.size for ids, _ in examples], SEQ_LEN)
    total, count = 0.0, 0
    with torch.no_grad():
        for members in bins:
            row = pack_row([examples[i] for i in members], SEQ_LEN)
            segments = torch.from_numpy(row.segment_ids)[None]
            for core in cores:
                core.mask = block_causal_mask(segments) if keep_apart else None
            if not keep_apart:  # the control: one causal sequence, positions 0..seq-1
                for core in cores:
                    core.mask = torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool).tril()
            model.rope_positions = torch.from_numpy(row.position_ids) if keep_apart else None
            labels = torch.from_numpy(row.labels)[None]
            mean_over_positions = model(torch.from_numpy(row.input_ids)[None], labels)
            total += float(mean_over_positions) * labels.numel()  # the sum over targets (-100 adds 0)
            count += int((labels != IGNORE_INDEX).sum())
    model.rope_positions = None
    return total / count, len(bins)


def test_packed_examples_give_transformers_loss_of_each_alone(setup):
    examples, _, model, shape, expected = setup
    ours, rows = packed_loss(model, shape, examples)
    assert rows <= len(examples) / 2  # several conversations share each row
    assert abs(ours - expected) < TOLERANCE, (ours, expected)


def test_without_the_block_mask_and_restarted_positions_the_examples_leak(setup):
    examples, _, model, shape, expected = setup
    leaking, _ = packed_loss(model, shape, examples, keep_apart=False)
    assert abs(leaking - expected) > 100 * TOLERANCE, (leaking, expected)


def test_one_example_alone_matches_unpacked_too(setup):
    examples, reference, model, shape, _ = setup
    one = [examples[5]]
    assert abs(packed_loss(model, shape, one)[0] - reference_loss(reference, one)) < TOLERANCE
    assert np.asarray(one[0][1]).any()
