"""What a checkpoint holds besides the model and optimizer shards, and the errors a save or load raises.

TrainerState is the loop's position (step, data position, data source, world size, the recipe it was
written with); rank-N.pt holds it with the scheduler and the RNG states. Transformer Engine FP8 modules
carry their scaling state as `_extra_state`, a byte tensor that is empty until the module's first FP8
forward (TE's `get_extra_state` returns `torch.empty(0)` then). A freshly built model therefore offers a
0-byte tensor where the checkpoint holds hundreds of bytes, and DCP refuses the size change. On load the
placeholders for every `_extra_state` are sized from the checkpoint's own metadata
(`size_extra_states_from`), then handed to the module's `set_extra_state` through `set_state_dict`.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from trainstack.protocol.checkpoint_format import step_dir_name

EXTRA_STATE = "_extra_state"


class CheckpointError(Exception):
    """A save that had to succeed (the final one) did not, or a load failed for a reason other than
    the checkpoint's own files (which CheckpointDamaged reports)."""


class CheckpointDamaged(Exception):
    """A checkpoint whose files do not match what its marker recorded (raised on every rank)."""

    def __init__(self, step: int, problem: str):
        super().__init__(f"{step_dir_name(step)}: {problem}")
        self.step, self.problem = step, problem


@dataclass(frozen=True)
class TrainerState:
    step: int  # optimizer steps completed
    samples_consumed: int  # the data position: sample indices below this are used
    data_source: str  # name of the token source; resuming onto a different one is refused
    world_size: int
    recipe: str | None = (
        None  # the resolved recipe (JSON) it was written with; trainer.checkpoint.resume compares
    )
    data_schedule: str = ""  # a blend's weights by data position (trainer.data.blend.Schedule); "" otherwise


def rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def size_extra_states_from(metadata: Metadata, model_state: dict[str, Any], prefix: str = "model.") -> None:
    """Replace each `_extra_state` placeholder of a fresh model with one shaped as the checkpoint holds
    it: TE's is empty before the first FP8 forward, and DCP refuses a tensor whose size changed."""
    for key in list(model_state):
        if not key.endswith(EXTRA_STATE):
            continue
        saved = metadata.state_dict_metadata.get(prefix + key)
        if isinstance(saved, TensorStorageMetadata):
            model_state[key] = torch.empty(saved.size, dtype=saved.properties.dtype)
        elif isinstance(saved, BytesStorageMetadata):
            model_state[key] = io.BytesIO()


def extra_states_as_tensors(model_state: dict[str, Any]) -> None:
    for key, value in model_state.items():
        if key.endswith(EXTRA_STATE) and isinstance(value, io.BytesIO):
            raw = value.getvalue()
            model_state[key] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0)
