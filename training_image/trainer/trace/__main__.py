"""`python -m trainer.trace --recipe FILE [--set k=v ...] [--world N] [--out FILE.json]`.

Progress on stderr; the report as JSON on stdout (or in --out). Exit 0 traced; 2 a recipe the trainer
cannot build (one line naming the file and field, as `trainstack plan` says it); 3 a layout the trace
cannot follow (the report is `{"unsupported": {"knob", "reason"}}`: trainstack falls back to the
planner and says so).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from trainstack.errors import TrainstackError

EXIT_RECIPE = 2
EXIT_UNSUPPORTED = 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.trace", description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True, help="recipe YAML (or a full recipe JSON)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--world", type=int, default=None, help="ranks to trace (default: the recipe's GPUs)")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here, not to stdout")
    parser.add_argument("--no-flops", action="store_true", help="skip counting the step's FLOPs")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from trainer.config import load_recipe

    try:
        recipe, source = load_recipe(args.recipe, tuple(args.overrides))
    except TrainstackError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_RECIPE
    from trainer.trace.step import trace

    try:
        report = trace(recipe, source, world=args.world, count_flops=not args.no_flops).to_dict()
        code = 0
    except TrainstackError as error:  # the layout does not divide the world: a recipe mistake
        print(f"error: {error}", file=sys.stderr)
        return EXIT_RECIPE
    except Exception as error:  # a layout the fake mode cannot follow: named, never a traceback
        report = {"unsupported": unsupported(recipe, error)}
        code = EXIT_UNSUPPORTED
    text = json.dumps(report, indent=2)
    if args.out is not None:
        args.out.write_text(text)
    else:
        print(text)
    return code


def unsupported(recipe, error: Exception) -> dict:
    """Which knob most likely took the trace off the path it can follow, and the error's first line."""
    first = (str(error).strip().splitlines() or [""])[0][:300]
    reason = f"{type(error).__name__}: {first}"
    if recipe.parallelism.cp > 1:
        knob = "parallelism.cp"
    elif recipe.parallelism.shard_group < recipe.world_size:
        knob = "parallelism.shard_group"
    elif recipe.activation_checkpointing.mode != "none":
        knob = "activation_checkpointing"
    else:
        knob = "the layout"
    return {"knob": knob, "reason": reason}


if __name__ == "__main__":
    sys.exit(main())
