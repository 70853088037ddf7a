"""Validation: the same fixed batches of held-out data, evaluated every `validation.every_steps` steps.

With `validation.at_start` (on by default with `model.init_from`) also once before the first step of a
run, printed as `step=0 val_loss=...`, so the starting model's loss is the first point.

What is evaluated: samples 0 .. batches x global_batch - 1 of each validation split, every time, so two
evaluations differ only by the model (no zig-zag from changing batches), and the set does not depend on
the world size: rank r takes the samples a training step from position b x global_batch would give it
(trainer.data.loader.micro_batch_indices), for b = 0 .. batches - 1.

Where from: a prepared dataset keeps its validation split in `<dataset>/validation/`, in the same
format as its training shards (`trainstack data prepare --validation-fraction`); a blend evaluates each
source's split on its own and reports `val_loss_<source>` for each, and `val_loss` as their plain mean
(not weighted by the blend's weights, so a weight change mid-run does not move it). A synthetic run
evaluates the synthetic set at sample indices from 2**40 on, which training never reaches.

How: on every rank, the same number of forward passes (FSDP's all-gathers pair up), under
`torch.no_grad()` and `model.eval()` (restored after), with the training autocast. Not
`torch.inference_mode()`: inference tensors cannot later take part in autograd, and FSDP2 keeps
and reuses its unsharded parameter storage between forward passes. The loss of each micro-batch is
its mean over micro_batch x seq_len tokens; all micro-batches hold the same number of tokens, so the
mean of the micro-batch means, all-reduced, is the mean over every validation token. Under context
parallelism every rank evaluates its chunks of its group's samples (S / cp tokens each, the same
count on every rank), so the same all-reduced mean over all ranks is still the mean over every token.

Fine-tuning (`training.objective: sft`): the validation split is held-out conversations, packed as
training packs them (trainer.data.packing.open_chat), and the loss is the training loss: every
micro-batch's summed loss over its target tokens, summed over the batches and all-reduced, divided by
their target tokens, all-reduced too (the mean over every held-out target, whatever the packing).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.config import Layout
from trainer.data.blend import source_directories
from trainer.data.loader import Prefetcher, TokenSource, micro_batch_indices
from trainer.data.packing import IGNORE_INDEX
from trainstack.errors import TrainstackError
from trainstack.protocol.metrics import SOURCE_VAL_LOSS
from trainstack.recipes.schema import VALIDATION_DIR, Recipe, Validation

log = logging.getLogger(__name__)
SYNTHETIC_HELD_OUT = 1 << 40  # first synthetic sample index validation reads (training: 1e12 samples away)


class HeldOut:
    """Samples `offset`, `offset` + 1, ... of a source, as samples 0, 1, ... (the synthetic held-out set)."""

    def __init__(self, source: TokenSource, offset: int):
        self.source, self.offset = source, offset
        self.name = f"{source.name}[{offset}:]"

    def sample(self, index: int):
        return self.source.sample(self.offset + index)


@dataclass(frozen=True)
class ValidationSet:
    label: str | None  # the blend source's name; None for a single dataset
    source: TokenSource


def validation_sets(
    recipe: Recipe,
    data_dir: Path | None,
    synthetic: bool,
    train_source: TokenSource,
    open_source: Callable[[Path], TokenSource],
) -> list[ValidationSet]:
    """The held-out splits a recipe validates on: one per blend source, else the dataset's own."""
    if recipe.validation is None:
        return []
    if synthetic or (data_dir is None and not recipe.data.sources):
        return [ValidationSet(None, HeldOut(train_source, SYNTHETIC_HELD_OUT))]
    if recipe.data.sources:
        return [
            ValidationSet(name, _open_split(directory, open_source, f"data.sources.{i}.uri"))
            for i, (name, directory) in enumerate(source_directories(recipe, data_dir))
        ]
    return [ValidationSet(None, _open_split(Path(data_dir), open_source, "data.train_s3_uri"))]


def _open_split(dataset: Path, open_source: Callable[[Path], TokenSource], field: str) -> TokenSource:
    split = dataset / VALIDATION_DIR
    if not split.is_dir():
        raise TrainstackError(
            f"validation: {field}'s dataset has no validation split ({split} does not exist; "
            "`trainstack data prepare --validation-fraction F` writes one); or remove validation"
        )
    return open_source(split)


