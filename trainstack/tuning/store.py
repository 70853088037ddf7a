"""Measurements and results of tuning runs, kept in one JSON file, and the plan they correct.

Measurements are keyed by the hardware they were taken on (instance type, GPU, image digest, the ranks
the job ran on) and the model shape (model, sequence length, global batch, precision): only a
measurement of the same shape on the same instance type and GPU ever corrects a plan, so a CPU
measurement (GPU `cpu`) never changes a GPU plan. Results (the chosen layout) are keyed by recipe, team
and image: a second `tune` of the same recipe on the same image reuses its result unless --fresh.

The file: $TRAINSTACK_TUNING_STORE, else $XDG_STATE_HOME/trainstack/tuning.json (~/.local/state/...).
Written whole to a temporary file and renamed: a reader never sees half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainstack.errors import TrainstackError
from trainstack.planner import checkpointing_label
from trainstack.recipes.schema import Recipe
from trainstack.tuning.candidates import plan_layout

VERSION = 1


@dataclass(frozen=True)
class Hardware:
    instance_type: str  # ml.p6-b200.48xlarge, or "local" for the emulator's CPU jobs
    gpu: str  # B200, H100, ..., or "cpu"
    image: str  # the training image's digest (local: a hash of the trainer's sources)
    ranks: int  # processes the job trained on

    @property
    def is_cpu(self) -> bool:
        return self.gpu == "cpu"

    def describe(self) -> str:
        return f"{self.instance_type} ({self.gpu}, {self.ranks} ranks, image {self.image[:19]})"


def recipe_hardware(recipe: Recipe, image: str = "") -> Hardware:
    """The hardware a recipe plans for: its instance type and GPU, on all its ranks."""
    return Hardware(recipe.compute.instance_type, recipe.instance.gpu.name, image, recipe.world_size)


def shape_key(recipe: Recipe) -> str:
    """What every candidate of a tuning run shares: the model, sequence length, global batch, dtype."""
    shape = {
        "model": recipe.model.model_dump(mode="json"),
        "seq_len": recipe.training.seq_len,
        "global_batch": recipe.training.global_batch,
        "dtype": recipe.precision.dtype,
    }
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


def layout_key(recipe: Recipe) -> list:
    """What a candidate changes: micro-batch, checkpointing, shard group, compile, FP8 recipe."""
    tr = recipe.training
    return [
        tr.micro_batch,
        checkpointing_label(recipe.activation_checkpointing),
        recipe.parallelism.shard_group,
        tr.compile if tr.compile is not None else True,
        recipe.precision.fp8_recipe,
    ]


def default_path() -> Path:
    if os.environ.get("TRAINSTACK_TUNING_STORE"):
        return Path(os.environ["TRAINSTACK_TUNING_STORE"])
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "trainstack" / "tuning.json"


def result_key(recipe: str, team: str | None, image: str) -> str:
    return f"{recipe}|{team or '-'}|{image}"


class Store:
    def __init__(self, path: Path | None = None):
        self.path = path or default_path()
        self.data: dict[str, Any] = {"version": VERSION, "measurements": [], "results": {}}
        if self.path.exists():
            try:
                data = json.loads(self.path.read_text())
            except ValueError as exc:
                raise TrainstackError(f"{self.path}: not a tuning store ({exc})") from None
            if not isinstance(data, dict) or data.get("version") != VERSION:
                raise TrainstackError(f"{self.path}: not a version {VERSION} tuning store")
            self.data = data

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True))
        os.replace(tmp, self.path)

    def record(
        self,
        run: str,
        date: str,
        recipe: Recipe,
        team: str | None,
        hardware: Hardware,
        measured: list[dict],
        result: dict,
    ) -> None:
        """A tuning run's measurements (one dict per candidate: layout, overrides, status, planned,
        measured) and its result."""
        for m in measured:
            self.data["measurements"].append(
                {
                    "run": run,
                    "date": date,
                    "recipe": recipe.name,
                    "team": team,
                    "hardware": asdict(hardware),
                    "shape": shape_key(recipe),
                    **m,
                }
            )
        self.data["results"][result_key(recipe.name, team, hardware.image)] = {
            "run": run,
            "date": date,
            "hardware": asdict(hardware),
            **result,
        }

    def result(self, recipe: str, team: str | None, image: str) -> dict | None:
        return self.data["results"].get(result_key(recipe, team, image))

    def latest_result(self, recipe: str, team: str | None) -> dict | None:
        """The newest result for recipe and team on any image (for provenance in `show`)."""
        found = [v for k, v in self.data["results"].items() if k.startswith(f"{recipe}|{team or '-'}|")]
        return max(found, key=lambda v: (v["date"], v["run"])) if found else None

    def measurements(self, recipe: Recipe, hardware: Hardware) -> list[dict]:
        """Completed measurements of `recipe`'s shape on `hardware`'s instance type, GPU and ranks,
        newest first (the image is a preference, not a filter: see `refit`)."""
        shape = shape_key(recipe)
        out = [
            m
            for m in self.data["measurements"]
            if m["shape"] == shape
            and m["status"] == "ok"
            and m["hardware"]["instance_type"] == hardware.instance_type
            and m["hardware"]["gpu"] == hardware.gpu
            and m["hardware"]["ranks"] == hardware.ranks
        ]
        return sorted(
            out, key=lambda m: (m["hardware"]["image"] == hardware.image, m["date"], m["run"]), reverse=True
        )


@dataclass(frozen=True)
class Refit:
    """The plan's figures corrected by measurements on the same hardware."""

    step_time_s: float
    tokens_per_s: float  # per GPU
    peak_gib: float | None  # measured allocated peak (exact layout only)
    planned_step_time_s: float  # the arithmetic's, on the same ranks
    source: str  # "measured by tuning run X on <date>" or "refit from N measurements of ..."
    exact: bool  # this very layout was measured
    run: str
    date: str
    clock: str = "wall"  # step_time_s in wall seconds, or CPU seconds (CPU hardware: tuning.measure)


