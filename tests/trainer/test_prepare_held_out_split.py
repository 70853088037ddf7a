"""A held-out split that `data prepare` leaves empty is said when it happens, and the rerun that fixes it
works: the split is by a hash of each document, so a small corpus at the default fraction (0.005) holds
out none, and a recipe that validates on it would be refused at launch (trainstack.aws.dataset_check)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.fast


def prepare(tmp_path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "trainer.prepare", str(tmp_path / "docs.jsonl"), "--tokenizer", "bytes"]
    command += ["--out", str(tmp_path / "out"), "--workers", "1", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.fixture
def corpus(tmp_path):
    lines = [json.dumps({"text": f"document {i} " * 8}) for i in range(40)]
    (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path


def test_a_fraction_that_held_out_nothing_is_said_on_stderr(corpus):
    done = prepare(corpus)
    assert done.returncode == 0, done.stderr
    assert "0 documents (0 tokens) held out for validation" in done.stdout
    warning = [line for line in done.stderr.splitlines() if "warning" in line]
    assert warning == [
        "prepare: warning: --validation-fraction 0.005 held out no document (the share is by a hash of "
        "each); a recipe with validation cannot use this dataset: rerun with a larger fraction (and "
        "--overwrite, or another --out), or train without validation"
    ]


def test_overwrite_replaces_a_local_dataset_prepared_with_another_fraction(corpus):
    assert prepare(corpus).returncode == 0
    refused = prepare(corpus, "--validation-fraction", "0.25")
    assert refused.returncode != 0
    assert (
        refused.stderr.strip()
        .splitlines()[-1]
        .endswith(
            "already holds a dataset prepared with validation_fraction 0.005, not 0.25; give another prefix, "
            "--overwrite to replace it (a local one), or the same settings to resume it"
        )
    )
    replaced = prepare(corpus, "--validation-fraction", "0.25", "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert "--overwrite: deleted the dataset prepared with validation_fraction 0.005" in replaced.stderr
    manifest = json.loads((corpus / "out" / "manifest.json").read_text())
    held = manifest["validation"]
    assert held["fraction"] == 0.25 and held["documents"] > 0
    assert manifest["documents"] + held["documents"] == 40  # every document once, none lost or doubled
    assert "warning" not in replaced.stderr
