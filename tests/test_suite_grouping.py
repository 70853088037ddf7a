"""How the suite is run. The tiers: `make test` runs `pytest -m "not slow"`, `make test-all` every test,
and tests/conftest.py refuses a run in which any test belongs to no tier (pinned below on a throwaway
tree, with the real conftest).

Both run `pytest -n 2 --dist loadgroup`: the tests that share an expensive fixture (one
emulator deploy, one synthesis, one reference training run) say so with an xdist_group mark, and must
then run on one worker, or each worker builds its own copy. pytest 9.2 with xdist 3.8.0 silently
ignored every mark (pytest-dev/pytest-xdist#1386); this notices such a pin."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast
ROOT = Path(__file__).resolve().parents[1]
INI = "[pytest]\nmarkers =\n    fast: f\n    slow: s\naddopts = --strict-markers\n"

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


TIERED = {
    "test_fast.py": "import pytest\n\npytestmark = pytest.mark.fast\n\ndef test_quick():\n    pass\n",
    "test_slow.py": "import pytest\n\npytestmark = pytest.mark.slow\n\ndef test_long():\n    pass\n",
    "test_mixed.py": (
        "import pytest\n\npytestmark = pytest.mark.fast\n\ndef test_quick():\n    pass\n\n"
        "@pytest.mark.slow\ndef test_long():\n    pass\n"
    ),
    # a fast mark cannot pull a test out of a slow module: `-m "not slow"` sees the module's mark
    "test_mostly_slow.py": (
        "import pytest\n\npytestmark = pytest.mark.slow\n\ndef test_long():\n    pass\n\n"
        "@pytest.mark.fast\ndef test_quick():\n    pass\n"
    ),
}


def _run_pytest(tree: Path, *args: str) -> subprocess.CompletedProcess:
    (tree / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tree / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    fast: f\n    slow: s\naddopts = --strict-markers\n"
    )
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_fast_tier_deselects_slow_tests_and_says_how_many(tmp_path: Path) -> None:
    for name, body in TIERED.items():
        (tmp_path / name).write_text(body)
    fast = _run_pytest(tmp_path, "-m", "not slow")
    assert fast.returncode == 0, fast.stdout[-3000:]
    assert "2 passed, 4 deselected" in fast.stdout, fast.stdout[-3000:]
    said = "the fast tier: 2 tests selected, 4 of the slow tier deselected"
    assert said in fast.stdout, fast.stdout[-3000:]
    # as `make test` runs it: xdist's controller prints no deselected count of its own
    spread = _run_pytest(tmp_path, "-m", "not slow", "-n", "2")
    assert spread.returncode == 0 and said in spread.stdout, spread.stdout[-3000:]
    every = _run_pytest(tmp_path)
    assert every.returncode == 0 and "6 passed" in every.stdout, every.stdout[-3000:]


def test_a_test_module_in_no_tier_stops_the_run_naming_its_file(tmp_path: Path) -> None:
    for name, body in TIERED.items():
        (tmp_path / name).write_text(body)
    (tmp_path / "test_forgotten.py").write_text("def test_unmarked():\n    pass\n")
    for args in ((), ("-m", "not slow")):
        result = _run_pytest(tmp_path, *args)
        assert result.returncode != 0, result.stdout[-3000:]
        output = result.stdout + result.stderr
        assert "belong to no tier" in output and "test_forgotten.py" in output, output[-3000:]
        assert "passed" not in result.stdout, result.stdout[-3000:]


def test_make_test_is_the_fast_tier_and_ci_runs_every_test() -> None:
    """The README's `make test` deselects the slow tier; `.ci/run` calls `make test-all`, which does not."""
    makefile = (ROOT / "Makefile").read_text()
    fast = makefile.split("\ntest: ", 1)[1].split("\n\n", 1)[0]
    every = makefile.split("\ntest-all: ", 1)[1].split("\n\n", 1)[0]
    assert '-m "not slow"' in fast and "tests" in fast, fast
    assert "pytest" in every and "-m " not in every, every
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "make test-all" in ci, ci
