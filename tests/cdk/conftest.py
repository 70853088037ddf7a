"""One in-process synthesis of `-c recipe=all` (every base recipe, and every team's recipes), shared by
the template gates. Synthesis itself is the cdk-nag gate: any unacknowledged finding fails it.

Each synthesis here is made once per test session, not once per xdist worker: the first worker to need
it synthesizes into the session's shared temporary root under a file lock, the other reads it."""

from __future__ import annotations

from pathlib import Path

import pytest
from cdk_helpers import synth, templates
from filelock import FileLock


def shared_synth(tmp_path_factory: pytest.TempPathFactory, name: str, context: dict[str, str]) -> Path:
    """The assembly of `context`, synthesized by whichever worker asks first (all workers of one session
    share the parent of their base temporary directories)."""
    root = tmp_path_factory.getbasetemp()
    if root.name.startswith("popen-gw"):  # an xdist worker: its siblings' root
        root = root.parent
    outdir, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():  # a synthesis that failed leaves no mark: the next asker fails the same way
            synth(context, outdir)
            done.touch()
    return outdir


@pytest.fixture(scope="session")
def all_outdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_synth(tmp_path_factory, "cdk-all", {"recipe": "all"})


@pytest.fixture(scope="session")
def all_templates(all_outdir: Path) -> dict[str, dict]:
    return templates(all_outdir)


# VPC mode, with the recipe tracking in the team's managed MLflow App and to TensorBoard: the VPC
# statements of the execution role, the team's tracking stack, the MLflow grant (test_iam_policies.py,
# test_tracking_stack.py). One synthesis for both.
VPC_TRACKING_CONTEXT = {
    "recipe": "1b-bf16",
    "vpc": "true",
    "set": "tracking.mlflow=managed,tracking.tensorboard=true",
}


@pytest.fixture(scope="session")
def vpc_tracking_outdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_synth(tmp_path_factory, "cdk-vpc-tracking", VPC_TRACKING_CONTEXT)


@pytest.fixture(scope="session")
def vpc_tracking_templates(vpc_tracking_outdir: Path) -> dict[str, dict]:
    return templates(vpc_tracking_outdir)
