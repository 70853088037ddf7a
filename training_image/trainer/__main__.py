"""`python -m trainer`: train the recipe. See trainer.train for exit codes, docs/trainer.md for use."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from trainer.checkpoint.manager import CheckpointError
from trainer.runtime import failure
from trainer.runtime.health import EXIT_NON_FINITE, NonFiniteLoss
from trainer.train import RunOptions, run
from trainstack.errors import TrainstackError
from trainstack.protocol import exit_codes
from trainstack.protocol.container import opt_ml

# /opt/ml/... on SageMaker; under $TRAINSTACK_OPT_ML in the local emulator (trainstack.protocol.container)
SAGEMAKER_CHECKPOINTS = opt_ml("checkpoints")
SAGEMAKER_TRAIN_CHANNEL = opt_ml("input/data/train")


def default_data_dir() -> Path | None:
    channel = os.environ.get("SM_CHANNEL_TRAIN")
    if channel:
        return Path(channel)
    return SAGEMAKER_TRAIN_CHANNEL if SAGEMAKER_TRAIN_CHANNEL.is_dir() else None


EXIT_SAVE_FAILED = 1  # the final save failed: worth another job of the run (not trainstack-fatal)


def default_checkpoint_location() -> str:
    """$TRAINSTACK_CHECKPOINT_URI (the launcher sets the run's s3:// prefix), else
    $TRAINSTACK_CHECKPOINT_DIR, else /opt/ml/checkpoints on SageMaker, else ./checkpoints."""
    for name in ("TRAINSTACK_CHECKPOINT_URI", "TRAINSTACK_CHECKPOINT_DIR"):
        if os.environ.get(name):
            return os.environ[name]
    return str(SAGEMAKER_CHECKPOINTS if SAGEMAKER_CHECKPOINTS.parent.is_dir() else Path("checkpoints"))


EPILOG = """\
examples:
  torchrun --standalone --nproc-per-node 2 -m trainer --recipe tests/trainer/fixtures/tiny.yaml \\
      --device cpu --max-steps 30 --checkpoint-dir /tmp/ck
  AWS_REGION=us-west-2 python -m trainer --recipe 8b-fp8 --checkpoint-dir s3://bucket/checkpoints/run-1/

exit codes (each failure also one line in /opt/ml/output/failure: trainstack.protocol.failures):
  0  finished, or stopped by SIGTERM (saved, or logged which checkpoint the next job resumes from)
  1  possibly transient: the final checkpoint could not be saved, the network, a collective, a peer
  2  a mistake in the recipe, the data or the environment (one line names the file and field)
  3  the loss or the gradient norm became NaN/inf (nothing saved from that step on)
  5  the GPU ran out of memory (the layout does not fit)
  6  an error of the code itself (TypeError, ImportError, a torch.compile failure): not retried
  7  a missing or refused resource (a bucket, a key, a file, access denied): not retried
"""


def parse_args(argv: list[str] | None) -> RunOptions:
    parser = argparse.ArgumentParser(
        prog="python -m trainer",
        description="Train a trainstack recipe with FSDP2; resume from the newest complete checkpoint.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
    parser.add_argument(
        "--recipe",
        help="recipe YAML (or name), recipe JSON, or hyperparameters JSON; "
        "default: /opt/ml/input/config/hyperparameters.json",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe field (YAML recipes only), e.g. training.steps=100",
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    parser.add_argument(
        "--max-steps",
        type=int,
        default=_env_int("TRAINSTACK_MAX_STEPS"),
        help="stop after this many optimizer steps in total (the LR schedule still "
        "follows training.steps); default: $TRAINSTACK_MAX_STEPS or training.steps",
    )
    parser.add_argument(
        "--checkpoint-dir",
        dest="checkpoint_location",
        metavar="PATH_OR_S3_URI",
        default=default_checkpoint_location(),
        help="where checkpoints go: a local directory or s3://bucket/prefix/ (written from every rank "
        "with s3torchconnector; needs AWS_REGION). Default: $TRAINSTACK_CHECKPOINT_URI, else "
        "$TRAINSTACK_CHECKPOINT_DIR, else /opt/ml/checkpoints on SageMaker, else ./checkpoints",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=default_data_dir(),
        help="token shards; default: $SM_CHANNEL_TRAIN or /opt/ml/input/data/train",
    )
    parser.add_argument("--synthetic", action="store_true", help="train on the synthetic token set")
    parser.add_argument("--sync-checkpoints", action="store_true", help="save synchronously (debugging)")
    parser.add_argument("--trace-dir", type=Path, help="write per-step loss and sample indices (tests)")
    args = parser.parse_args(argv)
    if args.max_steps is not None and args.max_steps < 0:
        parser.error("--max-steps must be >= 0")
    return RunOptions(
        recipe=args.recipe,
        overrides=tuple(args.overrides),
        device=args.device,
        max_steps=args.max_steps,
        checkpoint_location=args.checkpoint_location,
        data_dir=args.data_dir,
        synthetic=args.synthetic,
        trace_dir=args.trace_dir,
        async_checkpoint=not args.sync_checkpoints,
    )


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


# SageMaker's failure file and the one-line error: trainer.runtime.failure (also the export's and the
# processing job's entry points); kept under these names for the callers of `python -m trainer`'s module.
failure_file = failure.failure_file
report_failure = failure.report_failure


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    try:
        return run(options)
    except TrainstackError as exc:
        return report_failure(exc.exit_code, str(exc))
    except NonFiniteLoss as exc:
        return report_failure(EXIT_NON_FINITE, str(exc))
    except torch.OutOfMemoryError as exc:  # the layout needs more memory than the GPU has
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return report_failure(exit_codes.OUT_OF_MEMORY, f"{exit_codes.OOM_MESSAGE}: {first}")
    except CheckpointError as exc:
        # The final save failed: worth another job (exit 1), unless what it could not reach is missing
        # or refused (a bucket gone, access denied), which the next job would meet again.
        found = failure.failures.classify(exc)
        if found.kind == failure.failures.MISSING_RESOURCE:
            return failure.report_uncaught(exc)
        return report_failure(EXIT_SAVE_FAILED, str(exc))
    except Exception as exc:  # every other failure says why, and whether the next job would repeat it
        return failure.report_uncaught(exc)


if __name__ == "__main__":
    sys.exit(failure.run_reporting(main))  # what escapes main (its arguments' parsing) says why too
