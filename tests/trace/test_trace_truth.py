"""The trace tells the truth: the trainer's step tracked on fake tensors (trainer.trace) peaks at the
same bytes, category by category, as the same step on real CPU tensors under the same tracker, at 2
ranks (real gloo processes against a fake world of 2), with and without activation checkpointing.
And the DTensor trap the trace works around (trainer/trace/fake.py) is still there: left in place, it
over-counts the optimizer state, so a torch upgrade that fixes (or changes) it fails here and the
workaround can be dropped or revisited.

Limits (docs/planner.md, "The traced step"): the trace runs the pure-PyTorch block eager; torch.compile
and Transformer Engine's kernels are not traced, so neither is compared here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

WORKER = Path(__file__).with_name("truth_worker.py")
MODES = ("none", "full")
TOLERANCE = 0.02  # the issue's: within 2% of the real step's tracked peak


def _run(kind: str, *modes: str) -> dict:
    done = subprocess.run(
        [sys.executable, str(WORKER), kind, *modes], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def real_steps() -> dict:
    return _run("real", *MODES)


@pytest.fixture(scope="module")
def fake_steps() -> dict:
    return _run("fake", *MODES)


@pytest.mark.parametrize("mode", MODES)
def test_fake_peak_equals_the_real_two_rank_step_within_two_percent(real_steps, fake_steps, mode):
    real, fake = real_steps[mode]["peak_bytes"], fake_steps[mode]["peak_bytes"]
    assert abs(fake / real - 1) <= TOLERANCE, (mode, fake, real)


@pytest.mark.parametrize("mode", MODES)
def test_fake_categories_equal_the_real_steps(real_steps, fake_steps, mode):
    real, fake = real_steps[mode]["by_category_bytes"], fake_steps[mode]["by_category_bytes"]
    for category in ("parameters", "gradients", "optimizer", "activations"):
        assert fake[category] == pytest.approx(real[category], rel=TOLERANCE), category


def test_checkpointing_lowers_the_tracked_activations(real_steps):
    """Not a tautology of the comparison above: the tracker does see checkpointing's effect."""
    assert (
        real_steps["full"]["by_category_bytes"]["activations"]
        < real_steps["none"]["by_category_bytes"]["activations"] / 10
    )


def test_the_dtensor_fake_mode_trap_still_overcounts_the_optimizer_state(real_steps):
    """torch 2.13: DTensor's sharding propagation reuses the trace's fake mode (detect_fake_mode), and
    its full-size fake copies count as optimizer state. If this fails, torch changed: re-check whether
    trainer.trace.fake.sharding_propagation_unfaked is still needed."""
    trapped = _run("fake-trap", "none")["none"]["by_category_bytes"]["optimizer"]
    real = real_steps["none"]["by_category_bytes"]["optimizer"]
    assert trapped > 2 * real, (trapped, real)
