#!/usr/bin/env python3
"""`make demo`: a run that trains for real on a local AWS emulator, end to end, with no hand in it; no AWS
account needed.

1. start the emulator (moto in server mode, patched: trainstack.emulator) with MLflow's server beside it;
   its jobs run as local processes with SageMaker's container contract, it delivers their state-change
   events to the deployed EventBridge rules and runs the reconciler's schedule itself
2. `npx cdk bootstrap`, then the real `npx cdk deploy --all -c recipe=scripts/demo-tiny.yaml` (1b-bf16's
   deployment with a model small enough for a laptop's CPU)
3. `trainstack data prepare docs --tokenizer bytes --out s3://trainstack-demo-data/tokens/ --local`: the
   repository's docs as a small local corpus, tokenized into the emulator's S3
4. `trainstack launch scripts/demo-tiny.yaml --local --name demo --wait`: job 1 trains; the emulator
   stops it at a short max runtime (EMULATOR: a recipe's is at least an hour; here job 1's is capped)
5. watch: the supervisor hears the MaxRuntimeExceeded stop and starts job 2, which resumes from job 1's
   checkpoint and completes the run; the run's export job writes a Hugging Face folder
6. `trainstack runs scripts/demo-tiny.yaml --local`: the run, its jobs, its export
7. the exported folder loaded with transformers, and the run's one MLflow run across both jobs
8. what to try next; the emulator keeps running for it (`trainstack emulator stop` ends it, `--stop`
   stops it at the end instead). An emulator already running here is reused.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainstack.emulator import endpoint as emu  # noqa: E402
from trainstack.emulator import events as emulator_events  # noqa: E402
from trainstack.emulator.endpoint import ACCOUNT, REGION, Emulator  # noqa: E402
from trainstack.errors import TrainstackError  # noqa: E402

RECIPE = "scripts/demo-tiny.yaml"
RECIPE_NAME = "demo-tiny"
DEMO_DATA_BUCKET = "trainstack-demo-data"
# Job 1's max runtime in the emulator, seconds (its recipe says 1 h, the least a recipe may): long enough to
# start and save a checkpoint on two busy cores (about 90 steps at load average 15), short of the run's 720
# steps on two idle ones (about 0.125 s a step: 0.25 CPU-seconds per step of this recipe on 2 ranks,
# measured; about 8 s to start).
FIRST_JOB_MAX_RUNTIME_S = 60
RUN_TIMEOUT_S = 900  # the whole run, export included, on a loaded 2-core machine
NODE_NOISE = (
    "NodeVersionSupportWarning",
    "versions published after",
    "will require node",
    "To continue receiving",
    "and security updates",
    "More information can be found",
    "node --trace-warnings",
    "Node 20",
)


class DemoError(Exception):
    pass


def step(n: int, total: int, text: str) -> float:
    print(f"\n[{n}/{total}] {text}", flush=True)
    return time.monotonic()


def run(cmd: list[str], env: dict[str, str], *, quiet: bool = False, timeout: float = 600) -> str:
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = "\n".join(
        line
        for line in (proc.stdout + proc.stderr).splitlines()
        if line.strip() and not any(noise in line for noise in NODE_NOISE)
    )
    if proc.returncode != 0:
        raise DemoError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{out[-4000:]}")
    if not quiet:
        print("    " + out.replace("\n", "\n    "), flush=True)
    print(f"    ({time.monotonic() - started:.1f} s)", flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--keep",
        action="store_true",
        default=True,
        help="leave the emulator running at the end, for the next steps it prints (the default)",
    )
    parser.add_argument("--stop", dest="keep", action="store_false", help="stop the emulator at the end")
    args = parser.parse_args()

    npx = shutil.which("npx")
    if npx is None:
        print("error: npx not found: install Node.js 20+ and run `make setup`", file=sys.stderr)
        return 2
    trainstack = str(Path(sys.executable).parent / "trainstack")
    state_file, log = ROOT / emu.STATE_FILE, ROOT / emu.LOG_FILE
    log.parent.mkdir(exist_ok=True)
    total = 8
    t0 = time.monotonic()
    reused = emu.running(state_file)
    emulator = Emulator(port=int(reused["endpoint"].rsplit(":", 1)[1])) if reused else Emulator(log_path=log)
    try:
        if reused:
            step(1, total, f"using the local AWS emulator already running on {emulator.endpoint}")
            print(f"    (pid {reused.get('pid')}; `trainstack emulator stop` stops it)", flush=True)
        else:
            step(1, total, f"starting the local AWS emulator (moto server; log: {log.relative_to(ROOT)})")
            start_recorded(emulator, state_file, log)
            print(f"    listening on {emulator.endpoint} (pid {emulator.pid})", flush=True)
        settings = emulator_events.configure(emulator.env(), jobs="train", events="auto")
        print(
            f"    jobs run as local processes; job-state events delivered and schedules run by the emulator "
            f"(schedules {settings['schedule_speedup']:g}x faster than on AWS)",
            flush=True,
        )
        env = {
            **os.environ,
            **emulator.env(),
            "JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION": "1",
            "JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION": "20",
            "CDK_DISABLE_CLI_TELEMETRY": "true",
        }
        context = ["-c", f"recipe={RECIPE}"]

        step(2, total, f"npx cdk bootstrap aws://{ACCOUNT}/{REGION}")
        # bootstrap needs no recipe: the app synthesizes nothing for it (app.py)
        run([npx, "cdk", "bootstrap", f"aws://{ACCOUNT}/{REGION}", "-o", "cdk.out.demo"], env, quiet=True)

        step(
            3,
            total,
            f"npx cdk deploy --all -c recipe={RECIPE} --require-approval=never   "
            "(a script: no terminal to confirm the IAM changes in)",
        )
        deploy = [npx, "cdk", "deploy", "--all", *context, "--require-approval=never"]
        out = run([*deploy, "-o", "cdk.out.demo"], env, quiet=True)
        for line in out.splitlines():
            if "✅" in line:
                print("    " + line.strip(), flush=True)

        prepare_data(emulator, env, trainstack)

        # A run's name is unique, here and in the MLflow store an earlier demo left (.emulator/mlflow).
        name = f"demo-{time.strftime('%H%M%S')}"
        step(5, total, f"trainstack launch {RECIPE} --local --name {name} --wait")
        print(
            f"    EMULATOR: job 1's max runtime is {FIRST_JOB_MAX_RUNTIME_S} s (the recipe's: 1 h, the least "
            "a recipe may ask), so the run needs a second job",
            flush=True,
        )
        emulator_events.configure(emulator.env(), max_runtime_cap_seconds=FIRST_JOB_MAX_RUNTIME_S)
        try:
            launched = run([trainstack, "launch", RECIPE, "--local", "--name", name, "--wait"], env)
        finally:  # only job 1: the jobs the supervisor creates later keep the recipe's max runtime
            emulator_events.configure(emulator.env(), no_max_runtime_cap=True)
        run_name = launched.splitlines()[0].split()[2].rstrip(":")  # "launched run <run>: job <job> ..."
        watched = watch(emulator.env(), run_name)

        step(6, total, f"trainstack runs {RECIPE} --local")
        run([trainstack, "runs", RECIPE, "--local"], env)

        step(7, total, "the exported Hugging Face folder, loaded with transformers; the run in MLflow")
        folder = download_export(emulator, watched["export_out"], ROOT / ".emulator" / "demo-export" / name)
        load_with_transformers(folder)
        show_mlflow(state_file, run_name, watched["mlflow_run_id"])
    except (DemoError, TrainstackError, subprocess.TimeoutExpired, KeyboardInterrupt) as exc:
        print(f"\nerror: {exc or 'interrupted'}", file=sys.stderr)
        print(f"(emulator log: {log}; jobs' logs: {log.parent / 'jobs'})", file=sys.stderr)
        if not reused:  # ours, and the demo did not get far enough to be worth keeping
            emu.stop_recorded(state_file)
            emulator.stop()
        return 1
    print(
        f"\ndone in {time.monotonic() - t0:.0f} s: run {run_name} trained {watched['steps']} steps in "
        f"{watched['jobs']} jobs, completed, and was exported, with nothing run by hand.",
        flush=True,
    )
    if not args.keep:
        if not reused:
            emu.stop_recorded(state_file)
        print("The emulator is stopped (--stop).", flush=True)
        return 0
    print(next_steps(RECIPE, None, emulator.endpoint, reused, log, run_name), flush=True)
    return 0


def prepare_data(emulator: Emulator, env: dict[str, str], trainstack: str) -> None:
    """A small local corpus (the repository's docs), tokenized byte by byte into the emulator's S3."""
    step(
        4, 8, f"trainstack data prepare docs --tokenizer bytes --out s3://{DEMO_DATA_BUCKET}/tokens/ --local"
    )
    emulator.client("s3").create_bucket(Bucket=DEMO_DATA_BUCKET)
    # A demo kept from an earlier run already holds the dataset: the rerun finds every file done.
    run(
        [trainstack, "data", "prepare", "docs", "--tokenizer", "bytes"]
        + ["--out", f"s3://{DEMO_DATA_BUCKET}/tokens/", "--local", "--validation-fraction", "0.25"]
        + ["--workers", "1"],
        env,
    )


def watch(env: dict[str, str], run_name: str, timeout_s: float = RUN_TIMEOUT_S) -> dict:
    """Follow run `run_name` until it has completed and its export job has ended, printing each job's
    status changes and its newest metrics as SageMaker reports them; nothing is done to it."""
    sagemaker, cloudformation, dynamodb = emu.clients(env, "sagemaker", "cloudformation", "dynamodb")
    from trainstack.aws.registry import read_run

    outputs = cloudformation.describe_stacks(StackName="Trainstack-platform-demo-tiny-Data")["Stacks"][0]
    table = {o["OutputKey"]: o["OutputValue"] for o in outputs.get("Outputs", [])}["RunTableName"]
    shown: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        record = read_run(dynamodb, table, run_name)
        names = [j.name for j in record.jobs] + [e["job"] for e in record.exports]
        for job in names:
            try:
                described = sagemaker.describe_training_job(TrainingJobName=job)
            except sagemaker.exceptions.ClientError:
                continue  # registered, not created yet
            metrics = {m["MetricName"]: m["Value"] for m in described.get("FinalMetricDataList", [])}
            state = f"{described['TrainingJobStatus']} / {described['SecondaryStatus']}"
            progress = ", ".join(
                f"{k.removeprefix('train:')} {v:.4g}"
                for k, v in metrics.items()
                if k in ("train:step", "train:loss", "train:val_loss")
            )
            line = f"{state}" + (f" ({progress})" if progress else "")
            if shown.get(job, "").split(" (")[0] != state:
                print(f"    {time.strftime('%H:%M:%S')} {job}: {line}", flush=True)
                shown[job] = line
        export_done = record.exports and shown.get(record.exports[-1]["job"], "").startswith(
            ("Completed", "Failed", "Stopped")
        )
        if record.state in ("failed", "stopped") or (record.state == "completed" and export_done):
            break
        if time.monotonic() > deadline:
            raise DemoError(f"run {run_name} is still {record.state} after {timeout_s:.0f} s ({record.why})")
        time.sleep(2)
    if record.state != "completed":
        raise DemoError(f"run {run_name} ended {record.state}: {record.why}")
    export = record.exports[-1]
    described = sagemaker.describe_training_job(TrainingJobName=export["job"])
    if described["TrainingJobStatus"] != "Completed":
        raise DemoError(
            f"export job {export['job']} {described['TrainingJobStatus']}: {described.get('FailureReason')}"
        )
    print(f"    run {run_name}: {record.state} ({record.why}); jobs {', '.join(j.name for j in record.jobs)}")
    return {
        "export_out": export["out_parent"],
        "steps": record.steps,
        "jobs": len(record.jobs),
        "mlflow_run_id": record.mlflow_run_id,
    }


def download_export(emulator: Emulator, out_parent: str, dest: Path) -> Path:
    """The export's step-N/ folder from the emulator's S3 into `dest`."""
    bucket, _, prefix = out_parent.removeprefix("s3://").partition("/")
    s3 = emulator.client("s3")
    keys = [
        o["Key"]
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        for o in page.get("Contents", [])
    ]
    steps = sorted({k[len(prefix) :].split("/")[0] for k in keys if k[len(prefix) :].startswith("step-")})
    if not steps:
        raise DemoError(f"the export wrote nothing under {out_parent}")
    folder_prefix = f"{prefix}{steps[-1]}/"
    shutil.rmtree(dest, ignore_errors=True)
    for key in (k for k in keys if k.startswith(folder_prefix)):
        target = dest / key[len(folder_prefix) :]
        target.parent.mkdir(parents=True, exist_ok=True)
        s3.download_file(bucket, key, str(target))
    files = ", ".join(sorted(p.name for p in dest.iterdir()))
    print(f"    s3://{bucket}/{folder_prefix} -> {dest.relative_to(ROOT)}: {files}")
    return dest


def load_with_transformers(folder: Path) -> None:
    """transformers' own loader reads the folder; the loss it computes on a held-out text shows it learned
    (a byte-level model that learned nothing scores ln(vocab))."""
    import math

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()

    model = AutoModelForCausalLM.from_pretrained(folder)
    text = (ROOT / "README.md").read_bytes()[:512]
    ids = torch.tensor([list(text[:64])])
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    parameters = sum(p.numel() for p in model.parameters())
    print(
        f"    transformers loaded {type(model).__name__} ({parameters:,} parameters); its loss on "
        f"README.md's first 64 bytes: {loss:.2f} (untrained: about ln({model.config.vocab_size}) = "
        f"{math.log(model.config.vocab_size):.2f})",
        flush=True,
    )


def show_mlflow(state_file: Path, run_name: str, run_id: str) -> None:
    """The run's one MLflow run (the one launch created, recorded in the registry): both jobs' metrics in
    it, by step."""
    from trainstack.aws import tracking
    from trainstack.protocol.tracking import RUN_TAG

    url = (emu.read_state(state_file) or {}).get("mlflow")
    if not url or not run_id:
        print("    (no MLflow server beside this emulator)")
        return
    client = tracking.client(url)
    found = client.get_run(run_id)
    if found.data.tags.get(RUN_TAG) != run_name:
        raise DemoError(f"MLflow run {run_id} is not {run_name}'s: {found.data.tags.get(RUN_TAG)}")
    losses = client.get_metric_history(run_id, "loss")
    validation = sorted(client.get_metric_history(run_id, "val_loss"), key=lambda m: m.step)
    jobs = sorted({k.split(".")[2] for k in found.data.tags if k.startswith("trainstack.job.")})
    steps = sorted(m.step for m in losses)
    print(
        f"    MLflow run {run_id} ({url}, experiment platform/{RECIPE_NAME}): one run for {run_name}, "
        f"loss at {len(steps)} steps from {steps[0]} to {steps[-1]} ({len(jobs)} jobs); val_loss "
        f"{validation[0].value:.3f} at step {validation[0].step} -> {validation[-1].value:.3f} at step "
        f"{validation[-1].step}",
        flush=True,
    )


def start_recorded(emulator: Emulator, state_file: Path, log: Path) -> None:
    """Start the emulator in its own session (it outlives this script) and record the server's PID."""
    from trainstack.emulator import mlflow_server

    emu.stop_recorded(state_file)  # a stale record: its server is gone
    # MLflow's own server beside moto, as `trainstack emulator start` runs it (runs of recipes that track
    # in MLflow are tracked there with --local); it comes up while moto and the deploy do.
    tracker = mlflow_server.launch_beside(ROOT / mlflow_server.STATE_DIR, ROOT / mlflow_server.LOG_FILE)
    try:
        emulator.start(timeout_s=120, detach=True)
    except BaseException:
        if tracker is not None:
            tracker.stop()
        raise
    emu.write_state(
        emulator.endpoint, emulator.pid or 0, state_file, log=log.relative_to(ROOT), mlflow=tracker
    )


def next_steps(
    recipe: str,
    team: str | None,
    endpoint: str,
    reused: dict | None,
    log: Path,
    run_name: str = "ts-platform-demo-tiny--demo",
) -> str:
    """What to try next, against the emulator the demo leaves running (every line works as printed)."""
    ts = ".venv/bin/trainstack"
    t = f" --team {team}" if team else ""
    pid = (reused or emu.read_state(ROOT / emu.STATE_FILE) or {}).get("pid")
    rows = [
        (f"{ts} runs {recipe}{t} --local --mlflow", "the demo's run: its jobs, export, MLflow run"),
        (f"{ts} status {recipe}{t} --local", "its newest job against the plan"),
        (f"{ts} logs {recipe}{t} --local", "the trainer's log lines, from CloudWatch Logs"),
        (f"{ts} export {run_name} --local", "export its newest checkpoint again"),
        (f"{ts} plan 30b-fp8", "memory, speed, cost of a real recipe (no AWS)"),
        ('eval "$(.venv/bin/trainstack emulator env)"', "point npx cdk and the AWS CLI here too"),
        (f"{ts} emulator stop", "when you are done"),
    ]
    width = max(len(cmd) for cmd, _ in rows)
    lines = [
        "",
        f"The emulator keeps running on {endpoint} (pid {pid}, log {log.relative_to(ROOT)}). Try next:",
        *(f"  {cmd:<{width}}  # {why}" for cmd, why in rows),
        "Your own model and data: docs/tutorial.md. On AWS: README.md, 'On a real AWS account'.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