class Validator:
    """Evaluates the model on the fixed validation batches every `settings.every_steps` steps."""

    def __init__(
        self,
        sets: Sequence[ValidationSet],
        settings: Validation,
        layout: Layout,
        rank: int,
        device: torch.device,
        split: Callable[[torch.Tensor], torch.Tensor] | None = None,
        at_start: bool = False,
    ):
        if not sets:
            raise ValueError("a validator needs at least one validation set")
        self.sets, self.settings, self.layout, self.device = tuple(sets), settings, layout, device
        self.split = split  # context parallelism: this rank's chunks, as in training
        self.at_start = at_start  # also at step 0, before the first step (Recipe.validates_at_start)
        # This rank's micro-batches: the same list at every evaluation. The CP ranks of one group read
        # the same samples (rank // cp among world // cp), as in training.
        self.plan = [
            micro_batch_indices(
                b * layout.global_batch, m, rank // layout.cp, layout.data_ranks, layout.micro_batch
            )
            for b in range(settings.batches)
            for m in range(layout.grad_accum)
        ]
        samples = settings.batches * layout.global_batch
        self.packed = any(hasattr(vs.source, "micro_batch") for vs in self.sets)  # chat rows: a masked loss
        for vs in self.sets:
            windows = getattr(vs.source, "total_windows", None)
            if windows is not None and windows < samples:
                log.warning(
                    "validation split %s holds %d windows (packed rows), fewer than batches x "
                    "global_batch = %d: "
                    "some are evaluated twice (fewer validation.batches avoids that)",
                    vs.source.name,
                    windows,
                    samples,
                )

    def due(self, step: int) -> bool:
        """After step `step` (0: before the first, only with at_start)."""
        return step % self.settings.every_steps == 0 and (step > 0 or self.at_start)

    def evaluate(self, model: torch.nn.Module, autocast: Callable) -> dict[str, float]:
        """Metric-line values: `val_loss`, and `val_loss_<source>` per blend source. Every rank calls it."""
        sums = torch.zeros(len(self.sets), dtype=torch.float32, device=self.device)
        targets = torch.zeros(len(self.sets), dtype=torch.float32, device=self.device)  # packed rows only
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                for k, vs in enumerate(self.sets):
                    batches = Prefetcher(vs.source, iter(self.plan), self.device, split=self.split)
                    try:
                        for indices in self.plan:
                            batch = batches.next(indices)
                            if batch.packed is not None:  # the summed loss over its targets
                                with autocast():
                                    sums[k] += model(batch.inputs, batch.targets, packed=batch.packed).float()
                                targets[k] += (batch.targets != IGNORE_INDEX).sum()
                                continue
                            with autocast():
                                sums[k] += model(batch.inputs, batch.targets).float()
                    finally:
                        batches.close()
        finally:
            model.train(was_training)
        if self.packed:
            both = torch.cat((sums, targets))
            dist.all_reduce(both)
            sums, targets = both.split(len(self.sets))
            losses = (sums / targets.clamp_min(1.0)).tolist()
        else:
            dist.all_reduce(sums)
            losses = (sums / (len(self.plan) * self.layout.world)).tolist()
        values = {"val_loss": sum(losses) / len(losses)}
        for vs, loss in zip(self.sets, losses, strict=True):
            if vs.label is not None:
                values[f"{SOURCE_VAL_LOSS}{vs.label}"] = loss
        return values

    def run_if_due(
        self, step: int, model: torch.nn.Module, autocast: Callable
    ) -> tuple[dict[str, float], float]:
        """(metric-line values, seconds it took) after step `step`; ({}, 0) when no evaluation is due."""
        if not self.due(step):
            return {}, 0.0
        started = time.perf_counter()
        values = self.evaluate(model, autocast)
        seconds = time.perf_counter() - started
        log.info("validation at step %d: %s (%.1f s)", step, _described(values), seconds)
        return values, seconds


def _described(values: dict[str, float]) -> str:
    return ", ".join(f"{key} {value:.4f}" for key, value in values.items())


def build_validator(
    recipe: Recipe,
    layout: Layout,
    rank: int,
    device: torch.device,
    data_dir: Path | None,
    synthetic: bool,
    train_source: TokenSource,
    open_source: Callable[[Path], TokenSource],
    split: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Validator | None:
    """The recipe's validator, or None when the recipe has no `validation` section."""
    if recipe.validation is None:
        return None
    sets = validation_sets(recipe, data_dir, synthetic, train_source, open_source)
    validator = Validator(
        sets, recipe.validation, layout, rank, device, split, at_start=recipe.validates_at_start
    )
    log.info(
        "validation every %d steps%s: %d batches x %d samples of %s",
        recipe.validation.every_steps,
        " and before the first" if validator.at_start else "",
        recipe.validation.batches,
        layout.global_batch,
        ", ".join(vs.source.name for vs in sets),
    )
    return validator
