"""What one step of a base recipe's emulator stand-in costs, at the stand-in's shape and at a larger one,
side by side in one run (the same runner, recipe, ranks and data).

    .venv/bin/python bench/stand_in_step.py [--recipe 30b-fp8] [--steps 8] [--ranks 2]

A base recipe's run on the emulator trains its stand-in (trainstack.emulator.stand_in) for as many steps
as the recipe says; what a step costs decides how long a user (or a test) waits for one to checkpoint,
stop or complete. Each shape runs as the emulator's job does (the trainer under torchrun, one thread per
rank, synthetic tokens of the recipe's vocabulary, global_batch 8 x the recipe's nodes). Prints each
shape's median step time and CPU seconds per step (the machine may be shared: CPU time is the steadier
figure) and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainstack.emulator import stand_in  # noqa: E402
from trainstack.protocol.metrics import parse_line  # noqa: E402
from trainstack.recipes.loader import resolve  # noqa: E402
from trainstack.recipes.schema import Recipe  # noqa: E402
from trainstack.tuning.local import run_job  # noqa: E402

# The stand-in's shape before this round's change (docs/benchmarks.md): 128 tokens x 64 wide.
LARGER = ({"layers": 2, "hidden": 64, "heads": 4, "ffn": 176}, 128)


def shaped(recipe: Recipe, shape: dict, seq_len: int) -> Recipe:
    """The stand-in of `recipe` (its own node count) with its model `shape` and `seq_len`."""
    small = stand_in.stand_in_recipe(recipe, recipe.compute.instance_count)
    data = small.model_dump(mode="json", exclude={"extends"})
    data["model"].update(shape, head_dim=shape["hidden"] // shape["heads"])
    data["training"].update(seq_len=seq_len, loss_chunk_tokens=seq_len)
    data["checkpointing"]["interval_steps"] = 1000  # the step alone
    if data.get("validation"):
        data["validation"]["at_start"] = False
    return Recipe.model_validate(data)


def measure(name: str, recipe: Recipe, steps: int, ranks: int, workdir: Path) -> tuple[float, float]:
    log = run_job(name, recipe, steps, ranks, workdir)
    if log.exit_code != 0:
        raise SystemExit(f"{name}: exit {log.exit_code}: {log.failure_reason or log.lines[-5:]}")
    points = [parse_line(line) for line in log.lines]
    points = [p for p in points if "step_time_s" in p][1:]  # the first interval holds the warm-up
    if not points:
        raise SystemExit(f"{name}: no metric line past the first (raise --steps)")
    return (
        statistics.median(p["step_time_s"] for p in points),
        statistics.median(p["cpu_time_s"] for p in points),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="30b-fp8")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    recipe = resolve(args.recipe, overrides=("training.log_every=1",)).recipe
    shapes = {
        f"stand-in ({stand_in.STAND_IN_SEQ_LEN} tokens x {stand_in.STAND_IN_SHAPE['hidden']} wide)": (
            stand_in.STAND_IN_SHAPE,
            stand_in.STAND_IN_SEQ_LEN,
        ),
        f"larger ({LARGER[1]} tokens x {LARGER[0]['hidden']} wide)": LARGER,
    }
    batch = 8 * recipe.compute.instance_count
    print(
        f"{args.recipe}: vocab {recipe.model.vocab}, {args.ranks} ranks, "
        f"global_batch {batch}, {args.steps} steps"
    )
    results = {}
    with tempfile.TemporaryDirectory(prefix="stand-in-bench-") as workdir:
        for i, (label, (shape, seq_len)) in enumerate(shapes.items()):
            results[label] = measure(
                f"s{i}", shaped(recipe, shape, seq_len), args.steps, args.ranks, Path(workdir)
            )
            wall, cpu = results[label]
            print(f"  {label:<36} step {wall:6.3f} s   CPU {cpu:6.3f} s per rank per step")
    (new_wall, new_cpu), (old_wall, old_cpu) = results.values()
    print(f"  larger / stand-in: step {old_wall / new_wall:.1f}x, CPU {old_cpu / new_cpu:.1f}x")


if __name__ == "__main__":
    main()
