"""A fine-tuning run priced from its data: epochs, the tokens they hold, packing, time and cost per epoch.

A supervised fine-tuning recipe (`training.objective: sft`) runs `training.steps` optimizer steps of
`global_batch` packed rows of `seq_len` positions each, like a pretraining one: that is what the plan's
hours and cost price, padding included (a padding position goes through every GEMM of the step as a
token does; the varlen attention kernels skip it only in attention). What a fine-tuning run is planned
in is epochs over a prepared set, so this module reads the set's manifest (`data prepare --format
chat` writes it: trainer.prepare.chat_prepare) and says what the steps mean there:

    rows     packed sequences the set fills at the recipe's seq_len (the manifest's `chat.packing`,
             best-fit decreasing, when it was packed at that seq_len; else estimated, and said so)
    epochs   steps x global_batch / rows (the trainer reshuffles the rows each epoch)
    tokens   epochs x the set's tokens (context and targets: every token of a conversation is read,
             its assistant tokens are the targets), targets = epochs x its target tokens
    padding  1 - efficiency of the positions computed (steps x global_batch x seq_len)
    per epoch: the plan's training hours and cost over the epochs

and the steps for a whole number of epochs: ceil(E x rows / global_batch). Pure: the manifest comes in
as a dict (trainstack.aws.chat_dataset reads it); no I/O here.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from trainstack.recipes.schema import Recipe

# Published full-parameter SFT runs train 1 to 3 epochs (Tulu 3: 2, "longer training did not help",
# arXiv:2411.15124); below one pass part of the set is never seen, far above it the model memorises it.
FEW_EPOCHS = 1.0
MANY_EPOCHS = 5.0


@dataclass(frozen=True)
class FineTuningPlan:
    manifest: str  # where the manifest was read
    examples: int  # conversations in the training split
    tokens: int  # their tokens (context and targets), padding apart
    target_tokens: int
    rows: int  # packed rows at the recipe's seq_len
    rows_estimated: bool  # the manifest was packed at another seq_len: rows from its efficiency
    packing_efficiency: float  # share of the rows' positions that are tokens (the manifest's)
    epochs: float  # steps x global_batch / rows
    steps_per_epoch: float
    tokens_trained: float  # epochs x tokens
    targets_trained: float  # epochs x target tokens
    positions_computed: int  # steps x global_batch x seq_len: what the plan prices
    padding_share: float  # of the positions computed
    hours_per_epoch: float  # the plan's training hours (validation included) per epoch
    usd_per_epoch: float  # the plan's cost per epoch
    usd_per_million_targets: float
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "notes": list(self.notes)}

    def steps_for(self, epochs: float, global_batch: int) -> int:
        """Optimizer steps for `epochs` passes over the set (what training.steps should be)."""
        return max(1, math.ceil(epochs * self.rows / global_batch))


class ManifestProblem(ValueError):
    """The manifest is not a chat dataset's (one line, naming the manifest and the field)."""


def _number(block: dict, key: str, where: str, kind: type = int) -> Any:
    value = block.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int) or value < 0:
        raise ManifestProblem(f"{where}: {key}: expected a non-negative number, got {value!r}")
    return value


def chat_figures(manifest: Any, where: str) -> dict[str, Any]:
    """The figures a plan needs from a chat dataset's manifest.json; ManifestProblem (one line) when it
    is not one (a pretraining dataset has no `chat` block: every token would be a target)."""
    if not isinstance(manifest, dict):
        raise ManifestProblem(f"{where}: expected a JSON object")
    chat = manifest.get("chat")
    if not isinstance(chat, dict):
        raise ManifestProblem(
            f"{where}: chat: missing: not a chat dataset (training.objective sft trains on "
            "`trainstack data prepare --format chat`'s output)"
        )
    packing = chat.get("packing")
    if not isinstance(packing, dict):
        raise ManifestProblem(f"{where}: chat.packing: missing")
    figures = {
        "tokens": _number(manifest, "tokens", where),
        "examples": _number(chat, "examples", f"{where}: chat"),
        "target_tokens": _number(chat, "target_tokens", f"{where}: chat"),
        "seq_len": _number(chat, "seq_len", f"{where}: chat"),
        "sequences": _number(packing, "sequences", f"{where}: chat.packing"),
        "efficiency": float(_number(packing, "efficiency", f"{where}: chat.packing", float)),
    }
    if not figures["sequences"] or not figures["tokens"] or not 0 < figures["efficiency"] <= 1:
        raise ManifestProblem(
            f"{where}: chat.packing: an empty set (no packed sequence) cannot be trained on"
        )
    return figures


