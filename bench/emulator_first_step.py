#!/usr/bin/env python3
"""Time from CreateTrainingJob to the first training step of a job the local emulator runs.

    .venv/bin/python bench/emulator_first_step.py [--recipe tests/trainer/fixtures/tiny.yaml] [--repeats 1]

Starts an emulator (trainstack.emulator), creates one training job of the recipe as `trainstack launch`
would (the image's entry point, the recipe's hyperparameters and MetricDefinitions, the run's S3
checkpoint prefix; no data channel: the synthetic token set) and reads, from the job's own CloudWatch log
stream (event timestamps) and DescribeTrainingJob, when each phase was reached:

    Training         the status SageMaker reports once the node processes start (Starting -> Training)
    entrypoint       the image's entry point printed its torchrun command (Python + the entrypoint up)
    trainer up       the trainer's first log line (torch imported, process group formed)
    first step       the first `step=` metric line (model built, sharded, one optimizer step)

A base recipe (e.g. `--recipe 8b-fp8`) is trained as its stand-in (trainstack.emulator.stand_in), which
this measures too. Wall-clock figures on a shared machine vary with its load: the script prints the load
average before and after, and the CPU count. Figures go to docs/benchmarks.md ("Local emulator jobs").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TINY = ROOT / "tests" / "trainer" / "fixtures" / "tiny.yaml"
BUCKET = "bench-first-step"


def one_job(emulator, recipe, name: str) -> dict[str, float]:
    from trainstack.aws.runs import LogCursor, log_streams, read_new_lines
    from trainstack.protocol.metrics import metric_definitions
    from trainstack.recipes.schema import to_hyperparameters

    sagemaker, logs = emulator.client("sagemaker"), emulator.client("logs")
    created = time.time()
    sagemaker.create_training_job(
        TrainingJobName=name,
        RoleArn="arn:aws:iam::123456789012:role/bench",
        AlgorithmSpecification={
            "TrainingImage": "123456789012.dkr.ecr.us-east-1.amazonaws.com/trainstack:bench",
            "TrainingInputMode": "File",
            "MetricDefinitions": metric_definitions(recipe.data.source_names),
        },
        ResourceConfig={
            "InstanceType": recipe.compute.instance_type,
            "InstanceCount": recipe.compute.instance_count,
            "VolumeSizeInGB": 50,
        },
        StoppingCondition={"MaxRuntimeInSeconds": 3600},
        OutputDataConfig={"S3OutputPath": f"s3://{BUCKET}/output/"},
        HyperParameters=to_hyperparameters(recipe),
        Environment={
            "TRAINSTACK_CHECKPOINT_URI": f"s3://{BUCKET}/checkpoints/{name}/",
            "TRAINSTACK_RUN": name,
        },
    )
    marks: dict[str, float] = {}
    cursor = LogCursor()
    deadline = time.monotonic() + 900
    while "first step" not in marks:
        if time.monotonic() > deadline:
            raise SystemExit(f"{name}: no step within 900 s")
        described = sagemaker.describe_training_job(TrainingJobName=name)
        for t in described["SecondaryStatusTransitions"]:
            if t["Status"] == "Training":
                marks.setdefault("Training", t["StartTime"].timestamp() - created)
        if described["TrainingJobStatus"] in ("Failed", "Stopped", "Completed") and "first step" not in marks:
            raise SystemExit(
                f"{name} ended {described['TrainingJobStatus']}: {described.get('FailureReason')}"
            )
        for stream, ms, message in read_new_lines(logs, log_streams(logs, name), cursor):
            if "/algo-1-" not in stream:
                continue
            at = ms / 1000 - created
            if message.startswith("entrypoint:"):
                marks.setdefault("entrypoint", at)
            elif " rank0 " in message:
                marks.setdefault("trainer up", at)
            elif message.startswith("step="):
                marks.setdefault("first step", at)
            elif message.startswith("EMULATOR: stand-in"):
                marks.setdefault("stand-in", 0.0)
        time.sleep(0.2)
    sagemaker.stop_training_job(TrainingJobName=name)
    from trainstack.emulator import events

    events.wait_for_status(emulator.env(), name, ("Stopped", "Completed", "Failed"), timeout_s=300)
    return marks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(TINY))
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()

    from trainstack.emulator.endpoint import Emulator
    from trainstack.recipes.loader import resolve

    recipe = resolve(args.recipe).recipe
    print(f"machine: {os.cpu_count()} CPUs, load average before {os.getloadavg()[0]:.2f} (shared: varies)")
    runs = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        Emulator(log_path=Path(tmp) / "moto.log").start(timeout_s=180) as e,
    ):
        e.client("s3").create_bucket(Bucket=BUCKET)
        for i in range(args.repeats):
            marks = one_job(e, recipe, f"bench-first-step-{i + 1}")
            runs.append(marks)
            shown = ", ".join(f"{k} {v:.1f} s" for k, v in marks.items() if k != "stand-in")
            print(f"job {i + 1}{' (stand-in)' if 'stand-in' in marks else ''}: {shown}", flush=True)
    print(f"load average after {os.getloadavg()[0]:.2f}")
    for key in ("Training", "entrypoint", "trainer up", "first step"):
        values = [m[key] for m in runs if key in m]
        if values:
            print(f"CreateTrainingJob -> {key}: median {statistics.median(values):.1f} s over {len(values)}")
    first = statistics.median(m["first step"] for m in runs)
    up = statistics.median(m["Training"] for m in runs)
    print(
        f"share of the wait before the container starts: {up / first:.0%} (the rest: Python, torch, trainer)"
    )


if __name__ == "__main__":
    main()
