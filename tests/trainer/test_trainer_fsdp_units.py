"""FSDP units as torchtitan's, on 2 gloo ranks: the embedding and [final norm + output head] are
units of their own, so the embedding is resharded through the step and only the head and the last
block stay gathered after forward (what trainstack.planner.trainer_memory tells the planner)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from trainer_helpers import REPO, TINY, trainer_env

pytestmark = [pytest.mark.fast, pytest.mark.xdist_group("trainer")]


@pytest.fixture(scope="module")
def units(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fsdp") / "units.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(REPO / "tests" / "trainer" / "fsdp_units_worker.py"),
        str(out),
        str(TINY),
    ]
    result = subprocess.run(command, cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def test_embedding_blocks_and_head_are_separate_units_and_only_the_last_two_stay_gathered(units):
    untied = units["False"]
    assert untied["planned_reshard_after_forward"] == {
        "tok_embeddings": True,
        "layers.0": True,
        "layers.1": True,
        "layers.2": False,  # backward starts with it
        "norm+output": False,  # the loss's backward starts with it
    }
    assert untied["groups"] == {
        "tok_embeddings": True,
        "layers.0": True,
        "layers.1": True,
        "layers.2": False,
        "norm, output": False,
    }
    assert untied["gathered_after_forward"] == ["layers.2", "norm, output"]
    assert untied["gathered_bytes"] == untied["expected_bytes"]
    assert untied["sharded_param_ranks"] == [2]


def test_tied_embeddings_are_one_unit_with_the_head_kept_gathered(units):
    tied = units["True"]
    assert tied["groups"] == {
        "tok_embeddings, norm, output": False,
        "layers.0": True,
        "layers.1": True,
        "layers.2": False,
    }
    assert tied["gathered_after_forward"] == ["layers.2", "tok_embeddings, norm, output"]
    assert tied["gathered_bytes"] == tied["expected_bytes"]
