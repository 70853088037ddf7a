"""Record the tuning tests' job logs: real trainer runs on this machine's CPU (run by hand, not by pytest).

    .venv/bin/python tests/tuning/record_logs.py

Writes tests/tuning/data/<name>.log (stdout and stderr of each job, verbatim) and <name>.failure (the
failure file's line, where the job wrote one): the tiny recipe's three candidates as `tune --local`
picks them, one with a learning rate ten times the others' (the same run it is not: its loss must be
flagged), and one whose forward raises torch.OutOfMemoryError at step 4 (TRAINSTACK_FAULT_INJECT=oom@4,
test-only), which the trainer reports with its out-of-memory failure line.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from trainstack.recipes.loader import resolve  # noqa: E402
from trainstack.tuning.candidates import Candidate, candidates  # noqa: E402
from trainstack.tuning.engine import job_recipe, step_plan  # noqa: E402
from trainstack.tuning.local import run_job  # noqa: E402

DATA = Path(__file__).resolve().parent / "data"
TINY = REPO / "tests" / "trainer" / "fixtures" / "tiny.yaml"
WINDOW = 12


def main() -> None:
    recipe = resolve(str(TINY)).recipe
    found = candidates(recipe, 3, world=1, compile_choices=False)
    lr = Candidate("lr10x", ("training.lr=0.03",), "the recipe's layout, lr 10x", found[0].planned, True)
    jobs = [(c, {}) for c in found] + [(lr, {}), (found[1], {"TRAINSTACK_FAULT_INJECT": "oom@4"})]
    names = [c.name for c in found] + ["lr10x", "oom"]
    with tempfile.TemporaryDirectory() as work:
        for name, (c, env) in zip(names, jobs, strict=True):
            steps = step_plan(recipe, c, compiled=False, window=WINDOW)
            log = run_job(name, job_recipe(recipe, c, steps), steps.max_steps, 1, Path(work), extra_env=env)
            (DATA / f"{name}.log").write_text("\n".join(log.lines) + "\n")
            if log.failure_reason:
                (DATA / f"{name}.failure").write_text(log.failure_reason + "\n")
            print(name, c.overrides, "exit", log.exit_code, f"{log.seconds:.0f} s", flush=True)


if __name__ == "__main__":
    main()
