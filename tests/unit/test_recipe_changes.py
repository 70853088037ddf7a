"""Mid-run recipe changes: the schedule, cadence and layout may change between jobs of a run; the model,
sequence length, global batch, seed, precision and data may not (trainstack.recipes.changes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainstack.recipes import changes
from trainstack.recipes.loader import resolve

pytestmark = pytest.mark.fast

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


def test_resume_refuses_steps_below_the_runs_step_and_warmup_at_or_above_steps():
    """Safe keys, values a run cannot continue with: `training.steps=10` on a run at step 1234 made the
    trainer exit 0 with nothing to do and the run completed for good; a warm-up past the run's end."""
    before = _recipe()  # 30b-fp8
    end_there = _recipe("training.steps=1234", "training.warmup_steps=100")
    assert changes.resume_problem(before, end_there, 1234) is None  # end right there
    assert changes.resume_problem(before, _recipe("training.steps=60000"), 1234) is None
    key, why = changes.resume_problem(before, _recipe("training.steps=10", "training.warmup_steps=5"), 1234)
    assert key == "training.steps" and "10 is below the run's step 1,234" in why and "at least 1,234" in why
    steps = before.training.steps
    key, why = changes.resume_problem(before, _recipe(f"training.warmup_steps={steps}"), 0)
    assert key == "training.warmup_steps" and f"not below training.steps {steps:,}" in why
    key, _ = changes.resume_problem(before, _recipe("training.warmup_steps=999999"), 0)
    assert key == "training.warmup_steps"
    lowered = _recipe(f"training.steps={before.training.warmup_steps}")  # steps down onto the warm-up
    assert changes.resume_problem(before, lowered, 0)[0] == "training.warmup_steps"
    assert (
        changes.resume_problem(before, _recipe("training.lr=1e-4"), 10**9) is None
    )  # untouched: no judgment
