"""docs/api.md's notebook cell and pipeline step, run as written on the local emulator.

The set-up is what the page asks for, `make demo`'s emulator: in a copy of this checkout (the docs
walkthrough's workspace, tests/docs/test_doc_commands.py: `trainstack emulator start`, its MLflow server
beside it), `npx cdk deploy` of scripts/demo-tiny.yaml and its data prepared with `trainstack data prepare`,
as scripts/demo.py does (its own run, export and transformers check left out: the page needs none of them).
Then each Python block of the page is written to a file and run with the venv's python from the copy's
root, as a reader runs it: the notebook cell plans, tunes two layouts on the emulator's jobs, launches 30
steps with the chosen one, waits for the run's end and plots its loss from its MLflow run; the pipeline
step exits 0 on a run that completes and 1 on one whose trainer diverges (a NaN at step 3, the emulator's
test-only fault setting: a failure the supervisor does not retry).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import test_doc_commands as walkthrough

from trainstack.emulator import events as emulator_events
from trainstack.emulator.endpoint import ACCOUNT, REGION, clients

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("api-doc")]

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "api.md"
RECIPE = "scripts/demo-tiny.yaml"
DATA_BUCKET = "trainstack-demo-data"  # demo-tiny's data.train_s3_uri
RUN_TIMEOUT_S = 1500  # a block's whole run on a loaded 2-core machine


def block(marker: str) -> str:
    """The Python block after `<!-- api-doc: MARKER -->` in docs/api.md, as written."""
    text = PAGE.read_text()
    after = text.split(f"<!-- api-doc: {marker} -->", 1)[1]
    assert after.lstrip().startswith("```python\n"), f"docs/api.md: no python block after the {marker} marker"
    return after.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_pages_blocks_are_python_that_imports_only_the_public_api():
    """Fast to check, before the emulator: each block compiles and uses trainstack.api's public names."""
    from trainstack import api

    for marker in ("notebook", "pipeline"):
        source = block(marker)
        compile(source, f"docs/api.md ({marker})", "exec")
        used = set(re.findall(r"\bapi\.(\w+)", source))
        assert used and used <= set(api.__all__), sorted(used - set(api.__all__))


def test_the_notebook_cell_and_the_pipeline_step_run_as_written_on_the_emulator(tmp_path: Path) -> None:
    with walkthrough.workspace(tmp_path) as ws:
        env = {
            **ws.aws_env,
            "MPLBACKEND": "Agg",  # no display: plt.show() draws nothing, savefig still writes
            "TRAINSTACK_TUNING_STORE": str(ws.home / "tuning.json"),
        }
        for command in (
            f"npx cdk bootstrap aws://{ACCOUNT}/{REGION}",
            f"npx cdk deploy --all -c recipe={RECIPE} --require-approval=never",
        ):
            status, out, _ = ws.shell(command, env)
            assert status == 0, f"{command}:\n{out[-3000:]}"
        (s3,) = clients(env, "s3")
        s3.create_bucket(Bucket=DATA_BUCKET)
        prepare = (
            ".venv/bin/trainstack data prepare docs --tokenizer bytes "
            f"--out s3://{DATA_BUCKET}/tokens/ --local --validation-fraction 0.25 --workers 1"
        )
        status, out, _ = ws.shell(prepare, env)
        assert status == 0, out[-3000:]

        (ws.repo / "notebook_cell.py").write_text(block("notebook"))
        status, out, _ = ws.shell("python notebook_cell.py", env, timeout=RUN_TIMEOUT_S)
        assert status == 0 and "Traceback" not in out, out[-5000:]
        assert "fits: True" in out
        assert re.search(r"^tuning demo-tiny: 2 candidates on local \(cpu, \d+ ranks", out, re.M), out[-5000:]
        assert re.search(r"^chosen: c\d \[", out, re.M), out[-5000:]
        ended = re.search(r"^run (ts-platform-demo-tiny--\S+): completed at step 30 ", out, re.M)
        assert ended, out[-5000:]
        points = re.search(r"^(\d+) loss points, (\d+\.\d+) -> (\d+\.\d+)$", out, re.M)
        assert points and int(points.group(1)) >= 3, out[-3000:]
        assert (ws.repo / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        # The progress the cell printed is the commands' own: each candidate, then the run's steps.
        assert "reusing tuning run" not in out and f"run {ended.group(1)}: running, job" in out

        (ws.repo / "pipeline_step.py").write_text(block("pipeline"))
        status, out, _ = ws.shell("python pipeline_step.py", env, timeout=RUN_TIMEOUT_S)
        assert status == 0, out[-5000:]
        assert re.search(r"^run ts-platform-demo-tiny--\S+ completed: ", out, re.M), out[-3000:]

        emulator_events.configure(env, fault_inject="nan-gradients@3")
        try:
            status, out, _ = ws.shell("python pipeline_step.py", env, timeout=RUN_TIMEOUT_S)
        finally:
            emulator_events.configure(env, fault_inject="")
        assert status == 1, out[-5000:]
        failed = re.search(r"^run ts-platform-demo-tiny--\S+ failed: (.+)$", out, re.M)
        assert failed and "nan" in failed.group(1).lower(), out[-3000:]
        assert "Traceback" not in out