def plan_fine_tuning(
    recipe: Recipe, manifest: dict[str, Any], where: str, training_hours: float, total_usd: float
) -> FineTuningPlan:
    """The fine-tuning figures of `recipe` over the set `manifest` describes (read from `where`), with
    the plan's training hours (validation included) and total cost. ManifestProblem: not a chat set."""
    figures = chat_figures(manifest, where)
    tr = recipe.training
    notes: list[str] = []
    if figures["seq_len"] == tr.seq_len:
        rows, estimated, efficiency = figures["sequences"], False, figures["efficiency"]
    else:
        # Not packed at this seq_len: the rows the same efficiency would give (longer rows pack at
        # least as well, so above the manifest's seq_len this is an upper bound on the rows).
        efficiency = figures["efficiency"]
        rows, estimated = max(1, math.ceil(figures["tokens"] / (tr.seq_len * efficiency))), True
        notes.append(
            f"the set was prepared for seq_len {figures['seq_len']:,}, the recipe trains at "
            f"{tr.seq_len:,}: rows estimated at the set's {efficiency:.1%} packing efficiency"
            + (
                "; examples longer than the recipe's seq_len do not fit a row (prepare at the "
                "recipe's seq_len)"
                if tr.seq_len < figures["seq_len"]
                else ""
            )
        )
    steps_per_epoch = rows / tr.global_batch
    epochs = tr.steps / steps_per_epoch
    positions = tr.steps * tr.global_batch * tr.seq_len
    tokens_trained = epochs * figures["tokens"]
    targets_trained = epochs * figures["target_tokens"]
    if epochs < FEW_EPOCHS:
        notes.append(
            f"{epochs:.2f} epochs: the run ends before one pass over the set ({1 - epochs:.0%} of the "
            "rows are never trained on)"
        )
    elif epochs > MANY_EPOCHS:
        notes.append(
            f"{epochs:.1f} epochs: published full fine-tuning runs train 1-3 epochs (Tulu 3: 2); this many "
            "passes over the same conversations tend to memorise them (watch val_loss rise)"
        )
    return FineTuningPlan(
        manifest=where,
        examples=figures["examples"],
        tokens=figures["tokens"],
        target_tokens=figures["target_tokens"],
        rows=rows,
        rows_estimated=estimated,
        packing_efficiency=efficiency,
        epochs=epochs,
        steps_per_epoch=steps_per_epoch,
        tokens_trained=tokens_trained,
        targets_trained=targets_trained,
        positions_computed=positions,
        padding_share=max(0.0, 1.0 - tokens_trained / positions),
        hours_per_epoch=training_hours / epochs,
        usd_per_epoch=total_usd / epochs,
        usd_per_million_targets=total_usd / max(targets_trained / 1e6, 1e-12),
        notes=tuple(notes),
    )


def summary_lines(plan: FineTuningPlan, recipe: Recipe) -> list[str]:
    """What `trainstack plan` prints for a fine-tuning run (one line each)."""
    tr = recipe.training
    rows = f"{'about ' if plan.rows_estimated else ''}{plan.rows:,} rows of {tr.seq_len:,}"
    whole = max(1, round(plan.epochs))
    lines = [
        f"fine-tuning data: {plan.manifest}: {plan.examples:,} conversations, {_count(plan.tokens)} tokens "
        f"({_count(plan.target_tokens)} targets, {plan.target_tokens / plan.tokens:.0%}), packed into {rows} "
        f"at {plan.packing_efficiency:.1%} efficiency",
        f"fine-tuning run: {tr.steps:,} steps x {tr.global_batch:,} rows = {plan.epochs:.2f} epochs: "
        f"{_count(plan.tokens_trained)} tokens trained ({_count(plan.targets_trained)} targets), "
        f"{_count(plan.positions_computed)} positions computed ({plan.padding_share:.1%} padding, priced "
        f"like tokens); {_hours(plan.hours_per_epoch)} and {_usd(plan.usd_per_epoch)} USD per epoch, "
        f"{_usd(plan.usd_per_million_targets)} USD per million target tokens; {whole} epoch"
        f"{'s' if whole != 1 else ''} = {plan.steps_for(whole, tr.global_batch):,} steps",
    ]
    lines += [f"fine-tuning note: {note}" for note in plan.notes]
    return lines


def unpriced_line(recipe: Recipe, where: str, reason: str) -> str:
    """The one line a plan prints when the set's manifest cannot be read here."""
    tr = recipe.training
    return (
        f"fine-tuning: epochs and the price per epoch need the prepared set's manifest ({where}: {reason}); "
        f"the plan prices {tr.steps:,} steps x {tr.global_batch:,} packed rows of {tr.seq_len:,}"
    )


def _hours(hours: float) -> str:
    if hours >= 1:
        return f"{hours:,.1f} h"
    return f"{hours * 60:.0f} min" if hours * 60 >= 10 else f"{hours * 3600:.0f} s"


def _usd(usd: float) -> str:
    return f"{usd:,.0f}" if usd >= 100 else f"{usd:.2f}"


def _count(n: float) -> str:
    """2,609 -> 2.6K, 260,900 -> 261K, 2.1e8 -> 210M: three significant figures at most."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"
