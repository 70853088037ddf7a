"""The trainer's own step traced on fake tensors (`python -m trainer.trace`), run and cached.

trainstack never imports the trainer (tests/test_architecture.py): the trace runs as a subprocess of
this Python, as `trainstack data prepare --here` runs `trainer.prepare`, with its progress on the
terminal and its JSON report read back. A report is cached by what decides it: the recipe's layout
(model shape, sequence, batch, checkpointing, parallelism, precision, world size), the torch version
and a hash of the trainer's code that the trace runs, so a second `plan --trace` of the same layout
reads the file and starts nothing.

The cache: $TRAINSTACK_TRACE_CACHE, else $XDG_CACHE_HOME/trainstack/traces (~/.cache/...), one
JSON file per key. `launch` reads it (`trace_refusal`): a recipe whose trace was run and did not fit
is refused like a planner refusal.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from trainstack.recipes.schema import Recipe

# The trainer's code the trace runs (under training_image/trainer): a change to any of it is a new trace.
TRAINER_CODE = ("models", "distributed", "trace", "optim.py", "train.py", "config.py")
EXIT_RECIPE, EXIT_UNSUPPORTED = 2, 3


@dataclass(frozen=True)
class TraceOutcome:
    """A report (trainer.trace's JSON), or why there is none: `unsupported` names the knob the trace
    could not follow; `error` is a recipe the trainer cannot build (one line)."""

    report: dict | None = None
    cached: bool = False
    unsupported: dict | None = None
    error: str | None = None


def layout_of(recipe: Recipe) -> dict:
    """What decides a trace's figures (nothing of the schedule, data or cost)."""
    tr = recipe.training
    return {
        "model": recipe.model.model_dump(mode="json"),
        "training": {
            k: getattr(tr, k)
            for k in ("seq_len", "micro_batch", "global_batch", "loss_chunk_tokens", "compile")
        },
        "precision": recipe.precision.model_dump(mode="json"),
        "activation_checkpointing": recipe.activation_checkpointing.model_dump(mode="json"),
        "parallelism": recipe.parallelism.model_dump(mode="json"),
        "world_size": recipe.world_size,
    }


def trainer_directory() -> Path | None:
    """Where the `trainer` package is (found, not imported), or None when it is not installed. A
    directory named trainer elsewhere on the path (tests/trainer under pytest) is not it: the package
    is the one with train.py, as the checkout's training_image/trainer beside trainstack/."""
    try:
        spec = importlib.util.find_spec("trainer")
    except (ImportError, ValueError):
        spec = None
    found = list(spec.submodule_search_locations or []) if spec is not None else []
    for place in [*found, Path(__file__).resolve().parents[2] / "training_image" / "trainer"]:
        if (Path(place) / "train.py").is_file() and (Path(place) / "trace").is_dir():
            return Path(place)
    return None


def trainer_code_hash(directory: Path) -> str:
    digest = hashlib.sha256()
    for name in TRAINER_CODE:
        path = directory / name
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for file in files:
            digest.update(str(file.relative_to(directory)).encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()


def torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def trace_key(recipe: Recipe, directory: Path) -> str:
    blob = json.dumps([layout_of(recipe), torch_version(), trainer_code_hash(directory)], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def cache_directory() -> Path:
    if os.environ.get("TRAINSTACK_TRACE_CACHE"):
        return Path(os.environ["TRAINSTACK_TRACE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "trainstack" / "traces"


def cached_report(recipe: Recipe) -> dict | None:
    """The cached trace of this layout with today's trainer and torch, or None."""
    directory = trainer_directory()
    if directory is None:
        return None
    path = cache_directory() / f"{trace_key(recipe, directory)}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_trace(
    recipe: Recipe, *, use_cache: bool = True, quiet: bool = False, timeout_s: float | None = None
) -> TraceOutcome:
    """The trace of `recipe` (from the cache when it is there). Progress goes to stderr unless `quiet`."""
    directory = trainer_directory()
    if directory is None:
        return TraceOutcome(
            unsupported={
                "knob": "the trainer",
                "reason": "the trainer package is not installed here (pip install .[trainer])",
            }
        )
    path = cache_directory() / f"{trace_key(recipe, directory)}.json"
    if use_cache:
        try:
            return TraceOutcome(report=json.loads(path.read_text()), cached=True)
        except (OSError, ValueError):
            pass
    with tempfile.TemporaryDirectory(prefix="trainstack-trace-") as tmp:
        recipe_file, out = Path(tmp) / "recipe.json", Path(tmp) / "report.json"
        recipe_file.write_text(json.dumps(recipe.model_dump(mode="json")))
        command = [sys.executable, "-m", "trainer.trace", "--recipe", str(recipe_file), "--out", str(out)]
        try:
            done = subprocess.run(
                command,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE if quiet else None,
                text=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired:
            return TraceOutcome(
                unsupported={"knob": "the layout", "reason": f"the trace ran past {timeout_s:.0f} s"}
            )
        if done.returncode == EXIT_RECIPE:
            lines = (done.stderr or "").strip().splitlines()
            return TraceOutcome(
                error=lines[-1].removeprefix("error: ") if lines else "the trainer refused the recipe"
            )
        report = json.loads(out.read_text()) if out.is_file() else None
    if done.returncode == EXIT_UNSUPPORTED and report is not None:
        return TraceOutcome(unsupported=report["unsupported"])
    if done.returncode != 0 or report is None:
        return TraceOutcome(
            unsupported={"knob": "the layout", "reason": f"the trace exited with status {done.returncode}"}
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(report, indent=2))
    partial.replace(path)  # whole or absent: a second run never reads half a report
    return TraceOutcome(report=report)


def trace_refusal(recipe: Recipe) -> str | None:
    """One line refusing `recipe` when its trace was run (it is cached) and, with the modelled terms
    added, it does not fit the GPU; None when it fits or was never traced (the planner's verdict
    stands then). For `launch`, beside the planner's refusal."""
    report = cached_report(recipe)
    if report is None:
        return None
    from trainstack.planner import recipe_memory
    from trainstack.planner.traced import traced_memory

    traced = traced_memory(recipe, recipe_memory(recipe), recipe.instance.gpu.usable_gib, report)
    if traced.fits:
        return None
    return (
        f"{recipe.name} does not fit by its trace: {traced.verdict} "
        f"(trainstack plan {recipe.name} --trace shows where; change the layout)"
    )


def counted_candidate(candidate, recipe: Recipe, report: dict):
    """A tuning candidate (trainstack.tuning.candidates.Candidate) whose planned step time, tokens/s,
    hours and cost follow its traced step's counted FLOPs where they differ from the planner's by more
    than 2% (trainstack.planner.traced.counted_flops); the candidate itself otherwise. The tuning
    run's job budget and step windows are then those of the work the step runs."""
    from dataclasses import replace

    from trainstack.planner import recipe_throughput
    from trainstack.planner.traced import counted_flops

    counted = counted_flops(report, recipe_throughput(recipe))
    if not counted or counted["time"] != "counted":
        return candidate
    scale = counted["time_scale"]
    p = candidate.planned
    planned = replace(
        p,
        step_time_s=p.step_time_s * scale,
        tokens_per_s=p.tokens_per_s / scale,
        hours=p.hours * scale,
        usd=p.usd * scale,
    )
    return replace(candidate, planned=planned)
