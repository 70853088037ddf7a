"""A candidate's short job as a local CPU process: the trainer under torchrun, as the emulator's
training job runs it (the container's command without the container). Used by `trainstack tune
--local` where the emulator does not run training jobs itself.

Each job gets the recipe as a JSON file (the trainer reads recipe JSON as the container reads its
hyperparameters), its own checkpoint directory (a fresh run: nothing to resume), synthetic tokens when
the recipe names no data, one thread per rank (the machine is shared), and --max-steps (the learning
rate schedule still follows the whole run's training.steps, so the short job trains the run's first
steps). Its stdout and stderr are the job's log.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from trainstack.errors import TrainstackError
from trainstack.recipes.schema import Recipe
from trainstack.tuning.store import Hardware

LOCAL_INSTANCE = "local"


@dataclass(frozen=True)
class JobLog:
    name: str
    lines: tuple[str, ...]
    exit_code: int
    failure_reason: str  # the failure file's line (SageMaker's FailureReason), "" when none
    seconds: float


def trainer_digest() -> str:
    """What stands for the image digest locally: a hash of the trainer's and the protocol's sources."""
    from importlib.util import find_spec

    spec = find_spec("trainer")  # the training image's package, installed beside this one (not imported)
    if spec is None or spec.origin is None:
        raise TrainstackError("the trainer package is not installed here: run `make setup`")
    h = hashlib.sha256()
    roots = [Path(spec.origin).parent, Path(__file__).parents[1] / "protocol"]
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            h.update(path.relative_to(root).as_posix().encode())
            h.update(path.read_bytes())
    return "local:sha256:" + h.hexdigest()[:16]


def local_hardware(ranks: int) -> Hardware:
    return Hardware(LOCAL_INSTANCE, "cpu", trainer_digest(), ranks)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(
    name: str,
    recipe: Recipe,
    max_steps: int,
    ranks: int,
    workdir: Path,
    timeout_s: float = 600.0,
    extra_env: dict[str, str] | None = None,
) -> JobLog:
    """Train `recipe` for `max_steps` on `ranks` CPU processes; the job's log, exit code and failure."""
    job_dir = workdir / name
    job_dir.mkdir(parents=True, exist_ok=True)
    recipe_file = job_dir / "recipe.json"
    recipe_file.write_text(json.dumps(recipe.model_dump(mode="json", exclude={"extends"})))
    failure = job_dir / "failure"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={ranks}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
        "-m", "trainer", "--device", "cpu", "--recipe", str(recipe_file), "--max-steps", str(max_steps),
        "--checkpoint-dir", str(job_dir / "checkpoints"),
    ]  # fmt: skip
    if not recipe.data.train_s3_uri and not recipe.data.sources:
        command.append("--synthetic")
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        TRAINSTACK_FAILURE_FILE=str(failure),
    )
    env.pop("TRAINSTACK_MAX_STEPS", None)
    env.update(extra_env or {})
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as out:
        try:
            proc = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = 124
        out.seek(0)
        text = out.read()
        (job_dir / "log.txt").write_text(text)  # the job's log, as CloudWatch would keep it
        lines = tuple(text.splitlines())
    reason = failure.read_text().strip() if failure.exists() else ""
    if code == 124 and not reason:
        reason = f"the job ran past {timeout_s:.0f} s and was stopped"
    return JobLog(name, lines, code, reason, time.monotonic() - started)
