"""The fine-tuning loss is the mean over the target tokens of the whole global batch, across ranks and
micro-batches (issue 38; docs/trainer.md): one optimizer step on 2 gloo ranks x 4 micro-batches of one
packed row (a recipe planned for 8 GPUs laid out on 2: accumulation 8 / (1 x 2)), through the trainer's
plan, `target_scale`, `micro_step` and FSDP2's gradient averaging, gives the loss and the gradients of
one process computing the summed target loss of the same 8 rows divided by their target count. The
micro-batches hold different numbers of targets, so the mean of per-micro-batch means (what
transformers computed before PR #34191) differs: the test can fail."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from sft_trainer_helpers import llama_base, prepare, sft_recipe, write_recipe
from trainer.data.loader import Prefetcher, micro_batch_plan
from trainer.data.packing import IGNORE_INDEX, open_chat
from trainer.hf.conversion import from_hf
from trainer.models.model import build_model, pytorch_backend
from trainer_helpers import REPO, trainer_env

pytestmark = [pytest.mark.fast, pytest.mark.xdist_group("trainer")]

SEQ_LEN = 128


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("sft-ranks")
    reference, _ = llama_base(transformers, root / "base", SEQ_LEN, seed=1)
    data = prepare(root, root / "base", count=24, seq_len=SEQ_LEN, validation_fraction=0.0)
    recipe = sft_recipe(root / "base", seq_len=SEQ_LEN, micro_batch=1, global_batch=8, loss_chunk_tokens=48)
    recipe_path = write_recipe(recipe, root / "recipe.json")
    out = root / "step.pt"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        str(REPO / "tests" / "trainer" / "sft_ranks_worker.py"), str(recipe_path), str(data), str(out),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return reference, data, recipe, torch.load(out)


def one_process(reference, data, recipe, rows: list[int]):
    """The rows in one process: (sum of target losses / target count, its gradients, the target counts
    of the trainer's micro-batches (a row each), the mean of the per-micro-batch means)."""
    model = build_model(recipe.model, SEQ_LEN, pytorch_backend(), recipe.training.loss_chunk_tokens)
    model.to_empty(device="cpu")
    model.load_state_dict(from_hf(reference.state_dict(), recipe.model))
    model.init_rope()
    source = open_chat(data, SEQ_LEN, recipe.model.vocab, recipe.training.seed)
    batches = Prefetcher(source, micro_batch_plan(0, len(rows), len(rows), 0, 1, 1), torch.device("cpu"))
    try:
        read = [batches.next(range(i, i + 1)) for i in rows]
    finally:
        batches.close()
    sums = [model(b.inputs, b.targets, packed=b.packed) for b in read]
    counts = [int((b.targets != IGNORE_INDEX).sum()) for b in read]
    loss = sum(sums) / sum(counts)
    loss.backward()
    per_micro_batch = sum(float(s.detach()) / n for s, n in zip(sums, counts, strict=True)) / len(rows)
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}, counts, per_micro_batch


def test_two_ranks_four_micro_batches_equal_one_process_mean_over_targets(run):
    reference, data, recipe, step = run
    assert step["grad_accum"] == 4 and sorted(i for r in step["rows"] for i in r) == list(range(8))
    loss, grads, counts, per_micro_batch = one_process(reference, data, recipe, list(range(8)))
    assert len(set(counts)) > 1  # rows with different target counts: the two means differ
    assert abs(step["loss"] - loss) < 1e-5, (step["loss"], loss)
    assert abs(per_micro_batch - loss) > 1e-3, (per_micro_batch, loss)
    assert set(step["grads"]) == set(grads)
    for name, expected in grads.items():
        got = step["grads"][name]
        scale = expected.abs().max().item()
        assert (got - expected).abs().max().item() <= 1e-5 * max(scale, 1.0), name
