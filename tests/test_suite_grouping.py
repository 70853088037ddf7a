"""`make test` runs `pytest -n 2 --dist loadgroup`: the tests that share an expensive fixture (one
emulator deploy, one synthesis, one reference training run) say so with an xdist_group mark, and must
then run on one worker, or each worker builds its own copy. pytest 9.2 with xdist 3.8.0 silently
ignored every mark (pytest-dev/pytest-xdist#1386); this notices such a pin."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

GROUPED = """
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.xdist_group("shared")


@pytest.mark.parametrize("i", range(4))
def test_worker(i):
    (Path(__file__).parent / "ran").joinpath(f"{Path(__file__).stem}-{i}").write_text(
        os.environ["PYTEST_XDIST_WORKER"]
    )
"""


def test_tests_of_one_xdist_group_run_on_one_worker(tmp_path: Path) -> None:
    for name in ("test_a.py", "test_b.py"):
        (tmp_path / name).write_text(GROUPED)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "ran").mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    ran = {p.name: p.read_text() for p in (tmp_path / "ran").iterdir()}
    assert len(ran) == 8, ran
    workers = set(ran.values())
    assert len(workers) == 1, f"one group ran on {sorted(workers)}:\n{result.stdout[-3000:]}"
