"""The prepared datasets a recipe names, read before anything is paid (`validate`, `plan`, `launch`).

The trainer checks each dataset's manifest.json against the recipe at step 0 (trainer.data.manifest,
trainer.data.loader, trainer.validation), but by then the nodes are paid for: a held-out split that
`data prepare` left empty (its share is by a hash of each document, so a small corpus at the default
0.005 holds out none), another tokenizer's shards, a text dataset under `training.objective: sft`, each
ends the first job. Reading the same manifest first, from where the job would (the emulator's S3 with
--local, AWS's otherwise), turns each into one line before the launch.

    dataset_problem(recipe, manifest, where, field) -> the one line, or None (pure)
    check_datasets(recipe, s3)                      -> raises TrainstackError (exit 2) on a problem

The manifest is read as `plan` reads a chat set's (trainstack.aws.chat_dataset.read_manifest). One that
cannot be read here (no manifest: a Megatron dataset of another tool, shards from before manifests; or no
access from this machine) is not checked, as the trainer does not check a dataset without one either.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from trainstack.aws.chat_dataset import ManifestUnreadable, read_manifest
from trainstack.errors import TrainstackError
from trainstack.recipes.schema import Recipe

DATASET_FORMAT = "trainstack-dataset-v1"  # what trainer.data.manifest writes and reads


def datasets(recipe: Recipe) -> Iterator[tuple[str, str]]:
    """(recipe field, s3 prefix) of every dataset the job reads: one, or each source of a blend."""
    if recipe.data.train_s3_uri:
        yield "data.train_s3_uri", recipe.data.train_s3_uri
    for index, source in enumerate(recipe.data.sources):
        yield f"data.sources.{index}.uri", source.uri


def dataset_problem(recipe: Recipe, manifest: dict[str, Any], where: str, field: str) -> str | None:
    """The one line a recipe is refused with for the dataset whose train manifest is `manifest` (read
    from `where`, named by the recipe's `field`), or None (pure)."""
    if manifest.get("format") != DATASET_FORMAT:
        return f"{field}: {where}: format: expected a {DATASET_FORMAT!r} manifest"
    tokenizer = manifest.get("tokenizer") or {}
    expected = recipe.data.tokenizer
    if expected and tokenizer.get("identity") != expected:
        return (
            f"{field}: {where}: the shards were made with tokenizer {tokenizer.get('identity')}, "
            f"data.tokenizer is {expected}; re-prepare the data with that tokenizer or fix the recipe"
        )
    vocab = tokenizer.get("vocab_size")
    if isinstance(vocab, int) and vocab > recipe.model.vocab:
        return (
            f"{field}: {where}: the shards use {vocab:,} token ids, model.vocab is {recipe.model.vocab:,} "
            "(the embedding has no row for the rest); prepare with the model's tokenizer"
        )
    chat = manifest.get("chat") is not None
    if recipe.training.objective == "sft" and not chat:
        return (
            f"{field}: {where}: a text dataset; training.objective sft trains on conversations "
            "(`trainstack data prepare --format chat`)"
        )
    if recipe.training.objective == "pretrain" and chat:
        return (
            f"{field}: {where}: a chat dataset; set training.objective: sft to fine-tune on it (read as "
            "text, every token would be a target and conversations would run into each other)"
        )
    if recipe.validation is not None:
        held = manifest.get("validation")
        if held is None:
            return (
                f"validation: {field}: {where}: the dataset has no validation split (`trainstack data "
                "prepare --validation-fraction F` writes one); or remove validation"
            )
        if not held.get("documents"):
            return (
                f"validation: {field}: {where}: the validation split holds no document (--validation-"
                f"fraction {held.get('fraction')} held out none: the share is by a hash of each document); "
                "re-prepare with a larger fraction, or remove validation"
            )
    return None


def check_datasets(recipe: Recipe, s3: Any) -> None:
    """Refuse (TrainstackError, exit 2) a recipe whose prepared data the trainer would refuse at step 0."""
    for field, uri in datasets(recipe):
        try:
            manifest, where = read_manifest(uri, s3)
        except ManifestUnreadable:  # not prepared by trainstack, or not readable from here
            continue
        except TrainstackError as error:  # there, but not JSON
            raise TrainstackError(f"{field}: {str(error).removeprefix('data.train_s3_uri: ')}") from None
        problem = dataset_problem(recipe, manifest, where, field)
        if problem is not None:
            raise TrainstackError(
                f"{problem} (the trainer would refuse it at step 0, after the nodes are paid for)"
            )