def refit(
    recipe: Recipe,
    hardware: Hardware,
    store: Store,
    exclude_run: str | None = None,
    leave_out_own: bool = False,
) -> Refit | None:
    """`recipe`'s step time on `hardware` from what tuning runs measured there: this layout's own
    measurement (the newest), else the arithmetic times the median measured/planned ratio of the newest
    tuning run of this shape on this hardware. None when nothing of this shape was measured there.
    `exclude_run`: leave that run's measurements out (a check of the refit against a fresh job);
    `leave_out_own`: leave this layout's own measurements out (the refit's leave-one-out check)."""
    mine = layout_key(recipe)
    records = [
        m
        for m in store.measurements(recipe, hardware)
        if m["run"] != exclude_run and not (leave_out_own and m["layout"] == mine)
    ]
    if not records:
        return None
    planned, _ = plan_layout(recipe, hardware.ranks)
    tokens_per_step = recipe.training.global_batch * recipe.training.seq_len / hardware.ranks
    exact = [m for m in records if m["layout"] == mine]
    if exact:
        m = exact[0]
        step = m["measured"]["step_time_s"]
        return Refit(
            step,
            tokens_per_step / step,
            m["measured"]["peak_mem_gib"],
            planned.step_time_s,
            f"measured by tuning run {m['run']} on {m['date']}",
            True,
            m["run"],
            m["date"],
            m["measured"].get("clock", "wall"),
        )
    newest = records[0]["run"]
    same_run = [m for m in records if m["run"] == newest]
    ratio = statistics.median(m["measured"]["step_time_s"] / m["planned"]["step_time_s"] for m in same_run)
    step = planned.step_time_s * ratio
    return Refit(
        step,
        tokens_per_step / step,
        None,
        planned.step_time_s,
        f"refit from {len(same_run)} measurements of tuning run {newest} on {records[0]['date']} "
        f"(measured/planned step time x{ratio:.3g})",
        False,
        newest,
        records[0]["date"],
        records[0]["measured"].get("clock", "wall"),
    )
