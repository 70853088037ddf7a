"""Mid-run recipe changes: the schedule, cadence and layout may change between jobs of a run; the model,
sequence length, global batch, seed, precision and data may not (trainstack.recipes.changes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainstack.recipes import changes
from trainstack.recipes.loader import resolve

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def _recipe(*overrides: str):
    return resolve("30b-fp8", recipes_dir=RECIPES, overrides=list(overrides)).recipe


def test_identical_recipes_have_no_changes():
    assert changes.changes(_recipe(), _recipe()) == []


@pytest.mark.parametrize(
    "override",
    [
        "training.lr=1e-4",
        "training.steps=60000",
        "checkpointing.keep=5",
        "compute.instance_count=8",
        "training.grad_clip=0.5",
        "monitoring.stall_minutes=40",
        "compute.volume_size_gb=1000",  # was unsafe: not listed, though nothing the run resumes lives there
    ],
)
def test_schedule_cadence_and_layout_changes_are_safe(override):
    found = changes.changes(_recipe(), _recipe(override))
    assert [c.key for c in found] == [override.split("=")[0]] and not changes.unsafe(found)


@pytest.mark.parametrize(
    "override", ["model.layers=48", "training.seq_len=4096", "training.global_batch=512", "training.seed=7"]
)
def test_shape_sequence_batch_and_seed_changes_are_unsafe(override):
    found = changes.changes(_recipe(), _recipe(override))
    assert [c.key for c in changes.unsafe(found)] == [override.split("=")[0]]


def test_a_change_prints_key_before_and_after():
    (change,) = changes.changes(_recipe(), _recipe("training.lr=1e-4"))
    assert str(change) == f"training.lr: {_recipe().training.lr} -> 0.0001"


def test_keys_not_listed_are_unsafe_by_default():
    assert not changes.is_safe("model.some_future_key") and changes.is_safe("data.sources.3.weight")
