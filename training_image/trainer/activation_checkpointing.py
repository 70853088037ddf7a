"""Activation checkpointing as the recipe says: none, selective (one block in every N), or full.

A checkpointed block keeps only its input in forward and recomputes its activations in backward
(costs about one extra forward of that block). With Transformer Engine FP8 the recompute must use
TE's own checkpoint so the FP8 scaling state is replayed exactly; otherwise torch's non-reentrant
checkpoint.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch.utils.checkpoint import checkpoint

from trainer.model import Transformer
from trainstack.recipe import ActivationCheckpointing


def recompute_function(backend_name: str) -> Callable:
    if backend_name == "transformer_engine":
        import transformer_engine.pytorch as te

        # Non-reentrant: the reentrant variant does not compose with FSDP2's backward hooks.
        return functools.partial(te.distributed.checkpoint, use_reentrant=False)
    return functools.partial(checkpoint, use_reentrant=False)


def checkpointed_blocks(config: ActivationCheckpointing, layers: int) -> list[int]:
    """Indices of the blocks that recompute: all, none, or every `every`-th starting at 0."""
    if config.mode == "none":
        return []
    if config.mode == "full":
        return list(range(layers))
    return [i for i in range(layers) if i % config.every == 0]


def apply_activation_checkpointing(model: Transformer, config: ActivationCheckpointing) -> list[int]:
    chosen = checkpointed_blocks(config, len(model.layers))
    recompute = recompute_function(model.backend_name) if chosen else None
    for index in chosen:
        model.layers[index].recompute = recompute
    return chosen
