"""One in-process synthesis of `-c recipe=all` (every base recipe, and every team's recipes), shared by
the template gates. Synthesis itself is the cdk-nag gate: any unacknowledged finding fails it."""

from __future__ import annotations

from pathlib import Path

import pytest
from cdk_helpers import synth, templates


@pytest.fixture(scope="session")
def all_outdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth({"recipe": "all"}, tmp_path_factory.mktemp("cdk-all"))


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
    return synth(VPC_TRACKING_CONTEXT, tmp_path_factory.mktemp("cdk-vpc-tracking"))


@pytest.fixture(scope="session")
def vpc_tracking_templates(vpc_tracking_outdir: Path) -> dict[str, dict]:
    return templates(vpc_tracking_outdir)
